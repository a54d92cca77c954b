"""DeepSpeed ZeRO stages 1-3: replace the per-parameter overflow check and gradient-norm loops with one fused pass.

DeepSpeed's ``DeepSpeedZeroOptimizer`` (deepspeed/runtime/zero/stage_1_and_2.py) checks every gradient for inf/NaN
with a few tensor ops per parameter, and computes the global gradient norm with one ``vector_norm`` per parameter.
:func:`patch_zero_optimizer` binds replacements to the optimizer instance that do the same with ort_optim's
``grad_stats`` op (one multi-tensor pass giving the sum of squares and the inf/NaN flag), keeping everything else
DeepSpeed does around them: the all-reduces over the data- and model-parallel groups, the model-parallel and
pipeline-replication filters, the -1 for a non-finite norm, the return types and devices.

The methods are recognised by their names and signatures, never by their source text (ORT 1.19 compared source
text and silently stopped patching after DeepSpeed 0.9.2). The shapes known here (tested with DeepSpeed 0.16.9 and 0.19.8):

* ``has_overflow_serial(self, params)`` -> bool tensor [1] on the accelerator: any ``p.grad`` non-finite;
* ``has_overflow_partitioned_grads_serial(self)`` -> bool tensor [1]: any tensor of ``self.averaged_gradients[i]``
  (``i`` over ``self.bit16_groups``) non-finite;
* ``get_grad_norm_direct(self, gradients, params, norm_type=2)`` -> 0-dim float32 tensor: the L2 norm (other norm
  types keep DeepSpeed's code).

ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``, deepspeed/runtime/zero/stage3.py) already checks overflow on its flat
gradient buffer; what loops per parameter there is:

* ``get_grad_norm_direct(self, gradients, params, norm_type=2)`` -> 0-dim float64 tensor (one ``double().norm(2)``
  per gradient, summed in float64, -1 for a non-finite norm), used when the optimizer is not offloaded;
* ``has_overflow_serial(self, params, is_grad_list=False)`` -> Python bool (one host sync per gradient, through a
  float32 sum that also calls a finite gradient whose sum overflows an overflow; ours checks the elements).

Anything else (a missing method, another signature, a missing helper in the module) gets one warning per class and
the optimizer is left exactly as it was.
"""

from __future__ import annotations

import gc
import inspect
import math
import sys
import types
import warnings
from typing import Any, Optional

import torch

from .. import backends

# Per shape: method name -> the parameter names (after self) it must have, with their defaults; the names the
# replacements take from the optimizer's own module (so they use exactly what DeepSpeed's code uses) and instance.
_STAGE_1_2 = dict(
    signatures={
        "has_overflow_serial": (("params", inspect.Parameter.empty),),
        "has_overflow_partitioned_grads_serial": (),
        "get_grad_norm_direct": (("gradients", inspect.Parameter.empty), ("params", inspect.Parameter.empty),
                                 ("norm_type", 2)),
    },
    module_names=("dist", "get_accelerator", "is_model_parallel_parameter", "mask_nan_or_inf_with_val_inplace",
                  "PIPE_REPLICATED"),
    instance_names=("averaged_gradients", "bit16_groups", "dp_process_group", "model_parallel_rank",
                    "_model_parallel_all_reduce", "device"),
)
_STAGE_3 = dict(
    signatures={
        "has_overflow_serial": (("params", inspect.Parameter.empty), ("is_grad_list", False)),
        "get_grad_norm_direct": (("gradients", inspect.Parameter.empty), ("params", inspect.Parameter.empty),
                                 ("norm_type", 2)),
    },
    module_names=("dist", "get_accelerator", "is_model_parallel_parameter"),
    instance_names=("dp_process_group", "model_parallel_rank", "_model_parallel_all_reduce", "device"),
)
SHAPES = {"ZeRO stage 1/2": _STAGE_1_2, "ZeRO stage 3": _STAGE_3}
PATCHED_NAMES = ("has_overflow_serial", "has_overflow_partitioned_grads_serial", "get_grad_norm_direct")
PATCHED_MARK = "_ort_optim_fused_checks"
_warned: set[str] = set()


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def find_zero_optimizer(obj: Any) -> Optional[Any]:
    """The DeepSpeed ZeRO optimizer behind obj: obj itself, a DeepSpeedEngine's ``.optimizer``, or accelerate's
    ``DeepSpeedOptimizerWrapper``'s ``.optimizer``; None when obj is none of these."""
    candidates = [obj, getattr(obj, "optimizer", None)]
    for candidate in candidates:
        if candidate is not None and type(candidate).__module__.startswith("deepspeed.runtime.zero") \
                and hasattr(candidate, "get_grad_norm_direct"):
            return candidate
    return None


