"""The Triton kernels behind ort_optim._triton (imported lazily: importing ort_optim never imports triton).

Every kernel is a true multi-tensor launch: program ``pid`` reads its work item (tensor index, element offset) from a
work list and the tensor's addresses from a device table of int64 addresses (one row per tensor), so one launch
covers any number of tensors. The math is the one of ops/README.md, in the CPU kernel's order of operations:

* fp32 compute (fp64 for fp64 params); every per-step scalar (``lr / bc1``, ``1 - lr*wd``, ...) is formed in fp64
  inside the kernel, from the fp64 hyperparameters (passed as their IEEE bit patterns: a Python float argument would be
  fp32 in Triton 3.0) and the tensor's fp64 step count, and rounded once;
* divisions and square roots are the correctly rounded ones (``div_rn``/``sqrt_rn``; Triton's plain fp32 ``sqrt`` is
  an approximation on NVIDIA GPUs) and the launches pass ``enable_fp_fusion=False``, so no multiply-add is contracted;
* fp16 rounding is the hardware's round-to-nearest-even; bf16 rounding is done with integer bit operations (the
  interpreter truncates fp32 -> bf16, and bf16 is then never touched as a float type at all);
* fp16 moment states are quantised per 1024-element block with the power-of-two rule of ops/README.md; a scaled
  fp16 second moment holds sqrt(v) (``_spec.FP16_SQRT_SECOND_MOMENT``);
* 8-bit and 4-bit moment states (``_spec.Q8``/``Q4``: uint8 codes, one scale per 256 or 128 elements) are decoded
  with a lookup table and encoded by a binary search over the format's float32 thresholds (the count of thresholds
  <= the normalised value: the reference's ``searchsorted(..., right=True)``), so the codes and scales are the
  reference's (``formats.quantize_low_bit``) bit for bit;
* fp8 moment states (``_spec.Fp8Format``: float8_e4m3fn / float8_e5m2 codes, a power-of-two scale per 256 elements)
  are encoded and decoded by exponent and mantissa arithmetic on the bits (``formats.quantize_fp8``), no tables.

Trap-driven choices (see tests/triton_backend/test_triton.py): pointer types are always built from literal dtypes (``tl.pointer_type``
of a constexpr dtype runs in the interpreter but does not compile with Triton 3.0/3.1); the skip flag is honoured with
an early ``return`` (``mask & (scalar == 0)`` trips the interpreter); NaNs are kept out of block maxima explicitly
(GPU ``max`` ignores them, numpy propagates them).
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Compiled kernels get their correctly rounded fp32 division and square root from inline PTX: tl.math.div_rn and
# tl.sqrt_rn lower to the flush-to-zero forms (div.rn.ftz.f32, sqrt.rn.ftz.f32), plain `/` to div.full.f32 (an
# approximation) and tl.sqrt to sqrt.approx. The interpreter (numpy) has no inline PTX and is exact anyway.
_PTX = tl.constexpr(not INTERPRET)


def _device(fn):
    """@triton.jit for the helper functions, except under the interpreter: there each call of a nested jit function
    re-patches triton.language (inspect.getmembers over the module, ~0.2 ms), which made the helpers cost more than
    the arithmetic; as plain Python functions they run on the language the kernel already patched."""
    return fn if INTERPRET else triton.jit(fn)

# dtype codes of the constexpr *_DT arguments; Q8 and Q4 are the 8-bit and 4-bit moment formats (uint8 codes),
# FP8_E4M3 and FP8_E5M2 the fp8 ones
F32, F16, BF16, F64, Q8, Q4, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3, 4, 5, 6, 7
# _spec.Fp8Format's smallest block exponent (asserted equal by triton.py)
FP8_MIN_EXPONENT = tl.constexpr(-110)
FP8_MAX_MANTISSA = tl.constexpr(0x600000)
FP8_MAX_ROOT = tl.constexpr(1.75 * 2.0**63)  # (_spec.FP8_MAX_ROOT)
# _spec's constants of the low-bit encoders (asserted equal by triton.py)
EXP_AVG_SNAP = tl.constexpr(1.0 + 2.0**-20)
MIN_SCALE = tl.constexpr(2.0**-126)
EXP_AVG_SR_ULPS = tl.constexpr(8)
CANONICAL_NAN = tl.constexpr(0x7FC00000)
# a non-zero second-moment block's smallest scale (_spec.MIN_SQRT_V): 8-bit and 4-bit scales, fp8 exponents
Q8_MIN_SQ_SCALE = tl.constexpr(2.0**-38)
Q4_MIN_SQ_SCALE = tl.constexpr(2.0**-53)
FP8_E4M3_MIN_SQ_EXPONENT = tl.constexpr(-54)
FP8_E5M2_MIN_SQ_EXPONENT = tl.constexpr(-47)

# Columns of the per-tensor table (int64). The addresses of optional tensors are 0 when absent (never read then).
COL_PARAM, COL_EXP_AVG, COL_EXP_AVG_SQ, COL_MAX_EXP_AVG_SQ, COL_MASTER = 0, 1, 2, 3, 4
COL_EXP_AVG_SCALE, COL_EXP_AVG_SQ_SCALE, COL_MAX_EXP_AVG_SQ_SCALE = 5, 6, 7
COL_NUMEL, COL_STEP_INDEX = 8, 9
META_COLS = 10

# Elements per block: the fp16 quantisation block (ops/README.md) and the unit every program works in.
BLOCK = 1024
FP16_HALF_LIMIT = 16384.0  # scaled block maxima land in (16384, 32768]


# ---- storage <-> compute conversions ---------------------------------------------------------------------------

@_device
def _load(addr, offs, mask, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Values of a DT tensor at int64 address `addr`, as float32 (float64 for DT == F64). Masked lanes read 0.
    ALIGNED: the address is a multiple of 16 bytes (lets the compiler use 16-byte accesses)."""
    if DT == 0:
        ptr = addr.to(tl.pointer_type(tl.float32))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    elif DT == 1:
        ptr = addr.to(tl.pointer_type(tl.float16))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    elif DT == 2:
        ptr = addr.to(tl.pointer_type(tl.uint16))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        bits = tl.load(ptr + offs, mask=mask, other=0)
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        ptr = addr.to(tl.pointer_type(tl.float64))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


@_device
def _bf16_bits(x):
    """float32 -> bfloat16 bit pattern, round to nearest even; every NaN becomes 0x7FC0 (like c10::BFloat16)."""
    b = x.to(tl.int32, bitcast=True)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    is_nan = (b & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7FC0, rounded).to(tl.uint16)


