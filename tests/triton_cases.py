"""Cases and an exact numpy model of ops/README.md, shared by tests/triton_backend/test_triton.py and tools/gpu_check.py.

No pytest here: tools/gpu_check.py runs these checks on a GPU machine that may have nothing but torch and triton.

* :func:`reference_step` is the op in numpy, float32 (float64 for float64 params), in the CPU kernel's order of
  operations, without fused multiply-adds, with the README's rounding (fp16 RNE, bf16 RNE with NaN -> 0x7FC0) and the
  fp16 block-scale rule written with Python's frexp/ldexp (a scaled fp16 second moment holds sqrt(v)). 8-bit and
  4-bit states are encoded and decoded by the spec's quantiser (``ort_optim.formats.quantize_low_bit`` /
  ``dequantize_low_bit``), the one definition of those formats. The Triton kernels must match it bit for bit.
* :func:`make_case` builds the op's arguments for every storage combination (COMBOS) with non-trivial states.
* :func:`check_same_stream` and :func:`check_graph_capture` are the CUDA-only checks (a non-default stream; CUDA graph
  capture and replay of FusedAdam.step with capturable=True); :func:`check_plain_step_norm` checks a plain step's
  last_grad_norm eagerly anywhere and from a captured graph on CUDA.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from ort_optim._spec import FP8_FORMATS, LOW_BIT_FORMATS, beta_power, low_bit_format
from ort_optim.backends.reference import round_bf16_stochastic
from ort_optim.formats import (dequantize_fp8, dequantize_low_bit, encode_state, is_relative, quantize_fp8,
                               quantize_low_bit, state_root)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
U8, U4 = torch.uint8, torch.uint4  # the exp_avg_dtype / exp_avg_sq_dtype options of the 8-bit and 4-bit formats
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2  # the fp8 formats


# ---- an exact numpy model of ops/README.md ------------------------------------------------------------------------

def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """Values of a float tensor as float32 (float64 for float64), exactly."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == BF16:
        bits = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        return (bits << 16).view(np.float32)
    if t.dtype == F64:
        return t.numpy().copy()
    return t.float().numpy().copy()


def _bf16_round(x: np.ndarray) -> torch.Tensor:
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[(b & 0x7FFFFFFF) > 0x7F800000] = 0x7FC0
    return torch.from_numpy(rounded.view(np.int16).copy()).view(BF16)


