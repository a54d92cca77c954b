"""FusedAdam and FP16_Optimizer against torch's own optimizer under the same engine, on 2 gloo ranks: the scenarios
that test_ddp.py, test_fsdp2.py, test_tensor_parallel.py, test_dcp.py and test_deepspeed.py compare.

mesh_scenarios.py compares FusedAdam with itself (a FusedAdam stepping the full gradients, or one process); these
compare it with what users switch from: ``torch.optim.AdamW`` (+ ``torch.nn.utils.clip_grad_norm_``)
inside the same engine, from the same seed, over many steps, and with torch's own checkpoint machinery:

* FSDP2 (``fully_shard``): fp32 and ``MixedPrecisionPolicy(param_dtype=bf16)``, ``reshard_after_forward`` both ways,
  uneven shards (dims not divisible by 2, a layer whose shard is empty on rank 1), a param that gets no gradient on
  odd steps, gradient accumulation through ``set_requires_gradient_sync(False)``, amsgrad/maximize/param groups,
  and HSDP (params replicated over a mesh dim);
* tensor parallel (``ColwiseParallel``/``RowwiseParallel``, whose row-wise bias is replicated: counted once);
* DDP with ``process_group=`` and gradient accumulation under ``no_sync()``;
* ``last_grad_norm`` equal on every rank to the total norm ``clip_grad_norm_`` returns for the whole model;
* FP16_Optimizer's overflow decision: an inf on one rank only skips the step on every rank, scales stay equal;
* ``torch.distributed.checkpoint``: FusedAdam's checkpoint loads into torch.optim.AdamW and torch's into FusedAdam
  (then both continue alike), the full-state-dict path and the flattened state dict (torchtitan's default) resume
  bit for bit, FP16_Optimizer(FusedAdam) resumes through the guide's recipe, a one-process checkpoint loads
  into 2 ranks (the other direction, 2 -> 1 and 2 -> 4, is in mesh_scenarios.py), and a checkpoint without masters
  loads into FusedAdam(master_weights=True) through the guide's recipe with each master from its loaded param;
* DeepSpeed ZeRO 1-3 (where DeepSpeed imports: the .venv environment): FusedAdam as the client against torch's
  AdamW with gradient accumulation and clipping, and ``max_grad_norm`` on the partitions refused;
* bad input refused with the param named and nothing changed.

Tolerances (stated per case below): in the same engine both optimizers see the same gradients; FusedAdam's
ADAMW_TORCH update is torch's formula in another order of float32 operations (measured here: 3e-8 to 6e-8 after 20
steps of lr 1e-2), so fp32 params agree within 1e-6, and the clipping norm within 1e-5 relative (another summation
order). Under bf16 compute the same small difference feeds the next forward in bf16, where it can flip a rounding
(measured: none, 3e-8): 1e-4.

One spawn of 2 ranks runs every scenario (tests/distributed_harness.py, once per test session). FSDP2 and DCP need torch >= 2.6 on CPU with
gloo; in older torch (the .venv environment) those skip with the reason, and DDP, TP and DeepSpeed run.
"""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path

import pytest
import torch
import fp16_scenarios
from distributed_harness import run_once, torch_too_old
from torch import nn

from ort_optim import AdamWMode, FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer

WORLD = 2
STEPS = 20
LR, EPS, WD = 1e-2, 1e-8, 1e-2
CLIP = 0.05  # below the gradients' norm (about 0.2-1): every step clips
FSDP2_REASON = torch_too_old((2, 6), "FSDP2 (fully_shard) and torch.distributed.checkpoint on CPU with gloo")
needs_fsdp2 = pytest.mark.skipif(FSDP2_REASON is not None, reason=FSDP2_REASON or "")


class Net(nn.Module):
    """Uneven shards on 2 ranks: 5 rows (3 + 2), and a 1-row head whose shard on rank 1 is empty. `side` is used on
    even steps only, so on odd steps its params have no gradient."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 5)
        self.head = nn.Linear(5, 1)
        self.side = nn.Linear(8, 1)

    def forward(self, x, step):
        out = self.head(torch.nn.functional.gelu(self.inp(x)))
        return out + self.side(x) if step % 2 == 0 else out


def make_net(dtype=torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def fused(params, clip=CLIP, **kwargs) -> FusedAdam:
    return FusedAdam(params, lr=LR, eps=EPS, weight_decay=WD, adam_w_mode=AdamWMode.ADAMW_TORCH, max_grad_norm=clip,
                     **kwargs)


def torch_adamw(params, **kwargs) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WD, foreach=False, **kwargs)


def groups(model) -> list[dict]:
    """The usual split: no weight decay for biases, and another lr for them."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("bias")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": LR / 2}]