def is_engine_or_zero(obj: Any) -> bool:
    """A DeepSpeed object that is not a torch.optim.Optimizer: an engine, a ZeRO optimizer, DeepSpeed's own
    FP16_Optimizer/BF16_Optimizer. DeepSpeed's plain optimizers (DeepSpeedCPUAdam, deepspeed.ops.adam.FusedAdam,
    FusedLamb, ...) are torch.optim.Optimizers."""
    return type(obj).__module__.split(".")[0] == "deepspeed" and not isinstance(obj, torch.optim.Optimizer)


def loss_scaling_target(obj: Any) -> Optional[Any]:
    """What ``FP16_Optimizer(obj)`` hands to DeepSpeed instead of wrapping obj: the ZeRO optimizer obj is or
    holds (patched), or the DeepSpeed object that is not a torch optimizer that obj is or holds through
    ``.optimizer`` (an engine, accelerate's wrapper of one: patched when it is a known ZeRO shape, else a warning);
    None for anything else (a torch optimizer, wrapped)."""
    target = find_zero_optimizer(obj)
    if target is not None:
        return target
    inner = getattr(obj, "optimizer", None)
    if is_engine_or_zero(inner):
        return inner
    return obj if is_engine_or_zero(obj) else None


def holder_of(obj: Any) -> Optional[Any]:
    """The DeepSpeed engine (``DeepSpeedEngine``) or DeepSpeed optimizer wrapper (``DeepSpeedOptimizer``: the ZeRO
    optimizers, DeepSpeed's FP16_Optimizer/FP16_UnfusedOptimizer/BF16_Optimizer) that holds obj as an attribute, or
    None. Recognised by type, found through the garbage collector's referrers: up to two scans of the heap (about
    30 ms each with torch and DeepSpeed loaded), so ask once, not per step. Answers None at once unless DeepSpeed is
    imported and torch.distributed initialised (``deepspeed.initialize`` initialises it)."""
    if "deepspeed" not in sys.modules or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    kinds = tuple(getattr(sys.modules.get(module), name, None) for module, name in (
        ("deepspeed.runtime.engine", "DeepSpeedEngine"), ("deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer")))
    kinds = tuple(kind for kind in kinds if isinstance(kind, type))
    if not kinds:
        return None
    referrers = gc.get_referrers(obj)
    found = next((r for r in referrers if isinstance(r, kinds)), None)
    # (an attribute lives in the holder's __dict__, which is what refers to obj: find whose __dict__ it is)
    dicts = {id(r): r for r in referrers if type(r) is dict}
    if found is None and dicts:
        found = next((o for o in gc.get_referrers(*dicts.values()) if isinstance(o, kinds)
                      and id(getattr(o, "__dict__", None)) in dicts), None)
    return found


# DeepSpeed's ZeRO optimizers call their client's step() once per param group (stages 1/2:
# ``_optimizer_step(group_no)`` for each of ``bit16_groups``) or once per sub-group of a param group (stage 3:
# ``_optimizer_step(sub_group_id)`` for each of ``fp16_groups``), each time with the client's param_groups narrowed to
# that one group. Recognised by the name of _optimizer_step's parameter; the value names the list with one entry per
# call.
_STEPPED_APART = {"group_no": "bit16_groups", "sub_group_id": "fp16_groups"}


def groups_stepped_apart(optimizer: Any) -> int:
    """How many times the DeepSpeed optimizer ``optimizer`` calls its client's step() per step of its own, each time
    on one param group (ZeRO stages 1/2) or one sub-group (stage 3); 1 for those that step every group in one call
    (BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer) and for any other shape."""
    method = getattr(type(optimizer), "_optimizer_step", None)
    try:
        names = list(inspect.signature(method).parameters)[1:] if callable(method) else []
    except (TypeError, ValueError):
        names = []
    if len(names) != 1 or names[0] not in _STEPPED_APART:
        return 1
    return max(1, len(getattr(optimizer, _STEPPED_APART[names[0]], None) or ()))