def _from_numpy(x: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype == BF16:
        out = _bf16_round(x)
    elif dtype == F16:
        out = torch.from_numpy(x.astype(np.float32).astype(np.float16))
    elif dtype == F64:
        out = torch.from_numpy(x.astype(np.float64))
    else:
        out = torch.from_numpy(x.astype(np.float32))
    return out.reshape(shape)


def ref_scale(amax: float) -> float:
    """The CPU kernel's fp16_block_scale, with Python's frexp/ldexp."""
    if not (amax > 0.0) or not math.isfinite(amax):
        return 1.0
    f, e = math.frexp(amax)
    k = 16 - e if f == 0.5 else 15 - e
    scaled = np.float32(math.ldexp(amax, min(max(k, -126), 126)))
    if float(np.float16(scaled)) <= 16384.0:
        k += 1
    return math.ldexp(1.0, min(max(k, -126), 126))


def ref_quantize(x: np.ndarray, no_zero: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float32 values -> (float16 codes, float32 scales), as the CPU kernel stores an fp16 state: the scale of each
    block's largest finite magnitude; no_zero (a second moment's sqrt(v)): a positive value that would round to 0
    takes the smallest subnormal, 2**-24."""
    n = x.size
    codes = np.empty(n, dtype=np.float16)
    scales = np.empty((n + 1023) // 1024, dtype=np.float32)
    for b in range(scales.size):
        blk = x[b * 1024:(b + 1) * 1024]
        finite = np.abs(blk)[np.isfinite(blk)]
        s = ref_scale(float(finite.max())) if finite.size else 1.0
        scales[b] = s
        block_codes = (blk * np.float32(s)).astype(np.float16)
        if no_zero:
            block_codes = np.where((block_codes == 0) & (blk > 0), np.float16(2.0**-24), block_codes)
        codes[b * 1024:(b + 1) * 1024] = block_codes
    return codes, scales


def ref_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    inv = (np.float32(1.0) / scales.astype(np.float32)).astype(np.float32)
    return codes.astype(np.float32) * np.repeat(inv, 1024)[: codes.size]


def canonical_nan(scales: torch.Tensor) -> torch.Tensor:
    """bfloat16 NaN scales as 0x7FC0, the quiet NaN that the kernels write (as c10::BFloat16(float) does); torch's
    vectorised float32 -> bfloat16 conversion, which the reference quantiser's .to(bfloat16) uses, gives 0xFFFF."""
    if scales.dtype != BF16:
        return scales
    return torch.where(scales.isnan(), torch.tensor(0x7FC0, dtype=torch.int16).view(BF16), scales)


def reference_step(args: list, hp: dict) -> None:
    """The op, in numpy, in place on CPU copies of its arguments (same list layout as adam_step_'s)."""
    params, grads, ms, vs, vmaxs, masters, mss, vss, vmaxss, steps = args
    if hp.get("found_inf") is not None and float(hp["found_inf"]) != 0.0:
        return
    lr = float(hp["lr_tensor"]) if hp.get("lr_tensor") is not None else hp["lr"]
    beta1, beta2, eps, wd, mode = hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], hp["adam_w_mode"]
    grad_mul = (float(hp["inv_grad_scale"]) if hp.get("inv_grad_scale") is not None else 1.0) * \
        (-1.0 if hp["maximize"] else 1.0)
    amsgrad = len(vmaxs) > 0

    def read_state(t, scales, second, shape, root=None):
        if scales is not None and t.dtype in FP8_FORMATS:
            return dequantize_fp8(t.cpu(), scales.cpu(), FP8_FORMATS[t.dtype], second, shape).reshape(-1).numpy()
        if scales is not None and t.dtype == torch.uint8:
            return dequantize_low_bit(t.cpu(), scales.cpu(), low_bit_format(scales.dtype), second,
                                      shape, root).reshape(-1).numpy()
        if scales is not None:
            u = ref_dequantize(t.cpu().reshape(-1).numpy(), scales.cpu().numpy())
            return u * u if second else u
        return _to_numpy(t)

    def root(i, shape):  # a 4-bit exp_avg's: the decoded sqrt(v) of exp_avg_sq as stored now (EXP_AVG_RELATIVE)
        if len(mss) and is_relative(ms[i], mss[i]):
            return state_root(vs[i].cpu(), vss[i].cpu(), shape)
        return None

    def write_state(values, t, scales, second, step, m=None, root=None):
        if scales is not None and t.dtype in FP8_FORMATS:  # (m: the step's exp_avg, whose hash rounds both moments)
            codes, new_scales = quantize_fp8(torch.from_numpy(values.astype(np.float32)), FP8_FORMATS[t.dtype],
                                             second, step, None if m is None else torch.from_numpy(m.astype(np.float32)))
            t.copy_(codes.view(t.shape))
            scales.copy_(canonical_nan(new_scales))
        elif scales is not None and t.dtype == torch.uint8:  # (m: the step's exp_avg, as for fp8)
            codes, new_scales = quantize_low_bit(torch.from_numpy(values.astype(np.float32)),
                                                 low_bit_format(scales.dtype), second, step, root,
                                                 None if m is None else torch.from_numpy(m.astype(np.float32)))
            t.copy_(codes.view(t.shape))
            scales.copy_(canonical_nan(new_scales))
        elif scales is not None:
            codes, new_scales = ref_quantize(np.sqrt(values) if second else values, no_zero=second)
            t.copy_(torch.from_numpy(codes).reshape(t.shape))
            scales.copy_(torch.from_numpy(new_scales))
        else:
            t.copy_(_from_numpy(values, t.dtype, t.shape))

    for i, param in enumerate(params):
        F = np.float64 if param.dtype == F64 else np.float32
        t = float(steps[i]) + 1.0
        bc1 = 1.0 - beta_power(beta1, t) if hp["bias_correction"] else 1.0
        bc2 = 1.0 - beta_power(beta2, t) if hp["bias_correction"] else 1.0
        step_size = lr / bc1 if mode == 2 else lr * math.sqrt(bc2) / bc1
        master = masters[i] if len(masters) else None
        g = _to_numpy(grads[i]).astype(F) * F(grad_mul)
        p = _to_numpy(master if master is not None else param).astype(F)
        m = read_state(ms[i], mss[i] if len(mss) else None, False, param.shape, root(i, param.shape)).astype(F)
        v = read_state(vs[i], vss[i] if len(vss) else None, True, param.shape).astype(F)
        with np.errstate(all="ignore"):  # inf and NaN are legitimate IEEE results here
            if mode == 0:
                g = g + F(wd) * p
            if mode == 2:
                p = p * F(1.0 - lr * wd)
            w = F(1.0 - beta1)  # torch's lerp: m + w*(g - m) for w < 0.5, else g + (w - 1)*(g - m)
            m = m + w * (g - m) if w < 0.5 else g + (w - F(1.0)) * (g - m)
            v = v * F(beta2) + F(1.0 - beta2) * g * g
            v_used = v
            if amsgrad:
                vmax = read_state(vmaxs[i], vmaxss[i] if len(vmaxss) else None, True, param.shape).astype(F)
                vmax = np.where((vmax < v) | np.isnan(v), v, vmax).astype(F)  # (torch.maximum: NaN in either stays)
                v_used = vmax
            if mode == 2:
                p = p - F(step_size) * (m / (np.sqrt(v_used) / F(math.sqrt(bc2)) + F(eps)))
            else:
                p = p - F(step_size) * (m / (np.sqrt(v_used) + F(eps)))
                if mode == 1:
                    p = p - F(lr * wd) * p
        write_state(v, vs[i], vss[i] if len(vss) else None, True, int(t), m)  # (exp_avg_sq first: EXP_AVG_RELATIVE)
        if amsgrad:
            write_state(vmax, vmaxs[i], vmaxss[i] if len(vmaxss) else None, True, int(t), m)
        write_state(m, ms[i], mss[i] if len(mss) else None, False, int(t), root=root(i, param.shape))
        if master is not None:
            master.copy_(torch.from_numpy(p.astype(np.float32)).reshape(master.shape))
        if hp.get("rounding_keys") is not None:  # stochastic rounding: the spec's hash, from the reference
            param.copy_(round_bf16_stochastic(torch.from_numpy(p.astype(np.float32)), int(hp["rounding_keys"][i]),
                                              int(t)).reshape(param.shape))
        else:
            param.copy_(_from_numpy(p, param.dtype, param.shape))
    steps += 1.0


