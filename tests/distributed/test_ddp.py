"""FusedAdam and FP16_Optimizer with data-parallel process groups (DDP, pipeline stages), as a specification.

* DDP with ``process_group=``: every rank ends bit for bit alike and within 5e-5 of one process on the whole batch;
  an inf on one rank skips the step on every rank (FusedAdam and FP16_Optimizer); the clipping norm is the group's
  (each replica counted once), not a native plan's local one; a rank without gradients joins the reduction and the
  skip; pipeline stages clip by the whole model's norm and skip together (mesh_scenarios, 4 gloo ranks).
* Against ``torch.optim.AdamW`` in the same DDP: accumulation under ``no_sync()`` equal within 1e-6;
  ``step_in_backward`` under DDP (which averages gradients after the hooks would have run) refused before anything
  changes, whichever was made first (torch_scenarios, 2 ranks).
* ``DDP(ORTModule(model))`` on two gloo ranks with FusedAdam and with FP16_Optimizer (ORT's guidance: wrap with
  ORTModule first, then DDP): one spawn runs both; the parent compares each with one eager process on the
  concatenated batch. ORTModule needs torch 2.4 + onnxruntime-training 1.19 (the .venv environment); elsewhere that
  test skips.
"""

from __future__ import annotations

import math
import re

import mesh_scenarios as mesh
import pytest
import torch_scenarios as against_torch
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from torch import nn

from ort_optim import AdamWMode, FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer

pytestmark = pytest.mark.distributed

try:
    from onnxruntime.training.ortmodule import ORTModule  # noqa: F401

    ORT_ERROR = None
except Exception as exc:  # ImportError, or ORT failing against this torch (torch >= 2.5)
    ORT_ERROR = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

needs_ortmodule = pytest.mark.skipif(
    ORT_ERROR is not None,
    reason=f"ORTModule is unavailable here ({ORT_ERROR}); it needs torch 2.4 + onnxruntime-training 1.19 (.venv)",
)

WORLD = 2
STEPS = 6
CASES = {"fp32-FusedAdam": torch.float32, "fp16-FP16_Optimizer": torch.float16}


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).to(dtype)


def make_optimizer(case: str, params):
    fused = FusedAdam(params, lr=3e-3, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=0.01,
                      max_grad_norm=None if case.startswith("fp16") else 0.5)
    if case.startswith("fp16"):
        return FP16_Optimizer(fused, init_scale=2.0**10, max_grad_norm=0.5)
    return fused


def full_batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8 * WORLD, 16, generator=g)
    return x.to(dtype), x[:, :4] * 0.5 - x[:, 4:8]


def train(model, opt, dtype, rank=None):
    losses = []
    for step in range(STEPS):
        x, y = full_batch(step, dtype)
        if rank is not None:
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if isinstance(opt, FP16_Optimizer):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def scenarios(rank: int, world: int, tmp_dir: str) -> dict:
    import os

    from onnxruntime.training.ortmodule import ORTModule

    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"  # fail rather than quietly run PyTorch instead
    out = {}
    for case, dtype in CASES.items():
        net = make_model(dtype)
        model = nn.parallel.DistributedDataParallel(ORTModule(net))
        opt = make_optimizer(case, model.parameters())
        losses = train(model, opt, dtype, rank)
        masters = opt.master_params if isinstance(opt, FP16_Optimizer) else list(net.parameters())
        out[case] = {"losses": losses, "masters": [m.detach().float().clone() for m in masters],
                     "ort_ran": model.module._torch_module._execution_manager(True)._onnx_models.optimized_model
                     is not None}
    return out


@pytest.fixture(scope="module")
def ortmodule_results(tmp_path_factory):
    return run_ranks(scenarios, WORLD, tmp_path_factory.mktemp("ortmodule_ddp"))


# fp32: ORT's kernels vs eager PyTorch, and a two-rank average vs one batch: float32 rounding, through 6 clipped
# steps. fp16: fp16 forward/backward in ORT vs eager, DDP's fp16 gradient average: about an fp16 ulp per gradient.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