@_device
def _store(addr, offs, x, mask, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Writes float32 (float64 for DT == F64) values to a DT tensor, rounding to nearest even."""
    if DT == 0:
        ptr = addr.to(tl.pointer_type(tl.float32))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        tl.store(ptr + offs, x, mask=mask)
    elif DT == 1:
        ptr = addr.to(tl.pointer_type(tl.float16))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        tl.store(ptr + offs, x.to(tl.float16), mask=mask)
    elif DT == 2:
        ptr = addr.to(tl.pointer_type(tl.uint16))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        tl.store(ptr + offs, _bf16_bits(x), mask=mask)
    else:
        ptr = addr.to(tl.pointer_type(tl.float64))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        tl.store(ptr + offs, x, mask=mask)


@_device
def _pow2(k):
    """2**k as float32 for an int32 k in [-126, 127], built from the exponent bits (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@_device
def _fp16_block_scale(amax):
    """The power-of-two scale of a block whose absolute maximum is amax >= 0 (ops/README.md, "fp16 states")."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    # frexp: amax = f * 2**e with f in [0.5, 1); f == 0.5 exactly when the mantissa bits are zero. Subnormal maxima
    # (biased == 0) would give k >= 141, which the clamp turns into 126 anyway.
    e = biased - 126
    k = tl.where((bits & 0x7FFFFF) == 0, 16 - e, 15 - e)
    k = tl.where(biased == 0, 126, k)
    k = tl.minimum(tl.maximum(k, -126), 126)
    scaled = (amax * _pow2(k)).to(tl.float16).to(tl.float32)
    k = tl.where(scaled <= 16384.0, k + 1, k)
    k = tl.minimum(k, 126)
    usable = (amax > 0.0) & (biased != 0xFF)
    return tl.where(usable, _pow2(k), 1.0)


@_device
def _load_state(addr, scale_addr, lut_ptr, offs, mask, block_index, DT: tl.constexpr, SCALED: tl.constexpr,
                SECOND: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """A moment state's values as float32 (float64 for DT == F64). SECOND: a second moment (exp_avg_sq or
    max_exp_avg_sq), whose scaled fp16 and low-bit codes hold sqrt(v)."""
    if DT >= 6:
        x = _load_fp8(addr, scale_addr, offs, mask, DT, SECOND)
    elif DT >= 4:
        x = _load_low_bit(addr, scale_addr, lut_ptr, offs, mask, DT, SECOND, BLOCK)
    elif SCALED:
        s = tl.load(scale_addr.to(tl.pointer_type(tl.float32)) + block_index)
        # 1/s in float32, correctly rounded: the fp64 quotient rounded to fp32 is (53 >= 2*24 + 2: double rounding
        # is innocuous for division), and it avoids the flush-to-zero fp32 division.
        inv = (1.0 / s.to(tl.float64)).to(tl.float32)
        x = _load(addr, offs, mask, 1, ALIGNED) * inv
        if SECOND:
            x = x * x
    else:
        x = _load(addr, offs, mask, DT, ALIGNED)
    return x


@_device
def _store_state(addr, scale_addr, lut_ptr, offs, x, mask, block_index, DT: tl.constexpr, SCALED: tl.constexpr,
                 SECOND: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, rnd=0, step=0,
                 HASH_HERE: tl.constexpr = False):
    """Stores x into a moment state. Returns, for a 4-bit second moment (DT == Q4), the decoded sqrt(v) of the codes
    written (what a 4-bit exp_avg is coded against, _spec.EXP_AVG_RELATIVE), else 0. rnd: the step's random bits
    (_moment_random_bits of its exp_avg), or with HASH_HERE (an 8-bit exp_avg, x the exp_avg itself) hashed from x
    and step where the store uses them."""
    root = 0.0
    if DT >= 6:  # (rnd: _moment_random_bits of this step's exp_avg)
        _store_fp8(addr, scale_addr, offs, x, mask, rnd, DT, SECOND, BLOCK)
    elif DT >= 4:
        root = _store_low_bit(addr, scale_addr, lut_ptr, offs, x, mask, rnd, step, DT, SECOND, BLOCK, HASH_HERE)
    elif SCALED:
        if SECOND:
            x = _sqrt(x, False)
        # The scale of the block's largest finite magnitude (an inf or NaN element keeps its own value: as
        # formats.fp16_block_scales). Masked lanes are left out.
        amax = tl.max(tl.where(mask & (x == x) & (tl.abs(x) != float("inf")), tl.abs(x), 0.0), axis=0)
        s = _fp16_block_scale(amax)
        if SECOND:  # no zero level: a positive sqrt(v) that would round to 0 takes the smallest subnormal code
            y = (x * s).to(tl.float16).to(tl.float32)
            y = tl.where((y == 0.0) & (x > 0.0), 5.960464477539063e-08, y)  # (2**-24)
            _store(addr, offs, y, mask, 1, ALIGNED)
        else:
            _store(addr, offs, x * s, mask, 1, ALIGNED)
        tl.store(scale_addr.to(tl.pointer_type(tl.float32)) + block_index, s)
    else:
        _store(addr, offs, x, mask, DT, ALIGNED)
    return root


# ---- 8-bit and 4-bit states (_spec.Q8, _spec.Q4; formats.quantize_low_bit is the definition) -------------------
#
# The lookup table of a format (float32, built by triton.py from _spec's levels), for BITS = 8 or 4:
#   [0, 2**BITS)                     exp_avg value of each code (sign-magnitude: the top bit negates)
#   [2**BITS, 2**(BITS+1))           sqrt(v) value of each exp_avg_sq code (relative to the block's scale)
#   [2**(BITS+1), +2**(BITS-1))      exp_avg thresholds (_spec.thresholds: 2**(BITS-1) - 1 of them, then padding)
#   [2**(BITS+1) + 2**(BITS-1), +2**BITS)  exp_avg_sq thresholds (LowBitFormat.sq_thresholds, the midpoints its
#                                    exp_avg_sq_nearest names: 2**BITS - 1, then padding)
#   [2**(BITS+2) - 2**(BITS-1), +2**BITS)  exp_avg_sq's stochastic rounding (_spec.EXP_AVG_SQ_STOCHASTIC): the
#                                    levels above the lowest as thresholds (thresholds(levels, False), then padding),
#   then 2**BITS level squares and 2**BITS square gaps (_spec.square_tables)
# A full binary tree of 2**k - 1 sorted thresholds: k probes find #{thresholds <= a}.


@_device
def _quant_blocks(x, mask, offs, SECOND: tl.constexpr, NB: tl.constexpr, QB: tl.constexpr):
    """The start of every block-quantised encoder (8-bit, 4-bit, fp8): the coded values u (x, or sqrt(x) for a
    SECOND moment), the mask and the element indices as (NB, QB) blocks, |u|, the overflowed elements (|u| = inf:
    for a second moment, v overflowed float32, which its block flags rather than loses), whether each block is bad
    (a NaN, or for exp_avg any inf: scale NaN, codes 0) and each block's largest finite |u| (0 without one; masked
    lanes are left out)."""
    if SECOND:
        u = _sqrt(x, False)
    else:
        u = x
    u2 = tl.reshape(u, (NB, QB))
    m2 = tl.reshape(mask, (NB, QB))
    offs2 = tl.reshape(offs, (NB, QB))
    au = tl.abs(u2)
    overflowed = m2 & (au == float("inf"))
    bad = m2 & (u2 != u2)
    if not SECOND:
        bad = bad | overflowed
    block_bad = tl.max(bad.to(tl.int32), axis=1) > 0
    amax = tl.max(tl.where(m2 & (au == au) & (au != float("inf")), au, 0.0), axis=1)
    return u2, m2, offs2, au, overflowed, block_bad, amax


@_device
def _q4_codes(addr, scale_addr, offs, mask, BLOCK: tl.constexpr):
    """A 4-bit state's codes (int32) and block scales (float32, from their bfloat16 bits) of BLOCK consecutive
    elements. Two codes per byte: element 2j in the low nibble of byte j, 2j+1 in the high one."""
    even_offs, _ = tl.split(tl.reshape(offs, (BLOCK // 2, 2)))
    even_mask, _ = tl.split(tl.reshape(mask, (BLOCK // 2, 2)))
    packed = tl.load(addr.to(tl.pointer_type(tl.uint8)) + even_offs // 2, mask=even_mask, other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK,))
    s_bits = tl.load(scale_addr.to(tl.pointer_type(tl.uint16)) + offs // 128, mask=mask, other=0)
    return codes, (s_bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@_device
def _load_low_bit(addr, scale_addr, lut_ptr, offs, mask, DT: tl.constexpr, SECOND: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Values of an 8-bit (DT == Q8) or 4-bit (DT == Q4) state: table[code] * scale (squared for SECOND). Masked
    lanes read 0. offs: BLOCK consecutive element indices starting at a multiple of BLOCK."""
    if DT == 4:
        codes = tl.load(addr.to(tl.pointer_type(tl.uint8)) + offs, mask=mask, other=0).to(tl.int32)
        s = tl.load(scale_addr.to(tl.pointer_type(tl.float32)) + offs // 256, mask=mask, other=0.0)
        bits = 8
    else:
        codes, s = _q4_codes(addr, scale_addr, offs, mask, BLOCK)
        bits = 4
    if SECOND:
        u = tl.load(lut_ptr + (1 << bits) + codes) * s
        x = u * u
        # a negative scale (its sign bit: -0.0 too; a NaN's sign means nothing) marks a block with overflowed v:
        # there code 0 reads as v = inf
        x = tl.where((s.to(tl.int32, bitcast=True) < 0) & (s == s) & (codes == 0), float("inf"), x)
    else:
        x = tl.load(lut_ptr + codes) * s
    return x


@_device
def _q4_root(addr, scale_addr, lut_ptr, offs, mask, BLOCK: tl.constexpr):
    """The decoded sqrt(v) of a 4-bit second moment's codes, as formats.low_bit_root: level * |s|, inf for code 0 in
    a flagged block (an overflowed v), NaN in a NaN block. What a 4-bit exp_avg is decoded through."""
    codes, s = _q4_codes(addr, scale_addr, offs, mask, BLOCK)
    u = tl.load(lut_ptr + 16 + codes) * tl.abs(s)
    return tl.where((s.to(tl.int32, bitcast=True) < 0) & (s == s) & (codes == 0), float("inf"), u)


@_device
def _bf16_stochastic(a, r16, SQUARES: tl.constexpr):
    """Finite a >= 0 rounded to one of the bfloat16 values lo <= a < hi next to it, as formats.bf16_scales_stochastic
    (_spec.BF16_SCALE_STOCHASTIC): hi iff (a^2 - lo^2) > uniform * (hi^2 - lo^2) with SQUARES (unbiased in v), else
    iff (a - lo) > uniform * (hi - lo), uniform = (2 * r16 + 1) * 2**-17; a itself where it is a bfloat16 value."""
    b = a.to(tl.uint32, bitcast=True)
    lo_bits = b & 0xFFFF0000
    lo = lo_bits.to(tl.float32, bitcast=True)
    hi = (lo_bits + 0x10000).to(tl.float32, bitcast=True)
    uniform = (r16 * 2 + 1).to(tl.float32) * 7.62939453125e-06  # 2**-17 (formats.sr_uniform)
    if SQUARES:
        up = (a * a - lo * lo) > uniform * (hi * hi - lo * lo)
    else:
        up = (a - lo) > uniform * (hi - lo)
    return tl.where((b & 0xFFFF) == 0, a, tl.where(up, hi, lo))


@_device
def _store_low_bit(addr, scale_addr, lut_ptr, offs, x, mask, rnd, step, DT: tl.constexpr, SECOND: tl.constexpr,
                   BLOCK: tl.constexpr, HASH_HERE: tl.constexpr):
    """Encodes float32 values x (v for SECOND: its square root is coded) into an 8-bit or 4-bit state and its
    scales, as formats.quantize_low_bit: per block the scale is the absolute maximum (rounded to bfloat16 for 4-bit,
    stochastically as in a step; 0 below float32's smallest normal), NaN for a block with an inf or NaN (whose codes are then 0), except
    a second moment's overflowed v (sqrt(v) = inf): the maximum of the finite ones with the sign bit set, code 0 for
    the overflowed elements and codes >= 1 for the others; the
    code of a normalised value a = min(|x| * (1/s) (* EXP_AVG_SNAP for exp_avg), 1) is the count of the format's
    thresholds <= a (_spec.thresholds), with the sign bit for a negative exp_avg; an exp_avg between two non-zero
    levels then rounds stochastically one up (_spec.EXP_AVG_SR_ULPS; rnd: _moment_random_bits of the step's exp_avg,
    the top 16 bits for exp_avg, the low 16 for a 4-bit second moment; with HASH_HERE hashed here from x, the exp_avg,
    and step, right where they are used: held from the start, they cost sm_80 8 bytes of spills). Returns
    for a 4-bit SECOND moment the decoded sqrt(v) of the codes written (as _q4_root would read them back), else 0."""
    if DT == 4:
        QB: tl.constexpr = 256
        BITS: tl.constexpr = 8
        MIN_SQ_SCALE: tl.constexpr = Q8_MIN_SQ_SCALE
    else:
        QB: tl.constexpr = 128
        BITS: tl.constexpr = 4
        MIN_SQ_SCALE: tl.constexpr = Q4_MIN_SQ_SCALE
    NB: tl.constexpr = BLOCK // QB
    u2, m2, offs2, au, overflowed, block_bad, amax = _quant_blocks(x, mask, offs, SECOND, NB, QB)
    if SECOND:  # a flagged block (see reference.quantize_low_bit)
        flagged = tl.max(overflowed.to(tl.int32), axis=1) > 0
    if DT == 5:  # the scale is stored in bfloat16: in a step rounded stochastically with the random bits of the
        # block's first element (_spec.BF16_SCALE_STOCHASTIC)
        rnd_first = tl.reshape(rnd, (NB, QB))
        if SECOND:
            rnd_first = rnd_first & 0xFFFF
        else:
            rnd_first = rnd_first >> 16
        rnd_first = tl.max(tl.where(tl.arange(0, QB)[None, :] == 0, rnd_first, 0), axis=1)
        amax = _bf16_stochastic(amax, rnd_first, SECOND)
    amax = tl.where(amax < MIN_SCALE, 0.0, amax)  # a subnormal maximum: a zero block
    if SECOND:  # (_spec.MIN_SQRT_V)
        amax = tl.where(amax > 0.0, tl.maximum(amax, MIN_SQ_SCALE), amax)
    s = tl.where(block_bad | (amax == float("inf")), float("nan"), amax)
    usable = s > 0.0  # false for NaN
    inv = tl.where(usable, (1.0 / tl.where(usable, s, 1.0).to(tl.float64)).to(tl.float32), 0.0)
    a_raw = au * inv[:, None]
    if not SECOND:
        a = a_raw * EXP_AVG_SNAP  # the level at or below, up to float32 noise (_spec.EXP_AVG_SNAP)
    else:
        a = a_raw
    a = tl.where(a < 1.0, a, 1.0)
    if SECOND:
        LEVEL_BITS: tl.constexpr = BITS
        THRESHOLDS: tl.constexpr = (2 << BITS) + (1 << (BITS - 1))
    else:
        LEVEL_BITS: tl.constexpr = BITS - 1
        THRESHOLDS: tl.constexpr = 2 << BITS
    code = tl.zeros((NB, QB), dtype=tl.int32)
    if SECOND and DT == 5:  # sqrt(v) in a step: stochastic, unbiased in v (_spec.EXP_AVG_SQ_STOCHASTIC)
        SR_THRESHOLDS: tl.constexpr = (4 << BITS) - (1 << (BITS - 1))
        a_up = a_raw * EXP_AVG_SNAP
        a_up = tl.where(a_up < 1.0, a_up, 1.0)
        for level in tl.static_range(BITS):
            half = 1 << (BITS - 1 - level)
            probe = tl.load(lut_ptr + SR_THRESHOLDS + code + (half - 1))
            code = tl.where(probe <= a_up, code + half, code)
        rnd2 = tl.reshape(rnd, (NB, QB))
        uniform = ((rnd2 & 0xFFFF) * 2 + 1).to(tl.float32) * 7.62939453125e-06  # 2**-17 (formats.sr_uniform)
        ab = a_raw.to(tl.uint32, bitcast=True)
        lowered = tl.where(ab > EXP_AVG_SR_ULPS, ab - EXP_AVG_SR_ULPS, 0).to(tl.float32, bitcast=True)
        lo2 = tl.load(lut_ptr + SR_THRESHOLDS + (1 << BITS) + code)
        gap2 = tl.load(lut_ptr + SR_THRESHOLDS + (2 << BITS) + code)
        up = (lowered * lowered - lo2) > uniform * gap2
        code = tl.where(up & (code < (1 << BITS) - 1), code + 1, code)
    else:
        for level in tl.static_range(LEVEL_BITS):
            half = 1 << (LEVEL_BITS - 1 - level)
            probe = tl.load(lut_ptr + THRESHOLDS + code + (half - 1))
            code = tl.where(probe <= a, code + half, code)
    if not SECOND:  # stochastic rounding from a non-zero level below the top one (_spec.EXP_AVG_SR_ULPS)
        if HASH_HERE:
            rnd2 = _moment_random_bits(u2, offs2, step)
        else:
            rnd2 = tl.reshape(rnd, (NB, QB))
        uniform = ((rnd2 >> 16) * 2 + 1).to(tl.float32) * 7.62939453125e-06  # 2**-17 (formats.sr_uniform)
        ab = a_raw.to(tl.uint32, bitcast=True)
        lowered = tl.where(ab > EXP_AVG_SR_ULPS, ab - EXP_AVG_SR_ULPS, 0).to(tl.float32, bitcast=True)
        lo = tl.load(lut_ptr + code)
        hi = tl.load(lut_ptr + code + 1)
        up = (lowered - lo) > uniform * (hi - lo)
        if DT == 5:  # the 4-bit exp_avg (m / sqrt(v)) rounds stochastically from level 0 too (EXP_AVG_RELATIVE)
            code = tl.where(up & (code < (1 << (BITS - 1)) - 1), code + 1, code)
        else:
            code = tl.where(up & (code > 0) & (code < (1 << (BITS - 1)) - 1), code + 1, code)
        code = tl.where((u2 < 0.0) & (code > 0), code | (1 << (BITS - 1)), code)
    if SECOND:  # in a flagged block code 0 means v = inf; finite values take codes >= 1, the scale its sign bit
        code = tl.where(flagged[:, None], tl.where(overflowed, 0, tl.maximum(code, 1)), code)
        s = tl.where(flagged & (s == s), s * -1.0, s)  # (-0.0 for a zero block: the interpreter's -s is 0 - s)
    code = tl.where(block_bad[:, None] | (m2 == 0), 0, code)
    block_mask = tl.max(m2.to(tl.int32), axis=1) > 0
    block_index = tl.min(offs2, axis=1) // QB
    if DT == 4:
        tl.store(addr.to(tl.pointer_type(tl.uint8)) + offs, tl.reshape(code, (BLOCK,)).to(tl.uint8), mask=mask)
        tl.store(scale_addr.to(tl.pointer_type(tl.float32)) + block_index, s, mask=block_mask)
    else:
        low, high = tl.split(tl.reshape(code, (BLOCK // 2, 2)))
        even_offs, _ = tl.split(tl.reshape(offs, (BLOCK // 2, 2)))
        even_mask, _ = tl.split(tl.reshape(mask, (BLOCK // 2, 2)))
        tl.store(addr.to(tl.pointer_type(tl.uint8)) + even_offs // 2, (low | (high << 4)).to(tl.uint8),
                 mask=even_mask)
        tl.store(scale_addr.to(tl.pointer_type(tl.uint16)) + block_index, _bf16_bits(s), mask=block_mask)
    root = 0.0
    if SECOND:
        if DT == 5:
            u = tl.load(lut_ptr + (1 << BITS) + code) * tl.abs(s)[:, None]
            u = tl.where(flagged[:, None] & (s == s)[:, None] & (code == 0), float("inf"), u)
            root = tl.reshape(u, (BLOCK,))
    return root


# ---- fp8 states (_spec.Fp8Format; formats.quantize_fp8 is the definition) ------------------------------------
# DT == FP8_E4M3: 3 mantissa bits, bias 7, largest finite 448 = 1.75 * 2**8 (code 0x7E); FP8_E5M2: 2 mantissa bits,
# bias 15, largest finite 57344 = 1.75 * 2**15 (code 0x7B). One float32 scale 2**k per 256 elements.


@_device
def _fp8_round(y, MB: tl.constexpr, BIAS: tl.constexpr):
    """Non-negative float32 values y (below 2**(emax + 1)) rounded to nearest even in the fp8 format, as int32 codes
    (not saturated), as formats.fp8_round: normal values by rounding the float32 mantissa to MB bits, subnormal
    ones by adding and subtracting 2**23 to y * 2**(BIAS - 1 + MB) (< 9: the float32 addition rounds to nearest
    even at integers; the launches forbid contracting it)."""
    SHIFT: tl.constexpr = 23 - MB
    b = y.to(tl.int32, bitcast=True)
    normal = ((b + ((1 << (SHIFT - 1)) - 1) + ((b >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MB)
    scaled = y * _pow2(tl.full(y.shape, BIAS - 1 + MB, tl.int32))
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(y < _pow2(tl.full(y.shape, 1 - BIAS, tl.int32)), subnormal, normal)


@_device
def _fp8_coded_amax(amax, r16, MB: tl.constexpr, EMAX: tl.constexpr):
    """Each block's largest magnitude as the block codes it, as formats.fp8_coded_amax with random bits r16: amax
    (finite, >= 0) divided by 2**k0 (k0 the smallest with it at most the largest finite value, capped at 127 -
    emax), rounded stochastically in the format (normal: the top two binades), saturated, times 2**k0; 0 below
    2**(emax + FP8_MIN_EXPONENT - 1)."""
    SHIFT: tl.constexpr = 23 - MB
    b = amax.to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) - 127
    live = e >= EMAX + FP8_MIN_EXPONENT - 1
    k0 = tl.minimum(e - EMAX + ((b & 0x7FFFFF) > FP8_MAX_MANTISSA).to(tl.int32), 127 - EMAX)
    k0 = tl.where(live, k0, 0)
    y = tl.where(live, b - (k0 << 23), 0)
    kept = ((y + (r16 << (SHIFT - 16))) >> SHIFT) << SHIFT
    coded = tl.minimum(kept, FP8_MAX_MANTISSA | ((EMAX + 127) << 23)) + (k0 << 23)
    return tl.where(live, coded.to(tl.float32, bitcast=True), 0.0)


@_device
def _moment_random_bits(m, offs, step):
    """The random bits of the low-bit and fp8 states of these elements in a step, from the step's new exp_avg m, as
    formats.moment_random_bits (_spec.MOMENT_RANDOM_BITS): fmix32(bits(m) ^ e * 0x9E3779B1 ^ (step * 0x85EBCA77 +
    0x6A09E667)) (uint32; e the element index's low 32 bits; a NaN m hashed as _spec.CANONICAL_NAN); exp_avg rounds
    with the top 16, a second moment with the low 16."""
    e = offs.to(tl.uint32)
    b = tl.where(m != m, CANONICAL_NAN, m.to(tl.uint32, bitcast=True))
    return _fmix32(b ^ (e * 0x9E3779B1) ^ (step * 0x85EBCA77 + 0x6A09E667))


@_device
def _fp8_round_stochastic(y, r16, MB: tl.constexpr, BIAS: tl.constexpr):
    """y rounded stochastically with 16 random bits r16, as formats.fp8_round with random bits: added right below
    the kept bits (normal: to the float32 bits; subnormal: to y in fixed point, truncated from min(y, the smallest
    normal) * 2**(BIAS + 22)), then truncated."""
    SHIFT: tl.constexpr = 23 - MB
    min_normal = _pow2(tl.full(y.shape, 1 - BIAS, tl.int32))
    add = (r16 << (SHIFT - 16)).to(tl.int32)
    normal = ((y.to(tl.int32, bitcast=True) + add) >> SHIFT) - ((127 - BIAS) << MB)
    fixed = (tl.minimum(y, min_normal) * _pow2(tl.full(y.shape, BIAS + 22, tl.int32))).to(tl.int32)
    subnormal = (fixed + add) >> SHIFT
    return tl.where(y < min_normal, subnormal, normal)


@_device
def _load_fp8(addr, scale_addr, offs, mask, DT: tl.constexpr, SECOND: tl.constexpr):
    """Values of an fp8 state: code * scale (squared for SECOND), the code's value from its bits (normal: exponent
    and mantissa shifted into a float32, the exponent rebased; subnormal: mantissa * 2**(1 - bias - MB)). Masked
    lanes read 0."""
    if DT == 6:
        MB: tl.constexpr = 3
        BIAS: tl.constexpr = 7
    else:
        MB: tl.constexpr = 2
        BIAS: tl.constexpr = 15
    code = tl.load(addr.to(tl.pointer_type(tl.uint8)) + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scale_addr.to(tl.pointer_type(tl.float32)) + offs // 256, mask=mask, other=0.0)
    c = code & 0x7F
    normal = ((c << (23 - MB)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
    subnormal = (c & ((1 << MB) - 1)).to(tl.float32) * _pow2(tl.full(c.shape, 1 - BIAS - MB, tl.int32))
    u = tl.where((c >> MB) == 0, subnormal, normal)
    u = tl.where((code & 0x80) != 0, -u, u) * s
    if SECOND:
        # a negative scale (its sign bit: -0.0 too; a NaN's sign means nothing) marks a block with overflowed v:
        # there code 0 reads as v = inf
        u = tl.where((s.to(tl.int32, bitcast=True) < 0) & (s == s) & (code == 0), float("inf"), u * u)
    return u


@_device
def _store_fp8(addr, scale_addr, offs, x, mask, rnd, DT: tl.constexpr, SECOND: tl.constexpr, BLOCK: tl.constexpr):
    """Encodes float32 values x (v for SECOND: its square root is coded) into an fp8 state and its scales, as
    formats.quantize_fp8: per block of 256 the block's largest magnitude as coded (formats.fp8_coded_amax: divided by
    2**k0, k0 the smallest with it at most the largest finite value (capped at 127 - emax), rounded stochastically with
    the random bits of the block's first element, times 2**k0), and the scale 2**k, k the same rule's for it; NaN for
    a block with inf or NaN (codes 0), except a second moment's overflowed v (sqrt(v) = inf): the scale of the finite
    ones with the sign bit set, code 0 for the overflowed elements and codes >= 1 for the others; 0 for a block whose
    coded largest magnitude is below 2**(emax + FP8_MIN_EXPONENT) (an all-zero block too); a second moment's k at
    least its FP8_*_MIN_SQ_EXPONENT. Codes round stochastically (rnd: _moment_random_bits of the step's exp_avg; the
    top 16 bits for exp_avg, the low 16 for a second moment), capped at the coded largest magnitude's code, which the
    block's largest magnitudes take; exp_avg keeps its sign (never -0), sqrt(v) gets at least the smallest subnormal
    code in a usable block."""
    if DT == 6:
        MB: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        EMAX: tl.constexpr = 8
        MAX_CODE: tl.constexpr = 0x7E
        MIN_SQ_EXPONENT: tl.constexpr = FP8_E4M3_MIN_SQ_EXPONENT
    else:
        MB: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        EMAX: tl.constexpr = 15
        MAX_CODE: tl.constexpr = 0x7B
        MIN_SQ_EXPONENT: tl.constexpr = FP8_E5M2_MIN_SQ_EXPONENT
    QB: tl.constexpr = 256
    NB: tl.constexpr = BLOCK // QB
    u2, m2, offs2, au, overflowed, block_bad, amax = _quant_blocks(x, mask, offs, SECOND, NB, QB)
    r2 = tl.reshape(rnd, (NB, QB))
    if SECOND:
        r16 = r2 & 0xFFFF
    else:
        r16 = r2 >> 16
    first = tl.arange(0, QB)[None, :] == 0
    r_first = tl.max(tl.where(first, r16, 0), axis=1)  # (the block's first element's random bits)
    coded_from = tl.where(block_bad == 0, amax, 0.0)
    if SECOND:  # at most FP8_MAX_ROOT: the decoded v, its square, stays finite (_spec.FP8_MAX_ROOT)
        coded_from = tl.minimum(coded_from, FP8_MAX_ROOT)
    coded = _fp8_coded_amax(coded_from, r_first, MB, EMAX)
    cb = coded.to(tl.int32, bitcast=True)
    k = ((cb >> 23) & 0xFF) - 127 - EMAX + ((cb & 0x7FFFFF) > FP8_MAX_MANTISSA).to(tl.int32)
    k = tl.minimum(k, 127 - EMAX)
    usable = (block_bad == 0) & (((cb >> 23) & 0xFF) - 127 >= EMAX + FP8_MIN_EXPONENT)
    if SECOND:  # (_spec.MIN_SQRT_V)
        k = tl.maximum(k, MIN_SQ_EXPONENT)
    k = tl.where(usable, k, 0)
    s = tl.where(usable, _pow2(k), tl.where(block_bad, float("nan"), 0.0))
    y = tl.where(usable[:, None], au * _pow2(-k)[:, None], 0.0)
    top = tl.minimum(_fp8_round(tl.where(usable, coded * _pow2(-k), 0.0), MB, BIAS), MAX_CODE)
    code = tl.minimum(_fp8_round_stochastic(y, r16, MB, BIAS), top[:, None])
    code = tl.where(au == amax[:, None], top[:, None], code)
    if SECOND:  # in a flagged block code 0 means v = inf; finite values take codes >= 1, the scale its sign bit
        flagged = (tl.max(overflowed.to(tl.int32), axis=1) > 0) & (block_bad == 0)
        code = tl.where(usable[:, None] | flagged[:, None], tl.maximum(code, 1), code)
        code = tl.where(overflowed, 0, code)
        s = tl.where(flagged, s * -1.0, s)  # (-0.0 for a zero block: the interpreter's -s is 0 - s)
    else:
        code = tl.where((u2 < 0.0) & (code > 0), code | 0x80, code)
    code = tl.where(m2, code, 0)
    block_mask = tl.max(m2.to(tl.int32), axis=1) > 0
    block_index = tl.min(offs2, axis=1) // QB
    tl.store(addr.to(tl.pointer_type(tl.uint8)) + offs, tl.reshape(code, (BLOCK,)).to(tl.uint8), mask=mask)
    tl.store(scale_addr.to(tl.pointer_type(tl.float32)) + block_index, s, mask=block_mask)


@_device
def _div(a, b, F64: tl.constexpr):
    """a / b rounded to nearest, subnormals kept (a and b are blocks)."""
    if F64:
        r = a / b  # div.rn.f64
    elif _PTX:
        r = tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = tl.math.div_rn(a, b)
    return r


@_device
def _sqrt(x, F64: tl.constexpr):
    """Correctly rounded square root, subnormals kept (x is a block)."""
    if F64:
        r = tl.sqrt(x)  # sqrt.rn.f64
    elif _PTX:
        r = tl.inline_asm_elementwise("sqrt.rn.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        r = tl.sqrt_rn(x)
    return r


@_device
def _to_compute(x, F64: tl.constexpr):
    if F64:
        r = x.to(tl.float64)
    else:
        r = x.to(tl.float32)
    return r


@_device
def _f64(bits):
    """A float64 from its IEEE bit pattern (an int32 or int64 kernel argument)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@_device
def _powi(base, t):
    """base ** t for float64 base and a whole float64 t >= 0, by binary exponentiation from t's lowest bit: the
    products of _spec.beta_power and the CPU kernel's, in their order."""
    e = t.to(tl.int64)
    result = base * 0.0 + 1.0
    while e > 0:
        result = tl.where((e & 1) == 1, result * base, result)
        base = base * base
        e = e >> 1
    return result


# ---- stochastic rounding of bfloat16 params (ops/README.md, "stochastic rounding"; reference.random_bits) -------

@_device
def _u64(hi, lo):
    """A uint64 constant from its two 32-bit halves (Python ints above 2**63 are not Triton literals)."""
    return (tl.full((), hi, tl.uint64) << 32) | tl.full((), lo, tl.uint64)


@_device
def _splitmix64(x):
    """splitmix64 on a uint64 (products wrap modulo 2**64), as _spec.splitmix64."""
    x = x + _u64(0x9E3779B9, 0x7F4A7C15)
    x = (x ^ (x >> 30)) * _u64(0xBF58476D, 0x1CE4E5B9)
    x = (x ^ (x >> 27)) * _u64(0x94D049BB, 0x133111EB)
    return x ^ (x >> 31)


@_device
def _fmix32(x):
    """murmur3's 32-bit finaliser on uint32 values (products wrap modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@_device
def _bf16_bits_stochastic(x, offs, key):
    """float32 -> bfloat16 bit pattern rounded up in magnitude with probability (the dropped 16 bits) / 2**16, from
    16 random bits of hash(key, element index); inf and NaN round to nearest (NaN -> 0x7FC0). key: the uint64
    splitmix64(rounding key ^ splitmix64(step))."""
    lo = (offs & 0xFFFFFFFF).to(tl.uint32)
    hi = (offs >> 32).to(tl.uint32)
    k_lo = (key & 0xFFFFFFFF).to(tl.uint32)
    k_hi = (key >> 32).to(tl.uint32)
    r = _fmix32(_fmix32(lo * 0x9E3779B1 + hi * 0x85EBCA77 + k_lo) ^ k_hi)
    b = x.to(tl.uint32, bitcast=True)
    stochastic = ((b + (r >> 16)) >> 16) & 0xFFFF
    finite = (b & 0x7FFFFFFF) < 0x7F800000
    return tl.where(finite, stochastic.to(tl.uint16), _bf16_bits(x))


# ---- the Adam step ---------------------------------------------------------------------------------------------

@_device
def _adam_block(
    offs, mask, block_index, p_addr, g_addr, m_addr, v_addr, vmax_addr, master_addr, ms_addr, vs_addr, vmaxs_addr,
    m_lut_ptr, v_lut_ptr, sr_key, m_step, grad_mul, b2, lerp_from_grad, lerp_coeff, one_minus_b2, eps, wd, step_size,
    bc2_sqrt, torch_decay, hf_decay, grad_scale, squares, P_DT: tl.constexpr, G_DT: tl.constexpr, M_DT: tl.constexpr,
    V_DT: tl.constexpr, HAS_MASTER: tl.constexpr, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
    AMSGRAD: tl.constexpr, MODE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, HAS_SR: tl.constexpr,
    UNSCALE_GRADS: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """One block of 1024 elements (one fp16 quantisation block, 4 or 8 low-bit ones) of one tensor. Returns the
    running sums of squares `squares` (BLOCK // 4 of them) plus, with HAS_NORM, the squares of the gradient as
    loaded (before unscaling; masked lanes load 0), each group of 4 adjacent ones into one sum. Added right after the
    load, so that the loaded values die early, and into a quarter as many sums as elements, which with the 4
    elements per thread of the 16-byte accesses is one register per thread (tools/aot_compile.py: 54 registers for
    the fp32 step instead of 57 with one sum per element, and 128 instead of 167 for 8-bit moments on sm_90)."""
    F64: tl.constexpr = P_DT == 3
    g_loaded = _load(g_addr, offs, mask, G_DT, ALIGNED)
    if HAS_NORM:  # each thread's 4 (at 8 warps) adjacent squares added first: one accumulator register per thread
        squares = squares + tl.sum(tl.reshape(g_loaded * g_loaded, (BLOCK // 4, 4)), axis=1)
    if UNSCALE_GRADS:  # the unscaled gradient back into .grad, as torch's fused AdamW: a division, rounded to G_DT
        _store(g_addr, offs, _div(g_loaded, grad_scale, F64), mask, G_DT, ALIGNED)
    g = g_loaded * grad_mul
    if HAS_MASTER:
        p = _load(master_addr, offs, mask, 0, ALIGNED)
    else:
        p = _load(p_addr, offs, mask, P_DT, ALIGNED)
    m = _load_state(m_addr, ms_addr, m_lut_ptr, offs, mask, block_index, M_DT, M_SCALED, False, ALIGNED, BLOCK)
    if M_DT == 5:  # a 4-bit exp_avg holds m / sqrt(v): m = q * u, 0 where q = 0 (_spec.EXP_AVG_RELATIVE)
        m = tl.where(m == 0.0, 0.0, m * _q4_root(v_addr, vs_addr, v_lut_ptr, offs, mask, BLOCK))
    v = _load_state(v_addr, vs_addr, v_lut_ptr, offs, mask, block_index, V_DT, V_SCALED, True, ALIGNED, BLOCK)
    if MODE == 0:
        g = g + wd * p  # L2: the decay enters the moments
    if MODE == 2:
        p = p * torch_decay
    # beta1*m + (1-beta1)*g in torch's lerp form (ops/adam_kernel.cpp, Lerp): m + w*(g - m), or g + (w-1)*(g - m)
    m = tl.where(lerp_from_grad, g, m) + lerp_coeff * (g - m)
    v = v * b2 + one_minus_b2 * g * g
    if AMSGRAD:
        vmax = _load_state(vmax_addr, vmaxs_addr, v_lut_ptr, offs, mask, block_index, V_DT, V_SCALED, True, ALIGNED,
                           BLOCK)
        vmax = tl.where((vmax < v) | (v != v), v, vmax)  # torch.maximum(vmax, v): a NaN in either stays
        v_used = vmax
    else:
        v_used = v
    if MODE == 2:
        p = p - step_size * _div(m, _div(_sqrt(v_used, F64), bc2_sqrt, F64) + eps, F64)
    else:
        p = p - step_size * _div(m, _sqrt(v_used, F64) + eps, F64)
        if MODE == 1:
            p = p - hf_decay * p  # HF transformers: decay after the update, with the plain lr
    # Without a master, the param first: its registers are then free for the quantisation of the states, which
    # needs the most of them (sm_80 spilled 116 bytes for bf16 params, 4-bit m, 8-bit v, amsgrad). With a master,
    # ptxas does better storing it last.
    if not HAS_MASTER:
        _store_param(p_addr, master_addr, offs, p, mask, sr_key, P_DT, HAS_MASTER, HAS_SR, ALIGNED)
    # The moments' random bits (_spec.MOMENT_RANDOM_BITS): one hash per element of m, taken here for fp8 and 4-bit
    # states (two stores use it, or a 4-bit exp_avg's store, which codes m / u), by the store itself for an 8-bit
    # exp_avg beside a second moment that takes none
    SHARED_RND: tl.constexpr = M_DT >= 5 or V_DT >= 5
    if SHARED_RND:
        rnd = _moment_random_bits(m, offs, m_step)
    else:
        rnd = 0
    if M_DT != 5:
        _store_state(m_addr, ms_addr, m_lut_ptr, offs, m, mask, block_index, M_DT, M_SCALED, False, ALIGNED, BLOCK,
                     rnd, m_step, M_DT == 4 and not SHARED_RND)
    root = _store_state(v_addr, vs_addr, v_lut_ptr, offs, v, mask, block_index, V_DT, V_SCALED, True, ALIGNED, BLOCK,
                        rnd)
    if AMSGRAD:
        _store_state(vmax_addr, vmaxs_addr, v_lut_ptr, offs, vmax, mask, block_index, V_DT, V_SCALED, True, ALIGNED,
                     BLOCK, rnd)
    if M_DT == 5:  # after exp_avg_sq: r = m / u against its new codes, 0 where u = 0 (_spec.EXP_AVG_RELATIVE)
        r = tl.where(root == 0.0, 0.0, _div(m, root, False))
        _store_state(m_addr, ms_addr, m_lut_ptr, offs, r, mask, block_index, M_DT, M_SCALED, False, ALIGNED, BLOCK,
                     rnd)
    if HAS_MASTER:
        _store_param(p_addr, master_addr, offs, p, mask, sr_key, P_DT, HAS_MASTER, HAS_SR, ALIGNED)
    return squares


@_device
def _store_param(p_addr, master_addr, offs, p, mask, sr_key, P_DT: tl.constexpr, HAS_MASTER: tl.constexpr,
                 HAS_SR: tl.constexpr, ALIGNED: tl.constexpr):
    """The new param value into the master (float32) and the param (rounded to P_DT, stochastically with HAS_SR)."""
    if HAS_MASTER:
        _store(master_addr, offs, p, mask, 0, ALIGNED)
    if HAS_SR:  # bfloat16 params without masters (checked by the host)
        ptr = p_addr.to(tl.pointer_type(tl.uint16))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        tl.store(ptr + offs, _bf16_bits_stochastic(p, offs, sr_key), mask=mask)
    else:
        _store(p_addr, offs, p, mask, P_DT, ALIGNED)


@triton.jit(do_not_specialize=["norm_partial_base", "lr_bits", "beta1_bits", "beta2_bits", "eps_bits", "wd_bits",
                            "sign_bits"])
def adam_kernel(
    meta_ptr, grads_ptr, work_ptr, steps_ptr, lr_ptr, betas_ptr, inv_scale_ptr, found_inf_ptr, grad_scale_ptr,
    m_lut_ptr, v_lut_ptr, keys_ptr, norm_partial_ptr, norm_partial_base,
    lr_bits: "int64", beta1_bits: "int64", beta2_bits: "int64", eps_bits: "int64", wd_bits: "int64",
    sign_bits: "int64",
    P_DT: tl.constexpr, G_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
    HAS_MASTER: tl.constexpr, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr, AMSGRAD: tl.constexpr,
    MODE: tl.constexpr, BIAS_CORRECTION: tl.constexpr, HAS_LR_TENSOR: tl.constexpr, HAS_INV_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, UNSCALE_GRADS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr, ALIGNED: tl.constexpr, HAS_SR: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_BETAS_TENSOR: tl.constexpr,
):
    """One Adam step over every tensor of the tables: program pid does work item pid (BLOCKS_PER_PROGRAM blocks of
    one tensor). Table row (int64): param, exp_avg, exp_avg_sq, max_exp_avg_sq, master, and the three scale
    addresses, numel, index into steps. m_lut_ptr / v_lut_ptr: the lookup tables of low-bit exp_avg / exp_avg_sq
    formats (M_DT / V_DT == Q8 or Q4; any pointer otherwise, never read). HAS_SR: round the bfloat16 params
    stochastically with the int64 rounding key keys_ptr[index into steps] (ops/README.md, "stochastic rounding").
    HAS_NORM: also norm_partial_ptr[norm_partial_base + pid] (float64) = the sum of squares of the gradients this
    program loaded, as loaded (before unscaling), NaN when the step is skipped, as the CPU kernel's grad_norm.
    HAS_BETAS_TENSOR: beta1 and beta2 are betas_ptr[0] and betas_ptr[1] (float64), not the bits arguments.

    Why per-program partial sums and not tl.atomic_add into one scalar: the order of atomic additions changes from
    run to run, and so would the norm's last bits; a partial per program summed by one fixed-order program
    (grad_stats_finish_kernel) gives the same bits for the same launch. Each thread accumulates the squares of its
    elements over the program's blocks in the compute dtype (a multiply and an add per element: the launches forbid
    contracting them into an FMA, see aot_compile.py; _adam_block), then one tree sum per program, rounded to
    float64."""
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0:  # skipped step: nothing is written (read on the device, no host sync)
            if HAS_NORM:
                tl.store(norm_partial_ptr + norm_partial_base + tl.program_id(0), float("nan"))
            return
    F64: tl.constexpr = P_DT == 3
    pid = tl.program_id(0).to(tl.int64)
    t_idx = tl.load(work_ptr + 2 * pid)
    start = tl.multiple_of(tl.load(work_ptr + 2 * pid + 1), BLOCK)  # work items start on block boundaries
    row = meta_ptr + t_idx * 10
    numel = tl.load(row + 8)
    p_addr = tl.load(row + 0)
    m_addr = tl.load(row + 1)
    v_addr = tl.load(row + 2)
    vmax_addr = tl.load(row + 3)
    master_addr = tl.load(row + 4)
    ms_addr = tl.load(row + 5)
    vs_addr = tl.load(row + 6)
    vmaxs_addr = tl.load(row + 7)
    step_index = tl.load(row + 9)
    g_addr = tl.load(grads_ptr + t_idx)

    # Per-tensor scalars, formed in float64 (ops/README.md) and rounded once to the compute dtype.
    if HAS_LR_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = _f64(lr_bits)
    if HAS_BETAS_TENSOR:
        beta1 = tl.load(betas_ptr).to(tl.float64)
        beta2 = tl.load(betas_ptr + 1).to(tl.float64)
    else:
        beta1 = _f64(beta1_bits)
        beta2 = _f64(beta2_bits)
    wd64 = _f64(wd_bits)
    grad_mul64 = _f64(sign_bits)
    if HAS_INV_SCALE:
        grad_mul64 = tl.load(inv_scale_ptr).to(tl.float64) * grad_mul64
    t = tl.load(steps_ptr + step_index) + 1.0
    if BIAS_CORRECTION:
        bc1 = 1.0 - _powi(beta1, t)
        bc2 = 1.0 - _powi(beta2, t)
    else:
        bc1 = t * 0.0 + 1.0
        bc2 = t * 0.0 + 1.0
    bc2_sqrt64 = tl.sqrt(bc2)
    if MODE == 2:
        step_size64 = lr / bc1
    else:
        step_size64 = lr * bc2_sqrt64 / bc1
    grad_mul = _to_compute(grad_mul64, F64)
    b2 = _to_compute(beta2, F64)
    lerp_weight = _to_compute(1.0 - beta1, F64)  # (the lerp's weight, 1 - beta1, in the compute dtype)
    lerp_from_grad = tl.abs(lerp_weight) >= 0.5
    lerp_coeff = tl.where(lerp_from_grad, lerp_weight - 1.0, lerp_weight)
    one_minus_b2 = _to_compute(1.0 - beta2, F64)
    eps = _to_compute(_f64(eps_bits), F64)
    wd = _to_compute(wd64, F64)
    step_size = _to_compute(step_size64, F64)
    bc2_sqrt = _to_compute(bc2_sqrt64, F64)
    torch_decay = _to_compute(1.0 - lr * wd64, F64)
    hf_decay = _to_compute(lr * wd64, F64)
    if HAS_SR:  # this step's key: splitmix64(rounding key ^ splitmix64(step)), step counted from 1
        key = tl.load(keys_ptr + step_index).to(tl.uint64, bitcast=True)
        sr_key = _splitmix64(key ^ _splitmix64(t.to(tl.uint64)))
    else:
        sr_key = 0
    m_step = t.to(tl.int64).to(tl.uint32)  # mixed into the moment states' stochastic rounding
    if UNSCALE_GRADS:
        grad_scale = _to_compute(tl.load(grad_scale_ptr), F64)
    else:
        grad_scale = eps

    # Full blocks without a mask (so that 16-byte accesses are possible), then the tensor's partial last block.
    end = tl.minimum(start + BLOCK * BLOCKS_PER_PROGRAM, numel)
    full_blocks = (end - start) // BLOCK
    full_end = start + full_blocks * BLOCK
    lanes = tl.arange(0, BLOCK)
    if F64:  # (without HAS_NORM never changed, and compiled away)
        squares = tl.zeros((BLOCK // 4,), dtype=tl.float64)
    else:
        squares = tl.zeros((BLOCK // 4,), dtype=tl.float32)
    for b in range(0, full_blocks):
        bs = start + b * BLOCK
        squares = _adam_block(
            bs + lanes, lanes < BLOCK, bs // BLOCK, p_addr, g_addr, m_addr, v_addr, vmax_addr, master_addr, ms_addr,
            vs_addr, vmaxs_addr, m_lut_ptr, v_lut_ptr, sr_key, m_step, grad_mul, b2, lerp_from_grad, lerp_coeff,
            one_minus_b2, eps, wd, step_size, bc2_sqrt, torch_decay, hf_decay, grad_scale, squares, P_DT, G_DT, M_DT,
            V_DT, HAS_MASTER, M_SCALED, V_SCALED, AMSGRAD, MODE, ALIGNED, BLOCK, HAS_SR, UNSCALE_GRADS, HAS_NORM)
    if full_end < end:
        offs = full_end + lanes
        squares = _adam_block(
            offs, offs < end, full_end // BLOCK, p_addr, g_addr, m_addr, v_addr, vmax_addr, master_addr, ms_addr,
            vs_addr, vmaxs_addr, m_lut_ptr, v_lut_ptr, sr_key, m_step, grad_mul, b2, lerp_from_grad, lerp_coeff,
            one_minus_b2, eps, wd, step_size, bc2_sqrt, torch_decay, hf_decay, grad_scale, squares, P_DT, G_DT, M_DT,
            V_DT, HAS_MASTER, M_SCALED, V_SCALED, AMSGRAD, MODE, ALIGNED, BLOCK, HAS_SR, UNSCALE_GRADS, HAS_NORM)
    if HAS_NORM:
        tl.store(norm_partial_ptr + norm_partial_base + pid, tl.sum(squares, axis=0).to(tl.float64))


@triton.jit(do_not_specialize=["n", "parts"])
def step_finish_kernel(steps_ptr, found_inf_ptr, n, partial_ptr, parts, stats_ptr, HAS_FOUND_INF: tl.constexpr,
                       HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
    """What follows the Adam launches of a call, in one launch: steps += 1 (program i the counts [i * BLOCK,
    (i + 1) * BLOCK)) unless the step is skipped, and with HAS_NORM program 0 also adds the launches' float64 partial
    sums of squares into stats_ptr, as grad_stats_finish_kernel (_finish_sum). Launched after the Adam kernels, which
    read the old counts."""
    if HAS_NORM:
        if tl.program_id(0) == 0:
            _finish_sum(partial_ptr, parts, stats_ptr, BLOCK)
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(steps_ptr + offs, mask=mask, other=0.0)
    tl.store(steps_ptr + offs, s + 1.0, mask=mask)


# ---- gradient statistics ---------------------------------------------------------------------------------------

@triton.jit
def grad_stats_kernel(addr_ptr, numel_ptr, work_ptr, partial_ptr, partial_base, DT: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, ALIGNED: tl.constexpr):
    """partial[partial_base + pid] = sum of squares of the work item's elements, in float64 (squares of fp32
    values are exact in fp64): per-lane sums over the item's blocks, then one tree sum. Deterministic."""
    pid = tl.program_id(0).to(tl.int64)
    t_idx = tl.load(work_ptr + 2 * pid)
    start = tl.multiple_of(tl.load(work_ptr + 2 * pid + 1), BLOCK)
    addr = tl.load(addr_ptr + t_idx)
    end = tl.minimum(start + BLOCK * BLOCKS_PER_PROGRAM, tl.load(numel_ptr + t_idx))
    full_blocks = (end - start) // BLOCK
    full_end = start + full_blocks * BLOCK
    lanes = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), dtype=tl.float64)
    for b in range(0, full_blocks):
        bs = start + b * BLOCK
        x = _load(addr, bs + lanes, lanes < BLOCK, DT, ALIGNED).to(tl.float64)
        total += x * x
    offs = full_end + lanes
    x = _load(addr, offs, offs < end, DT, ALIGNED).to(tl.float64)
    total += x * x
    tl.store(partial_ptr + partial_base + pid, tl.sum(total, axis=0))


@_device
def _finish_sum(partial_ptr, n, out_ptr, BLOCK: tl.constexpr):
    """out = [float32(sum of the n float64 partials), 1.0 if the sum is not finite else 0.0], in a fixed order."""
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + offs, mask=offs < n, other=0.0)
    total = tl.sum(acc, axis=0)
    finite = (total == total) & (tl.abs(total) != float("inf"))
    tl.store(out_ptr, total.to(tl.float32))
    tl.store(out_ptr + 1, tl.where(finite, 0.0, 1.0).to(tl.float32))


@triton.jit
def grad_stats_finish_kernel(partial_ptr, n, out_ptr, BLOCK: tl.constexpr):
    """out = [float32(sum of the partials), 1.0 if the sum is not finite else 0.0]; one program, fixed order."""
    _finish_sum(partial_ptr, n, out_ptr, BLOCK)