# ---- cases -------------------------------------------------------------------------------------------------------

# (param dtype, exp_avg dtype, exp_avg_sq dtype, master weights): every storage combination the op accepts, and
# the ones FusedAdam creates.
COMBOS = {
    "fp32": (F32, F32, F32, False),
    "fp32-bf16states": (F32, BF16, BF16, False),
    "fp32-fp16states": (F32, F16, F16, False),
    "fp16-master": (F16, F32, F32, True),
    "bf16-master-fp16m-bf16v": (BF16, F16, BF16, True),
    "bf16": (BF16, BF16, BF16, False),
    "fp16-master-fp16states": (F16, F16, F16, True),
    "fp64": (F64, F64, F64, False),
    # 8-bit and 4-bit states (uint8 codes with float32 / bfloat16 block scales), alone and mixed with the others
    "fp32-q8": (F32, U8, U8, False),
    "fp32-q4": (F32, U4, U4, False),
    "bf16-master-q8m-q4v": (BF16, U8, U4, True),
    "bf16-q4": (BF16, U4, U4, False),  # (a 4-bit exp_avg is coded relative to a 4-bit exp_avg_sq: both 4-bit)
    "fp16-master-q8m-q4v": (F16, U8, U4, True),
    # fp8 states (float8 codes with float32 power-of-two block scales), alone and mixed with the others
    "fp32-fp8": (F32, E4M3, E4M3, False),
    "fp32-e5m2": (F32, E5M2, E5M2, False),
    "bf16-master-fp8m-e5m2v": (BF16, E4M3, E5M2, True),
    "bf16-e5m2m-fp8v": (BF16, E5M2, E4M3, False),
    "fp16-master-fp8m-q8v": (F16, E4M3, U8, True),
}
QUANTISED = {**LOW_BIT_FORMATS, **FP8_FORMATS}
LOW_BIT_COMBOS = [name for name, (_, m, v, _) in COMBOS.items() if m in QUANTISED or v in QUANTISED]
FP8_COMBOS = [name for name, (_, m, v, _) in COMBOS.items() if m in FP8_FORMATS or v in FP8_FORMATS]
SHAPES = [(2500,), (), (0,), (32, 32), (7,)]  # several blocks with a partial one, 0-dim, empty, exact block, tiny


