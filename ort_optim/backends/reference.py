"""The reference backend: the ort_optim ops (ops/README.md) in pure PyTorch, used when the native library is
unavailable (or with ORT_OPTIM_BACKEND=torch).

It follows the native kernel's order of operations tensor by tensor with torch ops, so results agree within the
float32 rounding the tests state. Its states are read and written through ort_optim.formats, the one definition of
every stored moment format.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch

from .._spec import (FP8_FORMATS, GRAD_IN_PARAM, GRAD_OVERLAPS_ITSELF, MAX_STEP, beta_power, check_hyperparameters,
                     grad_in_param_memory, low_bit_format, splitmix64, step_count_refused)
from .._versions import tracks_versions
from ..formats import (MASK32, decode_state, fmix32, is_relative, quantize_fp8, quantize_fp16, quantize_low_bit,
                       sqrt_f32, sqrt_f64, state_root)
from ._validation import check_grads, check_lists, check_options, check_rounding_keys, check_tensors

# Where the step's host-side numbers are rounded: torch's default device (`with torch.device(...)`) is not the params'.
_CPU = torch.device("cpu")


def _read_state(state: torch.Tensor, scales: Optional[torch.Tensor], dtype: torch.dtype, second_moment: bool,
                shape: torch.Size, root: Optional[torch.Tensor] = None) -> torch.Tensor:
    return decode_state(state, scales, second_moment, shape, root).to(dtype)


def _root(exp_avg: torch.Tensor, exp_avg_scales: Optional[torch.Tensor], exp_avg_sq: torch.Tensor,
          exp_avg_sq_scales: Optional[torch.Tensor], shape: torch.Size) -> Optional[torch.Tensor]:
    """The decoded sqrt(v) that a 4-bit exp_avg is coded against (_spec.EXP_AVG_RELATIVE), from exp_avg_sq's codes
    as they are now; None for other exp_avg formats."""
    return state_root(exp_avg_sq, exp_avg_sq_scales, shape) if is_relative(exp_avg, exp_avg_scales) else None


def _write_state(values: torch.Tensor, state: torch.Tensor, scales: Optional[torch.Tensor],
                 second_moment: bool, step: int = 0, exp_avg: Optional[torch.Tensor] = None,
                 root: Optional[torch.Tensor] = None) -> None:
    if scales is None:
        state.copy_(values)
        return
    if state.dtype == torch.float16:
        codes, new_scales = quantize_fp16(sqrt_f32(values.float()) if second_moment else values.float(),
                                          second_moment)
    elif state.dtype in FP8_FORMATS:
        codes, new_scales = quantize_fp8(values, FP8_FORMATS[state.dtype], second_moment, step, exp_avg)
    else:
        codes, new_scales = quantize_low_bit(values, low_bit_format(scales.dtype), second_moment, step, root, exp_avg)
    state.copy_(codes.view(state.shape))
    scales.copy_(new_scales)


# ---- stochastic rounding (ops/README.md, "stochastic rounding") -------------------------------------------------


def random_bits(key: int, step: int, numel: int, device: torch.device) -> torch.Tensor:
    """The 32 random bits of each element of a param at this step (step counted from 1), as int64 in [0, 2**32) on
    the param's device."""
    k = splitmix64((key & ((1 << 64) - 1)) ^ splitmix64(step))
    e = torch.arange(numel, dtype=torch.int64, device=device)
    x = ((e & MASK32) * 0x9E3779B1 + (e >> 32) * 0x85EBCA77 + (k & MASK32)) & MASK32
    return fmix32(fmix32(x) ^ (k >> 32))


def round_bf16_stochastic(values: torch.Tensor, key: int, step: int) -> torch.Tensor:
    """float32 values -> bfloat16, each rounded up in magnitude with probability (dropped bits) / 2**16 using
    random_bits; inf and NaN round to nearest."""
    flat = values.float().reshape(-1)
    b = flat.view(torch.int32).long() & MASK32
    stochastic = ((b + (random_bits(key, step, flat.numel(), flat.device) >> 16)) >> 16) & 0xFFFF
    nearest = flat.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    out = torch.where((b & 0x7FFFFFFF) < 0x7F800000, stochastic, nearest)
    return torch.where(out >= 0x8000, out - 0x10000, out).to(torch.int16).view(torch.bfloat16).view(values.shape)


