"""FP16_Optimizer across two processes (torch.multiprocessing.spawn, gloo, CPU).

* An inf on one rank only: both ranks skip the step and keep identical scales and parameters (the overflow flag is
  MAX-reduced over the data-parallel group and any model-parallel groups before deciding).
* On 4 ranks (2 pipeline stages x 2 replicas), an inf on one stage skips the step on every rank, also where the inner
  FusedAdam all-reduces its own decision over the data-parallel group only.
* DDP on two ranks equals one process on the concatenated batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from torch import nn

from ort_optim import FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 5


def make_model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)


def make_inner(kind, params):
    if kind == "FusedAdam":
        return FusedAdam(params, lr=1e-2)
    if kind == "AdamW-fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def full_batch(step, dtype, n=8 * WORLD):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 8, generator=g).to(dtype), torch.randn(n, 4, generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y)


INF_CASES = [("FusedAdam", False), ("SGD", False), ("AdamW-fused", True)]
DDP_CASES = [(kind, dtype) for kind in ("FusedAdam", "SGD") for dtype in (torch.float16, torch.float32)]


def _inf_one_rank(rank, kind, explicit_groups):
    model = make_model(torch.float16)
    ddp = nn.parallel.DistributedDataParallel(model)
    kwargs = {}
    if explicit_groups:
        kwargs = dict(process_group=dist.new_group([0, 1]), model_parallel_groups=[dist.new_group([0, 1])])
    opt = FP16_Optimizer(make_inner(kind, list(ddp.parameters())), init_scale=2.0**8, **kwargs)
    record = []
    for step in range(STEPS):
        x, y = full_batch(step, torch.float16)
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        opt.backward(loss_of(ddp, x, y))
        if rank == 0 and step in (1, 3):  # after DDP's all-reduce: only rank 0 sees it
            model[0].weight.grad[0, 0] = float("inf")
        opt.step()
        record.append((opt.skipped, opt.loss_scale))
    return {"record": record, "params": [p.detach().clone() for p in model.parameters()],
            "masters": [m.detach().clone() for m in opt.master_params]}


def _ddp(rank, kind, dtype):
    model = make_model(dtype)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = FP16_Optimizer(make_inner(kind, list(ddp.parameters())), init_scale=2.0**8)
    for step in range(STEPS):
        x, y = full_batch(step, dtype)
        opt.zero_grad()
        opt.backward(loss_of(ddp, x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]))
        opt.step()
    masters = opt.master_params if dtype != torch.float32 else [p.detach() for p in model.parameters()]
    return {"masters": [m.detach().clone() for m in masters], "skipped": opt.skipped_steps}


def _scenarios(rank, world_size, tmp_dir):
    """Every scenario in one spawn (starting two processes costs several seconds)."""
    out = {}
    for kind, explicit in INF_CASES:
        out[f"inf-{kind}-{explicit}"] = _inf_one_rank(rank, kind, explicit)
    for kind, dtype in DDP_CASES:
        out[f"ddp-{kind}-{dtype}"] = _ddp(rank, kind, dtype)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_scenarios, WORLD, tmp_path_factory.mktemp("fp16_distributed"))


@pytest.mark.parametrize("kind,explicit_groups", INF_CASES)
def test_inf_on_one_rank_skips_on_all_ranks(results, kind, explicit_groups):
    r0, r1 = (r[f"inf-{kind}-{explicit_groups}"] for r in results)
    assert r0["record"] == r1["record"]
    assert [skipped for skipped, _ in r0["record"]] == [False, True, False, True, False]
    assert [scale for _, scale in r0["record"]] == [256.0, 128.0, 128.0, 64.0, 64.0]
    for a, b in zip(r0["params"] + r0["masters"], r1["params"] + r1["masters"]):
        assert torch.equal(a, b)


# Stated tolerances. fp32 params (loss scaling only): float32 rounding of a sum in another order. fp16 params: the
# two halves' fp16 gradients are averaged in fp16 by DDP, the single process rounds the full-batch gradient once, a
# difference of about one fp16 ulp per gradient element, carried through 5 Adam/SGD steps.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 5e-4}  # measured: 6e-8 and 5e-5


@pytest.mark.parametrize("kind,dtype", DDP_CASES)
def test_ddp_equals_one_process_on_the_concatenated_batch(results, kind, dtype):
    ranks = [r[f"ddp-{kind}-{dtype}"] for r in results]
    for a, b in zip(ranks[0]["masters"], ranks[1]["masters"]):
        assert torch.equal(a, b)
    model = make_model(dtype)
    opt = FP16_Optimizer(make_inner(kind, list(model.parameters())), init_scale=2.0**8)
    for step in range(STEPS):
        x, y = full_batch(step, dtype)
        opt.zero_grad()
        opt.backward(loss_of(model, x, y))
        opt.step()
    single = opt.master_params if dtype != torch.float32 else [p.detach() for p in model.parameters()]
    assert ranks[0]["skipped"] == opt.skipped_steps == 0
    diff = max(float((got - want).abs().max()) for got, want in zip(ranks[0]["masters"], single))
    print(f"{kind} {dtype}: max |DDP - single| = {diff:.3g}")
    assert diff <= TOLERANCE[dtype], diff


# ---- the wrapper's groups beside FusedAdam's own reduction -----------------------------------------------------------
# 4 ranks: 2 pipeline stages (stage rank // 2) x 2 data-parallel replicas (data-parallel groups {0, 1} and {2, 3},
# pipeline groups {0, 2} and {1, 3}). The inner FusedAdam all-reduces its skip decision over its data-parallel group
# only; the wrapper is told the pipeline group too, and its flag must span it: an inf on one stage skips the step on
# every rank.

GRID = 4


def _stages_decide_together(rank, world_size, tmp_dir):
    dp = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2]  # (every rank makes every group, in order)
    pp = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])][rank % 2]
    out = {}
    for inner in ("FusedAdam(process_group=dp)", "FusedAdam(process_group=dp, pipeline_group=pp)", "SGD"):
        model = make_model(torch.float16)
        params = list(model.parameters())
        opt = (torch.optim.SGD(params, lr=0.05) if inner == "SGD" else
               FusedAdam(params, lr=1e-2, process_group=dp, pipeline_group=pp if "pipeline" in inner else None))
        opt = FP16_Optimizer(opt, init_scale=2.0**8, process_group=dp, model_parallel_groups=[pp])
        record = []
        for step in range(3):
            x, y = full_batch(step, torch.float16)  # (the same batch on every rank: replicas agree without DDP)
            opt.zero_grad()
            opt.backward(loss_of(model, x, y))
            if rank == 2 and step == 1:  # one rank of the second stage only
                model[0].weight.grad[0, 0] = float("inf")
            opt.step()
            record.append((opt.skipped, opt.loss_scale))
        out[inner] = record
    return out


@pytest.fixture(scope="module")
def grid_results(tmp_path_factory):
    return run_ranks(_stages_decide_together, GRID, tmp_path_factory.mktemp("fp16_grid"))


@pytest.mark.parametrize("inner", ["FusedAdam(process_group=dp)", "FusedAdam(process_group=dp, pipeline_group=pp)",
                                   "SGD"])
def test_an_inf_on_one_pipeline_stage_skips_the_step_on_every_rank(grid_results, inner):
    records = [r[inner] for r in grid_results]
    assert all(record == records[0] for record in records), records
    assert records[0] == [(False, 256.0), (True, 128.0), (False, 128.0)]
