"""FP16_Optimizer's scenarios on several gloo ranks, which tests/fp16_optimizer/test_fp16_distributed.py compares: they
run inside the session's spawns (tests/distributed_harness.py), the two-rank ones in torch_scenarios.py's 2 ranks
(``torch_results[rank]["fp16-optimizer"]``), the four-rank one in mesh_scenarios.py's 4 ranks
(``mesh_results[rank]["fp16-optimizer-stages"]``): starting processes costs seconds, and these need no spawn of
their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ort_optim import FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer

WORLD = 2  # the ranks of the two-rank scenarios (torch_scenarios.WORLD)
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


def two_ranks(rank: int) -> dict:
    """The two-rank scenarios (DDP over the default group of 2 ranks)."""
    out = {}
    for kind, explicit in INF_CASES:
        out[f"inf-{kind}-{explicit}"] = _inf_one_rank(rank, kind, explicit)
    for kind, dtype in DDP_CASES:
        out[f"ddp-{kind}-{dtype}"] = _ddp(rank, kind, dtype)
    return out


# ---- the wrapper's groups beside FusedAdam's own reduction -----------------------------------------------------------
# 4 ranks: 2 pipeline stages (stage rank // 2) x 2 data-parallel replicas (data-parallel groups {0, 1} and {2, 3},
# pipeline groups {0, 2} and {1, 3}). The inner FusedAdam all-reduces its skip decision over its data-parallel group
# only; the wrapper is told the pipeline group too, and its flag must span it: an inf on one stage skips the step on
# every rank.

def four_ranks(rank: int) -> dict:
    """The four-rank scenario: 2 pipeline stages x 2 replicas."""
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