def make_case(combo: str, amsgrad: bool, seed: int, shapes=SHAPES, grad_dtype=None, scaled=True) -> list:
    """Arguments of adam_step_ (CPU tensors), with non-trivial states, as a list in the op's order."""
    pdt, mdt, vdt, master = COMBOS[combo]
    gen = torch.Generator().manual_seed(seed)

    def rand(shape, scale=1.0):
        return torch.randn(shape, generator=gen, dtype=F64) * scale

    params, grads, ms, vs, vmaxs, masters, mss, vss, vmaxss = ([] for _ in range(9))
    for j, shape in enumerate(shapes):
        p = rand(shape)
        params.append(p.to(pdt))
        if master:
            masters.append(p.float())
        grads.append(rand(shape, 10.0 ** (j - 2)).to(grad_dtype or pdt))
        m = rand(shape, 1e-2 * 10.0 ** (-j))
        v = rand(shape, 1e-2 * 10.0 ** (-j)).abs() ** 2
        if p.numel() > 1500:
            m.view(-1)[1024:2048] = 0.0  # an all-zero block: scale 1
        # exp_avg_sq first: a 4-bit exp_avg is coded relative to it (EXP_AVG_RELATIVE)
        for value, dtype, out, outs, second in ((v, vdt, vs, vss, True), (m, mdt, ms, mss, False)) + \
                (((v * 1.5, vdt, vmaxs, vmaxss, True),) if amsgrad else ()):
            if dtype in QUANTISED:
                pair = (state_root(vs[-1], vss[-1], shape) if not second and dtype == U4 else None)
                codes, scales = encode_state(value.float(), dtype, second, pair)
                out.append(codes)
                outs.append(scales)
            elif dtype == F16 and scaled:
                flat = value.float().reshape(-1).numpy()
                codes, scales = ref_quantize(np.sqrt(flat) if second else flat, no_zero=second)
                out.append(torch.from_numpy(codes).reshape(shape))
                outs.append(torch.from_numpy(scales))
            else:
                out.append(value.to(dtype))
    steps = torch.tensor([float(3 * j * j) for j in range(len(shapes))], dtype=F64)
    return [params, grads, ms, vs, vmaxs, masters, mss, vss, vmaxss, steps]


def clone_case(args, device=torch.device("cpu")) -> list:
    return [[t.detach().to(device, copy=True) for t in x] if isinstance(x, list)
            else x.detach().to(device, copy=True) for x in args]


def hyper(mode: int, **overrides) -> dict:
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, adam_w_mode=mode, bias_correction=True,
              maximize=False, lr_tensor=None, inv_grad_scale=None, found_inf=None, rounding_keys=None)
    hp.update(overrides)
    return hp


def on(device, hp: dict) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in hp.items()}


def run_triton(args, hp, device):
    from ort_optim.backends import triton as triton_backend

    triton_backend.adam_step_(*args, **on(device, hp))


NAMES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params", "exp_avg_scales",
         "exp_avg_sq_scales", "max_exp_avg_sq_scales")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (so -0.0 != 0.0, and bf16/fp16/fp8 codes compare exactly), with every NaN of a floating
    dtype written as one canonical NaN: a NaN's sign and payload are not part of the semantics (x86 propagates an
    operand's NaN and makes 0 * inf the negative 0xffc00000; NVIDIA GPUs make the positive 0x7fffffff)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if not t.numel():
        return torch.zeros(0, dtype=torch.uint8)
    if t.is_floating_point():
        nan = t.float().isnan()
        if bool(nan.any()):
            bits = t.view(_BITS[t.element_size()])
            canonical = torch.full((1,), float("nan"), dtype=t.dtype).view(bits.dtype)
            t = torch.where(nan, canonical, bits)
    return t.view(torch.uint8)


