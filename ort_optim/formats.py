"""The stored moment formats in torch ops: the one implementation of encoding moment values into a state tensor (and
its block scales) and decoding them back, for every format FusedAdam stores (ops/README.md, "fp16 states" and
"low-bit states"): plain float32/float64/bfloat16, scaled fp16 codes, 8-bit and 4-bit block-quantised codes, and fp8
codes with power-of-two block scales ("fp8 states").

Checkpoints decode and re-encode states through :func:`decode_state` and :func:`encode_state`; the reference backend
reads and writes its states with them; the native and Triton kernels implement the same rules and the tests hold
them to these functions bit for bit. The formats' constants (block sizes, code levels, thresholds, the LowBitFormat
records) are ort_optim._spec's, which the native build and the Triton kernels read as well; this module imports only
_spec and torch.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

try:
    import numpy
except ImportError:  # (torch runs without numpy; sqrt_f64 then takes torch's float64 sqrt)
    numpy = None

from ._spec import (CANONICAL_NAN, EXP_AVG_SNAP, EXP_AVG_SR_ULPS, FP8_FORMATS, FP8_MAX_ROOT, MIN_SCALE, FP16_LIMIT,
                    LOW_BIT_FORMATS, QUANT_BLOCK, Fp8Format, LowBitFormat, low_bit_format, num_blocks, square_tables)

# ---- the hash of the stochastic roundings (ops/README.md) -----------------------------------------------------------

MASK32 = 0xFFFFFFFF  # uint32 arithmetic on int64 tensors: products wrap to their low 32 bits


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values (products wrap; the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


# ---- scaled fp16 states (ops/README.md, "fp16 states") ----------------------------------------------------------


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x flattened and zero-padded to [num_blocks, QUANT_BLOCK]."""
    flat = x.reshape(-1)
    pad = num_blocks(flat.numel()) * QUANT_BLOCK - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, QUANT_BLOCK)


def fp16_block_scales(values: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale per 1024-element block of float32 values (ops/README.md, "fp16 states"), chosen by the
    block's largest finite magnitude: an inf or NaN element (an overflowed v, an inf or NaN gradient's moment) keeps
    its own value and leaves the others' scale as without it."""
    blocks = _blocks(values.float()).abs()
    amax = torch.where(torch.isfinite(blocks), blocks, torch.zeros_like(blocks)).amax(dim=1)
    mantissa, exponent = torch.frexp(amax)
    k = torch.where(mantissa == 0.5, 16 - exponent, 15 - exponent).clamp(-126, 126)
    rounded = torch.ldexp(amax, k.float()).half().float()
    k = torch.where(rounded <= FP16_LIMIT / 2, k + 1, k).clamp(-126, 126)
    usable = amax > 0
    return torch.where(usable, torch.ldexp(torch.ones_like(amax), k.float()), torch.ones_like(amax))


