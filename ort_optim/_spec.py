"""The numeric specification every backend shares (ops/README.md states the math): one place for its constants.

Backends (``ort_optim/backends/``) import this module and never one another; the C++ kernels mirror these values
(``kBlock`` in ops/adam_kernel.h, ``kFp16Limit`` in ops/conversions.h), and the tests check that the native library agrees.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from typing import Optional

import torch

# Elements per quantisation block of scaled fp16 states (one float32 scale each) and per unit of kernel work.
QUANT_BLOCK = 1024
# Scaled fp16 states: each block's absolute maximum is scaled into (FP16_LIMIT / 2, FP16_LIMIT]: half of fp16's range
# stays free as headroom for the next step, and the rule is idempotent (ops/README.md, "fp16 states").
FP16_LIMIT = 32768.0

LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.uint4, torch.float8_e4m3fn,
                torch.float8_e5m2)


class AdamWMode(enum.IntEnum):
    """Weight-decay variants, with ONNX Runtime's names and values (ops/README.md has the exact math)."""

    ADAM_L2_REGULARIZATION = 0  # g += wd * p before the moments; eps outside the bias-corrected sqrt
    ADAMW_TRANSFORMERS = 1  # HF transformers AdamW: p -= lr * wd * p after the update (ORT's default)
    ADAMW_TORCH = 2  # torch.optim.AdamW: p *= 1 - lr * wd before the update; torch's eps placement


# A step with grad_scale writes the unscaled gradient back into each gradient: one that overlaps itself cannot take
# one value per element, one in its param's own memory cannot take it beside the update. The ops' errors, after
# "grads[i] " (FusedAdam names the param instead).
GRAD_OVERLAPS_ITSELF = ("overlaps itself (an expand()ed tensor), so it cannot be unscaled in place: give it its own "
                        "memory (grad.contiguous()) or step without grad_scale")
GRAD_IN_PARAM = ("shares memory with the param itself (p.grad = p.detach(), or a view of it), so a step with grad_scale "
                 "cannot both update the param and leave the unscaled gradient in p.grad: give the gradient its own "
                 "memory (p.grad = p.grad.clone()) or step without grad_scale (a plain step, max_grad_norm and "
                 "found_inf read such a gradient before they write the param)")


PARAM_OVERLAPS_ITSELF = ("overlaps itself (an expand()ed tensor), so it cannot hold one updated value per element: give "
                         "it its own memory (param.clone())")


def exp_avg_not_relative(i: int) -> str:
    """The ops' refusal of a 4-bit exp_avgs[i] beside an exp_avg_sqs[i] that is not 4-bit (EXP_AVG_RELATIVE)."""
    return (f"exp_avgs[{i}] holds 4-bit codes, which are coded relative to a 4-bit exp_avg_sq, but exp_avg_sqs[{i}] is "
            "not 4-bit codes: store both moments as torch.uint4")


def scalar_type_name(dtype: torch.dtype) -> str:
    """A dtype as the native op's messages print it (c10's ScalarType name: Float for torch.float32, BFloat16 for
    torch.bfloat16), so that every backend refuses in the same words."""
    name = _SCALAR_TYPE_NAMES.get(dtype)
    if name is None:
        legacy = torch.empty(0, dtype=dtype, device="cpu").type()  # torch.<ScalarType name>Tensor
        name = _SCALAR_TYPE_NAMES.setdefault(dtype, legacy[len("torch."):-len("Tensor")])
    return name


_SCALAR_TYPE_NAMES: dict = {}


def host_hyperparameters_refused(name: str, t: torch.Tensor, device: torch.device) -> Optional[str]:
    """The ops' refusal of betas_tensor (float64 [2]: beta1, beta2) or group_hyperparameters (float64 [groups, 3]:
    each group's lr, beta1, beta2) that has another dtype, shape, device than the steps' or layout; None: accepted."""
    shape, what = ((2,), "[2] (beta1, beta2)") if name == "betas_tensor" else (None, "[groups, 3] (lr, beta1, beta2)")
    if (t.dtype == torch.float64 and t.layout == torch.strided and t.device == device
            and (tuple(t.shape) == shape if shape else (t.dim() == 2 and t.shape[1] == 3))):
        return None
    return (f"{name} must be a float64 tensor of shape {what} on the steps' device ({device}), got "
            f"{scalar_type_name(t.dtype)} of shape {list(t.shape)} on {t.device}")


def step_count_refused(i: int, count: float) -> str:
    """The ops' refusal of steps[i] that is not a whole number in [0, MAX_STEP] (a count written in place is not
    checked when written), as the native op words it (ops/step.cpp)."""
    return (f"steps[{i}] is {count:g}; a step count is a whole number in [0, 2**53], as a checkpoint's are (was it "
            "written in place?)")


def rounding_keys_refused(i: int, dtype: torch.dtype, has_master: bool) -> str:
    """The ops' refusal of rounding_keys for params[i], which is not a bfloat16 param without a master weight (as the
    native op words it, ops/validation.cpp: check_rounding_keys)."""
    return (f"rounding_keys (stochastic rounding) given but params[{i}] is {scalar_type_name(dtype)}"
            f"{' with a master weight' if has_master else ''}; stochastic rounding is for bfloat16 params without "
            "master weights")