def first_differences(a: torch.Tensor, b: torch.Tensor, count: int = 8) -> str:
    """The first `count` elements where two same-shaped tensors differ in their bytes: index, value, reference."""
    if a.shape != b.shape or a.dtype != b.dtype or a.numel() == 0:
        return ""
    a, b = a.reshape(-1), b.reshape(-1)
    differs = (raw(a).view(-1, a.element_size()) != raw(b).view(-1, b.element_size())).any(dim=1)
    index = differs.nonzero().flatten()[:count].tolist()
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return "; first at " + ", ".join(f"[{j}] {a[j].item()!r} vs {b[j].item()!r}" for j in index)


def assert_bitwise(triton_args, ref_args, what=""):
    for name, a_list, b_list in zip(NAMES, triton_args[:9], ref_args[:9]):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            a, b = a.detach().cpu(), b.detach().cpu()
            ok = a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))
            if not ok:
                diff = (a.double() - b.double()).abs().nan_to_num(1e300)
                bad = int((raw(a) != raw(b)).sum()) if a.shape == b.shape else -1
                raise AssertionError(f"{what}: {name}[{i}] differs from the reference ({bad} bytes; max abs diff "
                                     f"{float(diff.max()) if diff.numel() else 0.0}){first_differences(a, b)}")
    assert torch.equal(triton_args[9].cpu(), ref_args[9].cpu()), f"{what}: steps {triton_args[9]} vs {ref_args[9]}"


# ---- CUDA-only checks --------------------------------------------------------------------------------------------

def check_same_stream(device: torch.device) -> None:
    """The kernels run on the caller's current stream: gradients written on a non-default stream (after a long GPU
    sleep there) must be the ones the step reads. A launch on the default stream would read the old gradients."""
    from ort_optim.backends import triton as triton_backend

    base = make_case("fp32-fp16states", True, seed=31, shapes=[(1 << 18,), (3000,), ()])
    args, ref = clone_case(base, device), clone_case(base)
    gen = torch.Generator().manual_seed(32)
    new_grads = [torch.randn(p.shape, generator=gen) for p in base[0]]
    ref[1] = [g.clone() for g in new_grads]
    hp = hyper(2, found_inf=torch.zeros(1), inv_grad_scale=torch.tensor([0.5]))
    reference_step(ref, hp)
    staged = [g.to(device) for g in new_grads]
    dev_hp = on(device, hp)
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time before the gradients are written
        for g, s in zip(args[1], staged):
            g.copy_(s)
        triton_backend.adam_step_(*args, **dev_hp)
    torch.cuda.synchronize(device)
    assert_bitwise(args, ref, "step on a non-default stream")


def check_graph_capture(device: torch.device, steps: int = 6, clip: bool = False, stochastic: bool = False) -> None:
    """FusedAdam(capturable=True).step() captured once in a CUDA graph and replayed with new gradients, a changing lr
    (a device tensor updated in place) and a skipped step (found_inf) equals the same steps run eagerly, bit for
    bit, fp16 moments and per-parameter step counts included. clip=True adds max_grad_norm and a grad_scale tensor,
    so grad_stats and the unscale/clip arithmetic are in the graph too; stochastic=True steps bfloat16 params
    without masters, rounded stochastically (the rounding keys live on the device: no host copy in the graph)."""
    from ort_optim import FusedAdam

    shapes = [(1000, 1030), (4096,), (), (33, 17)]
    dtype = torch.bfloat16 if stochastic else torch.float32
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    all_grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    lrs = [1e-3, 2e-3, 5e-4, 1e-3, 4e-3, 3e-3][:steps]
    skips = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0][:steps]

    def make():
        params = [torch.nn.Parameter(p.clone().to(device)) for p in init]
        lr = torch.tensor(lrs[0], device=device)
        opt = FusedAdam(params, lr=lr, adam_w_mode=2, weight_decay=0.01, amsgrad=True, exp_avg_dtype=F16,
                        exp_avg_sq_dtype=F16, capturable=True, max_grad_norm=1.0 if clip else None,
                        stochastic_rounding=stochastic)
        return params, lr, opt

    scale = torch.tensor(8.0, device=device) if clip else None

    params_e, lr_e, opt_e = make()
    for i in range(steps):
        for p, g in zip(params_e, all_grads[i]):
            p.grad = g.to(device)
        lr_e.fill_(lrs[i])
        opt_e.step(found_inf=torch.tensor([skips[i]], device=device), grad_scale=scale)

    params_g, lr_g, opt_g = make()
    static_grads = [torch.zeros(s, device=device, dtype=dtype) for s in shapes]
    found = torch.zeros(1, device=device)
    for p, g in zip(params_g, static_grads):
        p.grad = g

    def load(i):
        for g, src in zip(static_grads, all_grads[i]):
            g.copy_(src)
        lr_g.fill_(lrs[i])
        found.fill_(skips[i])

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # step 0 eagerly: creates the state and compiles the kernels
        load(0)
        opt_g.step(found_inf=found, grad_scale=scale)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_g.step(found_inf=found, grad_scale=scale)
    for i in range(1, steps):
        load(i)
        graph.replay()
    torch.cuda.synchronize(device)

    for j, (pe, pg) in enumerate(zip(params_e, params_g)):
        assert torch.equal(raw(pe), raw(pg)), f"param {j}: graph replay differs from eager"
        se, sg = opt_e.state[pe], opt_g.state[pg]
        assert se.keys() == sg.keys()
        for key in se:
            assert torch.equal(raw(se[key]), raw(sg[key])), f"param {j} state {key}: graph replay differs"
        assert float(sg["step"]) == steps - sum(skips), f"param {j}: step count {float(sg['step'])}"