def clipping_holder(obj: Any) -> tuple[bool, Optional[Any], bool, int]:
    """What the DeepSpeed optimizer that holds obj shows obj's step() of the model's gradients, for clipping:
    (whether DeepSpeed could hold obj here, that holder or None, whether it steps obj on this rank's partition only,
    how many step() calls it makes per step of its own, each on one param group or sub-group).

    Partitioning: the ZeRO optimizers (stages 1-3) and BF16_Optimizer, which keep a ``partition_count`` over a
    ``dp_process_group`` of more than one rank; obj then sees only this rank's slice of the flat gradients. Stepping
    apart: :func:`groups_stepped_apart`. Whether DeepSpeed could hold obj is False until DeepSpeed is imported and
    torch.distributed initialised (then no heap scan ran: ask again later); otherwise one :func:`holder_of` scan."""
    if "deepspeed" not in sys.modules or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False, None, False, 1
    holder = holder_of(obj)
    for candidate in (holder, getattr(holder, "optimizer", None)):
        if candidate is None or not hasattr(candidate, "partition_count"):
            continue
        group = getattr(candidate, "dp_process_group", None)
        partitioned = group is not None and torch.distributed.get_world_size(group) > 1
        apart = groups_stepped_apart(candidate)
        if partitioned or apart > 1:
            return True, candidate, partitioned, apart
    return True, None, False, 1


def _undecorated(method: Any, name: str) -> Any:
    """The function under decorators that do not set __wrapped__ (DeepSpeed's ``instrument_w_nvtx`` wraps stage 3's
    get_grad_norm_direct in ``(*args, **kwargs)``): the closure's function of the same name, else method itself."""
    for _ in range(4):
        inner = [c.cell_contents for c in (getattr(method, "__closure__", None) or ())
                 if callable(c.cell_contents) and getattr(c.cell_contents, "__name__", None) == name]
        if not inner:
            break
        method = inner[0]
    return method


def _signature_mismatch(optimizer: Any, shape: dict) -> Optional[str]:
    for name, expected in shape["signatures"].items():
        method = getattr(type(optimizer), name, None)
        if method is None or not callable(method):
            return f"it has no method {name}"
        try:
            params = list(inspect.signature(_undecorated(method, name)).parameters.values())[1:]
        except (TypeError, ValueError):
            return f"the signature of {name} cannot be read"
        got = tuple((p.name, p.default) for p in params)
        if got != expected:
            return f"{name}{tuple(p for p, _ in got)} is not {name}{tuple(p for p, _ in expected)}"
    module = sys.modules.get(type(optimizer).__module__)
    missing = [n for n in shape["module_names"] if not hasattr(module, n)]
    if missing:
        return f"its module lacks {missing}"
    missing = [n for n in shape["instance_names"] if not hasattr(optimizer, n)]
    if missing:
        return f"the optimizer lacks the attributes {missing}"
    return None


def _known_shape(optimizer: Any) -> tuple[Optional[str], str]:
    """(name of the first shape optimizer matches, None) or (None, why it matches none)."""
    reasons = []
    for name, shape in SHAPES.items():
        reason = _signature_mismatch(optimizer, shape)
        if reason is None:
            return name, ""
        reasons.append(f"not {name}: {reason}")
    return None, "; ".join(reasons)


def patch_zero_optimizer(optimizer: Any) -> bool:
    """Binds the fused replacements to this DeepSpeed ZeRO optimizer; returns whether it did.

    Idempotent. On an unrecognised shape: one warning per class, nothing changed, False.
    """
    if getattr(optimizer, PATCHED_MARK, False):
        return True
    shape, reason = _known_shape(optimizer)
    if shape is None:
        key = _qualname(optimizer)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"FP16_Optimizer: {key} is not a DeepSpeed ZeRO optimizer of a known shape ({reason}); "
                "it is left unchanged and keeps DeepSpeed's own overflow check and gradient norm.",
                UserWarning,
                stacklevel=3,
            )
        return False
    module = sys.modules[type(optimizer).__module__]
    if shape == "ZeRO stage 3":
        optimizer.has_overflow_serial = types.MethodType(_make_has_overflow_serial_stage3(module), optimizer)
        optimizer.get_grad_norm_direct = types.MethodType(_make_get_grad_norm_direct_stage3(module), optimizer)
    else:
        optimizer.has_overflow_serial = types.MethodType(_make_has_overflow_serial(module), optimizer)
        optimizer.has_overflow_partitioned_grads_serial = types.MethodType(
            _make_has_overflow_partitioned_grads_serial(module), optimizer)
        optimizer.get_grad_norm_direct = types.MethodType(_make_get_grad_norm_direct(module), optimizer)
    setattr(optimizer, PATCHED_MARK, True)
    return True


