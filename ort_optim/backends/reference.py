"""The reference backend: the ort_optim ops (ops/README.md) in pure PyTorch, used when the native library is
unavailable (or with ORT_OPTIM_BACKEND=torch).

It follows the native kernel's order of operations tensor by tensor with torch ops, so results agree within the
float32 rounding the tests state. It also provides the state quantisers (fp16 blocks, 8-bit and 4-bit codes) that the
optimizer uses for checkpoints: :func:`encode_state` and :func:`decode_state` are the one definition of every stored
moment format (ops/README.md, "fp16 states" and "low-bit states").
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch

from .._spec import (EXP_AVG_SNAP, EXP_AVG_SR_ULPS, FP8_FORMATS, MIN_SCALE, FP16_LIMIT, LOW_BIT_FORMATS, QUANT_BLOCK,
                     Fp8Format, LowBitFormat, low_bit_format, num_blocks, splitmix64, thresholds)


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


# ---- 8-bit and 4-bit block-quantised states (ops/README.md, "low-bit states") ------------------------------------


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (torch's own float32 sqrt on the CPU is not: it can differ in the last
    bit, and a stored sqrt(v) must be the same bits on every backend). Via float64, which is exact here."""
    return x.double().sqrt().float()


def _levels(fmt: LowBitFormat, second_moment: bool) -> tuple[float, ...]:
    return fmt.exp_avg_sq_levels if second_moment else fmt.exp_avg_levels


def decode_table(fmt: LowBitFormat, second_moment: bool) -> torch.Tensor:
    """float32 [2**bits]: the value of each code relative to its block's scale (sign-magnitude for exp_avg; the
    code with only the sign bit set, never written, reads as 0)."""
    levels = torch.tensor(_levels(fmt, second_moment), dtype=torch.float32)
    if second_moment:
        return levels
    return torch.cat([levels, -levels])


