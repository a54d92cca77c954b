"""FusedAdam under torch.distributed: FSDP2, tensor parallel, 2D FSDP x TP, DDP and distributed checkpoints.

One spawn of 4 gloo ranks (tests/distributed_harness.py) runs every scenario; the parent compares. The 4 ranks form a
2 x 2 mesh ("dp", "tp"); two-rank scenarios run on the mesh's "tp" rows ({0, 1} and {2, 3}) side by side, on the
same data, so ranks 2 and 3 repeat ranks 0 and 1 (checked). Four-rank scenarios: FSDP2 over all ranks (one rank then
holds an empty shard), 2D (FSDP on "dp", TP on "tp"), and loading a two-rank checkpoint into four ranks.

Two references:
* **shadow**: inside the workers, each step's full gradients (``grad.full_tensor()``) also step a FusedAdam over plain
  full-size copies of the params, in one process. Without clipping the sharded update must equal it bit for bit
  (the update is per element); with clipping, the norm is summed in another order: within 1e-6.
* **one process**: the parent trains the same model on the whole batch in one process. The gradients themselves
  differ in rounding (the engines average the ranks' gradients instead of one batch's), so: within 5e-5 after
  several clipped steps.

FSDP2 needs torch >= 2.6 (CPU/gloo support): in older torch (the .venv environment) those scenarios skip with the
reason and the DDP ones run.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from distributed_harness import run_ranks
from torch import nn

from ort_optim import AdamWMode, FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer

WORLD = 4
STEPS = 5
SCALER_INIT = 2.0**8
CLIP = 0.05  # well below the gradients' norm (about 0.3-1): every step clips
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
FSDP2_REASON = None if TORCH_VERSION >= (2, 6) else (
    f"FSDP2 (fully_shard) on CPU with gloo needs torch >= 2.6 (these FSDP2/TP/2D/DCP scenarios run together); this "
    f"environment has torch {torch.__version__}")


def make_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # 3 output features: sharded over 4 ranks, the last weight's dim 0 leaves rank 3 an empty shard
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)).to(dtype)


def make_optimizer(params, clip=CLIP, **kwargs) -> FusedAdam:
    # Adam's update m / sqrt(v) does not see a gradient's scale, so a wrong clip coefficient would hardly show; with
    # eps (1e-3) near the clipped gradients' size (about 3e-3 per element) it does: a norm counted twice fails tests.
    return FusedAdam(params, lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-3, weight_decay=1e-2,
                     max_grad_norm=clip, **kwargs)


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 3, generator=g)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y)


def full(t: torch.Tensor) -> torch.Tensor:
    from ort_optim.integrations import dtensor

    return (t.full_tensor() if dtensor.is_dtensor(t) else t).detach().clone()


def one_process(steps=STEPS, clip=CLIP, dtype=torch.float32, grad_scaler=False, inf_step=None,
                **kwargs) -> list[torch.Tensor]:
    """The same training in one process. grad_scaler: through torch.amp.GradScaler; inf_step: the step whose first
    gradient element is set to inf (as the poisoned rank's)."""
    model = make_model(dtype)
    opt = make_optimizer(model.parameters(), clip, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALER_INIT) if grad_scaler else None
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model, x.to(dtype), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if step == inf_step:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


# ---- scenarios (inside the workers) ----------------------------------------------------------------------------------


def _train(model, opt, rank_in_group, group_size, shadow=None, data_parallel=True, steps=STEPS, poison=None,
           plans=None, scaler=None):
    """Trains; each rank takes its slice of the batch when data-parallel. shadow: (model, opt) over full plain copies,
    stepped with the full gradients. poison: (step, rank) whose local gradient gets an inf. plans: a list that gets
    the optimizer's plan after each step. scaler: a torch.amp.GradScaler that scales the loss and steps opt. Returns
    the skips."""
    skipped = []
    for step in range(steps):
        x, y = batch(step)
        dtype = next(model.parameters()).dtype
        if data_parallel:
            x, y = x.chunk(group_size)[rank_in_group], y.chunk(group_size)[rank_in_group]
        opt.zero_grad()
        loss = loss_fn(model, x.to(dtype), y)
        if isinstance(opt, FP16_Optimizer):
            opt.backward(loss)
        else:
            (scaler.scale(loss) if scaler else loss).backward()
        if poison is not None and poison[0] == step and poison[1] == rank_in_group:
            from ort_optim.integrations import dtensor

            g = dtensor.local(next(p for p in model.parameters() if dtensor.local(p).numel()).grad)
            g.view(-1)[0] = float("inf")
        if shadow is not None:
            for p, q in zip(model.parameters(), shadow[0].parameters()):
                q.grad = full(p.grad)
            shadow[1].step()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        inner = opt.optimizer if isinstance(opt, FP16_Optimizer) else opt
        skipped.append(inner.last_step_skipped)
        if plans is not None:
            plans.append(inner._plan)
    return skipped


def _shadow_of(model, **opt_kwargs):
    copy = make_model(next(model.parameters()).dtype)
    with torch.no_grad():
        for p, q in zip(model.parameters(), copy.parameters()):
            q.copy_(full(p))
    return copy, make_optimizer(copy.parameters(), **opt_kwargs)


def _fsdp(mesh, dtype=torch.float32, mp=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model(dtype)
    kwargs = {"mesh": mesh}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in (model[0], model[2]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _tp(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = make_model()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


FSDP_CASES = {  # name: (model kwargs, optimizer kwargs)
    "fp32-clip": ({}, {}),
    "fp32-noclip": ({}, {"clip": None}),
    "mp-bf16-clip": ({"mp": True}, {}),
    "bf16-masters-lowbit-amsgrad": ({"dtype": torch.bfloat16},
                                    {"master_weights": True, "exp_avg_dtype": torch.bfloat16,
                                     "exp_avg_sq_dtype": torch.float16, "amsgrad": True}),
}


def _fsdp_case(mesh, rank, name):
    model_kwargs, opt_kwargs = FSDP_CASES[name]
    model = _fsdp(mesh, **model_kwargs)
    opt = make_optimizer(model.parameters(), **opt_kwargs)
    shadow = _shadow_of(model, **opt_kwargs)
    plans = []
    _train(model, opt, rank, mesh.size(), shadow, plans=plans)
    return {"params": [full(p) for p in model.parameters()],
            "shadow": [p.detach().clone() for p in shadow[0].parameters()],
            "local_shapes": [tuple(p.to_local().shape) for p in model.parameters()],
            "plans": len({id(plan) for plan in plans})}


def _local_tensor_changes(mesh) -> dict:
    """An engine that gives a DTensor param another local tensor (FSDP2 does at its lazy init) or frees and
    re-allocates its storage in place between steps: each step must update what the DTensor holds then, as a
    FusedAdam over the plain shard does (bit for bit: no clipping)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    full_w = torch.randn(4, 6)
    w = nn.Parameter(distribute_tensor(full_w, mesh, [Shard(0)]))
    plain = nn.Parameter(w.to_local().clone())
    opt, plain_opt = make_optimizer([w], clip=None), make_optimizer([plain], clip=None)
    out = {}

    def step(seed):
        g = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
        w.grad = distribute_tensor(g, mesh, [Shard(0)])
        plain.grad = w.grad.to_local().clone()
        opt.step()
        plain_opt.step()

    step(1)
    step(2)
    old = w._local_tensor
    w._local_tensor = old.clone()  # a new local tensor, in new memory
    before = old.clone()
    step(3)
    out["old-untouched"] = bool(torch.equal(old, before))
    out["after-swap"] = bool(torch.equal(w.to_local(), plain.detach()))
    storage = w._local_tensor.untyped_storage()
    keep = w._local_tensor.clone()
    storage.resize_(0)  # freed and re-allocated in place (new memory, same tensor)
    storage.resize_(keep.numel() * keep.element_size())
    w._local_tensor.copy_(keep)
    step(4)
    out["after-realloc"] = bool(torch.equal(w.to_local(), plain.detach()))
    return out


def _checkpoint_case(mesh, rank, tmp_dir, pair):
    """Train 3 steps, dcp.save, train 3 more (uninterrupted); a fresh model + optimizer loads and trains the same 3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    opt_kwargs = dict(master_weights=True, exp_avg_sq_dtype=torch.float16)
    path = str(Path(tmp_dir) / f"ckpt-pair{pair}")

    def fresh():
        model = _fsdp(mesh, dtype=torch.bfloat16)
        return model, make_optimizer(model.parameters(), **opt_kwargs)

    model, opt = fresh()
    _train(model, opt, rank, mesh.size(), steps=3)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    saved = {fqn: {k: full(v) for k, v in s.items()} for fqn, s in state["optim"]["state"].items()}
    dcp.save(state, checkpoint_id=path, process_group=mesh.get_group())
    _train(model, opt, rank, mesh.size(), steps=3)
    uninterrupted = [full(p) for p in model.parameters()]

    model, opt = fresh()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path, process_group=mesh.get_group())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = {fqn: {k: full(v) for k, v in s.items()}
              for fqn, s in get_optimizer_state_dict(model, opt)["state"].items()}
    _train(model, opt, rank, mesh.size(), steps=3)
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted,
            "resumed": [full(p) for p in model.parameters()], "path": path}


def _reshard_to_world(world_mesh, rank, path):
    """All ranks load a two-rank checkpoint into FSDP2 over the whole world; returns the full states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _fsdp(world_mesh, dtype=torch.bfloat16)
    opt = make_optimizer(model.parameters(), master_weights=True, exp_avg_sq_dtype=torch.float16)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])
    return {fqn: {k: full(v) for k, v in s.items()} for fqn, s in get_optimizer_state_dict(model, opt)["state"].items()}


def _ddp_case(rank, group, poison=None, fp16=False):
    model = make_model(torch.float16 if fp16 else torch.float32)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = make_optimizer(ddp.parameters(), process_group=group)
    if fp16:
        opt = FP16_Optimizer(opt, init_scale=2.0**8)
    skipped = _train(ddp, opt, rank, 2, poison=poison)
    masters = opt.master_params if fp16 else list(model.parameters())
    import copy

    copied = copy.deepcopy(opt.optimizer if fp16 else opt)  # a process group is not copied: the copy decides alone
    return {"params": [m.detach().float().clone() for m in masters], "skipped": skipped,
            "copy_has_group": copied.process_group is not None}


def _replicas_with_own_grads(rank, group, steps=3):
    """Plain params replicated over a process group whose gradients differ from rank to rank (rank r's are r + 1
    times larger), in one native bucket: the case where the native plan could unscale and clip by itself
    (FusedAdam._scaled_in_plan) but must not, as it would clip by this rank's norm instead of the group's."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64))
    opt = make_optimizer([p], process_group=group)
    grads, norms = [], []
    for step in range(steps):
        p.grad = torch.randn(64, generator=torch.Generator().manual_seed(100 + step)) * (rank + 1)
        grads.append(p.grad.clone())
        opt.step()
        norms.append(opt.last_grad_norm.clone())
    lone_native = list(opt._plan.buckets())
    return {"param": p.detach().clone(), "grads": grads, "norms": norms,
            "fast_path_eligible": opt._scaled_in_plan(lone_native, None, None)}


def _rank_without_gradients(rank, group) -> dict:
    """Rank 1 has no gradient at all; rank 0's step still needs its share of the all-reduce (zeros), and both follow
    one decision: rank 0's gradient holds an inf at the second step, so both skip it."""
    p = nn.Parameter(torch.ones(4))
    opt = make_optimizer([p], process_group=group)
    skipped, norms = [], []
    for step in range(2):
        p.grad = torch.full((4,), float("inf") if step == 1 else 2.0) if rank == 0 else None
        opt.step(grad_scale=torch.tensor(2.0))
        skipped.append(opt.last_step_skipped)
        norms.append(float(opt.last_grad_norm))
    return {"skipped": skipped, "norms": norms, "param": p.detach().clone()}


def _pipeline_case(rank, pipeline_group, data_group, poison=None) -> dict:
    """2 pipeline stages x 2 data-parallel replicas on 4 ranks: stage rank % 2 owns layer 0 or layer 2 (each rank
    computes the whole small model, which is what the stages together do; only the ownership of params matters to
    the optimizer), replica rank // 2 takes half the batch and the gradients are averaged over data_group, as DDP
    does. The clipping norm must cover both stages' params (each replica counted once)."""
    import torch.distributed as dist

    stage, replica = rank % 2, rank // 2
    model = make_model()
    owned = list(model[2 * stage].parameters())
    opt = make_optimizer(owned, process_group=data_group, pipeline_group=pipeline_group)
    skipped = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(2)[replica], y.chunk(2)[replica]
        opt.zero_grad()
        model.zero_grad()
        loss_fn(model, x, y).backward()
        for q in owned:
            dist.all_reduce(q.grad, group=data_group)
            q.grad /= 2
        if poison is not None and poison == (step, rank):
            owned[0].grad.view(-1)[0] = float("inf")
        opt.step()
        skipped.append(opt.last_step_skipped)
        for owner in (0, 1):  # the next forward sees both stages' updated layers (as activations would carry them)
            for q in model[2 * owner].parameters():
                dist.broadcast(q.data, src=2 * replica + owner, group=pipeline_group)
    return {"stage": stage, "params": [q.detach().clone() for q in owned], "skipped": skipped,
            "norm": float(opt.last_grad_norm)}


def _refusals(mesh, other_mesh) -> dict:
    """Bad distributed input is refused before anything changes, with the param named."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    out = {}
    for name in ("plain-grad", "mesh"):  # (gradients in other placements are redistributed: test_tensor_parallel.py)
        w = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Replicate()]))
        w.grad = torch.ones(4, 2) if name == "plain-grad" else DTensor.from_local(torch.ones(4, 2), other_mesh,
                                                                                  [Replicate()], run_check=False)
        opt = make_optimizer([w])
        try:
            opt.step()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
        out[name + "-untouched"] = bool(torch.equal(w.to_local(), torch.ones(4, 2))) and not opt.state.get(w)
    w = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    w.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    opt = make_optimizer([w])
    opt.step()
    sd = opt.state_dict()
    before = {k: full(v) for k, v in opt.state[w].items()}
    sd["state"][0]["exp_avg"] = distribute_tensor(torch.ones(2, 4), mesh, [Shard(0)])  # the wrong full shape
    try:
        opt.load_state_dict(sd)
        out["bad-shape"] = "no error"
    except ValueError as exc:
        out["bad-shape"] = str(exc)
    out["bad-shape-untouched"] = all(torch.equal(full(opt.state[w][k]), v) for k, v in before.items())
    appended = make_optimizer([nn.Parameter(torch.zeros(1))])
    appended.param_groups[0]["params"].append(w)  # (not through add_param_group)
    out["appended-dtensor-reduces"] = appended._reduction() is not None
    try:
        FusedAdam([w], step_in_backward=True)
        out["step-in-backward"] = "no error"
    except ValueError as exc:
        out["step-in-backward"] = str(exc)
    return out


def scenarios(rank: int, world: int, tmp_dir: str) -> dict:
    import torch.distributed as dist

    out = {"rank": rank}
    pair_rank = rank % 2
    pair_ranks = [[0, 1], [2, 3]]
    pair_groups = [dist.new_group(r) for r in pair_ranks]  # every rank creates every group (collective)
    pair_group = pair_groups[rank // 2]
    out["ddp"] = _ddp_case(pair_rank, pair_group)
    out["ddp-inf"] = _ddp_case(pair_rank, pair_group, poison=(2, 0))
    out["ddp-fp16-inf"] = _ddp_case(pair_rank, pair_group, poison=(2, 0), fp16=True)
    out["replicas-own-grads"] = _replicas_with_own_grads(pair_rank, pair_group)
    out["rank-without-gradients"] = _rank_without_gradients(pair_rank, pair_group)
    data_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the two ranks of each pipeline stage
    out["pipeline"] = _pipeline_case(rank, pair_group, data_groups[rank % 2])
    out["pipeline-inf"] = _pipeline_case(rank, pair_group, data_groups[rank % 2], poison=(2, 3))
    if FSDP2_REASON is not None:
        return out

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pair_mesh = mesh["tp"]  # ranks {0, 1} and {2, 3}
    world_mesh = init_device_mesh("cpu", (world,))
    for name in FSDP_CASES:
        out[f"fsdp-{name}"] = _fsdp_case(pair_mesh, pair_rank, name)
    out["fsdp-world"] = _fsdp_case(world_mesh, rank, "fp32-clip")

    model = _fsdp(pair_mesh)
    out["fsdp-inf"] = _train(model, make_optimizer(model.parameters()), pair_rank, 2, poison=(2, 1))
    model = _fsdp(pair_mesh)
    fp16_opt = FP16_Optimizer(make_optimizer(model.parameters()), init_scale=2.0**8)
    out["fsdp-fp16-optimizer-inf"] = _train(model, fp16_opt, pair_rank, 2, poison=(2, 1))
    out["fsdp-fp16-optimizer-scale"] = fp16_opt.loss_scale
    model = _fsdp(pair_mesh)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALER_INIT)
    out["fsdp-grad-scaler-inf"] = _train(model, make_optimizer(model.parameters()), pair_rank, 2, poison=(2, 1),
                                         scaler=scaler)
    out["fsdp-grad-scaler"] = {"scale": scaler.get_scale(), "params": [full(p) for p in model.parameters()]}

    model = _tp(pair_mesh)
    opt = make_optimizer(model.parameters())
    shadow = _shadow_of(model)
    _train(model, opt, pair_rank, 2, shadow, data_parallel=False)
    out["tp"] = {"params": [full(p) for p in model.parameters()],
                 "shadow": [p.detach().clone() for p in shadow[0].parameters()]}

    model = _tp(mesh["tp"])
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = make_optimizer(model.parameters())
    shadow = _shadow_of(model)
    _train(model, opt, rank // 2, 2, shadow)  # data-parallel over "dp"; the two TP ranks of a row share the batch
    out["2d"] = {"params": [full(p) for p in model.parameters()],
                 "shadow": [p.detach().clone() for p in shadow[0].parameters()],
                 "placements": [str(p.placements) for p in model.parameters()]}

    out["refusals"] = _refusals(pair_mesh, world_mesh)
    out["local-tensor-changes"] = _local_tensor_changes(pair_mesh)
    out["checkpoint"] = _checkpoint_case(pair_mesh, pair_rank, tmp_dir, rank // 2)
    dist.barrier()
    out["reshard-2-to-4"] = _reshard_to_world(world_mesh, rank, str(Path(tmp_dir) / "ckpt-pair0"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(scenarios, WORLD, tmp_path_factory.mktemp("distributed"))


needs_fsdp2 = pytest.mark.skipif(FSDP2_REASON is not None, reason=FSDP2_REASON or "")


def assert_close(got, want, tol, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (what, i)
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        assert diff <= tol, f"{what}: param {i} differs by {diff} (tolerance {tol})"


def assert_bitwise(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: param {i} not bit for bit " \
            f"(max diff {float((a.double() - b.double()).abs().max())})"


# ---- DDP (both environments) ---------------------------------------------------------------------------------------


def test_ddp_with_process_group_equals_one_process(results):
    assert not results[0]["ddp"]["copy_has_group"]
    for r in results:
        assert_bitwise(r["ddp"]["params"], results[0]["ddp"]["params"], f"rank {r['rank']} vs rank 0")
    # the ranks' averaged gradients vs one batch: float32 rounding through 5 clipped steps
    assert_close(results[0]["ddp"]["params"], one_process(), 5e-5, "DDP vs one process")


@pytest.mark.parametrize("case", ["ddp-inf", "ddp-fp16-inf"])
def test_ddp_inf_on_one_rank_skips_on_every_rank(results, case):
    for r in results:
        assert r[case]["skipped"] == [step == 2 for step in range(STEPS)], (r["rank"], r[case]["skipped"])
        assert_bitwise(r[case]["params"], results[0][case]["params"], f"rank {r['rank']}")


def test_clipping_by_the_group_norm_not_the_native_plans_local_one(results):
    """One native bucket per rank with clipping would unscale and clip inside the plan, by the local norm; with a
    process_group the norm is the group's (each replica counted once: the mean of the ranks' sums of squares), and
    each rank's update equals one process stepping its gradient multiplied by that clip coefficient."""
    pair = [results[0]["replicas-own-grads"], results[1]["replicas-own-grads"]]
    assert all(out["fast_path_eligible"] for out in pair)  # (so this test would fail if the plan clipped alone)
    torch.manual_seed(0)
    init = torch.randn(64)
    for step in range(len(pair[0]["grads"])):
        want = (sum(out["grads"][step].double().square().sum() for out in pair) / len(pair)).sqrt()
        for out in pair:
            assert abs(float(out["norms"][step]) - float(want)) <= 1e-5 * float(want), (step, out["norms"][step], want)
    for rank, out in enumerate(pair):
        p = nn.Parameter(init.clone())
        opt = make_optimizer([p], clip=None)
        for step, g in enumerate(out["grads"]):
            norm = float(out["norms"][step])
            p.grad = g.clone()
            opt.step(grad_scale=1.0 / min(1.0, CLIP / (norm + 1e-6)))  # divides by 1 / clip_coef: clips
        assert_close([out["param"]], [p.detach()], 1e-6, f"rank {rank} vs one process clipped by the group norm")
        assert_bitwise([results[rank + 2]["replicas-own-grads"]["param"]], [out["param"]], "pairs agree")


def test_a_rank_without_gradients_joins_the_reduction_and_the_skip(results):
    for r in results:
        out = r["rank-without-gradients"]
        assert out["skipped"] == [False, True], (r["rank"], out)
        # the unscaled gradient (1.0 x 4 elements on rank 0, counted once for the 2 replicas): sqrt(4 / 2)
        assert out["norms"][0] == pytest.approx(2**0.5, rel=1e-6), (r["rank"], out)
        assert not math.isfinite(out["norms"][1]), (r["rank"], out)  # the inf reached rank 1's norm too
    assert not torch.equal(results[0]["rank-without-gradients"]["param"], torch.ones(4))  # rank 0 stepped once
    assert torch.equal(results[1]["rank-without-gradients"]["param"], torch.ones(4))  # rank 1 had nothing to step


def test_pipeline_stages_clip_by_the_whole_models_norm_and_skip_together(results):
    """pipeline_group adds the stages' sums: each stage's params equal the same layer of one process training the
    whole model (clipped at every step, so a stage-local norm would differ), and an inf on one rank of one stage
    skips the step on all four ranks."""
    want = one_process()
    for r in results:
        out = r["pipeline"]
        stage = out["stage"]
        assert_close(out["params"], want[2 * stage:2 * stage + 2], 5e-5, f"rank {r['rank']} (stage {stage})")
        assert out["norm"] == pytest.approx(results[0]["pipeline"]["norm"], rel=1e-6)
        assert r["pipeline-inf"]["skipped"] == [step == 2 for step in range(STEPS)], (r["rank"], r["pipeline-inf"])


def test_a_step_without_any_gradient_changes_nothing_with_or_without_loss_scaling():
    p = nn.Parameter(torch.ones(3))
    for kwargs in ({}, {"grad_scale": torch.tensor(4.0)}, {"grad_scale": 4.0}):
        opt = make_optimizer([p])
        opt.step(**kwargs)
        assert torch.equal(p, torch.ones(3)) and not opt.state.get(p) and not opt.last_step_skipped, kwargs


# ---- FSDP2, TP, 2D -------------------------------------------------------------------------------------------------


@needs_fsdp2
@pytest.mark.parametrize("name", list(FSDP_CASES) + ["world"])
def test_fsdp2_equals_full_tensor_shadow(results, name):
    for r in results:
        out = r[f"fsdp-{name}"]
        if FSDP_CASES.get(name, ({}, {}))[1].get("clip", CLIP) is None:
            assert_bitwise(out["params"], out["shadow"], f"rank {r['rank']} {name}")  # elementwise: exact
        else:
            assert_close(out["params"], out["shadow"], 1e-6, f"rank {r['rank']} {name}")
        assert_bitwise(out["params"], results[r["rank"] % 2][f"fsdp-{name}"]["params"] if name != "world"
                       else results[0]["fsdp-world"]["params"], "ranks agree")
        assert out["plans"] == 1  # planned at the first step, valid at every later one (FSDP2 keeps its shards)
    if name == "world":
        assert results[3]["fsdp-world"]["local_shapes"][2] == (0, 16)  # an empty shard took part


@needs_fsdp2
@pytest.mark.parametrize("name", ["fp32-clip", "fp32-noclip", "mp-bf16-clip", "world"])
def test_fsdp2_equals_one_process(results, name):
    out = results[0][f"fsdp-{name}"]
    clip = FSDP_CASES.get(name, ({}, {}))[1].get("clip", CLIP)
    # bf16 compute (MixedPrecisionPolicy) vs fp32 in one process: the forward/backward itself differs
    tolerance = 2e-2 if name.startswith("mp") else 5e-5
    assert_close(out["params"], one_process(clip=clip), tolerance, name)


@needs_fsdp2
def test_fsdp2_bf16_params_with_masters_and_low_precision_moments_equal_one_process(results):
    out = results[0]["fsdp-bf16-masters-lowbit-amsgrad"]
    _, opt_kwargs = FSDP_CASES["bf16-masters-lowbit-amsgrad"]
    ref = one_process(dtype=torch.bfloat16, **opt_kwargs)
    assert_close(out["params"], ref, 2 * 2.0**-8, "bf16 params within two bf16 ulps (of 1)")


@needs_fsdp2
@pytest.mark.parametrize("case", ["tp", "2d"])
def test_tensor_parallel_and_2d_equal_shadow_and_one_process(results, case):
    for r in results:
        assert_close(r[case]["params"], r[case]["shadow"], 1e-6, f"rank {r['rank']} {case} vs shadow")
        assert_bitwise(r[case]["params"], results[0][case]["params"], "ranks agree")
    assert_close(results[0][case]["params"], one_process(), 5e-5, f"{case} vs one process")
    if case == "2d":
        assert any("_StridedShard" in p or "Shard(dim=1)" in p for p in results[0]["2d"]["placements"])


@needs_fsdp2
def test_steps_follow_a_dtensors_new_local_tensor_and_reallocated_storage(results):
    for r in results:
        want = {"old-untouched": True, "after-swap": True, "after-realloc": True}
        assert r["local-tensor-changes"] == want, r["rank"]


@needs_fsdp2
@pytest.mark.parametrize("case", ["fsdp-inf", "fsdp-fp16-optimizer-inf"])
def test_fsdp2_inf_on_one_rank_skips_on_every_rank(results, case):
    for r in results:
        assert r[case] == [step == 2 for step in range(STEPS)], (r["rank"], r[case])
    assert len({r["fsdp-fp16-optimizer-scale"] for r in results}) == 1


@needs_fsdp2
def test_fsdp2_with_torch_grad_scaler_skips_together_and_equals_one_process(results):
    """torch.amp.GradScaler drives FusedAdam through grad_scale/found_inf (fused-optimizer protocol). Its found_inf
    comes from each rank's local shards; FusedAdam's one all-reduce makes the skip global, and the scale is updated
    alike on every rank (one halving for the one poisoned step)."""
    for r in results:
        assert r["fsdp-grad-scaler-inf"] == [step == 2 for step in range(STEPS)], (r["rank"], r["fsdp-grad-scaler-inf"])
        assert r["fsdp-grad-scaler"]["scale"] == SCALER_INIT / 2
    want = one_process(grad_scaler=True, inf_step=2)
    assert_close(results[0]["fsdp-grad-scaler"]["params"], want, 5e-5, "FSDP2 + GradScaler vs one process")
    assert_bitwise(results[1]["fsdp-grad-scaler"]["params"], results[0]["fsdp-grad-scaler"]["params"], "ranks agree")


# ---- distributed checkpoints ----------------------------------------------------------------------------------------


@needs_fsdp2
def test_dcp_resume_is_bit_for_bit(results):
    for r in results:
        out = r["checkpoint"]
        assert_bitwise(out["resumed"], out["uninterrupted"], f"rank {r['rank']}")
        for fqn, state in out["saved"].items():
            for key, value in state.items():
                assert torch.equal(out["loaded"][fqn][key], value), (fqn, key)


@needs_fsdp2
def test_two_rank_checkpoint_loads_into_four_ranks(results):
    saved = results[0]["checkpoint"]["saved"]
    for r in results:
        loaded = r["reshard-2-to-4"]
        assert loaded.keys() == saved.keys()
        for fqn in saved:
            for key, value in saved[fqn].items():
                assert torch.equal(loaded[fqn][key], value), (r["rank"], fqn, key)


@needs_fsdp2
def test_two_rank_checkpoint_loads_into_one_process(results):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = make_model(torch.bfloat16)
    opt = make_optimizer(model.parameters(), master_weights=True, exp_avg_sq_dtype=torch.float16)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=results[0]["checkpoint"]["path"], no_dist=True)
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = get_optimizer_state_dict(model, opt)["state"]
    saved = results[0]["checkpoint"]["saved"]
    assert loaded.keys() == saved.keys()
    for fqn in saved:
        for key, value in saved[fqn].items():
            assert torch.equal(loaded[fqn][key], value), (fqn, key)


@needs_fsdp2
def test_bad_distributed_input_is_refused_naming_the_param_and_changes_nothing(results):
    for r in results:
        out = r["refusals"]
        assert "param_groups[0]['params'][0]" in out["plain-grad"] and "needs a DTensor gradient" in out["plain-grad"]
        assert "param_groups[0]['params'][0]" in out["mesh"] and "on another device mesh" in out["mesh"], out["mesh"]
        assert "state_dict['state'][0]['exp_avg']" in out["bad-shape"] and "(2, 4)" in out["bad-shape"], \
            out["bad-shape"]
        assert out["plain-grad-untouched"] and out["mesh-untouched"] and out["bad-shape-untouched"]
        assert "param_groups[0]['params'][0]" in out["step-in-backward"] and "DTensor" in out["step-in-backward"]
        assert out["appended-dtensor-reduces"]


def test_step_in_backward_with_a_process_group_is_refused():
    # (its per-param updates would run before DDP has averaged the gradients)
    with pytest.raises(ValueError, match="process_group.*step_in_backward=False"):
        FusedAdam([nn.Parameter(torch.ones(2))], step_in_backward=True, process_group=object())