def unpatch_zero_optimizer(optimizer: Any) -> None:
    """Restores DeepSpeed's own methods on an optimizer patched by :func:`patch_zero_optimizer`."""
    for name in PATCHED_NAMES:
        optimizer.__dict__.pop(name, None)
    optimizer.__dict__.pop(PATCHED_MARK, None)


def _stats_on(tensors: list[torch.Tensor], device: Any) -> torch.Tensor:
    """grad_stats over tensors that may sit on several devices, combined on `device`: float32 [2]."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    total = torch.zeros(2, dtype=torch.float32, device=device)
    with torch.no_grad():  # (the statistics of gradients: nothing to differentiate)
        for group in by_device.values():
            total = total + backends.grad_stats(group).to(device)
    return total


def _overflow_flag(grads: list, device) -> torch.Tensor:
    """DeepSpeed's overflow flag: a bool tensor [1] on device, True when a gradient holds an inf or a NaN."""
    if not grads:
        return torch.zeros([1], dtype=torch.bool, device=device)
    return _stats_on(grads, device)[1:2] > 0


def _make_has_overflow_serial(module):
    get_accelerator = module.get_accelerator

    def has_overflow_serial(self, params):
        grads = [p.grad for p in params if p.grad is not None]
        return _overflow_flag(grads, get_accelerator().current_device_name())

    return has_overflow_serial


def _make_has_overflow_partitioned_grads_serial(module):
    get_accelerator = module.get_accelerator

    def has_overflow_partitioned_grads_serial(self):
        grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
        return _overflow_flag(grads, get_accelerator().current_device_name())

    return has_overflow_partitioned_grads_serial


def _make_get_grad_norm_direct(module):
    dist = module.dist
    get_accelerator = module.get_accelerator
    is_model_parallel_parameter = module.is_model_parallel_parameter
    mask_nan_or_inf_with_val_inplace = module.mask_nan_or_inf_with_val_inplace
    pipe_replicated = module.PIPE_REPLICATED

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        norm_type = float(norm_type)
        if norm_type != 2.0:  # inf and other p-norms: DeepSpeed's own code
            return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
        selected = []
        for g, p in zip(gradients, params):
            # Pipeline parallelism may replicate parameters: count them once (as DeepSpeed does).
            if hasattr(p, pipe_replicated) and p.ds_pipe_replicated:
                continue
            if is_model_parallel_parameter(p) or (self.model_parallel_rank == 0):
                selected.append(g)  # (not g.data, as DeepSpeed's loop: a new tensor object per gradient and step)
        if selected:
            device = get_accelerator().current_device_name()
            stats = _stats_on(selected, device)
            # A non-finite gradient makes DeepSpeed's norm inf/NaN; keep it non-finite so the mask below gives -1.
            total_norm = torch.where(stats[1] > 0, torch.full_like(stats[0], math.nan), stats[0])
        else:
            total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
        total_norm = total_norm.pow(1.0 / norm_type)
        mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
        return total_norm

    return get_grad_norm_direct


def _make_has_overflow_serial_stage3(module):
    get_accelerator = module.get_accelerator

    def has_overflow_serial(self, params, is_grad_list=False):
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        return bool(_stats_on(grads, get_accelerator().current_device_name())[1] > 0)  # the one host sync

    return has_overflow_serial


def _make_get_grad_norm_direct_stage3(module):
    dist = module.dist
    get_accelerator = module.get_accelerator
    is_model_parallel_parameter = module.is_model_parallel_parameter

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0:  # inf and other p-norms: DeepSpeed's own code
            return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
        selected = [g for g, p in zip(gradients, params) if is_model_parallel_parameter(p) or
                    self.model_parallel_rank == 0]
        device = get_accelerator().device_name()
        if selected:
            stats = _stats_on(selected, device)
            total = torch.where(stats[1] > 0, torch.full_like(stats[0], math.nan), stats[0]).double()
            if bool(torch.isinf(total)):  # (one host read) finite gradients whose squares overflow float32 (norm
                # above 1.8e19): DeepSpeed's float64 sum holds them, and clips with that norm; so does this one
                total = torch.stack([g.detach().double().pow(2).sum() for g in selected]).sum().to(device)
        else:
            total = torch.zeros((), dtype=torch.float64, device=device)
        # DeepSpeed's stage 3 sums and reduces in float64 and returns a float64 norm: so do we
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.sqrt()
        err = torch.tensor(-1.0, device=self.device, dtype=torch.float)
        return torch.where(total.isinf() | total.isnan(), err, total)

    return get_grad_norm_direct
