"""The Triton kernels (ort_optim/backends/triton.py, triton_kernels.py) against the CPU kernel, the fallback and an exact
numpy model of ops/README.md.

Without a GPU (this project's machines) the kernels run in Triton's interpreter on CPU tensors: this module defines
them with TRITON_INTERPRET=1 set only while ort_optim.backends.triton_kernels is imported, then restores the environment, so
the other test files of the same pytest run are untouched. On a machine with CUDA (tools/gpu_check.py runs this file
there) the same tests run the compiled kernels on CUDA tensors instead.

What is compared:
* bit for bit, with :func:`reference_step` (a numpy float32/float64 model of the README's math in the CPU kernel's
  order of operations, with no fused multiply-adds): params, masters, moments, fp16 codes and block scales, steps;
* with the native CPU op and the pure-PyTorch fallback, bit for bit too (the CPU kernel is built without multiply-add
  contraction, and every backend forms beta**t by the same binary exponentiation);
* with a float64 evaluation of the same step, loosely.

Budget: the interpreter costs milliseconds per program, so tensors are small (a few blocks of 1024).
"""

from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/triton_cases.py

USE_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEVICE = torch.device("cuda") if USE_CUDA else torch.device("cpu")
# The interpreter must be chosen before triton itself is imported (triton's own library functions such as tl.zeros
# and tl.sum are @triton.jit functions, decorated at import). When this process imported triton earlier without it,
# the tests run in a subprocess instead (test_in_a_subprocess below).
IN_PROCESS = USE_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not USE_CUDA and IN_PROCESS:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton")
        importlib.import_module("ort_optim.backends.triton_kernels")
        try:  # triton >= 3.5 imports gluon lazily at the first launch, and gluon checks the mode at import
            importlib.import_module("triton.experimental.gluon")
        except ImportError:
            pass
    finally:
        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved
else:
    triton = pytest.importorskip("triton")

from ort_optim import _spec, backends  # noqa: E402
from ort_optim.backends import reference as reference_backend, triton as triton_backend  # noqa: E402

_kernels_module = sys.modules.get("ort_optim.backends.triton_kernels")
if not USE_CUDA and _kernels_module is not None and not _kernels_module.INTERPRET:
    IN_PROCESS = False  # compiled kernels and no GPU: only the subprocess can test them

BROKEN = triton_backend.broken_interpreter_reason() if not USE_CUDA else None
needs_working_interpreter = pytest.mark.skipif(
    BROKEN is not None or not IN_PROCESS,
    reason=f"broken interpreter: {BROKEN}" if BROKEN else "triton was imported before this module could select its "
    "interpreter: test_in_a_subprocess runs these tests")


@pytest.fixture(autouse=True, scope="module")
def _interpreter_mode():
    """TRITON_INTERPRET=1 while this module's tests run (newer triton also reads it at launch), then restored."""
    if USE_CUDA or not IN_PROCESS:
        yield
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = saved