def full(t: torch.Tensor) -> torch.Tensor:
    from ort_optim.integrations import dtensor

    return (t.full_tensor() if dtensor.is_dtensor(t) else t).detach().clone()


def _train(model, opt, rank, kind, steps=STEPS, clip=CLIP, micro=1, sync=None, start=0):
    """Trains data-parallel (rank r takes its slice of each batch); kind 'fused' or 'torch' (torch: clip_grad_norm_
    then step). micro: micro-batches per step, all but the last under sync(False) (no_sync / FSDP2's
    set_requires_gradient_sync). Returns per-step norms: FusedAdam's last_grad_norm or clip_grad_norm_'s total."""
    norms = []
    for step in range(start, start + steps):
        x, y = batch(step, 8 * micro)
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = i == micro - 1
            with sync(last) if sync is not None else contextlib.nullcontext():
                out = model(xm.to(next(model.parameters()).dtype), step)
                (torch.nn.functional.mse_loss(out.float(), ym) / micro).backward()
        if kind == "torch" and clip is not None:
            norms.append(full(torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip, foreach=False)))
        opt.step()
        if kind == "fused" and clip is not None:
            norms.append(full(opt.last_grad_norm))
    return norms


def _fsdp(reshard=True, mp=False, dtype=torch.float32, hsdp=False):
    """FSDP2 over the 2 ranks; hsdp: HSDP on a (replicate 2, shard 1) mesh, whose params are Replicate on the first
    dim (the norm must count each replica once)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_net(dtype)
    mesh = (init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (WORLD,)))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model.inp, model.head):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)  # (side stays in the root's group)
    return model


FSDP_CASES = {  # name: (fsdp kwargs, train kwargs)
    "fp32-reshard": ({}, {}),
    "fp32-keep-unsharded": ({"reshard": False}, {}),
    "fp32-noclip": ({}, {"clip": None}),
    "mp-bf16": ({"mp": True}, {}),
    "grad-accumulation": ({}, {"micro": 2}),
    "amsgrad-maximize-groups": ({}, {"options": {"amsgrad": True, "maximize": True}, "groups": True}),
    "hsdp": ({"hsdp": True}, {}),
}


def _fsdp_vs_torch(rank, name):
    fsdp_kwargs, case = FSDP_CASES[name]
    train_kwargs = {k: v for k, v in case.items() if k not in ("options", "groups")}
    clip, options = case.get("clip", CLIP), case.get("options", {})
    out = {}
    for kind in ("fused", "torch"):
        model = _fsdp(**fsdp_kwargs)
        params = groups(model) if case.get("groups") else model.parameters()
        opt = fused(params, clip=clip, **options) if kind == "fused" else torch_adamw(params, **options)
        sync = (lambda last: _fsdp_sync(model, last)) if train_kwargs.get("micro", 1) > 1 else None
        norms = _train(model, opt, rank, kind, sync=sync, **train_kwargs)
        out[kind] = {"params": [full(p) for p in model.parameters()], "norms": norms,
                     "local": [tuple(p.to_local().shape) for p in model.parameters()],
                     "placements": {str(tuple(p.placements)) for p in model.parameters()}}
    return out


class _fsdp_sync:  # noqa: N801 (a context manager used like DDP's no_sync)
    """FSDP2's gradient accumulation: no reduce-scatter until the last micro-batch."""

    def __init__(self, model, last):
        self.model, self.last = model, last

    def __enter__(self):
        self.model.set_requires_gradient_sync(self.last)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


