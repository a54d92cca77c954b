"""The adam_step_ op's checks of its arguments' structure for the Python backends (reference.py, triton.py): list
lengths, shapes, dtypes, layouts, devices, contiguity, storages and the optional tensors' shapes, as the native op
makes them (ops/validation.cpp, ops/step.cpp) and in its words. Each backend calls them before it writes anything;
a refusal is a RuntimeError.

Where the rules differ, they differ by device only: the native op takes CPU tensors, its ``steps`` and
``rounding_keys`` on the CPU; the Python backends take the params of a call on one device (any: CUDA for Triton, and
for the reference where it serves CUDA tensors), and ``steps`` and ``rounding_keys`` on any device, so their texts
for those two leave out the native op's "CPU".

Not here: the checks of values the op reads (lr, betas, grad_scale, step counts: _spec), and the refusals that need
the kernels' own reading of the tensors (an overlapping gradient or one in its param's memory with grad_scale).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._spec import (FP8_FORMATS, LOW_PRECISION, PARAM_OVERLAPS_ITSELF, QUANT_BLOCK, SUPPORTED_PARAM_DTYPES,
                     exp_avg_not_relative, host_hyperparameters_refused, low_bit_format, rounding_keys_refused,
                     scalar_type_name)

_FLOAT_STORAGE = (torch.float32, torch.float16, torch.bfloat16)
_LOW_BIT_SCALES = (torch.float32, torch.bfloat16)  # uint8 codes' scales: 8-bit, 4-bit (_spec.low_bit_format)
_OPTIONAL_LISTS = ("max_exp_avg_sqs", "master_params", "exp_avg_scales", "exp_avg_sq_scales", "max_exp_avg_sq_scales")


def fail(message: str):
    raise RuntimeError("ort_optim::adam_step_: " + message)


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


def _bytes_needed(t: torch.Tensor) -> int:
    """Bytes of its storage a tensor reaches (0 for an empty one), as ops/validation.h's bytes_needed."""
    last = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return 0
        last += (size - 1) * stride
    return (last + 1) * t.element_size()


def _check_storage(t: torch.Tensor, name: str, i: int) -> None:
    """A storage freed or shrunk in place (untyped_storage().resize_(0), as CPU offload and FSDP do) under a tensor
    that still claims its elements: writing through it would write into freed memory."""
    have, needed = t.untyped_storage().nbytes(), _bytes_needed(t)
    if have < needed:
        fail(f"{name}[{i}] has a storage of {have} bytes but needs {needed} (was its storage freed or resized in "
             "place?)")


def _check_same_shape(t: torch.Tensor, p: torch.Tensor, name: str, i: int) -> None:
    if t.shape != p.shape:
        fail(f"{name}[{i}] has shape {_shape(t)} but params[{i}] has shape {_shape(p)}")
    if t.device != p.device:
        fail(f"{name}[{i}] is on {t.device} but params[{i}] is on {p.device}")
    _check_storage(t, name, i)


def _check_state(t: torch.Tensor, p: torch.Tensor, name: str, i: int, is_double: bool) -> None:
    if t.dtype != torch.uint8 or is_double:  # (uint8 codes' shapes are checked with their scales: _check_scales)
        _check_same_shape(t, p, name, i)
    else:
        _check_storage(t, name, i)
    if not t.is_contiguous():
        fail(f"{name}[{i}] must be contiguous")
    if is_double:
        if t.dtype != torch.float64:
            fail(f"{name}[{i}] has dtype {scalar_type_name(t.dtype)}; float64 params need float64 states")
    elif not (t.dtype in _FLOAT_STORAGE or t.dtype == torch.uint8 or t.dtype in FP8_FORMATS):
        fail(f"{name}[{i}] has dtype {scalar_type_name(t.dtype)}; states must be float32, bfloat16, float16, uint8 "
             "(low-bit codes) or float8_e4m3fn / float8_e5m2 (fp8 codes)")


