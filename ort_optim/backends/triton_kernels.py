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
* fp16 moment states are quantised per 1024-element block with the power-of-two rule of ops/README.md.

Trap-driven choices (see tests/test_triton.py): pointer types are always built from literal dtypes (``tl.pointer_type``
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

# dtype codes of the constexpr *_DT arguments
F32, F16, BF16, F64 = 0, 1, 2, 3

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
def _load_state(addr, scale_addr, offs, mask, block_index, DT: tl.constexpr, SCALED: tl.constexpr,
                ALIGNED: tl.constexpr):
    if SCALED:
        s = tl.load(scale_addr.to(tl.pointer_type(tl.float32)) + block_index)
        # 1/s in float32, correctly rounded: the fp64 quotient rounded to fp32 is (53 >= 2*24 + 2: double rounding
        # is innocuous for division), and it avoids the flush-to-zero fp32 division.
        inv = (1.0 / s.to(tl.float64)).to(tl.float32)
        x = _load(addr, offs, mask, 1, ALIGNED) * inv
    else:
        x = _load(addr, offs, mask, DT, ALIGNED)
    return x


@_device
def _store_state(addr, scale_addr, offs, x, mask, block_index, DT: tl.constexpr, SCALED: tl.constexpr,
                 ALIGNED: tl.constexpr):
    if SCALED:
        # NaNs are left out of the maximum (as std::max in the CPU kernel does), masked lanes too.
        amax = tl.max(tl.where(mask & (x == x), tl.abs(x), 0.0), axis=0)
        s = _fp16_block_scale(amax)
        _store(addr, offs, x * s, mask, 1, ALIGNED)
        tl.store(scale_addr.to(tl.pointer_type(tl.float32)) + block_index, s)
    else:
        _store(addr, offs, x, mask, DT, ALIGNED)


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
    """base ** t for float64 base and a whole float64 t >= 0, by repeated squaring."""
    e = t.to(tl.int64)
    result = base * 0.0 + 1.0
    while e > 0:
        result = tl.where((e & 1) == 1, result * base, result)
        base = base * base
        e = e >> 1
    return result


# ---- the Adam step ---------------------------------------------------------------------------------------------

@_device
def _adam_block(
    offs, mask, block_index, p_addr, g_addr, m_addr, v_addr, vmax_addr, master_addr, ms_addr, vs_addr, vmaxs_addr,
    grad_mul, b2, one_minus_b1, one_minus_b2, eps, wd, step_size, bc2_sqrt, torch_decay, hf_decay, grad_scale,
    P_DT: tl.constexpr, G_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr, HAS_MASTER: tl.constexpr,
    M_SCALED: tl.constexpr, V_SCALED: tl.constexpr, AMSGRAD: tl.constexpr, MODE: tl.constexpr,
    ALIGNED: tl.constexpr, UNSCALE_GRADS: tl.constexpr,
):
    """One block of 1024 elements (one fp16 quantisation block) of one tensor."""
    F64: tl.constexpr = P_DT == 3
    g_loaded = _load(g_addr, offs, mask, G_DT, ALIGNED)
    if UNSCALE_GRADS:  # the unscaled gradient back into .grad, as torch's fused AdamW: a division, rounded to G_DT
        _store(g_addr, offs, _div(g_loaded, grad_scale, F64), mask, G_DT, ALIGNED)
    g = g_loaded * grad_mul
    if HAS_MASTER:
        p = _load(master_addr, offs, mask, 0, ALIGNED)
    else:
        p = _load(p_addr, offs, mask, P_DT, ALIGNED)
    m = _load_state(m_addr, ms_addr, offs, mask, block_index, M_DT, M_SCALED, ALIGNED)
    v = _load_state(v_addr, vs_addr, offs, mask, block_index, V_DT, V_SCALED, ALIGNED)
    if MODE == 0:
        g = g + wd * p  # L2: the decay enters the moments
    if MODE == 2:
        p = p * torch_decay
    m = m + one_minus_b1 * (g - m)  # torch's lerp form of beta1*m + (1-beta1)*g
    v = v * b2 + one_minus_b2 * g * g
    if AMSGRAD:
        vmax = _load_state(vmax_addr, vmaxs_addr, offs, mask, block_index, V_DT, V_SCALED, ALIGNED)
        vmax = tl.where(vmax < v, v, vmax)  # std::max(vmax, v), NaN behaviour included
        v_used = vmax
    else:
        v_used = v
    if MODE == 2:
        p = p - step_size * _div(m, _div(_sqrt(v_used, F64), bc2_sqrt, F64) + eps, F64)
    else:
        p = p - step_size * _div(m, _sqrt(v_used, F64) + eps, F64)
        if MODE == 1:
            p = p - hf_decay * p  # HF transformers: decay after the update, with the plain lr
    _store_state(m_addr, ms_addr, offs, m, mask, block_index, M_DT, M_SCALED, ALIGNED)
    _store_state(v_addr, vs_addr, offs, v, mask, block_index, V_DT, V_SCALED, ALIGNED)
    if AMSGRAD:
        _store_state(vmax_addr, vmaxs_addr, offs, vmax, mask, block_index, V_DT, V_SCALED, ALIGNED)
    if HAS_MASTER:
        _store(master_addr, offs, p, mask, 0, ALIGNED)
    _store(p_addr, offs, p, mask, P_DT, ALIGNED)


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "eps_bits", "wd_bits", "sign_bits"])
def adam_kernel(
    meta_ptr, grads_ptr, work_ptr, steps_ptr, lr_ptr, inv_scale_ptr, found_inf_ptr, grad_scale_ptr,
    lr_bits: "int64", beta1_bits: "int64", beta2_bits: "int64", eps_bits: "int64", wd_bits: "int64",
    sign_bits: "int64",
    P_DT: tl.constexpr, G_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
    HAS_MASTER: tl.constexpr, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr, AMSGRAD: tl.constexpr,
    MODE: tl.constexpr, BIAS_CORRECTION: tl.constexpr, HAS_LR_TENSOR: tl.constexpr, HAS_INV_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, UNSCALE_GRADS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr, ALIGNED: tl.constexpr,
):
    """One Adam step over every tensor of the tables: program pid does work item pid (BLOCKS_PER_PROGRAM blocks of
    one tensor). Table row (int64): param, exp_avg, exp_avg_sq, max_exp_avg_sq, master, and the three scale
    addresses, numel, index into steps."""
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0:  # skipped step: nothing is written (read on the device, no host sync)
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
    one_minus_b1 = _to_compute(1.0 - beta1, F64)
    one_minus_b2 = _to_compute(1.0 - beta2, F64)
    eps = _to_compute(_f64(eps_bits), F64)
    wd = _to_compute(wd64, F64)
    step_size = _to_compute(step_size64, F64)
    bc2_sqrt = _to_compute(bc2_sqrt64, F64)
    torch_decay = _to_compute(1.0 - lr * wd64, F64)
    hf_decay = _to_compute(lr * wd64, F64)
    if UNSCALE_GRADS:
        grad_scale = _to_compute(tl.load(grad_scale_ptr), F64)
    else:
        grad_scale = eps

    # Full blocks without a mask (so that 16-byte accesses are possible), then the tensor's partial last block.
    end = tl.minimum(start + BLOCK * BLOCKS_PER_PROGRAM, numel)
    full_blocks = (end - start) // BLOCK
    full_end = start + full_blocks * BLOCK
    lanes = tl.arange(0, BLOCK)
    for b in range(0, full_blocks):
        bs = start + b * BLOCK
        _adam_block(bs + lanes, lanes < BLOCK, bs // BLOCK, p_addr, g_addr, m_addr, v_addr,
                    vmax_addr, master_addr, ms_addr, vs_addr, vmaxs_addr, grad_mul, b2, one_minus_b1,
                    one_minus_b2, eps, wd, step_size, bc2_sqrt, torch_decay, hf_decay, grad_scale, P_DT, G_DT, M_DT,
                    V_DT, HAS_MASTER, M_SCALED, V_SCALED, AMSGRAD, MODE, ALIGNED, UNSCALE_GRADS)
    if full_end < end:
        offs = full_end + lanes
        _adam_block(offs, offs < end, full_end // BLOCK, p_addr, g_addr, m_addr, v_addr, vmax_addr, master_addr,
                    ms_addr, vs_addr, vmaxs_addr, grad_mul, b2, one_minus_b1, one_minus_b2, eps, wd, step_size,
                    bc2_sqrt, torch_decay, hf_decay, grad_scale, P_DT, G_DT, M_DT, V_DT, HAS_MASTER, M_SCALED,
                    V_SCALED, AMSGRAD, MODE, ALIGNED, UNSCALE_GRADS)


@triton.jit
def advance_steps_kernel(steps_ptr, found_inf_ptr, n, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
    """steps += 1, unless the step is skipped. Launched after the Adam kernels, which read the old counts."""
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


@triton.jit
def grad_stats_finish_kernel(partial_ptr, n, out_ptr, BLOCK: tl.constexpr):
    """out = [float32(sum of the partials), 1.0 if the sum is not finite else 0.0]; one program, fixed order."""
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + offs, mask=offs < n, other=0.0)
    total = tl.sum(acc, axis=0)
    finite = (total == total) & (tl.abs(total) != float("inf"))
    tl.store(out_ptr, total.to(tl.float32))
    tl.store(out_ptr + 1, tl.where(finite, 0.0, 1.0).to(tl.float32))