def _tp(dtype=torch.float32) -> nn.Module:
    """Tensor parallel on the 2 ranks: a column-wise Linear (6 rows: 3 + 3) then a row-wise one, whose bias is
    replicated (each rank holds all of it: the global norm must count it once). Every rank sees the same batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 3)).to(dtype)
    return parallelize_module(model, init_device_mesh("cpu", (WORLD,)), {"0": ColwiseParallel(),
                                                                         "2": RowwiseParallel()})


def tp_batch(step: int):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)


def _tp_vs_torch(rank):
    out = {}
    for kind in ("fused", "torch"):
        model = _tp()
        opt = fused(model.parameters()) if kind == "fused" else torch_adamw(model.parameters())
        norms = []
        for step in range(STEPS):
            x, y = tp_batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if kind == "torch":
                norms.append(full(torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP, foreach=False)))
            opt.step()
            if kind == "fused":
                norms.append(full(opt.last_grad_norm))
        out[kind] = {"params": [full(p) for p in model.parameters()], "norms": norms,
                     "placements": [str(p.placements) for p in model.parameters()]}
    return out


def _ddp_vs_torch(rank):
    import torch.distributed as dist

    out = {}
    for kind in ("fused", "torch"):
        model = make_net()
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = (fused(ddp.parameters(), process_group=dist.group.WORLD) if kind == "fused"
               else torch_adamw(ddp.parameters()))
        norms = _train(ddp, opt, rank, kind, micro=2,
                       sync=lambda last: contextlib.nullcontext() if last else ddp.no_sync())
        out[kind] = {"params": [full(p) for p in model.parameters()], "norms": norms}
    return out


DDP_ORDERS = ("DDP made first", "optimizer made first", "DDP made after the first backward")


def _step_in_backward_under_ddp(rank, order: str) -> dict:
    """FusedAdam(step_in_backward=True) over the params of a DistributedDataParallel (its own process group). The
    optimizer resumes from a checkpoint (non-empty state) and the gradients hold zeros (zero_grad(set_to_none=False)),
    so that 'unchanged' means something. Returns the first backward's error and snapshots of params, gradients and
    optimizer state before and after it. 'DDP made after the first backward': that backward (without DDP) passes the
    setup check, so the end-of-backward check of the next one refuses (the backstop): params updated once."""
    import torch.distributed as dist

    from conftest import optimizer_snapshot

    group = dist.new_group([0, 1])  # (every rank calls it, in the same order)
    model = make_net()
    plain = fused(model.parameters(), clip=None)
    _train(model, plain, rank, "fused", steps=2, clip=None)  # (this rank's own data: a checkpoint to resume from)
    opt = fused(model.parameters(), clip=None, step_in_backward=True)
    opt.load_state_dict(plain.state_dict())
    opt.zero_grad(set_to_none=False)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group) if order == "DDP made first" else None
    x, y = batch(100)
    x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
    if order == "DDP made after the first backward":
        torch.nn.functional.mse_loss(model(x, 0), y).backward()
        opt.zero_grad(set_to_none=False)
    if ddp is None:
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    before = optimizer_snapshot(opt)
    try:
        torch.nn.functional.mse_loss(ddp(x, 0), y).backward()
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "before": before, "after": optimizer_snapshot(opt)}


INF_STEPS = (2, 5)  # an inf in rank 1's gradient shard only, at these steps
LOSS_SCALE = 2.0**8


def _poison(model, rank, step):
    from ort_optim.integrations import dtensor

    if rank == 1 and step in INF_STEPS:
        dtensor.local(model.inp.weight.grad).view(-1)[0] = float("inf")


def _fp16_optimizer_run(rank, engine: str, kind: str) -> dict:
    """FP16_Optimizer on DTensor params (engine 'fsdp2': data parallel, the Net; 'tp': the same batch everywhere),
    with clipping and an inf in rank 1's local gradient only. kind: 'fused' (FusedAdam inside: its masters and fused
    path), 'torch' (torch.optim.AdamW inside: fp32 masters swapped into its groups), 'torch-fp32' (the same on fp32
    params, where only the scaling, the skip and the clipping remain); the first two on fp16 params."""
    from ort_optim.integrations import dtensor

    dtype = torch.float32 if kind == "torch-fp32" else torch.float16
    model = _fsdp(dtype=dtype) if engine == "fsdp2" else _tp(dtype)
    inner = fused(model.parameters(), clip=None) if kind == "fused" else torch_adamw(model.parameters())
    opt = FP16_Optimizer(inner, init_scale=LOSS_SCALE, max_grad_norm=CLIP)
    first = next(model.parameters())
    record, norms = [], []
    for step in range(8):
        opt.zero_grad()
        if engine == "fsdp2":
            x, y = batch(step)
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
            opt.backward(torch.nn.functional.mse_loss(model(x.to(dtype), step).float(), y))
        else:
            x, y = tp_batch(step)
            opt.backward(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y))
        if rank == 1 and step in INF_STEPS:
            dtensor.local(first.grad).view(-1)[0] = float("inf")
        opt.step()
        record.append((opt.skipped, opt.loss_scale))
        norms.append(opt.last_grad_norm)
    return {"record": record, "norms": [float(n) for n in norms],
            "norm_types": sorted({type(n).__name__ for n in norms}),
            "masters": [full(m) for m in opt.master_params], "params": [full(p) for p in model.parameters()]}


def _clipped_torch_reference(rank, engine: str) -> dict:
    """torch.optim.AdamW + clip_grad_norm_ on the fp32 model of _fp16_optimizer_run, the poisoned steps skipped by
    hand: what FP16_Optimizer around torch.optim.AdamW must equal on fp32 params (a loss scale of 2**8 unscales
    exactly; the norm's summation order differs)."""
    model = _fsdp() if engine == "fsdp2" else _tp()
    opt = torch_adamw(model.parameters())
    norms = []
    for step in range(8):
        opt.zero_grad()
        if engine == "fsdp2":
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank], step), y.chunk(WORLD)[rank]).backward()
        else:
            x, y = tp_batch(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
        if step in INF_STEPS:
            norms.append(float("inf"))
            continue
        norms.append(float(full(torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP, foreach=False))))
        opt.step()
    return {"norms": norms, "params": [full(p) for p in model.parameters()]}


