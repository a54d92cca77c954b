"""FP16_Optimizer across processes (gloo, CPU). The scenarios (tests/distributed/fp16_scenarios.py) run in the
session's spawns of tests/distributed/ (torch_scenarios.py's 2 ranks, mesh_scenarios.py's 4); the tests compare.

* An inf on one rank only: both ranks skip the step and keep identical scales and parameters (the overflow flag is
  MAX-reduced over the data-parallel group and any model-parallel groups before deciding).
* On 4 ranks (2 pipeline stages x 2 replicas), an inf on one stage skips the step on every rank, also where the inner
  FusedAdam all-reduces its own decision over the data-parallel group only.
* DDP on two ranks equals one process on the concatenated batch.
"""

from __future__ import annotations

import pytest
import torch
from fp16_scenarios import DDP_CASES, INF_CASES, STEPS, full_batch, loss_of, make_inner, make_model

from ort_optim.fp16_optimizer import FP16_Optimizer

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(torch_results):
    """The two-rank scenarios (tests/distributed/fp16_scenarios.py), run in torch_scenarios.py's spawn."""
    return [r["fp16-optimizer"] for r in torch_results]


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
# 4 ranks (fp16_scenarios.four_ranks, run in mesh_scenarios.py's spawn): an inf on one pipeline stage skips the step on
# every rank, also where the inner FusedAdam all-reduces its skip decision over its data-parallel group only.


@pytest.fixture(scope="module")
def grid_results(mesh_results):
    return [r["fp16-optimizer-stages"] for r in mesh_results]


@pytest.mark.parametrize("inner", ["FusedAdam(process_group=dp)", "FusedAdam(process_group=dp, pipeline_group=pp)",
                                   "SGD"])
def test_an_inf_on_one_pipeline_stage_skips_the_step_on_every_rank(grid_results, inner):
    records = [r[inner] for r in grid_results]
    assert all(record == records[0] for record in records), records
    assert records[0] == [(False, 256.0), (True, 128.0), (False, 128.0)]