@needs_ortmodule
@pytest.mark.parametrize("case", list(CASES))
def test_ddp_of_ortmodule_equals_one_eager_process(ortmodule_results, case):
    dtype = CASES[case]
    r0, r1 = (r[case] for r in ortmodule_results)
    assert r0["ort_ran"] and r1["ort_ran"]
    for a, b in zip(r0["masters"], r1["masters"]):
        assert torch.equal(a, b)  # DDP keeps the ranks identical
    model = make_model(dtype)
    opt = make_optimizer(case, list(model.parameters()))
    losses = train(model, opt, dtype)
    single = opt.master_params if isinstance(opt, FP16_Optimizer) else list(model.parameters())
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    assert mean == pytest.approx(losses, rel=TOLERANCE[dtype] * 10)
    diff = max(float((got - want.float()).abs().max()) for got, want in zip(r0["masters"], single))
    assert diff <= TOLERANCE[dtype], diff
    assert losses[-1] < losses[0]


# ---- DDP and pipeline process groups, against one process ------------------------------------------------------------


def test_ddp_with_process_group_equals_one_process(mesh_results):
    assert not mesh_results[0]["ddp"]["copy_has_group"]
    for r in mesh_results:
        mesh.assert_bitwise(r["ddp"]["params"], mesh_results[0]["ddp"]["params"], f"rank {r['rank']} vs rank 0")
    # the ranks' averaged gradients vs one batch: float32 rounding through 5 clipped steps
    mesh.assert_close(mesh_results[0]["ddp"]["params"], mesh.one_process(), 5e-5, "DDP vs one process")


@pytest.mark.parametrize("case", ["ddp-inf", "ddp-fp16-inf"])
def test_ddp_inf_on_one_rank_skips_on_every_rank(mesh_results, case):
    for r in mesh_results:
        assert r[case]["skipped"] == [step == 2 for step in range(mesh.STEPS)], (r["rank"], r[case]["skipped"])
        mesh.assert_bitwise(r[case]["params"], mesh_results[0][case]["params"], f"rank {r['rank']}")


def test_clipping_by_the_group_norm_not_the_native_plans_local_one(mesh_results):
    """One native bucket per rank with clipping: the plan sees this rank's gradients only; with a process_group the
    norm is the group's (each replica counted once: the mean of the ranks' sums of squares), and each rank's update
    equals one process stepping its gradient multiplied by that clip coefficient."""
    pair = [mesh_results[0]["replicas-own-grads"], mesh_results[1]["replicas-own-grads"]]
    assert all(out["lone_native_bucket"] for out in pair)  # (so this test would fail if the plan clipped alone)
    torch.manual_seed(0)
    init = torch.randn(64)
    for step in range(len(pair[0]["grads"])):
        want = (sum(out["grads"][step].double().square().sum() for out in pair) / len(pair)).sqrt()
        for out in pair:
            assert abs(float(out["norms"][step]) - float(want)) <= 1e-5 * float(want), (step, out["norms"][step], want)
    for rank, out in enumerate(pair):
        p = nn.Parameter(init.clone())
        opt = mesh.make_optimizer([p], clip=None)
        for step, g in enumerate(out["grads"]):
            norm = float(out["norms"][step])
            p.grad = g.clone()
            opt.step(grad_scale=1.0 / min(1.0, mesh.CLIP / (norm + 1e-6)))  # divides by 1 / clip_coef: clips
        mesh.assert_close([out["param"]], [p.detach()], 1e-6, f"rank {rank} vs one process clipped by the group norm")
        mesh.assert_bitwise([mesh_results[rank + 2]["replicas-own-grads"]["param"]], [out["param"]], "pairs agree")


def test_a_rank_without_gradients_joins_the_reduction_and_the_skip(mesh_results):
    for r in mesh_results:
        out = r["rank-without-gradients"]
        assert out["skipped"] == [False, True], (r["rank"], out)
        # the unscaled gradient (1.0 x 4 elements on rank 0, counted once for the 2 replicas): sqrt(4 / 2)
        assert out["norms"][0] == pytest.approx(2**0.5, rel=1e-6), (r["rank"], out)
        assert not math.isfinite(out["norms"][1]), (r["rank"], out)  # the inf reached rank 1's norm too
    assert not torch.equal(mesh_results[0]["rank-without-gradients"]["param"], torch.ones(4))  # rank 0 stepped once
    assert torch.equal(mesh_results[1]["rank-without-gradients"]["param"], torch.ones(4))  # rank 1 had nothing to step