def _fp16_optimizer_on(rank, engine: str) -> dict:
    out = {kind: _fp16_optimizer_run(rank, engine, kind) for kind in ("fused", "torch", "torch-fp32")}
    out["reference-fp32"] = _clipped_torch_reference(rank, engine)
    return out


def _grad_scaler_on_fsdp2(rank):
    """torch.amp.GradScaler driving FusedAdam and torch's fused AdamW under FSDP2, an inf on rank 1 only; as is, and
    with AMP's clipping recipe (scaler.unscale_(opt), clip_grad_norm_, scaler.step(opt))."""
    out = {}
    for kind in ("fused", "torch-fused", "fused-unscale-clip", "torch-fused-unscale-clip"):
        model = _fsdp()
        opt = (fused(model.parameters(), clip=None) if kind.startswith("fused")
               else torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD, fused=True))
        scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
        scales = []
        for step in range(8):
            x, y = batch(step)
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x, step), y)).backward()
            _poison(model, rank, step)
            if kind.endswith("unscale-clip"):
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP, foreach=False)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        out[kind] = {"scales": scales, "params": [full(p) for p in model.parameters()]}
    return out


def _dcp_between_fused_adam_and_torch(rank, tmp_dir):
    """A FusedAdam checkpoint (dcp.save of get_optimizer_state_dict) resumed by torch.optim.AdamW, and the other way
    round, continues as the uninterrupted run does. Their param_groups hold different options (torch's foreach,
    fused, ...; FusedAdam's adam_w_mode, ...), so the load needs DefaultLoadPlanner(allow_partial_load=True): the
    state (step, exp_avg, exp_avg_sq) is the same and loads whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make(kind):
        model = _fsdp()
        return model, fused(model.parameters()) if kind == "fused" else torch_adamw(model.parameters())

    out = {}
    for src, dst in (("fused", "torch"), ("torch", "fused")):
        path = str(Path(tmp_dir) / f"dcp-{src}-to-{dst}")
        model, opt = make(src)
        _train(model, opt, rank, src, steps=4)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        _train(model, opt, rank, src, steps=4, start=4)
        uninterrupted = [full(p) for p in model.parameters()]
        model, opt = make(dst)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=path)
            out[f"{src}-to-{dst}-strict"] = "loaded"
        except BaseException as exc:  # (dcp's CheckpointException carries every rank's error)
            out[f"{src}-to-{dst}-strict"] = str(exc)[-300:]
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _train(model, opt, rank, dst, steps=4, start=4)
        out[f"{src}-to-{dst}"] = {"resumed": [full(p) for p in model.parameters()], "uninterrupted": uninterrupted}
    return out


def _full_state_dict_resume(rank):
    """The full-state-dict path of torch.distributed.checkpoint.state_dict (what a trainer saves with torch.save):
    gathered with full_state_dict=True, loaded back from rank 0 alone with broadcast_from_rank0=True, into
    FusedAdam with bf16 first and block-scaled fp16 second moments; resumes bit for bit."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.float16}

    def make():
        model = _fsdp()
        return model, fused(model.parameters(), **options)

    model, opt = make()
    _train(model, opt, rank, "fused", steps=4)
    gather = StateDictOptions(full_state_dict=True, cpu_offload=True)  # (rank 0 only keeps it)
    model_sd, optim_sd = get_model_state_dict(model, options=gather), get_optimizer_state_dict(model, opt,
                                                                                               options=gather)
    _train(model, opt, rank, "fused", steps=4, start=4)
    uninterrupted = [full(p) for p in model.parameters()]
    model, opt = make()
    scatter = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_sd if rank == 0 else {}, options=scatter)
    set_optimizer_state_dict(model, opt, optim_sd if rank == 0 else {}, options=scatter)
    _train(model, opt, rank, "fused", steps=4, start=4)
    return {"resumed": [full(p) for p in model.parameters()], "uninterrupted": uninterrupted,
            "gathered": sorted(optim_sd["state"]) if rank == 0 else None}


