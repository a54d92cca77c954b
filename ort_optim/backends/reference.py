"""The reference backend: the ort_optim ops (ops/README.md) in pure PyTorch, used when the native library is
unavailable (or with ORT_OPTIM_BACKEND=torch).

It follows the native kernel's order of operations tensor by tensor with torch ops, so results agree within the
float32 rounding the tests state. It also provides the fp16 block quantiser that the optimizer uses for checkpoints.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .._spec import FP16_LIMIT, QUANT_BLOCK, num_blocks


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x flattened and zero-padded to [num_blocks, QUANT_BLOCK]."""
    flat = x.reshape(-1)
    pad = num_blocks(flat.numel()) * QUANT_BLOCK - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, QUANT_BLOCK)


def fp16_block_scales(values: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale per 1024-element block of float32 values (ops/README.md, "fp16 states")."""
    amax = _blocks(values.float()).abs().amax(dim=1)
    mantissa, exponent = torch.frexp(amax)
    k = torch.where(mantissa == 0.5, 16 - exponent, 15 - exponent).clamp(-126, 126)
    rounded = torch.ldexp(amax, k.float()).half().float()
    k = torch.where(rounded <= FP16_LIMIT / 2, k + 1, k).clamp(-126, 126)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, torch.ldexp(torch.ones_like(amax), k.float()), torch.ones_like(amax))


def quantize_fp16(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values -> (float16 codes of the same shape, float32 block scales)."""
    scales = fp16_block_scales(values)
    codes = (_blocks(values.float()) * scales[:, None]).half().reshape(-1)[: values.numel()]
    return codes.view(values.shape), scales


def dequantize_fp16(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float16 codes and block scales -> float32 values."""
    values = (_blocks(codes.float()) * (1.0 / scales)[:, None]).reshape(-1)[: codes.numel()]
    return values.view(codes.shape)


def _read_state(state: torch.Tensor, scales: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if scales is not None:
        return dequantize_fp16(state, scales).to(dtype)
    return state.to(dtype)


def _write_state(values: torch.Tensor, state: torch.Tensor, scales: Optional[torch.Tensor]) -> None:
    if scales is not None:
        codes, new_scales = quantize_fp16(values)
        state.copy_(codes)
        scales.copy_(new_scales)
    else:
        state.copy_(values)


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
) -> None:
    if found_inf is not None and float(found_inf) != 0.0:
        return
    if grad_scale is not None:  # checked before anything is written, as the native op does
        if not (math.isfinite(float(grad_scale)) and float(grad_scale) != 0.0):
            raise RuntimeError(f"ort_optim::adam_step_: grad_scale must be finite and non-zero, got {float(grad_scale)}")
        for i, g in enumerate(grads):
            if torch._debug_has_internal_overlap(g) == 1:
                raise RuntimeError(f"ort_optim::adam_step_: grads[{i}] overlaps itself (an expand()ed tensor), so it "
                                   "cannot be unscaled in place")
    lr = float(lr_tensor) if lr_tensor is not None else lr
    grad_mul = (float(inv_grad_scale) if inv_grad_scale is not None else 1.0) * (-1.0 if maximize else 1.0)
    amsgrad = len(max_exp_avg_sqs) > 0

    def optional(items: Sequence[torch.Tensor], i: int) -> Optional[torch.Tensor]:
        return items[i] if len(items) else None

    for i, param in enumerate(params):
        compute = torch.float64 if param.dtype == torch.float64 else torch.float32
        t = float(steps[i]) + 1.0
        bc1 = 1.0 - beta1**t if bias_correction else 1.0
        bc2 = 1.0 - beta2**t if bias_correction else 1.0
        master = optional(master_params, i)
        p = (master if master is not None else param).to(compute, copy=True)
        g = grads[i].to(compute) * grad_mul
        m = _read_state(exp_avgs[i], optional(exp_avg_scales, i), compute)
        v = _read_state(exp_avg_sqs[i], optional(exp_avg_sq_scales, i), compute)
        if adam_w_mode == 0:
            g = g + weight_decay * p
        if adam_w_mode == 2:
            p = p * (1.0 - lr * weight_decay)
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * g * g
        v_used = v
        if amsgrad:
            vmax = torch.maximum(_read_state(max_exp_avg_sqs[i], optional(max_exp_avg_sq_scales, i), compute), v)
            v_used = vmax
        if adam_w_mode == 2:
            p = p - (lr / bc1) * (m / (v_used.sqrt() / math.sqrt(bc2) + eps))
        else:
            p = p - (lr * math.sqrt(bc2) / bc1) * (m / (v_used.sqrt() + eps))
            if adam_w_mode == 1:
                p = p - (lr * weight_decay) * p
        _write_state(m, exp_avgs[i], optional(exp_avg_scales, i))
        _write_state(v, exp_avg_sqs[i], optional(exp_avg_sq_scales, i))
        if amsgrad:
            _write_state(vmax, max_exp_avg_sqs[i], optional(max_exp_avg_sq_scales, i))
        if master is not None:
            master.copy_(p)
        param.copy_(p)
        if grad_scale is not None:  # the unscaled gradient back into .grad: a division, rounded to its dtype
            grads[i].copy_(grads[i].to(compute) / grad_scale.to(compute).reshape(()))
    steps.add_(1.0)


def grad_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for t in tensors:
        total += t.double().square().sum()
    return torch.stack([total, (~torch.isfinite(total)).double()]).float()
