"""FusedAdam under torch.distributed against itself: the scenarios (FSDP2, tensor parallel, 2D FSDP x TP, DDP, pipeline
process groups and distributed checkpoints) and references that test_ddp.py, test_fsdp2.py, test_tensor_parallel.py
and test_dcp.py compare.

One spawn of 4 gloo ranks (tests/distributed_harness.py, once per test session whichever of those modules run) runs
every scenario; the parent compares. The 4 ranks form a
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

import os
from pathlib import Path

import pytest
import torch
import fp16_scenarios
from distributed_harness import run_once, torch_too_old
from torch import nn

from ort_optim import AdamWMode, FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer

WORLD = 4
STEPS = 5
SCALER_INIT = 2.0**8
CLIP = 0.05  # well below the gradients' norm (about 0.3-1): every step clips
FSDP2_REASON = torch_too_old((2, 6), "FSDP2 (fully_shard) on CPU with gloo (these FSDP2/TP/2D/DCP scenarios run "
                                     "together)")


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


CODED_MOMENTS = (torch.uint8, torch.uint4, torch.float8_e4m3fn)


def _fsdp_coded_case(mesh, rank, dtype) -> dict:
    """8-bit, 4-bit or fp8 moments under FSDP2, without clipping, beside a FusedAdam over plain copies of this rank's
    local pieces stepped with their local gradients: the blocks and the stochastic roundings' element indices are the
    piece's, so the two must agree bit for bit."""
    from ort_optim.integrations import dtensor

    kwargs = dict(clip=None, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    model = _fsdp(mesh)
    opt = make_optimizer(model.parameters(), **kwargs)
    pieces = [nn.Parameter(dtensor.local(p).detach().clone()) for p in model.parameters()]
    pieces_opt = make_optimizer(pieces, **kwargs)
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(mesh.size())[rank], y.chunk(mesh.size())[rank]
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        for p, q in zip(model.parameters(), pieces):
            q.grad = dtensor.local(p.grad).detach().clone()
        opt.step()
        pieces_opt.step()
    return {"params": [dtensor.local(p).detach().clone() for p in model.parameters()],
            "pieces": [q.detach().clone() for q in pieces]}


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
    times larger), in one native bucket: the case where the native plan sees only this rank's gradients, whose norm
    is not the group's."""
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
            "lone_native_bucket": len(lone_native) == 1 and lone_native[0][2].native is not None}


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
    # params on meshes over ranks {0, 1} and {1, 2}, which together do not span the world: no global norm without a
    # process_group; refused at the first step, before any state is made (every rank creates both meshes)
    from torch.distributed.device_mesh import DeviceMesh

    apart = [DeviceMesh("cpu", ranks) for ranks in ([0, 1], [1, 2])]
    ws = [nn.Parameter(distribute_tensor(torch.ones(4, 3), m, [Shard(0)])) for m in apart]
    for p, m in zip(ws, apart):
        p.grad = distribute_tensor(torch.ones(4, 3), m, [Shard(0)])
    opt = make_optimizer(ws)
    try:
        opt.step()
        out["meshes-apart"] = "no error"
    except ValueError as exc:
        out["meshes-apart"] = str(exc)
    out["meshes-apart-untouched"] = (all(torch.equal(p.to_local(), torch.ones_like(p.to_local())) for p in ws)
                                     and not any(opt.state.get(p) for p in ws) and not opt.state_dict()["state"])
    appended = make_optimizer([nn.Parameter(torch.zeros(1))])
    appended.param_groups[0]["params"].append(w)  # (not through add_param_group)
    out["appended-dtensor-reduces"] = appended._reduction() is not None
    try:
        FusedAdam([w], step_in_backward=True)
        out["step-in-backward"] = "no error"
    except ValueError as exc:
        out["step-in-backward"] = str(exc)
    return out


def _foreign_checkpoint_case(mesh) -> dict:
    """A bitsandbytes AdamW8bit checkpoint (its layout: 8-bit codes, block scales, lookup tables) loaded into FusedAdam
    over DTensor params (Shard(0) and Shard(1), uneven over the ranks) and into FusedAdam over the same params whole,
    both with fp32 moments: the full states of each."""
    import math

    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(7)
    shapes = [(65, 128), (33, 257)]  # (at least 4096 elements each: bitsandbytes codes them)
    state = {}
    for i, shape in enumerate(shapes):
        quant = {}
        for j in (1, 2):
            quant[f"state{j}"] = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            quant[f"qmap{j}"] = torch.linspace(-1.0 if j == 1 else 0.0, 1.0, 256)
            quant[f"absmax{j}"] = torch.rand(-(-math.prod(shape) // 256), generator=g) * 0.1
        state[i] = {"step": 10, "__bnb_optimizer_quant_state__": quant}
    sd = {"state": state, "param_groups": [{"params": [0, 1], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                            "weight_decay": 0.01, "alpha": 0.0, "t_alpha": None, "t_beta3": None}]}
    whole = [nn.Parameter(torch.randn(shape, generator=g)) for shape in shapes]
    plain = make_optimizer(whole)
    plain.load_state_dict(sd)
    sharded = [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(dim)])) for dim, p in enumerate(whole)]
    opt = make_optimizer(sharded)
    opt.load_state_dict(sd)
    return {"sharded": [{k: full(v) for k, v in s.items()} for s in opt.state_dict()["state"].values()],
            "whole": [{k: full(v) for k, v in s.items()} for s in plain.state_dict()["state"].values()]}


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
    out["fp16-optimizer-stages"] = fp16_scenarios.four_ranks(rank)  # (test_fp16_distributed.py)
    if FSDP2_REASON is not None:
        return out

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pair_mesh = mesh["tp"]  # ranks {0, 1} and {2, 3}
    world_mesh = init_device_mesh("cpu", (world,))
    for name in FSDP_CASES:
        out[f"fsdp-{name}"] = _fsdp_case(pair_mesh, pair_rank, name)
    out["fsdp-world"] = _fsdp_case(world_mesh, rank, "fp32-clip")
    for dtype in CODED_MOMENTS:
        out[f"fsdp-coded-{dtype}"] = _fsdp_coded_case(pair_mesh, pair_rank, dtype)

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
    out["foreign-checkpoint"] = _foreign_checkpoint_case(world_mesh)
    return out


def results(tmp_path_factory) -> list[dict]:
    """Every scenario's results, one dict per rank, from one spawn per test session (several test modules read
    them)."""
    return run_once(scenarios, WORLD, tmp_path_factory)


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