def check_mixed_devices(device: torch.device, steps: int = 4) -> None:
    """One FusedAdam over params on the CPU and on the GPU, with a grad_scale and a found_inf tensor on the GPU and
    max_grad_norm, equals the same steps over CPU copies of every param (rtol 1e-6: the two sum the norm's squares in
    other orders), skips included. The multiplier, skip flag and scale computed on the GPU reach the CPU buckets by
    copies that wait for them (a non-blocking copy to the host is read by the CPU kernels before it lands)."""
    from ort_optim import FusedAdam

    shapes = [(1000, 1030), (4096,), (33, 17), (777,)]
    gen = torch.Generator().manual_seed(11)
    init = [torch.randn(s, generator=gen) for s in shapes]
    all_grads = [[torch.randn(s, generator=gen) * 64 for s in shapes] for _ in range(steps)]
    skips = [0.0, 1.0, 0.0, 0.0][:steps]

    def run(devices, flags_device):
        params = [torch.nn.Parameter(p.clone().to(d)) for p, d in zip(init, devices)]
        opt = FusedAdam(params, lr=1e-3, max_grad_norm=1.0)
        scale = torch.tensor(64.0, device=flags_device)
        for i in range(steps):
            for p, g in zip(params, all_grads[i]):
                p.grad = g.to(p.device)
            opt.step(grad_scale=scale, found_inf=torch.tensor([skips[i]], device=flags_device))
        return [p.detach().cpu() for p in params] + [opt.state[p][k].cpu() for p in params
                                                     for k in ("exp_avg", "exp_avg_sq", "step")]

    mixed = run([device, "cpu", device, "cpu"], device)
    on_cpu = run(["cpu"] * len(shapes), "cpu")
    for i, (a, b) in enumerate(zip(mixed, on_cpu)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=lambda m, i=i: f"tensor {i}: {m}")