def _round_to(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values rounded to nearest even in dtype (float32 or bfloat16), as float32."""
    return amax.to(dtype).float()


def exp_avg_random_bits(x: torch.Tensor, step: int) -> torch.Tensor:
    """The 32 random bits of each element of an exp_avg being quantised (float32 x, flat: element e is x[e]), as
    int64 in [0, 2**32): fmix32(fmix32(bits(x[e]) ^ e * 0x9E3779B1) ^ (step * 0x85EBCA77 + 0x6A09E667)), in uint32
    arithmetic (_spec.EXP_AVG_SR_ULPS says why the value's own bits)."""
    b = x.view(torch.int32).long() & _MASK32
    e = torch.arange(x.numel(), dtype=torch.int64)
    return _fmix32(_fmix32(b ^ ((e * 0x9E3779B1) & _MASK32)) ^ ((step * 0x85EBCA77 + 0x6A09E667) & _MASK32))


def quantize_low_bit(values: torch.Tensor, fmt: LowBitFormat, second_moment: bool,
                     step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values (v itself for a second moment: its square root is what gets coded) -> (uint8 codes in
    fmt.storage_shape, scales of fmt.scale_dtype, one per block). step: the Adam step (from 1) whose exp_avg this
    is, mixed into its stochastic rounding (0 for conversions outside a step)."""
    x = values.detach().float().reshape(-1)
    n = x.numel()
    u = sqrt_f32(x) if second_moment else x
    blocks = torch.nn.functional.pad(u, (0, -n % fmt.block)).view(-1, fmt.block)
    amax = blocks.abs().amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
    scales = _round_to(amax, fmt.scale_dtype)
    scales = torch.where(scales < MIN_SCALE, torch.zeros_like(scales), scales)  # (NaN compares False: kept)
    scales = torch.where(torch.isfinite(scales), scales, torch.full_like(scales, math.nan))
    usable = (scales > 0) & torch.isfinite(scales)
    inv = torch.where(usable, 1.0 / torch.where(usable, scales, torch.ones_like(scales)), torch.zeros_like(scales))
    a = blocks.abs() * inv[:, None]
    levels = _levels(fmt, second_moment)
    if second_moment:
        a = torch.where(a < 1.0, a, torch.ones_like(a))
        bounds = torch.tensor(thresholds(levels, True), dtype=torch.float32)
        codes = torch.searchsorted(bounds, a.reshape(-1).contiguous(), right=True).view_as(a)
    else:  # stochastic rounding between the level at or below and the next one (ort_optim._spec.EXP_AVG_SR_ULPS)
        a_up = a * EXP_AVG_SNAP
        a_up = torch.where(a_up < 1.0, a_up, torch.ones_like(a_up))
        bounds = torch.tensor(thresholds(levels, False), dtype=torch.float32)
        codes = torch.searchsorted(bounds, a_up.reshape(-1).contiguous(), right=True).view_as(a)
        table = torch.tensor(levels + (levels[-1],), dtype=torch.float32)
        lo, hi = table[codes], table[codes + 1]
        lowered = (a.view(torch.int32) - EXP_AVG_SR_ULPS).clamp_min(0).view(torch.float32)
        r = exp_avg_random_bits(torch.nn.functional.pad(x, (0, -n % fmt.block)), step).view_as(a)
        up = (lowered - lo) > (r >> 8).float() * 2.0**-24 * (hi - lo)
        codes = codes + (up & (codes > 0) & (codes < len(levels) - 1)).long()
    if not second_moment:
        codes = codes | (((blocks < 0) & (codes > 0)).long() << (fmt.bits - 1))
    codes = torch.where(torch.isnan(scales)[:, None], torch.zeros_like(codes), codes)  # a NaN block: all codes 0
    codes = codes.reshape(-1)[:n].to(torch.uint8)
    if fmt.bits == 4:
        codes = torch.nn.functional.pad(codes, (0, n % 2)).view(-1, 2)
        codes = codes[:, 0] | (codes[:, 1] << 4)
    return codes.view(fmt.storage_shape(values.shape)), scales.to(fmt.scale_dtype)


def dequantize_low_bit(codes: torch.Tensor, scales: torch.Tensor, fmt: LowBitFormat, second_moment: bool,
                       shape: torch.Size) -> torch.Tensor:
    """uint8 codes and block scales -> float32 values of the given shape (v = u * u for a second moment)."""
    n = math.prod(shape)
    flat = codes.reshape(-1)
    if fmt.bits == 4:
        flat = torch.stack([flat & 0xF, flat >> 4], dim=1).reshape(-1)
    flat = flat[:n].long()
    table = decode_table(fmt, second_moment).to(codes.device)
    values = torch.nn.functional.pad(table[flat], (0, -n % fmt.block)).view(-1, fmt.block)
    values = (values * scales.float()[:, None]).reshape(-1)[:n]
    if second_moment:
        values = values * values
    return values.view(shape)


# ---- fp8 states (ort_optim._spec.Fp8Format, ops/README.md "fp8 states") -------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bits of float32 values as int64 in [0, 2**32)."""
    return x.contiguous().view(torch.int32).long() & _MASK32


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the float32 values with those bits."""
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def fp8_round(y: torch.Tensor, fmt: Fp8Format, random: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Non-negative float32 values (finite, below 2**(emax + 1)) rounded in fmt, as int64 codes (exponent <<
    mantissa_bits | mantissa; not saturated: a code above fmt.max_code means the value rounded beyond the largest
    finite one). To nearest even where random is None or negative: normal values by rounding the float32 mantissa
    to mantissa_bits (add half an ulp of the target minus one, plus the lowest kept bit) with the exponent rebased;
    below the smallest normal (2**(1 - bias)) the count of subnormal steps, rint(y * 2**(bias - 1 +
    mantissa_bits)), exact to the multiplication (a power of two). Stochastically where random (16 random bits, int64
    in [0, 2**16)) is given and >= 0: up with probability equal to the dropped fraction (to 2**-16), by adding
    random << (7 - mantissa_bits), the random bits right below the kept ones (normal: to the float32 bits;
    subnormal: to the value in fixed point with as many fraction bits, truncated from min(y, 2**(1 - bias)) *
    2**(bias + 22), exact to the truncation), and truncating."""
    shift = 23 - fmt.mantissa_bits
    b = _bits(y)
    min_normal = 2.0 ** (1 - fmt.bias)
    sub = y < min_normal
    nearest_normal = ((b + (1 << (shift - 1)) - 1 + ((b >> shift) & 1)) >> shift)
    nearest = torch.where(sub, torch.round(y * 2.0 ** (fmt.bias - 1 + fmt.mantissa_bits)).long(),
                          nearest_normal - ((127 - fmt.bias) << fmt.mantissa_bits))
    if random is None:
        return nearest
    add = random.clamp_min(0) << (shift - 16)
    fixed = (y.clamp_max(min_normal) * 2.0 ** (fmt.bias + 22)).long()
    stochastic = torch.where(sub, (fixed + add) >> shift,
                             ((b + add) >> shift) - ((127 - fmt.bias) << fmt.mantissa_bits))
    return torch.where(random >= 0, stochastic, nearest)


def fp8_random_bits(exp_avg: torch.Tensor, step: int) -> torch.Tensor:
    """The random bits of an fp8 state's stochastic rounding in a step, from the step's new exp_avg (float32 m, flat:
    element e is m[e]), as int64 in [0, 2**32): fmix32(bits(m[e]) ^ e * 0x9E3779B1 ^ (step * 0x85EBCA77 + 0x6A09E667))
    in uint32 arithmetic. One hash per element serves both moments: an fp8 exp_avg takes its top 16 bits, an fp8
    exp_avg_sq (and max_exp_avg_sq) its low 16 (two moments of one element never share random bits, and the step
    hashes once per element, not once per moment)."""
    b = _bits(exp_avg.float())
    e = torch.arange(exp_avg.numel(), dtype=torch.int64)
    return _fmix32(b ^ ((e * 0x9E3779B1) & _MASK32) ^ ((step * 0x85EBCA77 + 0x6A09E667) & _MASK32))


def fp8_block_exponents(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Each block's k (int64) for its largest magnitude amax (finite, non-negative float32): the smallest k with
    fp8_round(amax * 2**-k) <= fmt.max_code, capped at 127 - emax (ort_optim._spec.Fp8Format)."""
    b = _bits(amax)
    e = ((b >> 23) & 0xFF) - 127
    top = _from_bits((b & 0x807FFFFF) | ((fmt.emax + 127) << 23))  # amax * 2**-(e - emax): its mantissa at 2**emax
    k = e - fmt.emax + (fp8_round(top, fmt) > fmt.max_code).long()
    return k.clamp_max(127 - fmt.emax)


def quantize_fp8(values: torch.Tensor, fmt: Fp8Format, second_moment: bool, step: int = 0,
                 exp_avg: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values (v itself for a second moment: its square root is what gets coded) -> (fmt.dtype codes of the
    values' shape, float32 power-of-two scales, one per block of fmt.block). step: the Adam step (from 1) that
    produced the values, whose codes then round stochastically (random bits: fp8_random_bits of that step's exp_avg,
    the values themselves for exp_avg, required for a second moment), except each block's largest magnitudes, which
    round to nearest even (so that the scale survives a decode and re-encode); 0 for conversions outside a step: to
    nearest even."""
    x = values.detach().float().reshape(-1)
    n = x.numel()
    u = sqrt_f32(x) if second_moment else x
    blocks = torch.nn.functional.pad(u, (0, -n % fmt.block)).view(-1, fmt.block)
    a = blocks.abs()
    amax = a.amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
    finite = torch.isfinite(amax)
    k = fp8_block_exponents(torch.where(finite, amax, torch.zeros_like(amax)), fmt)
    usable = finite & (amax > 0) & (k >= fmt.min_exponent)
    k = torch.where(usable, k, torch.zeros_like(k))
    scales = torch.where(usable, _from_bits((k + 127) << 23), torch.where(finite, 0.0, math.nan))
    inverse = _from_bits((127 - k) << 23)
    y = torch.where(usable[:, None], a * inverse[:, None], torch.zeros_like(a))
    random = None
    if step:
        if second_moment and (exp_avg is None or exp_avg.numel() != n):
            raise ValueError("quantize_fp8: a second moment's stochastic rounding (step > 0) needs the step's exp_avg")
        r = fp8_random_bits(x if not second_moment else exp_avg.detach().float().reshape(-1), step)
        r = torch.nn.functional.pad(r & 0xFFFF if second_moment else r >> 16, (0, -n % fmt.block)).view_as(a)
        random = torch.where(a == amax[:, None], -1, r)
    codes = fp8_round(y, fmt, random).clamp_max(fmt.max_code)
    if second_moment:
        codes = torch.where(usable[:, None], codes.clamp_min(1), codes)
    else:
        codes = codes | (((blocks < 0) & (codes > 0)).long() << 7)
    codes = codes.reshape(-1)[:n].to(torch.uint8).view(fmt.dtype)
    return codes.view(values.shape), scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format, second_moment: bool,
                   shape: torch.Size) -> torch.Tensor:
    """fp8 codes and their power-of-two block scales -> float32 values of the given shape (v = u * u for a second
    moment). torch's own float8 -> float32 conversion reads the codes (exact: every fp8 value is a float32)."""
    n = math.prod(shape)
    u = torch.nn.functional.pad(codes.reshape(-1).float(), (0, -n % fmt.block)).view(-1, fmt.block)
    u = (u * scales.float()[:, None]).reshape(-1)[:n]
    return (u * u if second_moment else u).view(shape)


def state_format(state: torch.Tensor, scales: Optional[torch.Tensor]) -> str:
    """"plain" (float32/float64/bfloat16, or float16 without scales), "fp16" (scaled codes), or a low-bit format's
    name: what a state tensor and its scales hold."""
    if scales is None:
        return "plain"
    if state.dtype == torch.float16:
        return "fp16"
    if state.dtype in FP8_FORMATS:
        return FP8_FORMATS[state.dtype].name
    return low_bit_format(scales.dtype).name


def encode_state(values: torch.Tensor, dtype: torch.dtype, second_moment: bool) -> tuple[torch.Tensor,
                                                                                            Optional[torch.Tensor]]:
    """float32/float64 moment values -> (state tensor, scales or None) for the storage dtype that FusedAdam's
    exp_avg_dtype / exp_avg_sq_dtype option names (torch.uint8 and torch.uint4 are the low-bit formats)."""
    if dtype in LOW_BIT_FORMATS:
        return quantize_low_bit(values, LOW_BIT_FORMATS[dtype], second_moment)
    if dtype in FP8_FORMATS:
        return quantize_fp8(values, FP8_FORMATS[dtype], second_moment)
    if dtype == torch.float16:
        return quantize_fp16(sqrt_f32(values.float()) if second_moment else values.float())
    return values.to(dtype), None


def decode_state(state: torch.Tensor, scales: Optional[torch.Tensor], second_moment: bool,
                 shape: torch.Size) -> torch.Tensor:
    """A state tensor (and its scales) -> its values: float32 (float64 for float64 states), of the param's shape."""
    if scales is None:
        return state.to(torch.float64 if state.dtype == torch.float64 else torch.float32)
    if state.dtype == torch.float16:
        u = dequantize_fp16(state, scales)
        return u * u if second_moment else u
    if state.dtype in FP8_FORMATS:
        return dequantize_fp8(state, scales, FP8_FORMATS[state.dtype], second_moment, shape)
    return dequantize_low_bit(state, scales, low_bit_format(scales.dtype), second_moment, shape)


def _read_state(state: torch.Tensor, scales: Optional[torch.Tensor], dtype: torch.dtype, second_moment: bool,
                shape: torch.Size) -> torch.Tensor:
    return decode_state(state, scales, second_moment, shape).to(dtype)


def _write_state(values: torch.Tensor, state: torch.Tensor, scales: Optional[torch.Tensor],
                 second_moment: bool, step: int = 0, exp_avg: Optional[torch.Tensor] = None) -> None:
    if scales is None:
        state.copy_(values)
        return
    if state.dtype == torch.float16:
        codes, new_scales = quantize_fp16(sqrt_f32(values.float()) if second_moment else values.float())
    elif state.dtype in FP8_FORMATS:
        codes, new_scales = quantize_fp8(values, FP8_FORMATS[state.dtype], second_moment, step, exp_avg)
    else:
        codes, new_scales = quantize_low_bit(values, low_bit_format(scales.dtype), second_moment, step)
    state.copy_(codes.view(state.shape))
    scales.copy_(new_scales)


# ---- stochastic rounding (ops/README.md, "stochastic rounding") -------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values (products wrap; the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def random_bits(key: int, step: int, numel: int) -> torch.Tensor:
    """The 32 random bits of each element of a param at this step (step counted from 1), as int64 in [0, 2**32)."""
    k = splitmix64((key & ((1 << 64) - 1)) ^ splitmix64(step))
    e = torch.arange(numel, dtype=torch.int64)
    x = ((e & _MASK32) * 0x9E3779B1 + (e >> 32) * 0x85EBCA77 + (k & _MASK32)) & _MASK32
    return _fmix32(_fmix32(x) ^ (k >> 32))


def round_bf16_stochastic(values: torch.Tensor, key: int, step: int) -> torch.Tensor:
    """float32 values -> bfloat16, each rounded up in magnitude with probability (dropped bits) / 2**16 using
    random_bits; inf and NaN round to nearest."""
    flat = values.float().reshape(-1)
    b = flat.view(torch.int32).long() & _MASK32
    stochastic = ((b + (random_bits(key, step, flat.numel()) >> 16)) >> 16) & 0xFFFF
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
) -> None:
    if rounding_keys is not None:
        if rounding_keys.dtype != torch.int64 or rounding_keys.shape != (len(params),):
            raise RuntimeError(f"ort_optim::adam_step_: rounding_keys must be an int64 tensor of shape [{len(params)}]")
        for i, param in enumerate(params):
            if param.dtype != torch.bfloat16 or len(master_params):
                raise RuntimeError(f"ort_optim::adam_step_: rounding_keys (stochastic rounding) given but params[{i}] "
                                   f"is {param.dtype}; stochastic rounding is for bfloat16 params without master "
                                   "weights")
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

    def update() -> None:
        for i, param in enumerate(params):
            compute = torch.float64 if param.dtype == torch.float64 else torch.float32
            t = float(steps[i]) + 1.0
            bc1 = 1.0 - beta1**t if bias_correction else 1.0
            bc2 = 1.0 - beta2**t if bias_correction else 1.0
            master = optional(master_params, i)
            p = (master if master is not None else param).to(compute, copy=True)
            g = grads[i].to(compute) * grad_mul
            m = _read_state(exp_avgs[i], optional(exp_avg_scales, i), compute, False, param.shape)
            v = _read_state(exp_avg_sqs[i], optional(exp_avg_sq_scales, i), compute, True, param.shape)
            if adam_w_mode == 0:
                g = g + weight_decay * p
            if adam_w_mode == 2:
                p = p * (1.0 - lr * weight_decay)
            m = m + (1.0 - beta1) * (g - m)
            v = v * beta2 + (1.0 - beta2) * g * g
            v_used = v
            if amsgrad:
                old = _read_state(max_exp_avg_sqs[i], optional(max_exp_avg_sq_scales, i), compute, True, param.shape)
                # std::max(old, v) as the kernels compute it: a NaN v keeps the old maximum, a NaN maximum stays
                # (torch.maximum would propagate either)
                vmax = torch.where(old < v, v, old)
                v_used = vmax
            root = v_used.sqrt() if compute == torch.float64 else sqrt_f32(v_used)
            if adam_w_mode == 2:
                p = p - (lr / bc1) * (m / (root / math.sqrt(bc2) + eps))
            else:
                p = p - (lr * math.sqrt(bc2) / bc1) * (m / (root + eps))
                if adam_w_mode == 1:
                    p = p - (lr * weight_decay) * p
            _write_state(m, exp_avgs[i], optional(exp_avg_scales, i), False, int(t))
            _write_state(v, exp_avg_sqs[i], optional(exp_avg_sq_scales, i), True, int(t), m)
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

    # A tensor made under torch.inference_mode() (a checkpoint loaded there, say) can be written in place only inside
    # it. The native and Triton kernels write through pointers either way; so does this path, instead of failing
    # halfway with some tensors written. Its in-place torch ops mark what they write for autograd (version counters,
    # inside inference_mode too, for every tensor that has one), as the other backends do (ort_optim/_versions.py).
    written = [*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs, *master_params, *exp_avg_scales,
               *exp_avg_sq_scales, *max_exp_avg_sq_scales, steps, *(grads if grad_scale is not None else ())]
    with torch.inference_mode() if any(t.is_inference() for t in written) else contextlib.nullcontext():
        update()


def grad_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for t in tensors:
        total += t.double().square().sum()
    return torch.stack([total, (~torch.isfinite(total)).double()]).float()