def test_in_a_subprocess():
    """When triton was imported (without TRITON_INTERPRET) before this module, the in-process tests skip and this
    runs the module in a fresh interpreter-mode process."""
    if IN_PROCESS:
        pytest.skip("the tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                            capture_output=True, text=True, timeout=1800, cwd=str(ROOT))
    assert result.returncode == 0, (result.stdout + result.stderr)[-8000:]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def test_interpreter_is_not_the_broken_numpy2_combination():
    """triton 3.0/3.1 + numpy 2 silently computes garbage in the interpreter: this must FAIL, not skip."""
    if USE_CUDA:
        pytest.skip("compiled kernels on CUDA: the interpreter is not used")
    assert BROKEN is None, BROKEN


@needs_working_interpreter
def test_interpreter_canary():
    """A tiny kernel through the same path: catches an interpreter that returns wrong numbers."""
    x = torch.arange(3000, dtype=torch.float32, device=DEVICE) / 7.0
    out = triton_backend.grad_stats([x])
    expected = float((x.double() ** 2).sum())
    assert abs(float(out[0]) - expected) <= 1e-6 * expected and float(out[1]) == 0.0


def test_block_sizes_agree():
    cpu_source = (ROOT / "ops" / "adam_kernel.h").read_text()
    assert re.search(r"constexpr int64_t kBlock = 1024;", cpu_source)
    assert triton_backend.BLOCK == _spec.QUANT_BLOCK == 1024
    assert triton_backend.kernels().BLOCK == 1024


def test_import_ort_optim_never_imports_triton():
    code = (
        "import sys, ort_optim, ort_optim.backends.triton\n"
        "from ort_optim import backends\n"
        "backends.native_available()\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


from cases import MALFORMED_OP_CALLS, op_arguments  # noqa: E402
from triton_cases import (  # noqa: E402
    COMBOS, LOW_BIT_COMBOS, NAMES, U4, U8, assert_bitwise, check_graph_capture,
    check_plain_step_norm, check_same_stream, clone_case, hyper, make_case, on, raw, reference_step, total_norm,
)


def run_triton(args, hp):
    triton_backend.adam_step_(*args, **on(DEVICE, hp))


# ---- the core comparison -----------------------------------------------------------------------------------------

# Every combination x mode x amsgrad for the float formats; for the low-bit ones (slower in the interpreter: a lookup
# and a binary search per element) three of the six, each mode and amsgrad once.
CORE_CASES = [(combo, mode, amsgrad) for combo in COMBOS for mode in (0, 1, 2) for amsgrad in (False, True)
              if combo not in LOW_BIT_COMBOS or (mode, amsgrad) in ((0, False), (1, True), (2, True))]


@needs_working_interpreter
@pytest.mark.parametrize("combo,mode,amsgrad", CORE_CASES)
def test_adam_step_matches_reference_native_and_fallback(combo, mode, amsgrad):
    base = make_case(combo, amsgrad, seed=100 * mode + 10 * amsgrad + len(combo))
    tri, ref, nat, fal = clone_case(base, DEVICE), clone_case(base), clone_case(base), clone_case(base)
    hp = hyper(mode, weight_decay=0.05 if mode != 1 else 0.01)
    for step in range(2):
        run_triton(tri, hp)
        reference_step(ref, hp)
        assert_bitwise(tri, ref, f"{combo} mode {mode} amsgrad {amsgrad} step {step}")
        reference_backend.adam_step_(*fal, **hp)
        if backends.native_available():
            torch.ops.ort_optim.adam_step_(*nat, **hp)
    assert_bitwise(tri, fal, f"{combo} vs fallback")
    if backends.native_available():
        assert_bitwise(tri, nat, f"{combo} vs native")


@needs_working_interpreter
@pytest.mark.parametrize("options", [
    dict(maximize=True),
    dict(bias_correction=False),
    dict(lr_tensor=torch.tensor([3e-3])),
    dict(lr_tensor=torch.tensor(2e-3, dtype=F64)),
    dict(inv_grad_scale=torch.tensor([1.0 / 1024])),
    dict(inv_grad_scale=torch.tensor([0.5]), maximize=True, lr_tensor=torch.tensor([1e-3])),
    dict(found_inf=torch.tensor([0.0])),
    dict(eps=0.0, weight_decay=0.0),
    dict(beta1=0.0, beta2=0.0),
    pytest.param(dict(beta1=0.5), id="beta1-0.5"),  # the lerp's second form from a weight of 0.5 on
    pytest.param(dict(beta1=0.3), id="beta1-0.3"),
], ids=lambda o: "-".join(f"{k}" for k in o))
@pytest.mark.parametrize("mode", [0, 2])
def test_options(options, mode):
    base = make_case("bf16-master-fp16m-bf16v", True, seed=7, shapes=[(1100,), (3,)])
    tri, ref, nat = clone_case(base, DEVICE), clone_case(base), clone_case(base)
    hp = hyper(mode, **options)
    run_triton(tri, hp)
    reference_step(ref, hp)
    assert_bitwise(tri, ref, str(options))
    if backends.native_available():
        torch.ops.ort_optim.adam_step_(*nat, **hp)
        assert_bitwise(tri, nat, f"{options} vs native")


@needs_working_interpreter
@pytest.mark.parametrize("combo,mode,amsgrad", [("fp32", 2, False), ("bf16-master-fp16m-bf16v", 0, True),
                                                ("fp32-q8", 1, False)])
def test_betas_tensor_gives_the_float_betas_results_bit_for_bit(combo, mode, amsgrad):
    """betas_tensor (float64 [beta1, beta2], read in the kernel) replaces the float betas, bias corrections included:
    the same bits as the float betas, over steps whose beta1 changes at every step (as OneCycleLR's momentum)."""
    base = make_case(combo, amsgrad, seed=11, shapes=[(1100,), (3,)])
    tensor, floats, ref = clone_case(base, DEVICE), clone_case(base, DEVICE), clone_case(base)
    for step, beta1 in enumerate((0.95, 0.9375, 0.85, 0.9)):
        hp = hyper(mode, beta1=beta1, beta2=0.99)
        run_triton(floats, hp)
        run_triton(tensor, dict(hp, beta1=0.0, beta2=0.0, betas_tensor=torch.tensor([beta1, 0.99], dtype=F64)))
        reference_step(ref, hp)
        assert_bitwise(tensor, floats, f"{combo} step {step}: betas_tensor vs float betas")
        assert_bitwise(tensor, ref, f"{combo} step {step}: betas_tensor vs the reference")


@needs_working_interpreter
@pytest.mark.parametrize("combo", ["bf16", "bf16-q4"])
@pytest.mark.parametrize("mode", [1, 2])
def test_stochastic_rounding_bitwise(combo, mode):
    """bfloat16 params without masters rounded stochastically (rounding_keys): the spec's counter-based hash of
    (key, step, element), so the same bits as the reference and the CPU kernel, step after step (each param at its
    own step count); and different keys give different roundings."""
    from ort_optim._spec import rounding_key

    base = make_case(combo, mode == 2, seed=17, shapes=[(2500,), (7,), ()])
    keys = torch.tensor([rounding_key(1234, ordinal) for ordinal in range(3)], dtype=torch.int64)
    hp = hyper(mode, rounding_keys=keys, lr=1e-3)
    tri, ref, nat = clone_case(base, DEVICE), clone_case(base), clone_case(base)
    for step in range(2):
        run_triton(tri, hp)
        reference_step(ref, hp)
        assert_bitwise(tri, ref, f"{combo} mode {mode} stochastic rounding, step {step}")
        if backends.native_available():
            torch.ops.ort_optim.adam_step_(*nat, **hp)
            assert torch.equal(raw(tri[0][0]), raw(nat[0][0])), "params differ from the CPU kernel's"
    nearest = clone_case(base, DEVICE)
    run_triton(nearest, hyper(mode, lr=1e-3))
    other = clone_case(base, DEVICE)
    run_triton(other, hyper(mode, lr=1e-3, rounding_keys=keys + 1))
    once = clone_case(base, DEVICE)
    run_triton(once, hp)
    assert not torch.equal(raw(once[0][0]), raw(nearest[0][0])), "stochastic rounding rounded like nearest"
    assert not torch.equal(raw(once[0][0]), raw(other[0][0])), "another key gave the same rounding"


@needs_working_interpreter
@pytest.mark.parametrize("flag", [torch.tensor([1.0]), torch.tensor([float("inf")]), torch.tensor([float("nan")]),
                                  torch.tensor(True), torch.tensor([2], dtype=torch.int32)],
                         ids=["one", "inf", "nan", "bool", "int"])
def test_found_inf_skips_everything_including_the_step_count(flag):
    base = make_case("fp16-master-fp16states", True, seed=3, shapes=[(1500,), ()])
    tri = clone_case(base, DEVICE)
    run_triton(tri, hyper(2, found_inf=flag))
    assert_bitwise(tri, base, "skipped step")
    run_triton(tri, hyper(2, found_inf=torch.zeros(1)))
    assert torch.equal(tri[9].cpu(), base[9] + 1)


@needs_working_interpreter
@pytest.mark.parametrize("combo", ["fp32-fp16states", "fp32-q8", "fp32-q4"])
def test_state_codes_and_scales_identical_to_the_cpu_kernel(combo):
    """Where the CPU kernel and the Triton kernel compute the same moment values (a first step from zero moments,
    or beta1 = beta2 = 0, where no multiply-add can be contracted), the fp16, 8-bit and 4-bit codes and block scales
    must be identical: the quantisation rules (fp16: power of two, (16384, 32768], zero blocks, clamping, rounding;
    low-bit: absmax scales, bfloat16 round-up, nearest level with ties up, NaN blocks) are the same."""
    if not backends.native_available():
        pytest.skip("the native CPU library is not available")
    gen = torch.Generator().manual_seed(11)
    shapes = [(3 * 1024 + 5,), (1024,), (2,), ()]
    grads = []
    for j, shape in enumerate(shapes):
        g = torch.randn(shape, generator=gen) * 10.0 ** (3 * j - 4)
        flat = g.view(-1)
        if flat.numel() > 3000:
            flat[:1024] *= 1e-30  # tiny block: the scale clamps at 2**126
            flat[1024:2048] = 0.0  # zero block
            flat[2048] = 1e30  # huge maximum: v overflows fp16's range without the scale
            flat[2049] = float(np.float32(2.0 ** -10))  # exact powers of two: the f == 0.5 branch
        grads.append(g)
    for hp, zero_start in ((hyper(1), True), (hyper(2, beta1=0.0, beta2=0.0), False)):
        base = make_case(combo, True, seed=5, shapes=shapes)
        base[1] = grads
        if zero_start:  # fresh states: zero codes; scales 1 (fp16) or 0 (low-bit)
            for which in (2, 3, 4):
                for t in base[which]:
                    t.zero_()
                for s in base[which + 4]:
                    s.fill_(1.0 if combo == "fp32-fp16states" else 0.0)
        tri, nat = clone_case(base, DEVICE), clone_case(base)
        run_triton(tri, hp)
        torch.ops.ort_optim.adam_step_(*nat, **hp)
        for which in (2, 3, 4):
            for i in range(len(shapes)):
                for lst in (which, which + 4):
                    a, b = tri[lst][i].cpu(), nat[lst][i]
                    assert torch.equal(raw(a), raw(b)), \
                        f"{combo}: {NAMES[lst]}[{i}] differs from the CPU kernel (zero start: {zero_start})"


@needs_working_interpreter
@pytest.mark.parametrize("combo", ["fp32-q8", "fp32-q4"])
def test_low_bit_edge_values_bitwise(combo):
    """The low-bit encoders on hand-picked blocks (one 256-element block per entry; two 128-element ones for 4-bit):
    values halfway between levels (exp_avg rounds stochastically, sqrt(v) to nearest), -0.0, powers of two, subnormal and underflowing values, a v that
    overflows float32 (its block: a negative scale) and a maximum that rounds to inf in bfloat16 (a NaN scale, zero
    codes), inf, NaN,
    all-zero blocks; a partial last block and an odd length (4-bit packing). beta1 = beta2 = 0, so m = g and
    v = g * g reach the encoders unchanged; amsgrad exercises the max_exp_avg_sq encoder too."""
    from ort_optim._spec import LOW_BIT_FORMATS

    fmt = LOW_BIT_FORMATS[COMBOS[combo][1]]
    magnitudes = torch.tensor(fmt.exp_avg_levels[1:], dtype=F32)
    mids = (magnitudes[1:] + magnitudes[:-1]) * 0.5  # float32 midpoints, as the spec's
    specials = [1.0, 0.5, 2.0 ** -20, 3.0, 1e-20, 1e-30, 1e19, 2e19, 3.4e38, float("inf"), 1e-40, -0.0, 0.0]
    blocks = []
    for b, value in enumerate(specials):
        block = torch.zeros(256)
        block[0], block[1] = value, -value * 0.75
        if b % 4 == 0:
            block[2] = float("nan")
        blocks.append(block)
    tie = torch.zeros(256)  # scale 1 (the first entry), then every midpoint, both signs: a == midpoint exactly
    tie[0] = 1.0
    tie[1:1 + len(mids)] = mids[:255]
    tie[128:128 + min(len(mids), 128)] = -mids[:128]
    blocks.append(tie)
    g = torch.cat(blocks + [torch.randn(301) * 1e-3])  # a partial last block, odd length
    base = make_case(combo, True, seed=1, shapes=[tuple(g.shape)])
    base[1] = [g]
    hp = hyper(1, beta1=0.0, beta2=0.0)
    tri, ref = clone_case(base, DEVICE), clone_case(base)
    run_triton(tri, hp)
    reference_step(ref, hp)
    assert_bitwise(tri, ref, f"{combo} edge values")
    # NaN scales exactly for the blocks with an inf or NaN (4-bit m: also a maximum that rounds to inf in bfloat16),
    # except where v = g * g overflows without a NaN: a scale with its sign bit set (that v reads back as inf)
    per_block = 256 // fmt.block
    m_scales, v_scales = tri[6][0].float().cpu(), tri[7][0].float().cpu()
    for b, block in enumerate(blocks[:len(specials)]):
        m_nan = not bool(block.isfinite().all()) or (fmt.bits == 4 and bool(block.abs().max().to(BF16).isinf()))
        v_nan = bool((block * block).isnan().any())
        v_overflow = not v_nan and bool((block * block).isinf().any())
        s = v_scales[b * per_block]
        assert bool(m_scales[b * per_block].isnan()) == m_nan, (b, specials[b], float(m_scales[b * per_block]))
        assert bool(s.isnan()) == v_nan and bool(torch.signbit(s)) == v_overflow, (b, specials[b], float(s))


@needs_working_interpreter
@pytest.mark.parametrize("combo", ["fp32-fp8", "fp32-e5m2"])
def test_fp8_edge_values_bitwise(combo):
    """The fp8 encoders on hand-picked 256-element blocks, against the reference and the CPU kernel bit for bit:
    maxima at and around the largest finite code (448 / 57344 and the ties above them, where the scale's exponent
    steps), powers of two, float32 subnormals, values that underflow the format (and the smallest-code floor of
    sqrt(v)), a block whose scale falls below the smallest exponent (a zero block), -0.0, inf and NaN (NaN scale, zero
    codes), a v that overflows float32 (its block: a negative scale, code 0 for that v); a partial last block. beta1
    = beta2 = 0: m = g and v = g * g reach the encoders unchanged; amsgrad exercises the max_exp_avg_sq encoder
    too."""
    fmt = _spec.FP8_FORMATS[COMBOS[combo][1]]
    top, half = fmt.max_value, 2.0 ** (fmt.emax - fmt.mantissa_bits - 1)
    specials = [1.0, top, top + half, top + half * 1.01, top * 0.999, 2.0 ** -20, 1e-40, 1e-33, 3.4e38, 2e19,
                float("inf"), float("nan"), -0.0, 0.0]
    blocks = []
    for b, value in enumerate(specials):
        block = torch.randn(256, generator=torch.Generator().manual_seed(b)) * 1e-3 * (abs(value) or 1.0)
        block[0], block[1], block[2], block[3] = value, -value * 0.75, value * 2.0 ** -12, value * 1e-9
        blocks.append(block)
    g = torch.cat(blocks + [torch.randn(301) * 1e-3])
    base = make_case(combo, True, seed=1, shapes=[tuple(g.shape)])
    base[1] = [g]
    hp = hyper(1, beta1=0.0, beta2=0.0)
    tri, ref, nat = clone_case(base, DEVICE), clone_case(base), clone_case(base)
    run_triton(tri, hp)
    reference_step(ref, hp)
    assert_bitwise(tri, ref, f"{combo} edge values")
    if backends.native_available():
        torch.ops.ort_optim.adam_step_(*nat, **hp)
        assert_bitwise(tri, nat, f"{combo} edge values vs native")
    m_scales, v_scales, v_codes = tri[6][0].cpu(), tri[7][0].cpu(), tri[3][0].cpu().view(torch.uint8)
    for b, value in enumerate(specials):
        assert bool(m_scales[b].isnan()) == (not math.isfinite(value)), (b, value, float(m_scales[b]))
        # a v = g * g that overflows float32 without a NaN: a finite scale with its sign bit set, code 0 for it alone
        v = blocks[b] * blocks[b]
        v_nan, v_overflow = bool(v.isnan().any()), bool(v.isinf().any()) and not bool(v.isnan().any())
        s = v_scales[b]
        assert bool(s.isnan()) == v_nan and bool(torch.signbit(s)) == v_overflow, (b, value, float(s))
        if v_overflow:
            assert torch.equal(v_codes[b * 256:(b + 1) * 256] == 0, v.isinf()), (b, value)


@needs_working_interpreter
def test_quantisation_edge_values_bitwise():
    """The scale rule on hand-picked maxima: powers of two, values that round up to 32768, subnormals, inf, NaN."""
    specials = [1.0, 0.5, 2.0 ** -20, 1.99999988, 3.0, 16384.0, 32767.0, 32768.0, 65504.0, 1e-40, 1e-45, 1e38,
                float("inf"), 2.0 ** -126, 2.0 ** 127, 0.999969482, 0.99997, 65519.0]
    shape = (len(specials) * 1024,)
    base = make_case("fp32-fp16states", False, seed=1, shapes=[shape])
    g = torch.zeros(shape)
    for b, value in enumerate(specials):
        g[b * 1024] = value
        g[b * 1024 + 1] = -value * 0.75
        if b % 3 == 0:
            g[b * 1024 + 2] = float("nan")
    base[1] = [g]
    hp = hyper(1, beta1=0.0, beta2=0.0)
    tri, ref = clone_case(base, DEVICE), clone_case(base)
    run_triton(tri, hp)
    reference_step(ref, hp)
    assert_bitwise(tri, ref, "edge values")


@needs_working_interpreter
def test_many_steps_against_float64():
    """Fifty steps of a mixed-precision setup stay within float32 rounding of a float64 evaluation."""
    base = make_case("fp16-master", False, seed=9, shapes=[(1030,), (5,)])
    tri = clone_case(base, DEVICE)
    exact = clone_case(base)
    exact[0] = [p.double() for p in exact[5]]
    exact[1] = [g.double() for g in exact[1]]
    exact[2] = [m.double() for m in exact[2]]
    exact[3] = [v.double() for v in exact[3]]
    exact[5] = []
    gen = torch.Generator().manual_seed(1)
    for step in range(50):
        grads = [torch.randn(p.shape, generator=gen) for p in base[0]]
        tri[1] = [g.to(F16).to(DEVICE) for g in grads]
        exact[1] = [g.to(F16).double() for g in grads]
        hp = hyper(2, lr=1e-3)
        run_triton(tri, hp)
        reference_backend.adam_step_(*exact, **hp)
    for i in range(2):
        master, ref = tri[5][i].cpu().double(), exact[0][i]
        assert float((master - ref).abs().max()) < 1e-5, f"master {i} drifted from float64"


@needs_working_interpreter
def test_blocks_per_program_and_multi_tensor_launch(monkeypatch):
    """Several blocks per program (the kernel's inner loop), one launch for many tensors, cache reuse."""
    monkeypatch.setattr(triton_backend, "BLOCKS_PER_PROGRAM", 2)
    base = make_case("fp32-fp16states", True, seed=4, shapes=[(3000,), (1024,), (1,), (0,), (2049,)])
    tri, ref = clone_case(base, DEVICE), clone_case(base)
    launches = []
    kernel = triton_backend.kernels().adam_kernel
    original = type(kernel).__getitem__

    def counting(self, grid):
        if self is kernel:
            launches.append(grid)
        return original(self, grid)

    monkeypatch.setattr(type(kernel), "__getitem__", counting)
    for _ in range(2):
        run_triton(tri, hyper(0))
        reference_step(ref, hyper(0))
    assert_bitwise(tri, ref, "2 blocks per program")
    # One launch per step for the 5 tensors: 2 + 1 + 1 + 0 + 2 programs of up to 2 blocks each.
    assert launches == [(6,), (6,)]


@needs_working_interpreter
def test_an_empty_tensor_last_does_not_drop_the_others():
    """An empty tensor at the end of the list must not cost the tensors before it their update."""
    base = make_case("fp32-fp16states", False, seed=13, shapes=[(1500,), (3,), (0,)])
    tri, ref = clone_case(base, DEVICE), clone_case(base)
    run_triton(tri, hyper(1))
    reference_step(ref, hyper(1))
    assert_bitwise(tri, ref, "empty tensor last")
    assert not torch.equal(tri[0][0].cpu(), base[0][0]) and torch.equal(tri[9].cpu(), base[9] + 1)


@needs_working_interpreter
def test_tables_follow_data_ptrs_and_grads():
    """Cached address tables are rebuilt when a state tensor is replaced or gradients change identity."""
    base = make_case("fp32", False, seed=8, shapes=[(1100,), (4,)])
    tri, ref = clone_case(base, DEVICE), clone_case(base)
    for step in range(4):
        new_grads = [torch.randn(p.shape) for p in base[0]]
        tri[1] = [g.to(DEVICE) for g in new_grads]  # new gradient tensors every step (set_to_none)
        ref[1] = [g.clone() for g in new_grads]
        if step == 2:  # replace a moment (as load_state_dict does)
            tri[2][0] = tri[2][0].clone()
        run_triton(tri, hyper(1))
        reference_step(ref, hyper(1))
        assert_bitwise(tri, ref, f"step {step}")


@needs_working_interpreter
def test_non_contiguous_params_and_grads():
    storage = torch.randn(40, 60, device=DEVICE)
    param = storage.t()[:, ::2]  # transposed and strided: [60, 20]
    grad = torch.randn(20, 60).t()  # transposed: [60, 20]
    base = [[param.cpu().contiguous()], [grad.contiguous()], [torch.zeros(param.shape)], [torch.zeros(param.shape)],
            [], [], [], [], [], torch.zeros(1, dtype=F64)]
    tri = clone_case(base, DEVICE)
    tri[0] = [param]
    tri[1] = [grad.to(DEVICE)]
    ref = clone_case(base)
    run_triton(tri, hyper(2))
    reference_step(ref, hyper(2))
    assert not tri[0][0].is_contiguous()
    assert torch.equal(tri[0][0].cpu(), ref[0][0])
    assert torch.equal(tri[2][0].cpu(), ref[2][0])


@needs_working_interpreter
def test_errors_name_the_argument():
    base = clone_case(make_case("fp32", False, seed=2, shapes=[(10,), (3,)]), DEVICE)
    hp = on(DEVICE, hyper(1))
    bad = list(base)
    bad[1] = [base[1][0], base[1][1][:2]]
    with pytest.raises(RuntimeError, match=r"grads\[1\] has shape"):
        triton_backend.adam_step_(*bad, **hp)
    bad = list(base)
    bad[2] = base[2][:1]
    with pytest.raises(RuntimeError, match="exp_avgs has 1 tensors"):
        triton_backend.adam_step_(*bad, **hp)
    mixed = clone_case(make_case("fp32", False, seed=2, shapes=[(10,)]), DEVICE)
    dbl = clone_case(make_case("fp64", False, seed=2, shapes=[(10,)]), DEVICE)
    joined = [a + b if isinstance(a, list) else torch.cat([a, b]) for a, b in zip(mixed, dbl)]
    with pytest.raises(RuntimeError, match="float64 params cannot share a call"):
        triton_backend.adam_step_(*joined, **hp)
    with pytest.raises(RuntimeError, match="steps must be"):
        triton_backend.adam_step_(*base[:9], base[9].float(), **hp)
    with pytest.raises(RuntimeError, match="mode must be"):
        triton_backend.adam_step_(*base, **dict(hp, adam_w_mode=3))
    with pytest.raises(RuntimeError, match=r"rounding_keys .* params\[0\] is Float"):
        triton_backend.adam_step_(*base, **dict(hp, rounding_keys=torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(RuntimeError, match=r"rounding_keys must be a contiguous int64 tensor of shape \[2\]"):
        triton_backend.adam_step_(*base, **dict(hp, rounding_keys=torch.zeros(3, dtype=torch.int64)))
    for betas in (torch.tensor([0.9, 0.999]), torch.tensor([0.9, 0.999, 0.5], dtype=F64),
                  torch.tensor([[0.9, 0.999]], dtype=F64), torch.tensor([0.9, 0.999], dtype=F64, device="meta")):
        before = clone_case(base, DEVICE)
        with pytest.raises(RuntimeError, match=r"betas_tensor must be a float64 tensor of shape \[2\] \(beta1, beta2\) "
                                               r"on the steps' device"):
            triton_backend.adam_step_(*base, **dict(hp, betas_tensor=betas))
        assert_bitwise(base, before, f"a refused betas_tensor {betas.dtype} {list(betas.shape)} wrote nothing")
    # (as the CPU kernel refuses them: a sparse one too)
    steps_device = base[9].device
    for rows in (torch.zeros(1, 3), torch.zeros(1, 2, dtype=F64), torch.zeros(1, 3, dtype=F64).to_sparse()):
        before = clone_case(base, DEVICE)
        with pytest.raises(RuntimeError, match=r"group_hyperparameters must be a float64 tensor of shape \[groups, 3\] "
                                               r"\(lr, beta1, beta2\) on the steps' device"):
            triton_backend.adam_step_(*base, **dict(hp, group_hyperparameters=rows.to(steps_device)))
        assert_bitwise(base, before, f"a refused group_hyperparameters {rows.layout} wrote nothing")
    low = clone_case(make_case("fp32-q4", False, seed=2, shapes=[(300,)]), DEVICE)
    bad = list(low)
    bad[6] = []
    with pytest.raises(RuntimeError, match=r"the uint8 \(low-bit\) state scaled by exp_avg_scales\[0\] needs its block "
                                           r"scales; exp_avg_scales is empty"):
        triton_backend.adam_step_(*bad, **hp)
    bad = list(low)
    bad[3] = [low[3][0][:-1]]
    with pytest.raises(RuntimeError, match=r"the 4-bit state scaled by exp_avg_sq_scales\[0\] must be a flat uint8 tensor "
                                           r"of 150 bytes \(two codes each\), got shape \[149\]"):
        triton_backend.adam_step_(*bad, **hp)
    bad = list(low)
    bad[7] = [low[7][0][:-1]]
    with pytest.raises(RuntimeError, match=r"exp_avg_sq_scales\[0\] has 2 scales; a 4-bit state of 300 elements has 3 "
                                           r"blocks of 128"):
        triton_backend.adam_step_(*bad, **hp)
    bad = list(low)
    bad[6] = [low[6][0].float()]  # float32 scales name the 8-bit format: one per 256 codes of the param's shape
    with pytest.raises(RuntimeError, match=r"exp_avg_scales\[0\] has 3 scales; a 8-bit state of 300 elements has 2 "
                                           r"blocks of 256"):
        triton_backend.adam_step_(*bad, **hp)


@needs_working_interpreter
@pytest.mark.parametrize("options,mutate,words", [c[1:] for c in MALFORMED_OP_CALLS],
                         ids=[c[0] for c in MALFORMED_OP_CALLS])
def test_a_malformed_call_is_refused_in_the_native_ops_words_before_anything_is_written(options, mutate, words):
    """The calls that tests/op/test_op.py refuses on every backend (tests/cases.py), made on this backend's device:
    a RuntimeError in the native op's words (its steps and rounding_keys are CPU tensors, Triton's on any device),
    every tensor as it was."""
    args, kwargs = op_arguments(device=DEVICE, **options)
    mutate(args, kwargs)
    before = clone_case(args, DEVICE)
    with pytest.raises(RuntimeError) as refused:
        triton_backend.adam_step_(*args, **kwargs)
    assert str(refused.value) == "ort_optim::adam_step_: " + words.replace(" CPU tensor", " tensor")
    assert_bitwise(args, before, "a refused call")
    assert torch.equal(args[9].cpu(), before[9].cpu()), "a refused call leaves the step counts"


@needs_working_interpreter
@pytest.mark.parametrize("skip", [False, True], ids=["step", "found_inf"])
@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(lr=float("nan")), dict(lr=float("inf")), dict(beta1=1.0),
                                 dict(beta2=-0.5)], ids=["lr<0", "lr-nan", "lr-inf", "beta1=1", "beta2<0"])
def test_float_lr_and_betas_out_of_range_are_refused_as_by_the_cpu_kernel(bad, skip):
    """lr, beta1 and beta2 given as floats are host values: out of the op's range (lr finite and >= 0, each beta in
    [0, 1)) the Triton backend refuses them with the CPU kernel's ValueError and message, before anything is written,
    also where found_inf would skip the step. A float that lr_tensor or betas_tensor replaces is not used, as on the
    CPU."""
    base = clone_case(make_case("fp32", False, seed=2, shapes=[(10,), (3,)]), DEVICE)
    before = clone_case(base, DEVICE)
    hp = hyper(1, found_inf=torch.tensor([1.0]) if skip else None, **bad)
    with pytest.raises(ValueError, match=r"ort_optim::adam_step_: (lr|betas\[[01]\]) must be") as refused:
        triton_backend.adam_step_(*base, **on(DEVICE, hp))
    assert_bitwise(base, before, f"a refused {bad} wrote nothing")
    assert torch.equal(base[9].cpu(), before[9].cpu()), "a refused step leaves the step counts"
    if backends.native_available():
        with pytest.raises(ValueError) as native:
            torch.ops.ort_optim.adam_step_(*clone_case(before), **hp)
        assert str(refused.value) == str(native.value)

    replaced = (dict(lr_tensor=torch.tensor(1e-2)) if "lr" in bad
                else dict(betas_tensor=torch.tensor([0.9, 0.999], dtype=F64)))
    triton_backend.adam_step_(*base, **on(DEVICE, dict(hp, **replaced)))
    expected = clone_case(before)
    reference_step(expected, hyper(1, found_inf=hp["found_inf"]))
    assert_bitwise(base, expected, f"{bad} replaced by {sorted(replaced)} steps as without it")


@needs_working_interpreter
@pytest.mark.parametrize("skip", [False, True], ids=["step", "found_inf"])
def test_an_expanded_param_is_refused_as_by_the_cpu_kernel(skip):
    """An expand()ed param cannot receive one value per element: refused with the CPU kernel's message before
    anything is written, also where found_inf would skip the step."""
    base = clone_case(make_case("fp32", False, seed=2, shapes=[(10,), (3,)]), DEVICE)
    base[0][1] = torch.randn(1, device=DEVICE).expand(3)
    before = clone_case(base, DEVICE)
    hp = hyper(1, found_inf=torch.tensor([1.0]) if skip else None)
    with pytest.raises(RuntimeError, match=r"params\[1\] overlaps itself") as refused:
        triton_backend.adam_step_(*base, **on(DEVICE, hp))
    assert_bitwise(base, before, "a refused step wrote nothing")
    if backends.native_available():
        on_cpu = clone_case(base)
        on_cpu[0][1] = torch.randn(1).expand(3)
        with pytest.raises(RuntimeError) as native:
            torch.ops.ort_optim.adam_step_(*on_cpu, **hp)
        assert str(refused.value).splitlines()[0] == str(native.value).splitlines()[0]


# ---- CUDA only: streams and graphs ----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not USE_CUDA, reason="needs a CUDA GPU (tools/gpu_check.py runs these there)")


@needs_cuda
def test_kernels_run_on_the_current_stream():
    check_same_stream(DEVICE)


@needs_cuda
@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip-and-scale"])
def test_cuda_graph_capture_and_replay_with_capturable(clip):
    check_graph_capture(DEVICE, clip=clip)


@needs_cuda
def test_plain_step_norm_eagerly_and_from_a_captured_graph():
    check_plain_step_norm(DEVICE)


# ---- grad_stats --------------------------------------------------------------------------------------------------

@needs_working_interpreter
@pytest.mark.parametrize("special", [None, "inf", "nan", "huge"])
def test_grad_stats_matches_the_cpu_kernel(special):
    gen = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(2500, generator=gen), torch.randn(3, 5, generator=gen).to(F16), torch.randn(1100, generator=gen)
        .to(BF16), torch.randn(7, generator=gen, dtype=F64), torch.zeros(0), torch.tensor(3.0),
        torch.randn(20, 30, generator=gen).t(),  # non-contiguous
    ]
    if special == "inf":
        tensors[1][1, 1] = float("inf")
    elif special == "nan":
        tensors[2][1000] = float("nan")
    elif special == "huge":
        tensors[0][5] = 3e38  # the sum overflows float32 but not float64: reported as inf, flag stays 0
    out = triton_backend.grad_stats([t.to(DEVICE) for t in tensors]).cpu()
    expected_sum = sum(float((t.double() ** 2).sum()) for t in tensors)
    assert out.dtype == F32 and out.shape == (2,)
    if special in ("inf", "nan"):
        assert float(out[1]) == 1.0 and not math.isfinite(float(out[0]))
    else:
        assert float(out[1]) == 0.0
        with np.errstate(over="ignore"):
            assert float(out[0]) == float(np.float32(expected_sum))
    if backends.native_available():
        try:
            native = torch.ops.ort_optim.grad_stats(tensors)
        except RuntimeError as exc:  # a CPU-kernel issue, not this kernel's: reported, compared where it works
            assert special == "huge", exc
        else:
            assert torch.equal(out.isfinite(), native.isfinite()) and float(out[1]) == float(native[1])
            if special not in ("inf", "nan"):
                assert torch.equal(out, native)
    fallback = reference_backend.grad_stats(tensors)
    assert float(out[1]) == float(fallback[1])


@needs_working_interpreter
def test_grad_stats_empty_inputs():
    assert torch.equal(triton_backend.grad_stats([torch.zeros(0, device=DEVICE)]).cpu(), torch.zeros(2))
    assert torch.equal(triton_backend.grad_stats([]).cpu(), torch.zeros(2))


# ---- registration, dispatch, FusedAdam through the Triton backend ---------------------------------------------------

def test_registered_as_the_cuda_kernels():
    if not backends.native_available():
        pytest.skip("the native library (which declares the op schemas) is not available")
    for op in ("ort_optim::adam_step_", "ort_optim::grad_stats"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op


def test_dispatch_routes_cuda_to_triton_or_warns_and_falls_back(monkeypatch):
    monkeypatch.setenv("ORT_OPTIM_BACKEND", "auto")
    assert backends.implementation(torch.device("cuda")) is triton_backend
    monkeypatch.setattr(triton_backend, "available", lambda: False)
    monkeypatch.setattr(triton_backend, "_warned", False)
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        assert backends.implementation(torch.device("cuda")) is reference_backend
    monkeypatch.setenv("ORT_OPTIM_BACKEND", "triton")  # asked for explicitly: no silent fallback
    assert backends.implementation(torch.device("cuda")) is triton_backend


@needs_working_interpreter
def test_dispatcher_calling_convention():
    """The registered Python kernel gets the dispatcher's arguments right (keyword-only scalars, optional tensors):
    checked on CPU by registering it for a copy of the schema in a test namespace."""
    if not backends.native_available():
        pytest.skip("the native library is not available")
    ns = "ort_optim_triton_test"
    if not hasattr(test_dispatcher_calling_convention, "lib"):
        schema = torch.ops.ort_optim.adam_step_.default._schema
        lib = torch.library.Library(ns, "DEF")
        lib.define(str(schema).split("::", 1)[1])
        lib.impl("adam_step_", backends._cuda_adam_step, "CPU")
        test_dispatcher_calling_convention.lib = lib
    base = make_case("fp32-fp16states", True, seed=12, shapes=[(1030,), ()])
    tri, ref = clone_case(base), clone_case(base)
    hp = hyper(2, lr_tensor=torch.tensor([1e-3]), inv_grad_scale=torch.tensor([0.25]), found_inf=torch.zeros(1))
    if DEVICE.type == "cpu":
        getattr(torch.ops, ns).adam_step_(*tri, **hp)
    else:
        pytest.skip("CPU-only check")
    reference_step(ref, hp)
    assert_bitwise(tri, ref, "through the dispatcher")


@needs_working_interpreter
@pytest.mark.parametrize("config", [
    dict(),
    dict(adam_w_mode=2, weight_decay=0.01, amsgrad=True),
    dict(master_weights=True, exp_avg_dtype=F16, exp_avg_sq_dtype=F16, dtype=F16),
    dict(master_weights=True, exp_avg_dtype=BF16, dtype=BF16, max_grad_norm=1.0),
    dict(adam_w_mode=2, weight_decay=0.01, amsgrad=True, exp_avg_dtype=U8, exp_avg_sq_dtype=U4),
    dict(exp_avg_dtype=U4, exp_avg_sq_dtype=U4, stochastic_rounding=True, dtype=BF16),
    dict(adam_w_mode=2, weight_decay=0.01, amsgrad=True, exp_avg_dtype=torch.float8_e4m3fn,
         exp_avg_sq_dtype=torch.float8_e5m2),
], ids=["default", "torch-amsgrad", "fp16-master-fp16states", "bf16-master-clip", "torch-amsgrad-q8m-q4v",
        "bf16-stochastic-rounding-q4", "torch-amsgrad-fp8"])
def test_fused_adam_through_the_triton_backend(config, monkeypatch):
    """FusedAdam with ORT_OPTIM_BACKEND=triton follows the CPU backend (a short run; `make test-triton` runs the
    whole FusedAdam suite this way)."""
    from ort_optim import FusedAdam

    config = dict(config)
    dtype = config.pop("dtype", F32)
    gen = torch.Generator().manual_seed(0)
    shapes = [(40, 30), (30,), (), (1100,)]
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(3)]
    results = {}
    for backend in ("triton", "native" if backends.native_available() else "torch"):
        monkeypatch.setenv("ORT_OPTIM_BACKEND", backend)
        device = DEVICE if backend == "triton" else torch.device("cpu")
        params = [torch.nn.Parameter(p.clone().to(device)) for p in init]
        opt = FusedAdam(params, lr=1e-2, **config)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(device, copy=True)  # (a scaled step writes the unscaled gradient back into it)
            opt.step(grad_scale=torch.tensor(4.0, device=device) if dtype == F16 else None)
        results[backend] = ([p.detach().cpu() for p in params], opt.state_dict())
    (tp, tsd), (cp, csd) = results.values()
    tol = dict(rtol=2e-2, atol=1e-3) if dtype != F32 else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(tp, cp):
        torch.testing.assert_close(a, b, **tol)
    for index, state in tsd["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(value.cpu(), csd["state"][index][key].cpu(), **tol)


@needs_working_interpreter
def test_fp16_optimizer_steps_again_over_a_skipped_steps_gradients_as_on_the_cpu(monkeypatch):
    """FP16_Optimizer(FusedAdam) on the Triton kernels, non-contiguous fp16 params (their gradients go through
    contiguous copies, written back after the launch): a step skipped for an overflow, then step() again over the same
    gradients without a backward, skips again and halves the scale again, as on the native CPU op. The kernels decide
    the skip on the device, which the host does not read, so the gradients' versions move on a skipped step too; the
    wrapper must not read that as "FusedAdam wrote them back unscaled" (it would then step on scaled, inf
    gradients)."""
    from ort_optim import FP16_Optimizer, FusedAdam

    results = {}
    for backend in ("triton", "native" if backends.native_available() else "torch"):
        monkeypatch.setenv("ORT_OPTIM_BACKEND", backend)
        device = DEVICE if backend == "triton" else torch.device("cpu")
        base = torch.randn(40, 8, generator=torch.Generator().manual_seed(0)).half().to(device)
        p = torch.nn.Parameter(base.t())
        opt = FP16_Optimizer(FusedAdam([p], lr=1e-2), init_scale=16.0)
        opt.backward((p.float() * 1e6).sum())  # overflows float16
        assert not p.grad.is_contiguous()
        history = []
        for _ in range(2):
            opt.step()
            history.append((opt.overflow, opt.loss_scale))
        results[backend] = (history, p.detach().cpu())
    (history, value), (cpu_history, cpu_value) = results.values()
    assert history == cpu_history == [(True, 8.0), (True, 4.0)]
    assert torch.equal(value, cpu_value) and torch.isfinite(value).all()


# ---- the gradients' norm from the update's own pass (adam_step_(grad_norm=True), FusedAdam.last_grad_norm) --------

def _joined(*cases) -> list:
    """One adam_step_ call over several cases (their tensors side by side): one launch per dtype group."""
    return [[t for case in cases for t in case[k]] for k in range(9)] + [torch.cat([case[9] for case in cases])]


# (cases joined into one call, mode, amsgrad, blocks per program: 0 is the interpreter's default of 64, one program
# per tensor here; 1 gives the 2500-element tensor three programs and partials)
NORM_CASES = {
    "fp32": (("fp32",), 2, False, 0),
    "fp16-fp16states+bf16-q8m-q4v-1-block": (("fp16-master-fp16states", "bf16-master-q8m-q4v"), 0, True, 1),
    "fp64": (("fp64",), 1, False, 1),
}


@needs_working_interpreter
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_grad_norm_is_summed_by_the_update_pass_and_changes_nothing_else(case, monkeypatch):
    """adam_step_(grad_norm=True) returns float32 [sum of squares of the gradients as loaded, 0.0] (float64 partials
    of float32 squares: within float32 rounding of the exact sum) from the same launches, and the update is the same
    bits as without it; several dtype groups in one call (two launches) share one buffer of partials."""
    combos, mode, amsgrad, bpp = NORM_CASES[case]
    monkeypatch.setattr(triton_backend, "BLOCKS_PER_PROGRAM", bpp)
    base = _joined(*(make_case(combo, amsgrad, seed=40 + i) for i, combo in enumerate(combos)))
    with_norm, without = clone_case(base, DEVICE), clone_case(base, DEVICE)
    stats = triton_backend.adam_step_(*with_norm, **on(DEVICE, hyper(mode)), grad_norm=True)
    assert triton_backend.adam_step_(*without, **on(DEVICE, hyper(mode))) is None
    assert_bitwise(with_norm, without, "grad_norm=True vs False")
    assert stats.dtype == F32 and stats.shape == (2,) and stats.device.type == DEVICE.type
    exact = sum(float((g.double() ** 2).sum()) for g in base[1])
    assert math.isclose(float(stats[0]), exact, rel_tol=2e-6) and float(stats[1]) == 0.0, (stats, exact)


@needs_working_interpreter
@pytest.mark.parametrize("special,expected", [("inf", (math.inf, 1.0)), ("nan", (math.nan, 1.0)),
                                              ("found_inf", (math.nan, 1.0)), ("no tensors", (0.0, 0.0)),
                                              ("empty tensors", (0.0, 0.0)),
                                              ("empty tensors, found_inf", (math.nan, 1.0)),
                                              ("no tensors, found_inf", (math.nan, 1.0))])
def test_grad_norm_of_non_finite_gradients_skipped_and_empty_steps(special, expected):
    """inf and NaN gradients make the sum inf / NaN (a plain step is still taken); a step skipped by found_inf reads
    no gradient and reports NaN, as the native plan, whatever its gradients hold; no tensors or only empty ones give
    [0, 0]."""
    shapes = [(0,), (0,)] if special.startswith("empty tensors") else [(1500,), (3,)]
    args = clone_case(make_case("fp32", False, seed=44, shapes=shapes), DEVICE)
    if special.startswith("no tensors"):
        args = [[] for _ in range(9)] + [torch.zeros(0, dtype=F64)]
    if special in ("inf", "nan"):
        args[1][0][1200] = float(special)
    hp = hyper(2, found_inf=torch.ones(1) if special.endswith("found_inf") else None)
    stats = triton_backend.adam_step_(*args, **on(DEVICE, hp), grad_norm=True).cpu()
    torch.testing.assert_close(stats, torch.tensor(expected), equal_nan=True, rtol=0, atol=0)


# FusedAdam configurations of the plain-step norm: params in two groups (fp32, then bf16 with a higher lr)
NORM_CONFIGS = {
    "fp32-moments": dict(),
    "master-q8m-q4v": dict(master_weights=True, exp_avg_dtype=U8, exp_avg_sq_dtype=U4),
    "master-fp32-moments-1-block": dict(master_weights=True, blocks_per_program=1),
}


@needs_working_interpreter
@pytest.mark.parametrize("config", list(NORM_CONFIGS))
def test_fused_adam_plain_step_norm_is_the_total_norm_of_the_gradients(config, monkeypatch):
    """ORT_OPTIM_BACKEND=triton: a plain step (no grad_scale, max_grad_norm, found_inf) sets last_grad_norm to
    the total norm of the gradients (float64 sum, rtol 1e-6), a 0-dim float32 tensor on the params' device, at every
    step; last_found_inf stays None. An inf gradient gives an inf norm (and the step is taken, like AdamW)."""
    from ort_optim import FusedAdam

    options = dict(NORM_CONFIGS[config])
    monkeypatch.setattr(triton_backend, "BLOCKS_PER_PROGRAM", options.pop("blocks_per_program", 0))
    monkeypatch.setenv("ORT_OPTIM_BACKEND", "triton")
    gen = torch.Generator().manual_seed(6)
    shapes, dtypes = [(5,), (3, 4), (), (2100,), (6,)], [F32, F32, F32, BF16, BF16]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt).to(DEVICE)) for s, dt in zip(shapes, dtypes)]
    opt = FusedAdam([{"params": params[:3]}, {"params": params[3:], "lr": 1e-2}], **options)
    for step in range(4):
        grads = [(torch.randn(p.shape, generator=gen) * 10.0 ** (i - 2)).to(p.dtype) for i, p in enumerate(params)]
        if step == 3:
            grads[3][7] = float("inf")
        for p, g in zip(params, grads):
            p.grad = g.to(DEVICE)
        before = [p.detach().clone() for p in params]
        opt.step()
        norm = opt.last_grad_norm
        assert norm.shape == () and norm.dtype == F32 and norm.device.type == DEVICE.type and opt.last_found_inf is None
        if step < 3:
            assert math.isclose(float(norm), total_norm(grads), rel_tol=1e-6), (float(norm), total_norm(grads))
        else:
            assert float(norm) == math.inf
            assert not torch.equal(params[0].detach(), before[0]), "a plain step is not skipped"