def _flattened_dcp_resume(rank, tmp_dir):
    """dcp.save/load with StateDictOptions(flatten_optimizer_state_dict=True) (torchtitan's default), FusedAdam with
    8-bit first and block-scaled fp16 second moments and amsgrad: resumes bit for bit. Regression: the load raised
    "state_dict['state']['inp.weight']['exp_avg_sq_scale']: unknown key", as torch unflattens by the keys of the
    live optimizer.state (which holds the block scales) and fills a key missing from the checkpoint with {}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    path = str(Path(tmp_dir) / "flattened")

    def make():
        model = _fsdp()
        return model, fused(model.parameters(), amsgrad=True, exp_avg_dtype=torch.uint8,
                            exp_avg_sq_dtype=torch.float16)

    model, opt = make()
    _train(model, opt, rank, "fused", steps=4)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _train(model, opt, rank, "fused", steps=4, start=4)
    uninterrupted = [full(p) for p in model.parameters()]
    model, opt = make()
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    _train(model, opt, rank, "fused", steps=4, start=4)
    return {"resumed": [full(p) for p in model.parameters()], "uninterrupted": uninterrupted,
            "flat": all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in optim_sd)}


def _one_process_checkpoint_into_two_ranks(rank, tmp_dir):
    """A one-process FusedAdam checkpoint (dcp.save(no_dist=True), plain params) loads into FSDP2 on 2 ranks: the
    same full states, and training continues like the one process (fp32 averaging order: 1e-5)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    path = str(Path(tmp_dir) / "one-process")
    single = make_net()
    single_opt = fused(single.parameters())
    for step in range(4):  # the whole batch in one process
        x, y = batch(step)
        single_opt.zero_grad()
        torch.nn.functional.mse_loss(single(x, step), y).backward()
        single_opt.step()
    saved = {fqn: {k: full(v) for k, v in s.items()} for fqn, s in single_opt.state_dict()["state"].items()}
    if rank == 0:
        dcp.save({"model": get_model_state_dict(single), "optim": get_optimizer_state_dict(single, single_opt)},
                 checkpoint_id=path, no_dist=True)
    dist.barrier()
    model = _fsdp()
    opt = fused(model.parameters())
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = {i: {k: full(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    _train(model, opt, rank, "fused", steps=4, start=4)
    for step in range(4, 8):
        x, y = batch(step)
        single_opt.zero_grad()
        torch.nn.functional.mse_loss(single(x, step), y).backward()
        single_opt.step()
    return {"saved": saved, "loaded": loaded, "params": [full(p) for p in model.parameters()],
            "single": [p.detach().clone() for p in single.parameters()]}


def _a_checkpoint_one_rank_refuses(rank):
    """A one-process checkpoint (full plain tensors) loaded into FSDP2 whose exp_avg_sq holds a negative element in
    rank 1's rows only (exp_avg doubled everywhere): each rank checks its own pieces, rank 1 refuses, and rank 0 must
    refuse too (all load or none): its error, and whether its state changed."""
    model = _fsdp()
    opt = fused(model.parameters())
    _train(model, opt, rank, "fused", steps=2)
    saved = opt.state_dict()
    state = {index: {k: full(v) for k, v in s.items()} for index, s in saved["state"].items()}
    first = next(index for index, s in state.items() if s["exp_avg_sq"].dim() == 2)
    state[first]["exp_avg"] = state[first]["exp_avg"] * 2
    state[first]["exp_avg_sq"] = state[first]["exp_avg_sq"].clone()
    state[first]["exp_avg_sq"][-1, -1] = -1.0  # (the last row: rank 1's shard of dim 0)
    before = {index: {k: v.clone() for k, v in s.items()} for index, s in opt.state_dict()["state"].items()}
    try:
        opt.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
        error = None
    except ValueError as refused:
        error = str(refused)
    after = opt.state_dict()["state"]
    unchanged = all(torch.equal(full(after[i][k]), full(v)) for i, s in before.items() for k, v in s.items())
    return {"error": error, "unchanged": unchanged}


def _dcp_into_master_weights(rank, tmp_dir):
    """A checkpoint without fp32 masters (torch.optim.AdamW's, or FusedAdam's without master_weights) of bf16 FSDP2
    params, loaded into FusedAdam(master_weights=True) through the guide's recipe (dcp.load with
    allow_partial_load=True, then the template's masters dropped: get_state_dict made them from the fresh model, and
    the checkpoint has none to write over them): each master is taken from its loaded param at the next step, as
    FusedAdam.load_state_dict does for a checkpoint without masters. The reference loads the source optimizer's
    state_dict() directly after the model's weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    out = {}
    for src in ("torch", "fused", "torch-flattened"):
        flat = src.endswith("flattened")
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        path = str(Path(tmp_dir) / f"dcp-{src}-to-masters")
        model = _fsdp(dtype=torch.bfloat16)
        opt = torch_adamw(model.parameters()) if src.startswith("torch") else fused(model.parameters())
        _train(model, opt, rank, src.split("-")[0], steps=4)
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        saved = [full(p) for p in model.parameters()]
        direct_model = _fsdp(dtype=torch.bfloat16)
        direct_model.load_state_dict(model.state_dict())
        direct = fused(direct_model.parameters(), master_weights=True)
        direct.load_state_dict(opt.state_dict())
        _train(direct_model, direct, rank, "fused", steps=4, start=4)

        model = _fsdp(dtype=torch.bfloat16)
        opt = fused(model.parameters(), master_weights=True)
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        if flat:  # (keys "state.<fqn>.master_param")
            for key in [key for key in state["optim"] if key.endswith(".master_param")]:
                del state["optim"][key]
        else:
            for entries in state["optim"]["state"].values():
                entries.pop("master_param", None)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
        masters_after_load = sum("master_param" in opt.state[p] for p in model.parameters())
        _train(model, opt, rank, "fused", steps=1, start=4)
        first = [full(p) for p in model.parameters()]
        _train(model, opt, rank, "fused", steps=3, start=5)
        out[src] = {"resumed": [full(p) for p in model.parameters()],
                    "direct": [full(p) for p in direct_model.parameters()],
                    "masters_after_load": masters_after_load, "first_step": max_diff(first, saved)}
    return out


def _fp16_optimizer_dcp_resume(rank, tmp_dir):
    """FP16_Optimizer(FusedAdam) on FSDP2's fp16 params through torch.distributed.checkpoint, as the guide says: the
    FusedAdam inside (which holds the fp32 masters) through get_state_dict/set_state_dict, the loss scaler's state
    as one more entry of the saved dict. An inf on rank 1 before the checkpoint halves the scale, which must come
    back; the resumed run equals the uninterrupted one bit for bit. (get_state_dict(model, the wrapper) itself
    fails inside DCP: the wrapper's state_dict() is ONNX Runtime's layout, not torch's.) The wrapper's own
    state_dict(), loaded in process into a fresh model and wrapper, resumes bit for bit too: its masters go into the
    DTensor params."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ort_optim.integrations import dtensor

    path = str(Path(tmp_dir) / "fp16-optimizer")

    def make():
        model = _fsdp(dtype=torch.float16)
        return model, FP16_Optimizer(fused(model.parameters(), clip=None), init_scale=LOSS_SCALE, max_grad_norm=CLIP)

    def train(model, opt, start):
        for step in range(start, start + 3):
            x, y = batch(step)
            opt.zero_grad()
            opt.backward(torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank].half(), step).float(),
                                                      y.chunk(WORLD)[rank]))
            if rank == 1 and step == 1:
                dtensor.local(model.inp.weight.grad).view(-1)[0] = float("inf")
            opt.step()

    model, opt = make()
    train(model, opt, 0)
    model_sd, optim_sd = get_state_dict(model, opt.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "loss_scaler": opt.scaler.state_dict()}, checkpoint_id=path)
    wrapper_sd = copy.deepcopy(opt.state_dict())  # (the wrapper's own checkpoint, in process)
    saved_scale = opt.loss_scale
    train(model, opt, 3)
    uninterrupted = [full(p) for p in model.parameters()] + [full(m) for m in opt.master_params]
    model, opt = make()
    opt.load_state_dict(wrapper_sd)  # (its masters, local pieces in FusedAdam's state, go into the DTensor params)
    train(model, opt, 3)
    resumed_in_process = [full(p) for p in model.parameters()] + [full(m) for m in opt.master_params]
    model, opt = make()
    model_sd, optim_sd = get_state_dict(model, opt.optimizer)
    state = {"model": model_sd, "optim": optim_sd, "loss_scaler": opt.scaler.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    opt.scaler.load_state_dict(state["loss_scaler"])
    loaded_scale = opt.loss_scale
    train(model, opt, 3)
    return {"saved_scale": saved_scale, "loaded_scale": loaded_scale, "uninterrupted": uninterrupted,
            "resumed": [full(p) for p in model.parameters()] + [full(m) for m in opt.master_params],
            "resumed_in_process": resumed_in_process}


def _refusals(rank):
    """Unsupported distributed input: a clear error naming the param, and nothing changed."""
    from torch.distributed.device_mesh import init_device_mesh

    try:  # torch >= 2.5; torch 2.4's private module has the same classes
        from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import DTensor, Partial, Shard, distribute_tensor

    out = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    partial = nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, [Partial()], run_check=False))
    try:
        fused([nn.Parameter(torch.ones(2)), partial])
        out["partial-param"] = "no error"
    except ValueError as exc:
        out["partial-param"] = str(exc)
    # FP16_Optimizer's master path (a torch optimizer inside) and a gradient laid out unlike its fp16 param
    w = nn.Parameter(distribute_tensor(torch.ones(4, 2, dtype=torch.float16), mesh, [Shard(0)]))
    opt = FP16_Optimizer(torch_adamw([w]), init_scale=LOSS_SCALE)
    w.grad = DTensor.from_local(torch.ones(4, 1, dtype=torch.float16), mesh, [Shard(1)], run_check=False)
    master_before = full(opt.master_params[0])
    try:
        opt.step()
        out["fp16-layout"] = "no error"
    except ValueError as exc:
        out["fp16-layout"] = str(exc)
    out["fp16-layout-untouched"] = (torch.equal(full(opt.master_params[0]), master_before)
                                    and torch.equal(w.to_local(), torch.ones(2, 2, dtype=torch.float16))
                                    and opt.loss_scale == LOSS_SCALE and not opt.optimizer.state)
    return out