def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor],
    exp_avg_sq_scales: Sequence[torch.Tensor],
    max_exp_avg_sq_scales: Sequence[torch.Tensor],
    steps: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: int,
    bias_correction: bool,
    maximize: bool,
    lr_tensor: Optional[torch.Tensor] = None,
    inv_grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    rounding_keys: Optional[torch.Tensor] = None,
    betas_tensor: Optional[torch.Tensor] = None,
    group_hyperparameters: Optional[torch.Tensor] = None,
) -> None:
    if any(t.is_meta for t in (steps, *params)):  # (no values to check or write: as the native op's fake kernel)
        return
    # the native op's checks of every argument's structure, then of the values it reads: all before anything is
    # written, in its words (_validation)
    check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                exp_avg_sq_scales, max_exp_avg_sq_scales, steps)
    check_tensors(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales, exp_avg_sq_scales,
                  max_exp_avg_sq_scales)
    check_grads(params, grads)
    check_options(len(params), steps.device, adam_w_mode, lr_tensor, inv_grad_scale, found_inf, grad_scale,
                  rounding_keys, betas_tensor, group_hyperparameters)
    if rounding_keys is not None:
        check_rounding_keys(params, len(master_params) > 0)
    if betas_tensor is not None:
        beta1, beta2 = betas_tensor.tolist()
    lr = float(lr_tensor) if lr_tensor is not None else lr
    # the step's own rules for the values it reads, as the native op checks them (step() checks them first): every
    # group's of the step first, then its own
    if group_hyperparameters is not None:
        for k, row in enumerate(group_hyperparameters.tolist()):
            check_hyperparameters(*row, prefix=f"param_groups[{k}]: ")
    check_hyperparameters(lr, beta1, beta2)
    if grad_scale is not None:  # checked before anything is written, and before a skip returns, as the native op does
        if not (math.isfinite(float(grad_scale)) and float(grad_scale) != 0.0):
            raise ValueError(f"ort_optim::adam_step_: grad_scale must be finite and non-zero, got "
                             f"{float(grad_scale):g}")  # (as the native op prints a double)
    if found_inf is not None and float(found_inf) != 0.0:
        return
    if grad_scale is not None:
        for i, g in enumerate(grads):
            if torch._debug_has_internal_overlap(g) == 1:
                raise RuntimeError(f"ort_optim::adam_step_: grads[{i}] {GRAD_OVERLAPS_ITSELF}")
            if grad_in_param_memory(g, params[i]):
                raise RuntimeError(f"ort_optim::adam_step_: grads[{i}] {GRAD_IN_PARAM}")
    for i, count in enumerate(steps.tolist()):  # before anything is written, as the native op does
        if not (0.0 <= count <= MAX_STEP and count == math.floor(count)):  # (-5 would never end beta_power's loop)
            raise ValueError(f"ort_optim::adam_step_: {step_count_refused(i, count)}")
    grad_mul = (float(inv_grad_scale) if inv_grad_scale is not None else 1.0) * (-1.0 if maximize else 1.0)
    amsgrad = len(max_exp_avg_sqs) > 0

    def optional(items: Sequence[torch.Tensor], i: int) -> Optional[torch.Tensor]:
        return items[i] if len(items) else None

    # beta1*m + (1-beta1)*g in torch's lerp form (ops/adam_kernel.cpp, Lerp), per compute dtype: with the weight
    # w = 1 - beta1 rounded to it, m + w*(g - m) for w < 0.5, else g + (w - 1)*(g - m)
    lerp_from_grad, lerp_coeff = {}, {}
    for compute in (torch.float32, torch.float64):
        w = torch.tensor(1.0 - beta1, dtype=compute, device=_CPU)
        lerp_from_grad[compute] = not bool(w.abs() < 0.5)
        lerp_coeff[compute] = float(w - 1.0 if lerp_from_grad[compute] else w)

    def update() -> None:
        for i, param in enumerate(params):
            compute = torch.float64 if param.dtype == torch.float64 else torch.float32
            t = float(steps[i]) + 1.0
            bc1 = 1.0 - beta_power(beta1, t) if bias_correction else 1.0
            bc2 = 1.0 - beta_power(beta2, t) if bias_correction else 1.0
            master = optional(master_params, i)
            p = (master if master is not None else param).to(compute, copy=True)
            g = grads[i].to(compute) * grad_mul
            m_scales, v_scales = optional(exp_avg_scales, i), optional(exp_avg_sq_scales, i)
            m = _read_state(exp_avgs[i], m_scales, compute, False, param.shape,
                            _root(exp_avgs[i], m_scales, exp_avg_sqs[i], v_scales, param.shape))
            v = _read_state(exp_avg_sqs[i], v_scales, compute, True, param.shape)
            if adam_w_mode == 0:
                g = g + weight_decay * p
            if adam_w_mode == 2:
                p = p * (1.0 - lr * weight_decay)
            m = (g if lerp_from_grad[compute] else m) + lerp_coeff[compute] * (g - m)
            v = v * beta2 + (1.0 - beta2) * g * g
            v_used = v
            if amsgrad:
                old = _read_state(max_exp_avg_sqs[i], optional(max_exp_avg_sq_scales, i), compute, True, param.shape)
                vmax = torch.maximum(old, v)  # (a NaN in either stays NaN)
                v_used = vmax
            root = sqrt_f64(v_used) if compute == torch.float64 else sqrt_f32(v_used)
            if adam_w_mode == 2:
                p = p - (lr / bc1) * (m / (root / math.sqrt(bc2) + eps))
            else:
                p = p - (lr * math.sqrt(bc2) / bc1) * (m / (root + eps))
                if adam_w_mode == 1:
                    p = p - (lr * weight_decay) * p
            # exp_avg_sq first: a 4-bit exp_avg is coded against its new codes (_spec.EXP_AVG_RELATIVE)
            _write_state(v, exp_avg_sqs[i], v_scales, True, int(t), m)
            _write_state(m, exp_avgs[i], m_scales, False, int(t),
                         root=_root(exp_avgs[i], m_scales, exp_avg_sqs[i], v_scales, param.shape))
            if amsgrad:
                _write_state(vmax, max_exp_avg_sqs[i], optional(max_exp_avg_sq_scales, i), True, int(t), m)
            if master is not None:
                master.copy_(p)
            if rounding_keys is not None:
                param.copy_(round_bf16_stochastic(p, int(rounding_keys[i]), int(t)))
            else:
                param.copy_(p)
            if grad_scale is not None:  # the unscaled gradient back into .grad: a division, rounded to its dtype
                grads[i].copy_(grads[i].to(compute) / grad_scale.to(compute).reshape(()))
        steps.add_(1.0)

    # A tensor made under torch.inference_mode() (a checkpoint loaded there, say), also one given other data with
    # `.data =` since, can be written in place only inside it. The native and Triton kernels write through pointers either way; so does this path, instead of failing
    # halfway with some tensors written. Its in-place torch ops mark what they write for autograd (version counters,
    # inside inference_mode too, for every tensor that has one), as the other backends do (ort_optim/_versions.py).
    written = [*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs, *master_params, *exp_avg_scales,
               *exp_avg_sq_scales, *max_exp_avg_sq_scales, steps, *(grads if grad_scale is not None else ())]
    with torch.inference_mode() if not all(map(tracks_versions, written)) else contextlib.nullcontext():
        update()


def grad_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for t in tensors:
        total += t.double().square().sum()
    return torch.stack([total, (~torch.isfinite(total)).double()]).float()