def test_pipeline_stages_clip_by_the_whole_models_norm_and_skip_together(mesh_results):
    """pipeline_group adds the stages' sums: each stage's params equal the same layer of one process training the
    whole model (clipped at every step, so a stage-local norm would differ), and an inf on one rank of one stage
    skips the step on all four ranks."""
    want = mesh.one_process()
    for r in mesh_results:
        out = r["pipeline"]
        stage = out["stage"]
        mesh.assert_close(out["params"], want[2 * stage:2 * stage + 2], 5e-5, f"rank {r['rank']} (stage {stage})")
        assert out["norm"] == pytest.approx(mesh_results[0]["pipeline"]["norm"], rel=1e-6)
        assert r["pipeline-inf"]["skipped"] == [step == 2 for step in range(mesh.STEPS)], (r["rank"], r["pipeline-inf"])


def test_a_step_without_any_gradient_changes_nothing_with_or_without_loss_scaling():
    p = nn.Parameter(torch.ones(3))
    for kwargs in ({}, {"grad_scale": torch.tensor(4.0)}, {"grad_scale": 4.0}):
        opt = mesh.make_optimizer([p])
        opt.step(**kwargs)
        assert torch.equal(p, torch.ones(3)) and not opt.state.get(p) and not opt.last_step_skipped, kwargs


def _unconnected_group() -> dist.ProcessGroup:
    """A ProcessGroup object of 2 ranks that no process joins (enough for options checked at construction)."""
    try:
        return dist.ProcessGroup(0, 2)  # (torch >= 2.6: rank, size)
    except TypeError:
        return dist.ProcessGroup(dist.HashStore(), 0, 2)


def test_step_in_backward_with_a_process_group_is_refused():
    # (its per-param updates would run before DDP has averaged the gradients)
    with pytest.raises(ValueError, match="process_group.*step_in_backward=False"):
        FusedAdam([nn.Parameter(torch.ones(2))], step_in_backward=True, process_group=_unconnected_group())


@pytest.mark.parametrize("name", ["process_group", "pipeline_group"])
@pytest.mark.parametrize("value", [object(), [0, 1], 2, "gloo"], ids=["object", "rank-list", "int", "str"])
def test_a_group_option_that_is_not_a_process_group_is_refused_at_construction_naming_it(name, value):
    # (accepted, it failed at the first step inside torch.distributed, after the state had been created)
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match=f"FusedAdam: {name} must be None or a torch.distributed ProcessGroup"):
        FusedAdam([p], max_grad_norm=1.0, **{name: value})


# ---- DDP, against torch.optim.AdamW in the same engine ---------------------------------------------------------------


@pytest.mark.parametrize("order", against_torch.DDP_ORDERS[:2])
def test_step_in_backward_under_ddp_is_refused_before_anything_changes(torch_results, order):
    """DDP averages each gradient across the ranks after autograd has accumulated it: updates in backward would use
    this rank's own gradient. The first backward refuses before the first gradient is accumulated, whichever was
    made first, naming the param and DDP and saying what to do: params, gradients (zeros here) and the optimizer's
    state (resumed from a checkpoint) are bit for bit as before, on both ranks."""
    from conftest import assert_same_snapshot

    for rank, out in enumerate(torch_results):
        got = out[("step_in_backward", order)]
        assert got["error"] is not None, f"rank {rank}: not refused"
        assert re.fullmatch(r"param_groups\[0\]\['params'\]\[\d\] \(shape .*\) is reduced by DistributedDataParallel "
                            r".*Nothing was updated \(no gradient accumulated either\)\. Use step_in_backward=False "
                            r"with DistributedDataParallel .*", got["error"], re.S), got["error"]
        assert_same_snapshot(got["before"], got["after"])


def test_step_in_backward_under_ddp_made_after_the_first_backward_is_refused_at_the_end_of_the_next(torch_results):
    """The setup check runs once, at the first backward: a DDP made later is caught by the end-of-backward check (the
    backstop), which refuses once DDP has written its average into a gradient that the update in backward freed:
    each param updated once (by its hook, with this rank's gradient), never twice."""
    for rank, out in enumerate(torch_results):
        got = out[("step_in_backward", against_torch.DDP_ORDERS[2])]
        assert got["error"] is not None and "has a gradient again" in got["error"], (rank, got["error"])
        steps = {k: float(v) for k, v in got["after"].items() if k.endswith(".step")}
        assert steps and all(s == float(got["before"][k]) + 1 for k, s in steps.items()), steps


def test_ddp_no_sync_accumulation_with_process_group_equals_torch_adamw(torch_results):
    for r in torch_results:
        against_torch.assert_like_torch(r["ddp"], 1e-6, what=f"rank {r['rank']}")
        for a, b in zip(r["ddp"]["fused"]["params"], torch_results[0]["ddp"]["fused"]["params"]):
            assert torch.equal(a, b)