try:
    import deepspeed  # noqa: F401

    DEEPSPEED_REASON = None
except Exception as exc:  # not installed (the torch 2.13 environment), or a missing dependency of it
    DEEPSPEED_REASON = f"DeepSpeed is not importable here ({type(exc).__name__}: {exc})"
DS_STAGES = (1, 2, 3)
DS_STEPS = 4  # optimizer steps, of 2 accumulated micro-batches each
DS_KINDS = ("torch", "fused", "fused-pipeline-group", "fused-refused", "fused-process-group-refused",
            "fused-groups-refused")


def full_params(engine, stage: int) -> list[torch.Tensor]:
    """The model's full params as float32 copies. Stage 3 keeps only each rank's partition (``p.ds_tensor``, the
    flattened param's chunk, zero-padded): gathered here with torch.distributed. (DeepSpeed's own
    ``GatheredParameters`` gave NaN on one rank in one fp16 run here and could not be reproduced in isolation, so
    the tests do not depend on it.)"""
    import torch.distributed as dist

    params = list(engine.module.parameters())
    if stage != 3:
        return [p.detach().float().clone() for p in params]
    out = []
    for p in params:
        pieces = [torch.empty_like(p.ds_tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, p.ds_tensor.detach())
        out.append(torch.cat(pieces)[:p.ds_numel].view(p.ds_shape).float())
    return out


def _deepspeed_run(rank, stage: int, kind: str) -> dict:
    """DeepSpeed ZeRO `stage` (fp32, 2 accumulated micro-batches per step) with a client optimizer. torch: torch's
    AdamW, DeepSpeed's gradient_clipping; fused: FusedAdam, the same; fused-pipeline-group: FusedAdam clipping by
    itself with pipeline_group over the ZeRO partitions' group (here the world); fused-refused: FusedAdam(max_grad_norm)
    alone, which would clip by this rank's partition: refused at the first step, nothing updated; so is it with a
    process_group (which would count the partitions as replicas); fused-groups-refused: FusedAdam(max_grad_norm) with
    pipeline_group over two param groups (biases without weight decay), which ZeRO steps one at a time: it would clip
    each group by its own norm, so it is refused at the first step too, nothing updated."""
    import deepspeed
    import torch.distributed as dist


    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    clip_in_fused = kind in ("fused-pipeline-group", "fused-refused", "fused-process-group-refused",
                             "fused-groups-refused")
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    elif kind == "fused-groups-refused":
        named = list(model.named_parameters())
        opt = fused([{"params": [p for n, p in named if not n.endswith("bias")]},
                     {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
                    pipeline_group=dist.group.WORLD)
    else:
        opt = fused(model.parameters(), clip=CLIP if clip_in_fused else None,
                    pipeline_group=dist.group.WORLD if kind == "fused-pipeline-group" else None,
                    process_group=dist.group.WORLD if kind == "fused-process-group-refused" else None)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 1e5, "allgather_bucket_size": 1e5},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0 if clip_in_fused else CLIP,
              "steps_per_print": 10**9}
    if stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1e5)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    before = full_params(engine, stage)
    error = None
    for step in range(DS_STEPS):
        g = torch.Generator().manual_seed(700 + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
        for micro in range(2):  # rank r's micro-batches: rows [4r, 4r + 4) of the step's batch, 2 at a time
            rows = slice(4 * rank + 2 * micro, 4 * rank + 2 * micro + 2)
            engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
            try:
                engine.step()
            except ValueError as exc:
                error = str(exc)
                break
        if error is not None:
            break
    return {"params": full_params(engine, stage), "before": before, "error": error,
            "state": sum(len(s) for s in opt.state.values())}


def scenarios(rank: int, world: int, tmp_dir: str) -> dict:
    out = {"rank": rank}
    out["ddp"] = _ddp_vs_torch(rank)
    for order in DDP_ORDERS:
        out[("step_in_backward", order)] = _step_in_backward_under_ddp(rank, order)
    out["tp"] = _tp_vs_torch(rank)
    out["fp16-optimizer-tp"] = _fp16_optimizer_on(rank, "tp")
    out["refusals"] = _refusals(rank)
    out["fp16-optimizer"] = fp16_scenarios.two_ranks(rank)  # (test_fp16_distributed.py)
    if DEEPSPEED_REASON is None:
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else a ~80 s JIT build per process
        deepspeed.init_distributed(dist_backend="gloo")  # joins the process group the harness created
        for stage in DS_STAGES:
            for kind in DS_KINDS:
                out[("deepspeed", stage, kind)] = _deepspeed_run(rank, stage, kind)
    if FSDP2_REASON is not None:
        return out
    for name in FSDP_CASES:
        out[f"fsdp-{name}"] = _fsdp_vs_torch(rank, name)
    out["fp16-optimizer-fsdp2"] = _fp16_optimizer_on(rank, "fsdp2")
    out["grad-scaler"] = _grad_scaler_on_fsdp2(rank)
    out["dcp-cross"] = _dcp_between_fused_adam_and_torch(rank, tmp_dir)
    out["full-state-dict"] = _full_state_dict_resume(rank)
    out["one-to-two"] = _one_process_checkpoint_into_two_ranks(rank, tmp_dir)
    out["one-rank-refuses"] = _a_checkpoint_one_rank_refuses(rank)
    out["flattened-dcp"] = _flattened_dcp_resume(rank, tmp_dir)
    out["fp16-optimizer-dcp"] = _fp16_optimizer_dcp_resume(rank, tmp_dir)
    out["dcp-into-master-weights"] = _dcp_into_master_weights(rank, tmp_dir)
    return out


def results(tmp_path_factory) -> list[dict]:
    """Every scenario's results, one dict per rank, from one spawn per test session (several test modules read
    them)."""
    return run_once(scenarios, WORLD, tmp_path_factory)


def max_diff(got, want) -> float:
    diffs = [float((a.double() - b.double()).abs().max()) for a, b in zip(got, want) if a.numel()]
    assert len(got) == len(want) and all(a.shape == b.shape for a, b in zip(got, want))
    return max(diffs, default=0.0)


def assert_like_torch(out, tol, norm_rtol=1e-5, what=""):
    diff = max_diff(out["fused"]["params"], out["torch"]["params"])
    print(f"{what}: max |FusedAdam - torch AdamW| = {diff:.3g}")
    assert diff <= tol, f"{what}: FusedAdam vs torch AdamW differ by {diff} (tolerance {tol})"
    for step, (a, b) in enumerate(zip(out["fused"]["norms"], out["torch"]["norms"])):
        assert abs(float(a) - float(b)) <= norm_rtol * float(b), (what, step, float(a), float(b))
    assert len(out["fused"]["norms"]) == len(out["torch"]["norms"])


def assert_resumed_bit_for_bit(results, scenario: str) -> None:
    for r in results:
        out = r[scenario]
        for a, b in zip(out["resumed"], out["uninterrupted"]):
            assert torch.equal(a, b), r["rank"]


needs_deepspeed = pytest.mark.skipif(DEEPSPEED_REASON is not None, reason=DEEPSPEED_REASON or "")