def check_fp16_optimizer(device: torch.device, steps: int = 5) -> None:
    """FP16_Optimizer(FusedAdam(master_weights=True)) over fp16 params, the Triton kernels on device against the
    native CPU op (the pure-PyTorch one where it is not loaded): params, fp32 masters and the loss-scale history bit
    for bit over steps with an overflow (skipped, scale halved) among them. (Not with max_grad_norm: the two sum the
    norm's squares in other orders, so the clip coefficient can differ in its last bit.) On CUDA, step() after the
    first makes no host sync (torch.cuda.set_sync_debug_mode("error") raises on one)."""
    from ort_optim import FP16_Optimizer, FusedAdam, backends

    shapes = [(1000, 1030), (4096,), (33, 17)] if device.type == "cuda" else [(100, 13), (257,), (3, 5)]
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen).half() for s in shapes]
    slopes = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    slopes[2][1][7] = 1e6  # (times the loss scale: not finite in float16, the step is skipped)

    def run(backend: str, on: torch.device):
        previous = os.environ.get("ORT_OPTIM_BACKEND")
        os.environ["ORT_OPTIM_BACKEND"] = backend
        try:
            params = [torch.nn.Parameter(p.to(on, copy=True)) for p in init]
            opt = FP16_Optimizer(FusedAdam(params, lr=1e-3, master_weights=True), init_scale=2.0 ** 10)
            history = []
            for i in range(steps):
                opt.zero_grad(set_to_none=True)
                opt.backward(sum((p.float() * g.to(on)).sum() for p, g in zip(params, slopes[i])))
                if on.type == "cuda" and i > 0:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    opt.step()
                finally:
                    if on.type == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
                history.append(float(opt.loss_scale))
            masters = [opt.optimizer.state[p]["master_param"].cpu() for p in params]
            return [p.detach().cpu() for p in params] + masters, history
        finally:
            if previous is None:
                os.environ.pop("ORT_OPTIM_BACKEND")
            else:
                os.environ["ORT_OPTIM_BACKEND"] = previous

    tensors, history = run("triton", device)
    cpu_tensors, cpu_history = run("native" if backends.native_available() else "torch", torch.device("cpu"))
    assert history == cpu_history and history[2] == history[1] / 2, (history, cpu_history)
    for i, (a, b) in enumerate(zip(tensors, cpu_tensors)):
        assert torch.equal(a, b), f"FP16_Optimizer tensor {i} differs from the CPU's"


def total_norm(grads) -> float:
    """The total 2-norm of these gradients, summed in float64. (clip_grad_norm_ on float32 CPU copies is no oracle
    at rtol 1e-6: on a million randn elements it is 1e-5 below the float64 sum, torch 2.13.)"""
    return math.sqrt(sum(float((g.detach().double() ** 2).sum()) for g in grads))


def check_plain_step_norm(device: torch.device, shapes=((1000, 1030), (4096,), (), (33, 17)), steps: int = 3) -> None:
    """FusedAdam.last_grad_norm after plain steps (no grad_scale, max_grad_norm or found_inf) on the Triton path is
    the float64 total norm (rtol 1e-6), as a 0-dim float32 tensor on the params' device: fp32 and bf16 params
    (with master weights) in two groups, 8-bit exp_avg. On CUDA also from a CUDA graph: step() with
    capturable=True captured once, replayed with new gradients; the captured norm tensor follows each replay."""
    from ort_optim import FusedAdam

    gen = torch.Generator().manual_seed(41)
    dtypes = [F32, BF16, F32, BF16][:len(shapes)]
    init = [torch.randn(s, generator=gen).to(dt) for s, dt in zip(shapes, dtypes)]
    all_grads = [[torch.randn(s, generator=gen).to(dt) for s, dt in zip(shapes, dtypes)] for _ in range(steps)]

    def make(capturable):
        params = [torch.nn.Parameter(p.clone().to(device)) for p in init]
        lr = torch.tensor(1e-3, device=device) if capturable else 1e-3
        opt = FusedAdam([{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}], lr=lr,
                        master_weights=True, adam_w_mode=2, weight_decay=0.01, exp_avg_dtype=U8,
                        capturable=capturable)
        return params, opt

    def expect(opt, grads, what):
        norm = opt.last_grad_norm
        assert norm is not None, f"{what}: last_grad_norm is None"
        assert norm.shape == () and norm.dtype == F32 and norm.device.type == device.type, (what, norm)
        assert opt.last_found_inf is None, what
        expected = total_norm(grads)
        assert math.isclose(float(norm), float(expected), rel_tol=1e-6), (what, float(norm), float(expected))

    params, opt = make(False)
    for i in range(steps):
        for p, g in zip(params, all_grads[i]):
            p.grad = g.to(device)
        opt.step()
        expect(opt, all_grads[i], f"eager step {i}")
    if device.type != "cuda":
        return

    params, opt = make(True)
    static_grads = [g.to(device) for g in all_grads[0]]
    for p, g in zip(params, static_grads):
        p.grad = g
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # eagerly once: creates the state, compiles the kernels
        opt.step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    captured = opt.last_grad_norm
    for i in range(1, steps):
        for g, src in zip(static_grads, all_grads[i]):
            g.copy_(src)
        graph.replay()
        torch.cuda.synchronize(device)
        assert opt.last_grad_norm is captured
        expect(opt, all_grads[i], f"graph replay {i}")