@pytest.mark.parametrize("why", ["reference backend", "update cannot report"])
def test_plain_step_norm_is_none_where_a_bucket_cannot_report_it(why, monkeypatch):
    """The pure-PyTorch backend sums no squares in its update: None (no extra pass is made for it). And the rule is
    all buckets or none (here: the Triton path said unable)."""
    from ort_optim import FusedAdam

    if why == "reference backend":
        monkeypatch.setenv("ORT_OPTIM_BACKEND", "torch")
    else:
        if BROKEN is not None or not IN_PROCESS:
            pytest.skip("needs the Triton interpreter in this process")
        monkeypatch.setenv("ORT_OPTIM_BACKEND", "triton")
        monkeypatch.setattr(backends, "update_reports_grad_norm", lambda device: False)
    params = [torch.nn.Parameter(torch.randn(s).to(DEVICE if why != "reference backend" else "cpu"))
              for s in [(30,), ()]]
    opt = FusedAdam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    before = params[0].detach().clone()
    opt.step()
    assert opt.last_grad_norm is None and opt.last_found_inf is None
    assert not torch.equal(params[0].detach(), before), "the step itself was taken"


# ---- ahead-of-time compilation and torch.compile ------------------------------------------------------------------

def test_aot_compile_for_sm80_and_sm90():
    """Every kernel variant compiles to PTX and cubin for sm_80 and sm_90 with this triton, without a GPU (what the
    interpreter cannot check: e.g. pointer types built from constexpr dtypes do not compile with triton 3.0/3.1).
    Runs tools/aot_compile.py in a subprocess (the kernels in this process are interpreted)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "aot_compile.py"), "--quick", "--check"],
                            env=env, capture_output=True, text=True, timeout=900)
    if result.returncode == 3:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def _compile_case(op, hp):
    base = make_case("fp32-bf16states", False, seed=21, shapes=[(300,), (4,)])
    eager, compiled = clone_case(base), clone_case(base)

    def step(args):
        op(*args, **hp)

    step(eager)
    torch.compile(step, fullgraph=True, backend="inductor")(compiled)
    for a_list, b_list in zip(eager[:9], compiled[:9]):
        for a, b in zip(a_list, b_list):
            assert torch.equal(a, b)
    assert torch.equal(eager[9], compiled[9]) and torch.equal(eager[9], base[9] + 1)


def _torch_version():
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def test_torch_compile_of_the_native_op():
    """torch.compile(fullgraph=True) of a function calling the op (native CPU kernel) matches eager.

    Measured: torch 2.4 cannot functionalise a custom op that mutates tensor lists ("Found a custom (non-ATen)
    operator whose output has alias annotations"), so it is skipped there; torch >= 2.5 compiles it. (The op's
    mode argument is named adam_w_mode: a keyword named `mode` collides with torch's redirect_to_mode wrapper.)"""
    if not backends.native_available():
        pytest.skip("the native library is not available")
    if _torch_version() < (2, 5):
        pytest.skip(f"torch {torch.__version__} cannot functionalise custom ops that mutate tensor lists")
    _compile_case(torch.ops.ort_optim.adam_step_, hyper(2))