def quantize_fp16(values: torch.Tensor, second_moment: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values -> (float16 codes of the same shape, float32 block scales). second_moment (values: sqrt(v)):
    a positive value that would round to 0 takes the smallest subnormal code instead (no zero level, as the other
    scaled formats: a v read back as 0 would make m / (sqrt(v) + eps) explode)."""
    scales = fp16_block_scales(values)
    blocks = _blocks(values.float())
    codes = (blocks * scales[:, None]).half()
    if second_moment:
        tiny = torch.tensor(2.0**-24, dtype=torch.float16, device=codes.device)
        codes = torch.where((codes == 0) & (blocks > 0), tiny, codes)
    codes = codes.reshape(-1)[: values.numel()]
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


def sqrt_f64(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float64 square root, as the native and Triton kernels take it. torch's own float64 sqrt on
    the CPU is not (its vectorised sqrt differs in the last bit for about 1% of values), so a float64 param would
    step differently on the reference backend: on the CPU this is numpy's (the hardware's instruction), on other
    devices torch's (CUDA's float64 sqrt is correctly rounded)."""
    if x.device.type != "cpu" or numpy is None:
        return x.sqrt()
    out = torch.empty_like(x)
    with numpy.errstate(invalid="ignore"):  # (a negative v, only from a damaged state: NaN, as torch gives)
        numpy.sqrt(x.detach().numpy(), out=out.numpy())
    return out


def _levels(fmt: LowBitFormat, second_moment: bool) -> tuple[float, ...]:
    return fmt.exp_avg_sq_levels if second_moment else fmt.exp_avg_levels


def decode_table(fmt: LowBitFormat, second_moment: bool, device: torch.device) -> torch.Tensor:
    """float32 [2**bits] on device: the value of each code relative to its block's scale (sign-magnitude for
    exp_avg; the code with only the sign bit set, never written, reads as 0)."""
    levels = torch.tensor(_levels(fmt, second_moment), dtype=torch.float32, device=device)
    if second_moment:
        return levels
    return torch.cat([levels, -levels])


def _round_to(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values rounded to nearest even in dtype (float32 or bfloat16), as float32."""
    return amax.to(dtype).float()


def bf16_scales_stochastic(amax: torch.Tensor, r16: torch.Tensor, second_moment: bool) -> torch.Tensor:
    """Blocks' largest magnitudes (float32) rounded to bfloat16 stochastically (_spec.BF16_SCALE_STOCHASTIC) with
    16 random bits each (int64): unbiased in v (a second moment's sqrt(v)) or in the value, as float32."""
    b = _bits(amax)
    lo = _from_bits(b & 0xFFFF0000)
    hi = _from_bits((b & 0xFFFF0000) + 0x10000)
    if second_moment:
        up = (amax * amax - lo * lo) > sr_uniform(r16) * (hi * hi - lo * lo)
    else:
        up = (amax - lo) > sr_uniform(r16) * (hi - lo)
    rounded = torch.where(up, hi, lo)
    return torch.where(torch.isfinite(amax) & ((b & 0xFFFF) != 0), rounded, amax)


def moment_random_bits(exp_avg: torch.Tensor, step: int) -> torch.Tensor:
    """The random bits of the low-bit and fp8 states' stochastic rounding in a step (_spec.MOMENT_RANDOM_BITS), from
    the step's new exp_avg (float32 m, flat: element e is m[e]), as int64 in [0, 2**32): fmix32(bits(m[e]) ^
    e * 0x9E3779B1 ^ (step * 0x85EBCA77 + 0x6A09E667)) in uint32 arithmetic, every NaN hashed as CANONICAL_NAN.
    One hash per element serves both moments: exp_avg takes its top 16 bits, exp_avg_sq and max_exp_avg_sq its low
    16."""
    m = exp_avg.float()
    b = torch.where(m.isnan(), CANONICAL_NAN, _bits(m))
    e = torch.arange(exp_avg.numel(), dtype=torch.int64, device=exp_avg.device)
    return fmix32(b ^ ((e * 0x9E3779B1) & MASK32) ^ ((step * 0x85EBCA77 + 0x6A09E667) & MASK32))


def sr_uniform(r16: torch.Tensor) -> torch.Tensor:
    """The uniform numbers that a low-bit map's stochastic rounding compares against (_spec.MOMENT_RANDOM_BITS):
    float32 (2 * r16 + 1) * 2**-17 for 16 random bits r16 (int64 in [0, 2**16)), the midpoints of 2**16 equal steps
    of (0, 1)."""
    return (2 * r16 + 1).float() * 2.0**-17


def _relative_root(fmt: LowBitFormat, second_moment: bool, root: Optional[torch.Tensor], n: int,
                   what: str) -> Optional[torch.Tensor]:
    """The flat float32 u that a relative exp_avg (_spec.EXP_AVG_RELATIVE) is coded against; None for every other
    state."""
    if second_moment or not fmt.exp_avg_relative:
        return None
    if root is None or root.numel() != n:
        raise ValueError(f"{what}: a {fmt.name} exp_avg is coded relative to its exp_avg_sq's decoded sqrt(v): pass "
                         f"root (low_bit_root of the {fmt.name} exp_avg_sq, {n} elements)")
    return root.detach().float().reshape(-1)


def low_bit_root(codes: torch.Tensor, scales: torch.Tensor, fmt: LowBitFormat, shape: torch.Size) -> torch.Tensor:
    """The decoded sqrt(v) (u = level * |s|, float32, of the given shape) of a second moment's uint8 codes: inf for
    an overflowed v (code 0 in a block whose scale has its sign bit set, and is no NaN), NaN in a NaN block. What a
    relative exp_avg is coded against (_spec.EXP_AVG_RELATIVE); v = u * u."""
    n = math.prod(shape)
    flat = _unpacked(codes, fmt, n)
    u = _times_block_scales(decode_table(fmt, True, codes.device)[flat], scales.float().abs(), fmt)
    return torch.where(_overflow_flags(scales, fmt, n) & (flat == 0), torch.full_like(u, math.inf), u).view(shape)


def _unpacked(codes: torch.Tensor, fmt: LowBitFormat, n: int) -> torch.Tensor:
    """The first n codes (int64, one per element) of a low-bit state's storage: 4-bit codes two per byte, element
    2j in the low nibble of byte j."""
    flat = codes.reshape(-1)
    if fmt.bits == 4:
        flat = torch.stack([flat & 0xF, flat >> 4], dim=1).reshape(-1)
    return flat[:n].long()


def _times_block_scales(values: torch.Tensor, scales: torch.Tensor, fmt: LowBitFormat | Fp8Format) -> torch.Tensor:
    """Flat per-element values times their block's (float32) scale (fmt.block elements a block)."""
    n = values.numel()
    return (torch.nn.functional.pad(values, (0, -n % fmt.block)).view(-1, fmt.block) * scales[:, None]).reshape(-1)[:n]


def _overflow_flags(scales: torch.Tensor, fmt: LowBitFormat | Fp8Format, n: int) -> torch.Tensor:
    """Per element: its block's scale has its sign bit set and is no NaN (the block holds an overflowed v, whose
    code 0 reads as inf)."""
    return (torch.signbit(scales.float()) & ~torch.isnan(scales.float())).repeat_interleave(fmt.block)[:n]


def quantize_low_bit(values: torch.Tensor, fmt: LowBitFormat, second_moment: bool, step: int = 0,
                     root: Optional[torch.Tensor] = None,
                     exp_avg: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values (v itself for a second moment: its square root is what gets coded) -> (uint8 codes in
    fmt.storage_shape, scales of fmt.scale_dtype, one per block). step: the Adam step (from 1) whose exp_avg this
    is, mixed into its stochastic rounding; 0 for conversions outside a step (checkpoint loads, from_optimizer),
    where exp_avg rounds to its nearest level instead (ties up), as bitsandbytes' and torchao's quantizers do: the
    smallest error of a one-off conversion (the step's stochastic rounding is unbiased over steps, but its error on
    one tensor is a third larger: 0.0082 against 0.0061 mean absolute error on randn(1024, 1024)). root: for an
    exp_avg of a relative format (4-bit), the decoded sqrt(v) of its exp_avg_sq as just encoded (low_bit_root):
    what is coded is then r = m / root (_spec.EXP_AVG_RELATIVE). exp_avg: the step's new exp_avg (float32 m), whose
    hash gives the stochastic rounding's random bits (moment_random_bits, _spec.MOMENT_RANDOM_BITS): the values
    themselves for an exp_avg; required for a second moment that rounds stochastically (the 4-bit one, step > 0)."""
    x = values.detach().float().reshape(-1)
    n = x.numel()
    r16 = None  # the 16 random bits of each element (padded to whole blocks), in a step
    if step and (not second_moment or fmt.exp_avg_sq_stochastic):
        if second_moment and (exp_avg is None or exp_avg.numel() != n):
            raise ValueError(f"quantize_low_bit: a {fmt.name} second moment's stochastic rounding (step > 0) needs "
                             f"the step's exp_avg ({n} elements)")
        r = moment_random_bits(x if not second_moment else exp_avg.detach().float().reshape(-1), step)
        r16 = torch.nn.functional.pad(r & 0xFFFF if second_moment else r >> 16, (0, -n % fmt.block))
    u_pair = _relative_root(fmt, second_moment, root, n, "quantize_low_bit")
    if u_pair is not None:  # r = m / u, 0 where u = 0
        x = torch.where(u_pair == 0, torch.zeros_like(x), x / u_pair)
    u = sqrt_f32(x) if second_moment else x
    blocks = torch.nn.functional.pad(u, (0, -n % fmt.block)).view(-1, fmt.block)
    # A second moment whose v overflowed float32 (sqrt(v) = inf; torch's AdamW keeps that v = inf): the element gets
    # code 0, which reads back as inf in a block whose scale has its sign bit set; the block's other elements are
    # coded by their own maximum, with codes >= 1 (_spec.LowBitFormat).
    overflowed = torch.isposinf(blocks) if second_moment else torch.zeros_like(blocks, dtype=torch.bool)
    finite = torch.where(overflowed, torch.zeros_like(blocks), blocks)
    amax = finite.abs().amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
    if r16 is not None and fmt.scale_dtype == torch.bfloat16:  # in a step (_spec.BF16_SCALE_STOCHASTIC)
        scales = _round_to(bf16_scales_stochastic(amax, r16.view(-1, fmt.block)[:, 0], second_moment), fmt.scale_dtype)
    else:
        scales = _round_to(amax, fmt.scale_dtype)
        if second_moment and fmt.scale_dtype == torch.bfloat16:
            # A finite v just below float32's largest has sqrt(v) within half a bfloat16 step of 2**64, which rounds
            # to 2**64: its square, the decoded v, would be inf. It takes the bfloat16 value below instead, as a
            # step's stochastic rounding does (BF16_SCALE_STOCHASTIC never rounds up where hi * hi overflows).
            below = _from_bits(_bits(amax) & 0xFFFF0000)
            scales = torch.where(torch.isfinite(amax) & torch.isinf(scales * scales), below, scales)
    scales = torch.where(scales < MIN_SCALE, torch.zeros_like(scales), scales)  # (NaN compares False: kept)
    if second_moment:  # (_spec.MIN_SQRT_V)
        scales = torch.where(scales > 0, scales.clamp_min(fmt.min_sq_scale), scales)
    scales = torch.where(torch.isfinite(scales), scales, torch.full_like(scales, math.nan))
    flagged = overflowed.any(dim=1) & ~torch.isnan(scales)
    usable = (scales > 0) & torch.isfinite(scales)
    inv = torch.where(usable, 1.0 / torch.where(usable, scales, torch.ones_like(scales)), torch.zeros_like(scales))
    a = blocks.abs() * inv[:, None]
    levels = _levels(fmt, second_moment)
    if second_moment and step and fmt.exp_avg_sq_stochastic:  # unbiased in v (_spec.EXP_AVG_SQ_STOCHASTIC)
        a_up = a * EXP_AVG_SNAP
        a_up = torch.where(a_up < 1.0, a_up, torch.ones_like(a_up))
        bounds = torch.tensor(fmt.sr_thresholds(True), dtype=torch.float32, device=a.device)
        codes = torch.searchsorted(bounds, a_up.reshape(-1).contiguous(), right=True).view_as(a)
        squares, gaps = (torch.tensor(t, dtype=torch.float32, device=a.device) for t in square_tables(levels))
        lowered = (a.view(torch.int32) - EXP_AVG_SR_ULPS).clamp_min(0).view(torch.float32)
        up = (lowered * lowered - squares[codes]) > sr_uniform(r16).view_as(a) * gaps[codes]
        codes = codes + (up & (codes < len(levels) - 1)).long()
    elif second_moment:
        a = torch.where(a < 1.0, a, torch.ones_like(a))
        bounds = torch.tensor(fmt.sq_thresholds(), dtype=torch.float32, device=a.device)
        codes = torch.searchsorted(bounds, a.reshape(-1).contiguous(), right=True).view_as(a)
    else:  # stochastic rounding between the level at or below and the next one (ort_optim._spec.EXP_AVG_SR_ULPS)
        a_up = a * EXP_AVG_SNAP
        a_up = torch.where(a_up < 1.0, a_up, torch.ones_like(a_up))
        bounds = torch.tensor(fmt.sr_thresholds(False), dtype=torch.float32, device=a.device)
        codes = torch.searchsorted(bounds, a_up.reshape(-1).contiguous(), right=True).view_as(a)
        table = torch.tensor(levels + (levels[-1],), dtype=torch.float32, device=a.device)
        lo, hi = table[codes], table[codes + 1]
        if step:
            lowered = (a.view(torch.int32) - EXP_AVG_SR_ULPS).clamp_min(0).view(torch.float32)
            up = (lowered - lo) > sr_uniform(r16).view_as(a) * (hi - lo)
            # (from level 0 too for a relative exp_avg: _spec.EXP_AVG_RELATIVE)
            from_level = (codes >= 0) if fmt.exp_avg_relative else (codes > 0)
            codes = codes + (up & from_level & (codes < len(levels) - 1)).long()
        else:  # a conversion: the nearest level (a value on a level, up to the decode noise, stays: idempotent)
            codes = codes + (((a - lo) >= (hi - a)) & (codes < len(levels) - 1)).long()
    if not second_moment:
        codes = codes | (((blocks < 0) & (codes > 0)).long() << (fmt.bits - 1))
    codes = torch.where(flagged[:, None], torch.where(overflowed, torch.zeros_like(codes), codes.clamp(min=1)), codes)
    scales = torch.where(flagged, -scales, scales)  # (-0.0 for a zero block)
    codes = torch.where(torch.isnan(scales)[:, None], torch.zeros_like(codes), codes)  # a NaN block: all codes 0
    codes = codes.reshape(-1)[:n].to(torch.uint8)
    if fmt.bits == 4:
        codes = torch.nn.functional.pad(codes, (0, n % 2)).view(-1, 2)
        codes = codes[:, 0] | (codes[:, 1] << 4)
    return codes.view(fmt.storage_shape(values.shape)), scales.to(fmt.scale_dtype)


def dequantize_low_bit(codes: torch.Tensor, scales: torch.Tensor, fmt: LowBitFormat, second_moment: bool,
                       shape: torch.Size, root: Optional[torch.Tensor] = None) -> torch.Tensor:
    """uint8 codes and block scales -> float32 values of the given shape (v = u * u for a second moment). root: for
    an exp_avg of a relative format (4-bit), the decoded sqrt(v) of the exp_avg_sq stored with it (low_bit_root):
    m = q * root, 0 where q = 0 (_spec.EXP_AVG_RELATIVE)."""
    n = math.prod(shape)
    u_pair = _relative_root(fmt, second_moment, root, n, "dequantize_low_bit")
    flat = _unpacked(codes, fmt, n)
    values = _times_block_scales(decode_table(fmt, second_moment, codes.device)[flat], scales.float(), fmt)
    if u_pair is not None:
        values = torch.where(values == 0, torch.zeros_like(values), values * u_pair)
    if second_moment:  # code 0 in a block whose scale has its sign bit set (and is no NaN): an overflowed v, inf
        flagged = _overflow_flags(scales, fmt, n)
        values = torch.where(flagged & (flat == 0), torch.full_like(values, math.inf), values * values)
    return values.view(shape)


# ---- fp8 states (ort_optim._spec.Fp8Format, ops/README.md "fp8 states") -------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bits of float32 values as int64 in [0, 2**32)."""
    return x.contiguous().view(torch.int32).long() & MASK32


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


def fp8_block_exponents(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Each block's k (int64) for a largest magnitude amax (finite, non-negative float32, not a zero block's): the
    smallest k with amax * 2**-k <= fmt.max_value, capped at 127 - emax (ort_optim._spec.Fp8Format)."""
    b = _bits(amax)
    e = ((b >> 23) & 0xFF) - 127
    k = e - fmt.emax + ((b & 0x7FFFFF) > fmt.max_mantissa).long()
    return k.clamp_max(127 - fmt.emax)


def fp8_coded_amax(amax: torch.Tensor, fmt: Fp8Format, random: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each block's largest magnitude as the block codes it (float32; ort_optim._spec.Fp8Format): amax * 2**-k0,
    k0 = fp8_block_exponents(amax), rounded in fmt (stochastically with 16 random bits, int64 in [0, 2**16), as
    fp8_round; to nearest even where random is None) and saturated at max_value, times 2**k0. 0 where amax lies
    below 2**(emax + min_exponent - 1): a zero block however it rounds."""
    b = _bits(amax)
    e = ((b >> 23) & 0xFF) - 127
    live = e >= fmt.emax + fmt.min_exponent - 1
    k0 = torch.where(live, fp8_block_exponents(amax, fmt), torch.zeros_like(e))
    y = torch.where(live, b - (k0 << 23), torch.zeros_like(b))  # (amax * 2**-k0: normal, exponent emax - 1 or emax)
    shift = 23 - fmt.mantissa_bits
    add = (1 << (shift - 1)) - 1 + ((y >> shift) & 1) if random is None else random << (shift - 16)
    kept = ((y + add) >> shift) << shift
    coded = torch.clamp_max(kept, ((fmt.emax + 127) << 23) | fmt.max_mantissa) + (k0 << 23)
    return torch.where(live, _from_bits(coded), torch.zeros_like(amax))


def fp8_zero_blocks(coded_amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Whether each block, by its coded largest magnitude (fp8_coded_amax), is a zero block: below 2**(emax +
    min_exponent) (ort_optim._spec.Fp8Format)."""
    return ((_bits(coded_amax) >> 23) & 0xFF) - 127 < fmt.emax + fmt.min_exponent


def quantize_fp8(values: torch.Tensor, fmt: Fp8Format, second_moment: bool, step: int = 0,
                 exp_avg: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values (v itself for a second moment: its square root is what gets coded) -> (fmt.dtype codes of the
    values' shape, float32 power-of-two scales, one per block of fmt.block). step: the Adam step (from 1) that
    produced the values, whose codes then round stochastically (random bits: moment_random_bits of that step's exp_avg,
    the values themselves for exp_avg, required for a second moment), each block's largest magnitude too (with the
    bits of the block's first element: fp8_coded_amax, whose result sets the scale and is the code of every element
    equal to that magnitude, and caps the others); 0 for conversions outside a step: to nearest even."""
    x = values.detach().float().reshape(-1)
    n = x.numel()
    u = sqrt_f32(x) if second_moment else x
    blocks = torch.nn.functional.pad(u, (0, -n % fmt.block)).view(-1, fmt.block)
    # A second moment whose v overflowed float32 (sqrt(v) = inf; torch's AdamW keeps that v = inf): the element gets
    # code 0, which reads back as inf in a block whose scale has its sign bit set; the block's other elements are
    # coded by their own maximum, with codes >= 1 (_spec.Fp8Format).
    overflowed = torch.isposinf(blocks) if second_moment else torch.zeros_like(blocks, dtype=torch.bool)
    a = torch.where(overflowed, torch.zeros_like(blocks), blocks.abs())
    amax = a.amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
    finite = torch.isfinite(amax)
    flagged = overflowed.any(dim=1) & finite
    random = None
    if step:
        if second_moment and (exp_avg is None or exp_avg.numel() != n):
            raise ValueError("quantize_fp8: a second moment's stochastic rounding (step > 0) needs the step's exp_avg")
        r = moment_random_bits(x if not second_moment else exp_avg.detach().float().reshape(-1), step)
        random = torch.nn.functional.pad(r & 0xFFFF if second_moment else r >> 16, (0, -n % fmt.block)).view_as(a)
    coded_from = torch.where(finite, amax, torch.zeros_like(amax))
    if second_moment:  # (its square, the decoded v, stays finite: _spec.FP8_MAX_ROOT)
        coded_from = coded_from.clamp_max(FP8_MAX_ROOT)
    coded = fp8_coded_amax(coded_from, fmt, None if random is None else random[:, 0])
    usable = finite & ~fp8_zero_blocks(coded, fmt)
    k = fp8_block_exponents(coded, fmt)
    if second_moment:  # (_spec.MIN_SQRT_V)
        k = k.clamp_min(fmt.min_sq_exponent)
    k = torch.where(usable, k, torch.zeros_like(k))
    scales = torch.where(usable, _from_bits((k + 127) << 23), torch.where(finite, 0.0, math.nan))
    inverse = _from_bits((127 - k) << 23)
    y = torch.where(usable[:, None], a * inverse[:, None], torch.zeros_like(a))
    top = fp8_round(torch.where(usable, coded * inverse, torch.zeros_like(coded)), fmt).clamp_max(fmt.max_code)
    codes = torch.minimum(fp8_round(y, fmt, random), top[:, None])
    codes = torch.where(a == amax[:, None], top[:, None], codes)
    if second_moment:
        codes = torch.where(usable[:, None] | flagged[:, None], codes.clamp_min(1), codes)
        codes = torch.where(overflowed, torch.zeros_like(codes), codes)
        scales = torch.where(flagged, -scales, scales)  # (-0.0 for a zero block)
    else:
        codes = codes | (((blocks < 0) & (codes > 0)).long() << 7)
    codes = codes.reshape(-1)[:n].to(torch.uint8).view(fmt.dtype)
    return codes.view(values.shape), scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format, second_moment: bool,
                   shape: torch.Size) -> torch.Tensor:
    """fp8 codes and their power-of-two block scales -> float32 values of the given shape (v = u * u for a second
    moment; code 0 in a block whose scale has its sign bit set, and is no NaN, is an overflowed v = inf). Each code
    reads as its bits say (ort_optim._spec.Fp8Format: normal codes by exponent and mantissa, subnormal ones as
    mantissa * 2**(1 - bias - mantissa_bits)): torch's float8 conversion for every code the encoder writes, and for
    the ones it never writes (e5m2's inf and NaN codes 0x7C-0x7F, e4m3fn's NaN 0x7F) the finite values beyond the
    largest that their bits give, as every kernel reads them."""
    n = math.prod(shape)
    c = codes.reshape(-1).view(torch.uint8).to(torch.int32)
    mag, mb = c & 0x7F, fmt.mantissa_bits
    normal = ((mag << (23 - mb)) + ((127 - fmt.bias) << 23)).view(torch.float32)
    subnormal = (mag & ((1 << mb) - 1)).float() * 2.0 ** (1 - fmt.bias - mb)
    u = torch.where((mag >> mb) == 0, subnormal, normal)
    u = _times_block_scales(torch.where((c & 0x80) != 0, -u, u), scales.float(), fmt)
    if not second_moment:
        return u.view(shape)
    overflowed = _overflow_flags(scales, fmt, n) & (c == 0)
    return torch.where(overflowed, torch.full_like(u, math.inf), u * u).view(shape)


# State dtypes that hold the values themselves (float16 holds values without scales, codes with them).
_VALUE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def state_format(state: torch.Tensor, scales: Optional[torch.Tensor]) -> str:
    """"plain" (float32/float64/bfloat16, or float16 without scales), "fp16" (scaled codes), or a low-bit format's
    name: what a state tensor and its scales hold. A float32/float64/bfloat16 tensor holds values whatever scales
    lie beside it (values assigned in place of codes, whose scales the next step drops)."""
    if scales is None or state.dtype in _VALUE_DTYPES:
        return "plain"
    if state.dtype == torch.float16:
        return "fp16"
    if state.dtype in FP8_FORMATS:
        return FP8_FORMATS[state.dtype].name
    return low_bit_format(scales.dtype).name


def encode_state(values: torch.Tensor, dtype: torch.dtype, second_moment: bool,
                 root: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """float32/float64 moment values -> (state tensor, scales or None) for the storage dtype that FusedAdam's
    exp_avg_dtype / exp_avg_sq_dtype option names (torch.uint8 and torch.uint4 are the low-bit formats,
    torch.float8_e4m3fn and torch.float8_e5m2 the fp8 ones: a conversion, rounded to nearest even). root: a 4-bit
    exp_avg's exp_avg_sq, decoded as sqrt(v) (state_root), encoded first (_spec.EXP_AVG_RELATIVE)."""
    if dtype in LOW_BIT_FORMATS:
        return quantize_low_bit(values, LOW_BIT_FORMATS[dtype], second_moment, root=root)
    if dtype in FP8_FORMATS:
        return quantize_fp8(values, FP8_FORMATS[dtype], second_moment)
    if dtype == torch.float16:
        return quantize_fp16(sqrt_f32(values.float()) if second_moment else values.float(), second_moment)
    return values.to(dtype), None


def decode_state(state: torch.Tensor, scales: Optional[torch.Tensor], second_moment: bool, shape: torch.Size,
                 root: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A state tensor (and its scales) -> its values: float32 (float64 for float64 states), of the param's shape.
    root: a 4-bit exp_avg's exp_avg_sq decoded as sqrt(v) (state_root; _spec.EXP_AVG_RELATIVE)."""
    if state_format(state, scales) == "plain":
        return state.to(torch.float64 if state.dtype == torch.float64 else torch.float32)
    if state.dtype == torch.float16:
        u = dequantize_fp16(state, scales)
        return u * u if second_moment else u
    if state.dtype in FP8_FORMATS:
        return dequantize_fp8(state, scales, FP8_FORMATS[state.dtype], second_moment, shape)
    return dequantize_low_bit(state, scales, low_bit_format(scales.dtype), second_moment, shape, root)


# A multiple of every format's block: a piece of a state that starts at a multiple of it starts a block (and a byte of
# 4-bit codes) in every format.
BLOCK_MULTIPLE = math.lcm(QUANT_BLOCK, *(f.block for f in LOW_BIT_FORMATS.values()),
                          *(f.block for f in FP8_FORMATS.values()))


def scale_block(state: torch.Tensor, scales: torch.Tensor) -> int:
    """How many elements one block scale of a scaled state (not "plain": state_format) covers: QUANT_BLOCK for fp16
    codes, the format's block for the low-bit and fp8 ones. Its elements [i * block, (i + 1) * block) are coded by
    scales[i] alone, so whole blocks encode and decode apart from the others."""
    if state.dtype == torch.float16:
        return QUANT_BLOCK
    if state.dtype in FP8_FORMATS:
        return FP8_FORMATS[state.dtype].block
    return low_bit_format(scales.dtype).block


def is_relative(state: torch.Tensor, scales: Optional[torch.Tensor]) -> bool:
    """Whether an exp_avg state so stored is coded relative to its exp_avg_sq (_spec.EXP_AVG_RELATIVE: 4-bit)."""
    return (scales is not None and state.dtype == torch.uint8 and scales.dtype in (torch.float32, torch.bfloat16)
            and low_bit_format(scales.dtype).exp_avg_relative)


def state_root(state: torch.Tensor, scales: Optional[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The decoded sqrt(v) of an exp_avg_sq state that a relative exp_avg pairs with: low_bit_root of its codes.
    Only a state in the relative format itself can pair (both moments 4-bit); anything else is a ValueError."""
    if not is_relative(state, scales):
        raise ValueError(f"a 4-bit exp_avg is coded relative to a 4-bit exp_avg_sq (both moments torch.uint4), "
                         f"but exp_avg_sq is stored as {state.dtype}"
                         + ("" if scales is None else f" with {scales.dtype} scales"))
    return low_bit_root(state, scales, low_bit_format(scales.dtype), shape)