def _check_scales(scales: Sequence[torch.Tensor], states: Sequence[torch.Tensor], i: int, name: str,
                  p: torch.Tensor) -> None:
    t = states[i]
    if not len(scales):
        if t.dtype == torch.uint8:
            fail(f"the uint8 (low-bit) state scaled by {name}[{i}] needs its block scales; {name} is empty")
        if t.dtype in FP8_FORMATS:
            fail(f"the {scalar_type_name(t.dtype)} (fp8) state scaled by {name}[{i}] needs its block scales; {name} "
                 "is empty")
        return
    s = scales[i]
    fp8 = FP8_FORMATS.get(t.dtype)
    if fp8 is not None:  # (its shape is the param's: _check_state)
        blocks = fp8.num_scales(p.numel())
        if not (s.device == t.device and s.is_contiguous() and s.dtype == torch.float32 and s.numel() == blocks):
            fail(f"{name}[{i}] must be a contiguous float32 tensor of {blocks} block scales on the state's device "
                 f"({scalar_type_name(t.dtype)} codes, one scale per {fp8.block})")
        _check_storage(s, name, i)
        return
    if t.dtype not in (torch.float16, torch.uint8):
        fail(f"{name}[{i}] is given but the state it scales is {scalar_type_name(t.dtype)}, not float16, uint8 or fp8")
    if not (s.device == t.device and s.is_contiguous()):
        fail(f"{name}[{i}] must be contiguous, on the state's device")
    _check_storage(s, name, i)
    if t.dtype == torch.float16:
        blocks = (t.numel() + QUANT_BLOCK - 1) // QUANT_BLOCK
        if not (s.dtype == torch.float32 and s.numel() == blocks):
            fail(f"{name}[{i}] must be a contiguous float32 tensor of {blocks} block scales on the state's device")
        return
    if s.dtype not in _LOW_BIT_SCALES:
        fail(f"{name}[{i}] has dtype {scalar_type_name(s.dtype)}; uint8 states take float32 scales (8-bit codes) or "
             "bfloat16 scales (4-bit codes, two per byte)")
    fmt = low_bit_format(s.dtype)
    n = p.numel()
    blocks = fmt.num_scales(n)
    if s.numel() != blocks:
        fail(f"{name}[{i}] has {s.numel()} scales; a {fmt.bits}-bit state of {n} elements has {blocks} blocks of "
             f"{fmt.block}")
    if fmt.bits == 8:
        if t.shape != p.shape:
            fail(f"the 8-bit state scaled by {name}[{i}] has shape {_shape(t)} but params[{i}] has shape {_shape(p)}")
    elif not (t.dim() == 1 and t.numel() == (n + 1) // 2):
        fail(f"the 4-bit state scaled by {name}[{i}] must be a flat uint8 tensor of {(n + 1) // 2} bytes (two codes "
             f"each), got shape {_shape(t)}")
    if t.device != p.device:
        fail(f"the state scaled by {name}[{i}] is on {t.device} but params[{i}] is on {p.device}")


def check_lists(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                exp_avg_sqs: Sequence[torch.Tensor], max_exp_avg_sqs: Sequence[torch.Tensor],
                master_params: Sequence[torch.Tensor], exp_avg_scales: Sequence[torch.Tensor],
                exp_avg_sq_scales: Sequence[torch.Tensor], max_exp_avg_sq_scales: Sequence[torch.Tensor],
                steps: torch.Tensor) -> None:
    """Every list has n tensors (the optional ones n or none), steps is float64 [n], and the scales lists go
    together: the checks that read no tensor of a list (a few per call)."""
    n = len(params)
    lists = (grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales, exp_avg_sq_scales,
             max_exp_avg_sq_scales)
    for name, items in zip(("grads", "exp_avgs", "exp_avg_sqs") + _OPTIONAL_LISTS, lists):
        if len(items) != n and not (len(items) == 0 and name in _OPTIONAL_LISTS):
            fail(f"{name} has {len(items)} tensors but params has {n}"
                 + (" (pass n tensors or none)" if name in _OPTIONAL_LISTS else ""))
    if len(max_exp_avg_sq_scales) and not len(max_exp_avg_sqs):
        fail("max_exp_avg_sq_scales given without max_exp_avg_sqs")
    if not (steps.dtype == torch.float64 and steps.dim() == 1 and steps.numel() == n and steps.is_contiguous()):
        fail(f"steps must be a contiguous float64 tensor of shape [{n}]")
    _check_storage(steps, "steps", 0)
    if len(max_exp_avg_sqs) and (len(exp_avg_sq_scales) > 0) != (len(max_exp_avg_sq_scales) > 0):
        fail("max_exp_avg_sqs share exp_avg_sqs' dtype, so both or neither need scales")


_is_contiguous = torch.Tensor.is_contiguous


def _storages_hold(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether each of these contiguous tensors' storage holds its elements."""
    return all([t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()
                for t in tensors])


def _plainly_valid(params: Sequence[torch.Tensor], states: tuple, masters: Sequence[torch.Tensor]) -> bool:
    """True where a call without scaled states passes every check of check_tensors, decided a list at a time (a few
    microseconds a param, where the checks one tensor at a time take several times that); False says nothing:
    check_tensors then makes its checks one tensor at a time, and names what it refuses."""
    if not len(params):
        return True
    device = params[0].device
    dtypes = {p.dtype for p in params}
    is_double = dtypes == {torch.float64}
    allowed = (torch.float64,) if is_double else _FLOAT_STORAGE
    if not (is_double or dtypes.issubset(_FLOAT_STORAGE)) or (len(masters) and not dtypes.issubset(LOW_PRECISION)):
        return False
    shapes = [p.shape for p in params]
    tensors = (params,) + states + ((masters,) if len(masters) else ())
    for items in tensors:
        if ([t.shape for t in items] != shapes or not all(map(_is_contiguous, items))
                or not all([t.device == device and t.layout == torch.strided for t in items])
                or not _storages_hold(items)):
            return False
    return (all([t.dtype in allowed for items in states for t in items])
            and (len(states) < 3 or [t.dtype for t in states[2]] == [t.dtype for t in states[1]])
            and all([t.dtype == torch.float32 for t in masters]))


def check_tensors(params: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                  exp_avg_sqs: Sequence[torch.Tensor], max_exp_avg_sqs: Sequence[torch.Tensor],
                  master_params: Sequence[torch.Tensor], exp_avg_scales: Sequence[torch.Tensor],
                  exp_avg_sq_scales: Sequence[torch.Tensor], max_exp_avg_sq_scales: Sequence[torch.Tensor]) -> None:
    """Each param and its states, masters and scales (after :func:`check_lists`): dtypes, shapes, devices, layouts,
    contiguity, storages, as ops/validation.cpp's check_params_and_states, then the 4-bit pairing of the moments.
    The params of a call share the first one's device."""
    amsgrad, has_master = len(max_exp_avg_sqs) > 0, len(master_params) > 0
    if not (len(exp_avg_scales) or len(exp_avg_sq_scales) or len(max_exp_avg_sq_scales)) and _plainly_valid(
            params, (exp_avgs, exp_avg_sqs) + ((max_exp_avg_sqs,) if amsgrad else ()), master_params):
        return
    any_double = any_single = False
    device = params[0].device if len(params) else None
    for i, p in enumerate(params):
        if p.dtype not in SUPPORTED_PARAM_DTYPES:
            fail(f"params[{i}] has dtype {scalar_type_name(p.dtype)}; supported are float32, float64, float16 and "
                 "bfloat16")
        if p.layout != torch.strided or p.device != device:
            fail(f"params[{i}] must be a dense tensor on {device} (all params of a call share a device)")
        if has_master and p.dtype not in LOW_PRECISION:
            fail(f"master_params given but params[{i}] is {scalar_type_name(p.dtype)}; master weights are for "
                 "float16/bfloat16 params")
        _check_storage(p, "params", i)
        if not p.is_contiguous() and torch._debug_has_internal_overlap(p) == 1:
            fail(f"params[{i}] {PARAM_OVERLAPS_ITSELF}")
        is_double = p.dtype == torch.float64
        if is_double:
            any_double = True
        else:
            any_single = True
        _check_state(exp_avgs[i], p, "exp_avgs", i, is_double)
        _check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i, is_double)
        if amsgrad:
            _check_state(max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i, is_double)
            if max_exp_avg_sqs[i].dtype != exp_avg_sqs[i].dtype:
                fail(f"max_exp_avg_sqs[{i}] must have the dtype of exp_avg_sqs[{i}]")
        if has_master:
            master = master_params[i]
            _check_same_shape(master, p, "master_params", i)
            if not (master.dtype == torch.float32 and master.is_contiguous()):
                fail(f"master_params[{i}] must be a contiguous float32 tensor")
        _check_scales(exp_avg_scales, exp_avgs, i, "exp_avg_scales", p)
        _check_scales(exp_avg_sq_scales, exp_avg_sqs, i, "exp_avg_sq_scales", p)
        if amsgrad:
            _check_scales(max_exp_avg_sq_scales, max_exp_avg_sqs, i, "max_exp_avg_sq_scales", p)
            if len(max_exp_avg_sq_scales) and max_exp_avg_sq_scales[i].dtype != exp_avg_sq_scales[i].dtype:
                fail(f"max_exp_avg_sq_scales[{i}] must have the dtype of exp_avg_sq_scales[{i}] (max_exp_avg_sqs "
                     "share exp_avg_sqs' format)")
    if any_double and any_single:
        fail("float64 params cannot share a call with other dtypes; group them separately")
    if len(exp_avg_scales):  # a 4-bit exp_avg is decoded through a 4-bit exp_avg_sq (_spec.EXP_AVG_RELATIVE)
        for i in range(len(params)):
            fmt = _low_bit(exp_avgs[i], exp_avg_scales[i])
            if fmt is not None and fmt.exp_avg_relative and (
                    not len(exp_avg_sq_scales) or _low_bit(exp_avg_sqs[i], exp_avg_sq_scales[i]) is not fmt):
                fail(exp_avg_not_relative(i))


def _low_bit(state: torch.Tensor, scales: torch.Tensor):
    """The low-bit format of a state (uint8 codes, told by its scales' dtype); None for another state."""
    return low_bit_format(scales.dtype) if state.dtype == torch.uint8 else None


def check_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Each gradient dense, of its param's shape, on its device, in a dtype the param takes (float64 for float64
    params, else float32, float16 or bfloat16), over a storage that holds it."""
    if (len(params) and all(map(_is_contiguous, grads))  # a list at a time first
            and all([p.dtype != torch.float64 for p in params])):
        device, shapes = params[0].device, [p.shape for p in params]
        if ([g.shape for g in grads] == shapes and all([g.dtype in _FLOAT_STORAGE and g.device == device
                                                        and g.layout == torch.strided for g in grads])
                and _storages_hold(grads)):
            return
    for i, (g, p) in enumerate(zip(grads, params)):
        if g.layout != torch.strided:
            fail(f"grads[{i}] is sparse; Adam needs dense gradients")
        _check_same_shape(g, p, "grads", i)
        if not (g.dtype == torch.float64 if p.dtype == torch.float64 else g.dtype in _FLOAT_STORAGE):
            fail(f"grads[{i}] has dtype {scalar_type_name(g.dtype)} for a {scalar_type_name(p.dtype)} parameter")


def check_options(n: int, steps_device: torch.device, adam_w_mode: int, lr_tensor: Optional[torch.Tensor],
                  inv_grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
                  grad_scale: Optional[torch.Tensor], rounding_keys: Optional[torch.Tensor],
                  betas_tensor: Optional[torch.Tensor], group_hyperparameters: Optional[torch.Tensor]) -> None:
    """adam_w_mode one of the three decays, the one-element tensors of one element, rounding_keys int64 [n], and
    betas_tensor and group_hyperparameters of their dtype, shape, layout and the steps' device."""
    if adam_w_mode not in (0, 1, 2):  # (another value would take none of the three decays)
        fail(f"adam_w_mode must be 0, 1 or 2, got {adam_w_mode}")
    if rounding_keys is not None and not (rounding_keys.dtype == torch.int64 and rounding_keys.dim() == 1
                                          and rounding_keys.numel() == n and rounding_keys.is_contiguous()):
        fail(f"rounding_keys must be a contiguous int64 tensor of shape [{n}]")
    for name, t in (("betas_tensor", betas_tensor), ("group_hyperparameters", group_hyperparameters)):
        refused = None if t is None else host_hyperparameters_refused(name, t, steps_device)
        if refused:
            fail(refused)
    for name, t in (("lr_tensor", lr_tensor), ("grad_scale", grad_scale), ("found_inf", found_inf),
                    ("inv_grad_scale", inv_grad_scale)):
        if t is not None and t.numel() != 1:
            fail(f"{name} must have exactly one element, got {t.numel()}")


def check_rounding_keys(params: Sequence[torch.Tensor], has_master: bool) -> None:
    """rounding_keys (given) only for bfloat16 params without master weights."""
    for i, p in enumerate(params):
        if p.dtype != torch.bfloat16 or has_master:
            fail(rounding_keys_refused(i, p.dtype, has_master))