def grad_in_param_memory(g: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether gradient g shares memory with its param p (GRAD_IN_PARAM): the bytes they reach meet, as the native
    op's ``grad_in_param_memory`` (ops/validation.h) decides: exact for contiguous tensors (two addresses and two
    sizes: the usual case), the spans for strided ones."""
    g_address, p_address = g.data_ptr(), p.data_ptr()
    if g.is_contiguous() and p.is_contiguous():  # (an empty tensor reaches no bytes)
        meet = g_address < p_address + p.nbytes and p_address < g_address + g.nbytes
    else:
        def span(t: torch.Tensor) -> int:  # bytes from t's first element to the end of its last
            return (sum(st * (sz - 1) for st, sz in zip(t.stride(), t.shape)) + 1) * t.element_size()

        meet = (g.numel() > 0 and p.numel() > 0 and g_address < p_address + span(p)
                and p_address < g_address + span(g))
    return meet and g.device == p.device and g.device.type != "meta"


def check_hyperparameters(lr: float, beta1: float, beta2: float, prefix: str = "") -> None:
    """The op's rules for the lr and betas it steps with (ops/README.md), as ValueErrors, as step() raises them and the
    CPU kernel (ops/step.cpp) words them; prefix names the group ("param_groups[k]: ") where the caller knows it."""
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"ort_optim::adam_step_: {prefix}lr must be finite and >= 0, got {lr:g}")
    for i, beta in enumerate((beta1, beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"ort_optim::adam_step_: {prefix}betas[{i}] must be in [0, 1), got {beta:g}")


def num_blocks(numel: int) -> int:
    """Quantisation blocks (QUANT_BLOCK elements each, the last one partial) of a tensor with numel elements."""
    return (numel + QUANT_BLOCK - 1) // QUANT_BLOCK


def beta_power(beta: float, t: int) -> float:
    """beta**t for a whole t in [0, 2**53] (a bias correction's power, in float64), by binary exponentiation from t's
    lowest bit: the same products in the same order on every backend (ops/step.cpp; the Triton kernels cannot call
    libdevice's pow in Triton's interpreter), so that float64 params step to the same bits on each. A few float64
    ulps from a correctly rounded pow."""
    result, e = 1.0, int(t)
    while e:
        if e & 1:
            result *= beta
        beta *= beta
        e >>= 1
    return result


# ---- block-quantised moments: 8-bit (torch.uint8) and 4-bit (torch.uint4) states (ops/README.md, "low-bit states") --


def to_float32(x: float) -> float:
    """x rounded to the nearest float32 (ties to even), as a Python float, as torch's conversion to float32 rounds
    it: inf (with x's sign) beyond float32's range, 0 below its smallest subnormal. The one float32 rounding of host
    numbers (quantisation levels, options, loss scales)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # (struct refuses what rounds to inf, and float() an int beyond float64's range)
        return math.inf if x > 0 else -math.inf


def decade_levels(counts: tuple[int, ...]) -> tuple[float, ...]:
    """Positive quantisation levels in (0, 1], ascending: a dynamic-exponent map in the spirit of bitsandbytes'
    ``create_dynamic_map``. Decade i (of len(counts), the last one ending at 1) holds counts[i] levels spread
    linearly over its upper 90%: ``10**(i - last) * (0.1 + 0.9 * k / counts[i])`` for k = 1..counts[i], rounded to
    float32. So the top decade has the finest absolute steps and every decade further down keeps a relative
    resolution: small values neither vanish nor lose all precision."""
    last = len(counts) - 1
    levels = []
    for i, count in enumerate(counts):
        top = 10.0 ** (i - last)
        levels.extend(to_float32(top * (0.1 + 0.9 * k / count)) for k in range(1, count + 1))
    return tuple(levels)


def binade_levels(mantissa_bits: tuple[int, ...]) -> tuple[float, ...]:
    """Positive quantisation levels in (0, 1], ascending: 1, and in each binade [2**-(i + 1), 2**-i) the
    2**mantissa_bits[i] values ``2**-(i + 1) * (1 + f / 2**mantissa_bits[i])``: a binary floating-point grid whose
    mantissa width may shrink from binade to binade (finer steps near the block's maximum, fewer levels far below
    it, down to 2**-len(mantissa_bits)). A normalised magnitude's level at or below is its float32 bits with the
    mantissa cut to its binade's width, and the level above adds one unit of that width: coding is bit arithmetic,
    with no search and no table of levels."""
    levels = [1.0]
    for i, bits in enumerate(mantissa_bits):
        levels.extend(2.0 ** -(i + 1) * (1 + f / 2**bits) for f in range(2**bits))
    return tuple(sorted(levels))


def reciprocal_midpoints(levels: tuple[float, ...]) -> tuple[float, ...]:
    """The float32 decision thresholds of sqrt(v) between consecutive levels a < b: ``2ab / (a + b)`` (computed in
    float64 from the float32 levels, rounded to float32), where 1/x is halfway between 1/a and 1/b. A normalised
    u = sqrt(v) gets the level index ``#{j : thresholds[j] <= u}``: the level nearest in 1/sqrt(v), the factor the
    update m / sqrt(v) scales with (ties to the larger level), so the update's rounding error is symmetric.

    The arithmetic midpoint (a + b) / 2, nearest in sqrt(v), rounds most of a wide gap down: in the 4-bit map's gap
    from 0.001 to 0.0055 every u below 0.00325 reads as 0.001, an update up to 3.25x too large, and u in
    (0.00169, 0.00325) is nearer to 0.0055 in 1/u. Measured (guides/low-bit-states.md, "Quality"): 4-bit moments
    trained digits 6% *faster* than fp32 moments with arithmetic midpoints (a larger effective learning rate), within
    1% with these."""
    return tuple(to_float32(2.0 * a * b / (a + b)) for a, b in zip(levels, levels[1:]))


# MOMENT_RANDOM_BITS: the random bits of every moment state that rounds stochastically in a step (the low-bit maps'
# exp_avg and 4-bit sqrt(v), the fp8 formats' codes). Per element, from the step's new exp_avg m (float32):
#   r = fmix32(bits(m) ^ e * 0x9E3779B1 ^ (step * 0x85EBCA77 + 0x6A09E667)) (uint32 arithmetic; e the element's index
#        in its tensor, step the Adam step from 1; bits(m) = CANONICAL_NAN for every NaN m: a NaN's sign and payload
#        depend on the operations that made it, which differ between backends, and its v still rounds with these bits);
#        exp_avg rounds with r16 = r >> 16, exp_avg_sq and max_exp_avg_sq with r16 = r & 0xFFFF. One hash (murmur3's
#        finaliser: two 32-bit multiplies) per element serves both moments, whose bits never coincide; a hash of the new
#        exp_avg's own bits, not of a seed: it needs no key and no generator state, every backend computes it from what
#        it already holds, and resume is exact because the bits depend only on the state and the gradient. Conversions
#        outside a step round to nearest and take no bits.
#   A low-bit map rounds one level up iff the fraction d / gap of the way to the next level exceeds
#        sr_uniform(r16) = (2 * r16 + 1) * 2**-17 (float32, exact): the midpoints of 2**16 equal steps of (0, 1), so
#        P(up) = round(d / gap * 2**16) / 2**16: off by at most 2**-17 of a gap for one value and unbiased on average
#        over where d / gap falls between the steps (exactly, over v spread across the 4-bit map: -7e-9 of v per
#        rounding). Without the half step (r16 * 2**-16) every rounding is biased up by 2**-17 of a gap on average,
#        +9e-6 of v per rounding over the 4-bit map, which v's average compounds about 1 / (1 - beta2) = 1000-fold
#        to about +0.9%.
# exp_avg rounds stochastically to one of its two neighbouring levels, up with probability (a - lo) / (hi - lo): the
# rounding is unbiased, so a decaying moment (g = 0 on a rare embedding row: m <- beta1 * m) decays like fp32's in
# expectation and cannot stick. Nearest rounding sticks: m * beta1 rounds back to the same level whenever the levels
# are more than 2 * (1 - beta1) apart, and the row keeps moving at its last speed (measured: 69x fp32 AdamW's drift
# with 8-bit nearest rounding); toward zero cures that but biases |m| down (4-bit: a decaying m reaches 0 within 10
# steps), which cost 3.6% (8-bit) and 44% (4-bit) of mean loss on digits (guides/low-bit-states.md, "Quality").
# Exactly, for a normalised magnitude a = |m| / s (float32):
#   lo = levels[j], j = #{k >= 1 : thresholds[k-1] <= min(a * EXP_AVG_SNAP, 1)} (the toward-zero index: EXP_AVG_SNAP
#        = 1 + 2**-20 absorbs the float32 noise of decode-then-encode, a decoded level reads back within 3 * 2**-24 of
#        itself); the top threshold is the format's exp_avg_top (not 1), so the block's largest element always gets
#        the top code even where its scale was rounded up into bfloat16, and the scale survives a re-encode: EXP_AVG_TOP
#        = 1 - 2**-8 (a scale rounded to nearest: up by at most 2**-9), 1 - 2**-7 for the 4-bit format, whose scale
#        rounds stochastically in a step (BF16_SCALE_STOCHASTIC: up by less than 2**-7);
#   between two non-zero levels (1 <= j < top), the code is j + 1 iff, in float32,
#        (lowered(a) - lo) > sr_uniform(r16) * (levels[j+1] - lo),
#        lowered(a) = the float whose bits are bits(a) - EXP_AVG_SR_ULPS (clamped at 0): a value on a level (up to the
#        decode noise) never moves, so encoding stays idempotent and checkpoints canonical; an integer step, not a
#        multiplication, so no backend can fuse it into an FMA (the Triton kernels on a GPU would);
#   below the lowest non-zero level (j = 0) it rounds toward zero: rounding a tiny m up to levels[1] * s would make the
#        update of an element whose v is tiny too (1e-7 of its block's gradients) explode (measured: 105 lr in one
#        step; tests/fused_adam/test_low_bit.py bounds it at 4 lr), and a moment that small decays to 0 rather than sticks;
#   r16 = the 16 random bits of exp_avg (MOMENT_RANDOM_BITS), sr_uniform(r16) = (2 * r16 + 1) * 2**-17 in float32.
CANONICAL_NAN = 0x7FC00000  # the bits a NaN exp_avg hashes as (MOMENT_RANDOM_BITS)
EXP_AVG_SNAP = 1.0 + 2.0**-20
EXP_AVG_TOP = 1.0 - 2.0**-8
# BF16_SCALE_STOCHASTIC: a block's bfloat16 scale (the 4-bit format's, of sqrt(v) and of r = m / sqrt(v)) is its
# largest magnitude a rounded to bfloat16 stochastically in a step: between the bfloat16 values lo <= a < hi next to
# it, hi iff, in float32, (a * a - lo * lo) > sr_uniform(r16) * (hi * hi - lo * lo) for sqrt(v) (unbiased in v) and
# (a - lo) > sr_uniform(r16) * (hi - lo) for r (unbiased), r16 the random bits of the block's first element (its
# moment's 16, MOMENT_RANDOM_BITS); a itself where it is a bfloat16 value, inf or NaN. Conversions round to nearest
# even, except a sqrt(v) that would round to 2**64 (a finite v just below float32's largest; its square, the decoded
# v, would be inf): it takes the bfloat16 value below, as the step does (hi * hi overflows, so it never rounds up).
# The block's largest element decodes to the scale (the top code), so the scale is its stored value: rounded to
# nearest, it stuck as any moment rounded to nearest does (v growing by 0.1% a step rounds back to the same bfloat16
# value; one element with gradient 1 at every step kept v = 0.18 where torch's AdamW reaches 0.98).
EXP_AVG_SR_ULPS = 8
# EXP_AVG_RELATIVE (a format with exp_avg_relative, the 4-bit one; both moments must then be stored in it). Per
# element, in float32, with u the decoded sqrt(v) of exp_avg_sq (level * |s|: a flagged block's scale is negative;
# inf for an overflowed v; NaN in a NaN block):
#   order: in a step (and in a conversion) exp_avg_sq is updated and encoded first; exp_avg is then encoded relative
#        to the u that exp_avg_sq's new codes decode to (the u the next step reads), and it is decoded relative to the
#        u of the exp_avg_sq codes stored with it. With amsgrad, u is exp_avg_sq's, never max_exp_avg_sq's;
#   encode: r = m / u (IEEE division, correctly rounded), r = 0 where u = 0 (a zero block of v: its |g|, so its |m|,
#        are below 2**-126; nothing is lost that a float32 update could use); r then takes LowBitFormat's exp_avg rule
#        (block scale, toward-zero index, stochastic rounding with exp_avg's random bits, which hash m's float32 bits
#        and element index; nearest for conversions), except that below the lowest non-zero level r also rounds
#        stochastically (between 0 and 1/7), not toward zero: the explosion that rule prevents cannot happen here, since the decoded
#        update |q| * u / (u_true + eps) is at most about twice the block's largest ratio, whatever v; and toward zero
#        it dropped the momentum of every element whose ratio is under 1/7 of its block's largest (the
#        noise-dominated ones, whose momentum carries their drift): digits at lr 1e-3 trained 7.5% slower than with
#        fp32 moments, unbiased -1.1% (guides/low-bit-states.md). u = inf (an overflowed v) gives r = 0: that
#        element's update is 0 anyway (m / inf), and its large m no longer sets its block's scale; u = NaN gives a
#        NaN block;
#   decode: m = q * u with q = level * s_r (float32), and m = 0 where q = 0 (0 * inf is 0, not NaN);
#   eps: r is relative to u, not u + eps. Where u << eps the update q * u / (u + eps) is small in any case, and |r|
#        stays bounded for every v (|m| / sqrt(v) is, and u rounds to a level never below a quarter of sqrt(v) in
#        a non-zero block: the level at or below it or the next one, the widest ratio of neighbours being 4), so a tiny v cannot make a decoded m explode; the block scale of r
#        takes whatever range r has.
# EXP_AVG_SQ_STOCHASTIC (a format with exp_avg_sq_stochastic, the 4-bit one): in a step, sqrt(v) (exp_avg_sq and
# max_exp_avg_sq) rounds stochastically between its two neighbouring levels, unbiased in v; conversions outside a
# step (step 0: checkpoint loads, from_optimizer) keep the level nearest in 1/sqrt(v) (reciprocal_midpoints). Why: v
# is an average over about 1 / (1 - beta2) = 1000 steps, and each step changes it by about 0.1%; rounded to nearest
# on levels 20-100% apart, it rounds back to its level in every step (it sticks: a decaying v never decays, a
# growing one grows only through its block's scale), and a per-step bias c of the stored v compounds in the average
# to about c / (1 - beta2). Unbiased in v (E[stored v] = v), the average is kept in expectation. Exactly, for a
# normalised a = sqrt(v) / s (float32, as the nearest rule computes it):
#   lo = levels[j], j = #{k >= 1 : thresholds[k-1] <= min(a * EXP_AVG_SNAP, 1)}, the thresholds being the levels
#        above the lowest and EXP_AVG_TOP for the top one (thresholds(levels, False), the search exp_avg uses);
#   the code is j + 1 iff j is below the top level and, in float32,
#        (lowered(a) * lowered(a) - SQUARES[j]) > sr_uniform(r16) * SQUARE_GAPS[j],
#        with SQUARES[j] = levels[j]**2 and SQUARE_GAPS[j] = SQUARES[j+1] - SQUARES[j] rounded to float32
#        (square_tables), lowered() as for exp_avg (a value on a level stays: re-encoding a decoded v is idempotent);
#        below the lowest level (a < levels[0]) the difference is negative: the lowest level (no zero, as nearest);
#   r16 = the 16 random bits of a second moment (MOMENT_RANDOM_BITS), sr_uniform as for exp_avg.
# Blocks whose largest magnitude is below float32's smallest normal (2**-126) are stored as zero blocks (scale 0):
# 1/s would overflow, and subnormal scales cannot round-trip.
MIN_SCALE = 2.0**-126
# MIN_SQRT_V: the smallest decoded sqrt(v) of a non-zero code of a block-scaled second moment (the low-bit and fp8
# formats). A non-zero block's scale s is at least the smallest power of two under which the format's smallest
# non-zero level times s reaches MIN_SQRT_V (LowBitFormat.min_sq_scale, Fp8Format.min_sq_exponent). Why: v decodes as
# u * u in float32, and below u = 2**-63 that square is subnormal, with too few bits to tell neighbouring levels
# apart: two codes would decode to one v, and a checkpoint (which holds v) would resume with the other code, whose u
# differs (the 4-bit exp_avg is coded relative to u) or whose v, re-coded in a step that skips its update, differs.
# With the floor every code decodes to its own normal v and re-encodes to itself. A block whose sqrt(v) all lie below
# the floor is coded against it (its largest element below the top level); a v below MIN_SQRT_V**2 (1.2e-38) reads
# back as the block's smallest level, which can only shrink its update, as the maps' missing zero does.
MIN_SQRT_V = 2.0**-63


def thresholds(levels: tuple[float, ...], second_moment: bool, nearest: str = "reciprocal",
               top: float = EXP_AVG_TOP) -> tuple[float, ...]:
    """The decision thresholds of a code map: for sqrt(v) the midpoints between neighbouring levels, reciprocal
    (``nearest="reciprocal"``: the nearest level in 1/sqrt(v), :func:`reciprocal_midpoints`) or arithmetic
    (``"root"``: the nearest level in sqrt(v) itself, (a + b) / 2 rounded to float32); for exp_avg the levels above
    zero (applied to a * EXP_AVG_SNAP: the level at or below, from which exp_avg rounds stochastically up or
    stays)."""
    if not second_moment:
        return tuple(levels[1:-1]) + (top,)
    if nearest == "root":
        return tuple(to_float32((a + b) / 2) for a, b in zip(levels, levels[1:]))
    return reciprocal_midpoints(levels)


def square_tables(levels: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(SQUARES, SQUARE_GAPS) of a sqrt(v) code map (EXP_AVG_SQ_STOCHASTIC): each level's float32 square, and the
    float32 difference to the next level's square (0 past the top level)."""
    squares = tuple(to_float32(level * level) for level in levels)
    gaps = tuple(to_float32(b - a) for a, b in zip(squares, squares[1:])) + (0.0,)
    return squares, gaps


@dataclasses.dataclass(frozen=True)
class LowBitFormat:
    """A block-quantised moment format. Per block of ``block`` elements (index // block within the tensor), one scale
    ``s`` (stored in ``scale_dtype``) and one ``bits``-bit code per element.

    * exp_avg (signed): ``m = sign * exp_avg_levels[magnitude] * s``; the code is sign-magnitude (top bit = sign,
      set only for a non-zero magnitude), ``exp_avg_levels[0] == 0``; magnitudes between two non-zero levels round
      stochastically to one of them, unbiased, those below the lowest non-zero level toward zero (stochastically
      too for a relative exp_avg, EXP_AVG_RELATIVE) (EXP_AVG_SR_ULPS
      states the rule and its random bits).
    * exp_avg_sq / max_exp_avg_sq: the code stores ``u = sqrt(v)``, ``v = (exp_avg_sq_levels[code] * s) ** 2``; the
      levels have no zero (Li et al. 2023's zero-point problem: a v rounded to 0 makes m / (sqrt(v) + eps) explode;
      here a tiny v reads as at least ``exp_avg_sq_levels[0] * s``, which can only shrink its update); sqrt(v)
      rounds to the level nearest in 1/sqrt(v) (ties up; :func:`reciprocal_midpoints`), or with
      ``exp_avg_sq_nearest="root"`` (the 8-bit format) to the level nearest in sqrt(v) (ties up), except in a step
      of a format with ``exp_avg_sq_stochastic``: stochastically, unbiased in v (EXP_AVG_SQ_STOCHASTIC).
    * ``s`` = the block's absolute maximum (of m, or of u), in ``scale_dtype``: float32 exactly; bfloat16 rounded to
      nearest even in a conversion, stochastically in a step (BF16_SCALE_STOCHASTIC) (normalised
      values are clamped to 1); a block with inf or NaN (or a maximum beyond the scale dtype's range) gets
      s = NaN, an all-zero block (a maximum below MIN_SCALE) s = 0; a second moment's s is at least
      :attr:`min_sq_scale` (MIN_SQRT_V: every code then decodes to its own normal float32 v).
    * Except a second moment whose v overflowed float32 (one gradient element above about 5.8e20 at beta2 = 0.999
      makes (1 - beta2) * g * g inf, and torch.optim.AdamW keeps that v = inf): such an element takes code 0 and
      reads back as v = inf, the block's other elements are coded as if it were absent (with codes >= 1: one on
      level 0 moves up to level 1, which can only shrink its update), and ``s`` is their maximum with the sign bit
      set (-0.0 when they are all zero), which marks the block. One element never makes its block's scale inf or
      NaN, so it never poisons its block's other params; a NaN still does (its block reads back as NaN, as before).
    * With ``exp_avg_relative`` (4-bit), exp_avg's codes hold ``r = m / u`` instead of m, where u is the decoded
      sqrt(v) of the element's exp_avg_sq in the same format (EXP_AVG_RELATIVE has the rule): the scale, levels and
      rounding above apply to r, and ``m = r * u``.
    """

    name: str
    bits: int
    block: int
    scale_dtype: torch.dtype
    exp_avg_levels: tuple[float, ...]
    exp_avg_sq_levels: tuple[float, ...]
    # exp_avg coded relative to the decoded sqrt(v) of the same step (EXP_AVG_RELATIVE states the rule)
    exp_avg_relative: bool = False
    # sqrt(v) rounded stochastically in a step, unbiased in v (EXP_AVG_SQ_STOCHASTIC states the rule)
    exp_avg_sq_stochastic: bool = False
    # which level sqrt(v) rounds to where it rounds to nearest: "reciprocal" (nearest in 1/sqrt(v)) or "root"
    # (nearest in sqrt(v)); thresholds() gives the midpoints of either
    exp_avg_sq_nearest: str = "reciprocal"
    # the top threshold of the stochastic roundings (EXP_AVG_TOP): at or below its block's largest magnitude over the
    # scale, so that the largest always gets the top code (a bfloat16 scale rounded up in a step: 1 - 2**-7)
    exp_avg_top: float = EXP_AVG_TOP

    def sq_thresholds(self) -> tuple[float, ...]:
        """The thresholds sqrt(v) rounds to nearest by (conversions; every step where it is not stochastic)."""
        return thresholds(self.exp_avg_sq_levels, True, self.exp_avg_sq_nearest)

    def sr_thresholds(self, second_moment: bool) -> tuple[float, ...]:
        """The thresholds of a stochastic rounding's level at or below (exp_avg's; a stochastic sqrt(v)'s): the
        levels above the lowest, then exp_avg_top."""
        return thresholds(self.exp_avg_sq_levels if second_moment else self.exp_avg_levels, False,
                          top=self.exp_avg_top)

    @property
    def min_sq_scale(self) -> float:
        """The smallest scale of a non-zero second-moment block (MIN_SQRT_V): the least power of two s with
        min(exp_avg_sq_levels) * s >= MIN_SQRT_V. With the level m * 2**e (m in [0.5, 1), math.frexp), that is
        MIN_SQRT_V * 2**(1 - e) (8-bit: 2**-38, 4-bit: 2**-53)."""
        return math.ldexp(MIN_SQRT_V, 1 - math.frexp(min(self.exp_avg_sq_levels))[1])

    def num_scales(self, numel: int) -> int:
        return (numel + self.block - 1) // self.block

    def storage_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """Shape of the uint8 code tensor of a state for a param of this shape (4-bit: two codes per byte, element
        2j in the low nibble of byte j, 2j+1 in the high one, flat)."""
        if self.bits == 8:
            return tuple(shape)
        return ((math.prod(shape) + 1) // 2,)

    def bytes_per_element(self) -> float:
        return self.bits / 8 + self.scale_dtype.itemsize / self.block


# 8-bit: bitsandbytes' and torchao's choice, block 256 with a float32 absmax: 2 * (1 + 4/256) = 2.031 bytes/param.
# Both maps are binade grids (binade_levels), so every backend codes by bit arithmetic (the native kernel: shifts, one
# table permute, no search), with a dynamic map's shape: the finest steps near the block's largest, fewer levels per
# binade further down, far down to small values. exp_avg: 127 magnitudes from 2**-20 (9.5e-7) to 1 (+ zero, signs): 32
# levels in each of [0.5, 1) and [0.25, 0.5), then 16, 8, 8, 4, 4, 4, 4, 2, 2, 2 and one per binade. exp_avg_sq: 256
# levels of sqrt(v) from 2**-25 (3.0e-8) to 1, 64 in [0.5, 1), 32 in each of the next three binades, then 16, 16, 16, 8,
# 8, 8, 4, 4, 2, 2 and one per binade; rounded to the level nearest in sqrt(v) (the arithmetic midpoints: the nearest in
# 1/sqrt(v) differs by less than a quarter of the square of the relative step, under 0.03% of a level where most
# elements lie, and costs a table lookup per element). Measured (guides/low-bit-states.md, "Formats" and "Quality"):
# mean loss against fp32 moments on digits-plain +0.13%, digits -0.34%, zipf +0.03%, GPT -0.06% (10, 10, 10 and 5 seeds;
# decade maps, (0,) + decade_levels((1, 2, 4, 8, 16, 32, 64)) and decade_levels((2, 2, 4, 8, 16, 32, 64, 128)) nearest
# in 1/sqrt(v), measured +0.21%, -0.36%, +0.05%, -0.00%); conversion error at most bitsandbytes' blockwise quantizer's
# on every tensor tried: randn(1024, 1024) 0.0061 (bitsandbytes 0.0100; decade maps 0.0086), uniform exp_avg 0.88x, v =
# randn**2 0.48x, uniform v 0.80x, an AdamW-like v 0.65x bitsandbytes'. Grids that lost: exp_avg with 32 levels in [0.5,
# 1) only and 16 in each of the next three binades, and sqrt(v) with 32 levels in each of the top five (uniform exp_avg
# 1.01x, uniform v 1.5x, AdamW-like v 1.3x, v concentrated near its block's largest 3.1x bitsandbytes' error); an e3m4
# exp_avg (16 levels per binade down to 2**-10: zipf +14.3% and digits-plain +3.2% beside the decade sqrt(v), 5 seeds;
# its rare rows' tiny m round to zero) and an e4m4 sqrt(v) (v's conversion error 1.3x bitsandbytes'; beside the decade
# exp_avg, zipf +0.13% and digits-plain +0.26%).
Q8 = LowBitFormat(
    name="8-bit", bits=8, block=256, scale_dtype=torch.float32,
    exp_avg_levels=(0.0,) + binade_levels((5, 5, 4, 3, 3, 2, 2, 2, 2, 1, 1, 1) + (0,) * 8),
    exp_avg_sq_levels=binade_levels((6, 5, 5, 5, 4, 4, 4, 3, 3, 3, 2, 2, 1, 1) + (0,) * 11),
    exp_avg_sq_nearest="root",
)
# 4-bit: Li et al.'s block 128 for both moments, with bfloat16 scales (float32's exponent range, half its bytes):
# 2 * (0.5 + 2/128) = 1.031 bytes/param. exp_avg: r = m / sqrt(v) (EXP_AVG_RELATIVE) on 7 linear magnitudes k/7
# (+ zero, signs; code 8, "-0", is never written); exp_avg_sq: 16 levels of sqrt(v) from 0.001 to 1, 10 of them at
# 0.1 and above (relative steps of 1.18-1.4, where most elements of a block lie), rounded stochastically in a step,
# unbiased in v (EXP_AVG_SQ_STOCHASTIC). Measured (guides/low-bit-states.md, "Choosing the 4-bit format"): a plain
# MLP on digits trained 4.7% slower than fp32 moments on every seed with sqrt(v) rounded to its nearest level
# (it sticks), about 2% faster with stochastic rounding (E[1/sqrt(v)] exceeds 1/sqrt(E[v]) on a two-level draw;
# 3.3% faster on the coarser decade levels 0.001, 0.0055, .., 0.1, 0.2, .., 1).
# Why m / sqrt(v) on linear levels (guides/low-bit-states.md, "Choosing the 4-bit format"): the update is m / sqrt(v),
# and coding that ratio spends the bits on what moves the weights; |m| / sqrt(v) is bounded whatever the gradient's
# scale (about 7 at betas (0.9, 0.999) by Cauchy-Schwarz over the two averaging windows), so a block's ratios span
# little and a linear map covers them, where m itself spans decades and needs a decade map. Measured against m on
# decade levels ((0,) + decade_levels((1, 2, 4))): 2.7 points less mean loss relative to fp32 moments on digits (81
# paired seeds); the only 4-bit candidate within +1.5% of fp32 moments on all three tasks at 1.031 bytes/param.
Q4 = LowBitFormat(
    name="4-bit", bits=4, block=128, scale_dtype=torch.bfloat16,
    exp_avg_levels=tuple(to_float32(k / 7) for k in range(8)),
    exp_avg_sq_levels=tuple(to_float32(x) for x in (0.001, 0.004, 0.01, 0.02, 0.04, 0.07, 0.1, 0.14, 0.19, 0.26, 0.34,
                                              0.44, 0.56, 0.7, 0.85, 1.0)),
    exp_avg_relative=True,
    exp_avg_sq_stochastic=True,
    exp_avg_top=1.0 - 2.0**-7,
)
# The exp_avg_dtype / exp_avg_sq_dtype options that select a low-bit format; their states are stored as uint8 codes.
LOW_BIT_FORMATS = {torch.uint8: Q8, torch.uint4: Q4}


def low_bit_format(scale_dtype: torch.dtype) -> LowBitFormat:
    """The format of a uint8 state, told by its scales' dtype (float32: 8-bit, bfloat16: 4-bit)."""
    for fmt in LOW_BIT_FORMATS.values():
        if fmt.scale_dtype == scale_dtype:
            return fmt
    raise ValueError(f"no low-bit state format has {scale_dtype} scales")


# ---- fp8 moments: float8_e4m3fn / float8_e5m2 codes with a power-of-two scale per block (ops/README.md, "fp8 states")


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """A block-scaled fp8 moment format: the state is a tensor of ``dtype`` (float8_e4m3fn or float8_e5m2) of the
    param's shape, ``state[key + '_scale']`` one float32 scale ``s = 2**k`` per block of ``block`` elements. The
    value of an element is ``code * s`` (exact in float32: a power-of-two scale only moves the exponent), for
    exp_avg_sq / max_exp_avg_sq that of ``u = sqrt(v)``: ``v = (code * s) ** 2``, as the other scaled formats.

    * The block's largest magnitude ``amax`` (of m, or of u) is coded first (formats.fp8_coded_amax): divided by
      ``2**k0``, k0 the smallest integer with ``amax / 2**k0 <= max_value`` (448 for e4m3fn, 57344 for e5m2; both
      ``1.75 * 2**emax``, so k0 is ``E - emax`` or ``E - emax + 1`` for ``amax = 1.f * 2**E``: read from amax's
      exponent and mantissa bits, no logarithm, no search; capped at ``127 - emax``), rounded in the format like any
      element (in a step stochastically, with the random bits of the block's first element; in a conversion to
      nearest even), times 2**k0: ``M``. k is the same rule's for M (k0 or k0 - 1). Every element equal to amax takes
      M's code and no element's code exceeds it, so a decoded block's largest value is M, which gives the same k and
      codes again: encoding is idempotent and a resume exact. Rounded like the others, the largest magnitude cannot
      stick on its level (rounded to nearest, a decaying m and a slowly growing v did: tests/fused_adam/test_low_bit.py).
      Codes saturate at max_value only where k is capped (|values| near float32's largest). A second moment's k is at
      least :attr:`min_sq_exponent` (MIN_SQRT_V: every non-zero code then decodes to its own normal float32 v), and
      its amax at most FP8_MAX_ROOT before it is coded (so M * M, the decoded v, is finite for every finite v).
    * A code reads as its bits say: exponent and mantissa (subnormal codes: mantissa * 2**(1 - bias -
      mantissa_bits)), the sign bit; torch's float8 value for every code written below. The codes never written
      (e5m2's 0x7C-0x7F, which torch reads as inf and NaN; e4m3fn's 0x7F, its NaN) read as the finite values their
      bits give beyond max_value, on every backend: one rule, no test per code in the kernels' decode loops.
    * Every element is ``x * 2**-k`` (exact) rounded in the format by exponent and mantissa arithmetic on its
      float32 bits (conversions to nearest even, subnormal codes by ``rint(y * 2**(bias - 1 + mantissa_bits))``; a
      step stochastically, formats.fp8_round), at most M's code. exp_avg keeps its sign (never -0); u rounds up to the smallest subnormal code instead of 0 in
      a non-zero block: a v that would read as 0 reads as the smallest level of its block instead, which can only
      shrink its update (the zero-point problem, as in the low-bit formats).
    * A block with inf or NaN gets s = NaN and codes 0 (it reads back as NaN, as an fp32 moment would); a block whose
      M is below ``2**(emax + min_exponent)`` (2**-102 for e4m3fn, 2**-95 for e5m2) is a zero block, s = 0: so every
      decoded value is a normal float32 (no backend flushes it differently), and a decoded block, whose largest value
      is M, is a zero block again exactly when it was.
    * Except a second moment whose v overflowed float32 (one gradient element above about 5.8e20 at beta2 = 0.999
      makes (1 - beta2) * g * g inf, and torch.optim.AdamW keeps that v = inf), as in the low-bit formats: such an
      element takes code 0 (a code u never takes otherwise) and reads back as v = inf, the block's other elements
      are coded as if it were absent (codes >= 1, also in a zero block), and ``s`` is their scale with the sign bit
      set (-0.0 for a zero block), which marks the block. One rule for both dtypes: e4m3fn has no inf code, and
      e5m2's inf code times the scale would give the same inf but would need a rule of its own. One element never
      makes its block's scale inf or NaN; a NaN still does. exp_avg keeps the NaN rule: m is a weighted mean of
      the gradients (m = 1e20 for a gradient of 1e21), so a finite gradient leaves it finite (short of float32's
      own overflow for gradients near its largest value, 3.4e38).
    """

    name: str
    dtype: torch.dtype
    mantissa_bits: int
    bias: int
    block: int = 256
    scale_dtype: torch.dtype = torch.float32
    min_exponent: int = -110

    @property
    def max_code(self) -> int:
        """The code of the largest finite magnitude, 1.75 * 2**emax (e4m3fn: 0x7E, its 0x7F is NaN; e5m2: 0x7B)."""
        return 0x7E if self.mantissa_bits == 3 else 0x7B

    @property
    def emax(self) -> int:
        """The exponent of the largest finite value (1.75 * 2**emax: 448 = 1.75 * 2**8, 57344 = 1.75 * 2**15)."""
        return 8 if self.mantissa_bits == 3 else 15

    @property
    def max_value(self) -> float:
        return 1.75 * 2.0**self.emax

    @property
    def max_mantissa(self) -> int:
        """max_value's float32 mantissa bits (0.75: 0x600000, both formats): a magnitude whose mantissa exceeds them
        at 2**emax is beyond max_value."""
        return int((self.max_value / 2.0**self.emax - 1) * 2**23)

    @property
    def min_sq_exponent(self) -> int:
        """The smallest k of a non-zero second-moment block (MIN_SQRT_V): the smallest subnormal code,
        2**(1 - bias - mantissa_bits), times 2**k reaches MIN_SQRT_V (e4m3fn: -54, e5m2: -47)."""
        return int(math.log2(MIN_SQRT_V)) + self.bias - 1 + self.mantissa_bits

    def num_scales(self, numel: int) -> int:
        return (numel + self.block - 1) // self.block

    def storage_shape(self, shape: torch.Size) -> tuple[int, ...]:
        return tuple(shape)

    def bytes_per_element(self) -> float:
        return 1 + self.scale_dtype.itemsize / self.block


# The largest sqrt(v) a second moment's fp8 block codes, 1.75 * 2**63 (max_value * 2**(63 - emax) in both formats): a
# block's largest magnitude above it (u up to sqrt of float32's largest, just below 2**64) is coded as this value, whose
# square (2.6e38) is finite; coded as the next level, 2**64, a finite v would read back as inf (an overflowed v).
FP8_MAX_ROOT = 1.75 * 2.0**63

# Steps are counted in float64, exact up to 2**53: a step count is a whole number in [0, MAX_STEP] (a checkpoint's, and
# the one the CPU step reads).
MAX_STEP = 2.0**53

# torchao's AdamWFp8 layout (float8_e4m3fn, one float32 scale per block of 256): 2 * (1 + 4/256) = 2.031 bytes/param
# for both moments. e4m3fn: 3 mantissa bits (relative steps of 6.25-12.5%), 2**-9 .. 448 (17.8 binades);
# e5m2: 2 mantissa bits, 2**-16 .. 57344 (31.8 binades).
FP8_E4M3 = Fp8Format(name="fp8 e4m3", dtype=torch.float8_e4m3fn, mantissa_bits=3, bias=7)
FP8_E5M2 = Fp8Format(name="fp8 e5m2", dtype=torch.float8_e5m2, mantissa_bits=2, bias=15)
FP8_FORMATS = {torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2}


# fp16 exp_avg_sq / max_exp_avg_sq hold sqrt(v) (the fp16 codes of sqrt(v) with the block rule above): v spans the
# square of the gradients' range, sqrt(v) the range itself, so an element 1e-7 of its block's largest keeps its v
# (stored as v, its v would be 1e-14 of the block's largest: below fp16's range, 0). v is read back as
# (code / s) ** 2, exact in float32 (an fp16 code has 11 significant bits).
FP16_SQRT_SECOND_MOMENT = True


# ---- stochastic rounding of bfloat16 params (ops/README.md, "stochastic rounding") --------------------------------

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser (Steele et al.) on a 64-bit unsigned int: the counter-based hash that turns (seed,
    param ordinal, step) into the key of a param's random bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rounding_key(seed: int, ordinal: int) -> int:
    """The op's rounding key of the param at this position of the optimizer (its ordinal over all param groups), as
    a signed int64 (the op reads its bits): ``splitmix64((seed mod 2**64) ^ splitmix64(ordinal))``. The op mixes in
    the step: ``splitmix64(key ^ splitmix64(step))``, step counting from 1."""
    key = splitmix64((seed & _MASK64) ^ splitmix64(ordinal))
    return key - (1 << 64) if key >= 1 << 63 else key
