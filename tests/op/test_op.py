"""ort_optim's operators (ops/README.md), as a specification.

* The native library builds and loads; opcheck passes over a list of sample inputs.
* grad_stats is the float64 sum of squares and the inf/NaN flag, independent of the thread count.
* The native adam_step_ and the pure-PyTorch fallback agree for every dtype combination; the native result does not
  depend on the thread count; the op validates its inputs before writing anything.
* The C++ fp16 block size equals ort_optim._spec.QUANT_BLOCK.
* FusedAdam refuses params that share memory and accepts disjoint views of one buffer.
* torch.compile of the op and of FusedAdam.step gives eager's result.
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch
from cases import MALFORMED_OP_CALLS, op_arguments
from conftest import (
    BACKENDS,
    assert_bitwise_equal,
    assert_same_snapshot,
    optimizer_snapshot,
    select_backend,
)

from ort_optim import FusedAdam, backends, formats
from ort_optim.backends import reference as reference_backend
from ort_optim._spec import QUANT_BLOCK

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

requires_native = pytest.mark.skipif(
    os.environ.get("ORT_OPTIM_NO_NATIVE") == "1" or not backends.native_available(),
    reason="the native CPU library is not available (test_native_library_builds_and_loads says why)",
)


def test_native_library_builds_and_loads():
    if os.environ.get("ORT_OPTIM_NO_NATIVE") == "1":
        pytest.skip("ORT_OPTIM_NO_NATIVE=1")
    assert backends.native_available(), "the native CPU kernels did not build or load; see the RuntimeWarning"
    assert hasattr(torch.ops.ort_optim, "adam_step_") and hasattr(torch.ops.ort_optim, "grad_stats")


# ---- sample inputs -------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    name: str
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    m_dtype: torch.dtype
    v_dtype: torch.dtype
    master: bool = False
    amsgrad: bool = False
    mode: int = 2
    maximize: bool = False
    bias_correction: bool = True
    lr_tensor: bool = False
    betas_tensor: bool = False  # betas as a float64 [2] tensor, the float betas 0
    inv_grad_scale: bool = False
    found_inf: float | None = None
    grad_scale: float | None = None  # the op writes the grads back divided by it
    shapes: tuple = ((), (7,), (0,), (QUANT_BLOCK + 5,), (3, 4))
    non_contiguous: bool = True

    def make(self, seed: int = 0, steps_before: float = 3.0):
        """(args, kwargs) for torch.ops.ort_optim.adam_step_, with moments as a few steps would have left them."""
        g = torch.Generator().manual_seed(seed)

        def rand(shape, scale=1.0):
            return scale * torch.randn(shape, generator=g)

        params, grads, ms, vs, vmaxs, masters, m_scales, v_scales, vmax_scales = ([] for _ in range(9))
        for i, shape in enumerate(self.shapes):
            value = rand(shape, 0.5)
            if self.non_contiguous and len(shape) == 2:
                p = torch.zeros(shape[1], shape[0], dtype=self.param_dtype).t()  # transposed view
                p.copy_(value)
            else:
                p = value.to(self.param_dtype)
            params.append(p)
            grads.append(rand(shape, 0.1).to(self.grad_dtype))
            if self.master:
                masters.append(value.float())
            for dtype, store, scales, magnitude in ((self.m_dtype, ms, m_scales, 0.01),
                                                    (self.v_dtype, vs, v_scales, 1e-4)) + (
                    ((self.v_dtype, vmaxs, vmax_scales, 2e-4),) if self.amsgrad else ()):
                values = rand(shape, magnitude).abs() if magnitude < 1e-2 else rand(shape, magnitude)
                if dtype == torch.float16:
                    codes, s = formats.quantize_fp16(values)
                    store.append(codes)
                    scales.append(s)
                else:
                    store.append(values.to(dtype))
        steps = torch.full((len(params),), steps_before, dtype=torch.float64)
        if len(params):
            steps[0] = 0.0  # a param taking its first step beside older ones
        kwargs = dict(lr=0.0 if self.lr_tensor else 1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                      bias_correction=self.bias_correction, maximize=self.maximize)
        kwargs["adam_w_mode"] = self.mode
        if self.lr_tensor:
            kwargs["lr_tensor"] = torch.tensor(1e-2)
        if self.betas_tensor:
            kwargs.update(beta1=0.0, beta2=0.0, betas_tensor=torch.tensor([0.9, 0.999], dtype=torch.float64))
        if self.inv_grad_scale:
            kwargs["inv_grad_scale"] = torch.tensor([1 / 64.0])
        if self.found_inf is not None:
            kwargs["found_inf"] = torch.tensor([self.found_inf])
        if self.grad_scale is not None:
            kwargs["grad_scale"] = torch.tensor([self.grad_scale])
        args = (params, grads, ms, vs, vmaxs, masters, m_scales, v_scales, vmax_scales, steps)
        return args, kwargs


F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16

SAMPLES = [
    Sample("fp32", F32, F32, F32, F32),
    Sample("fp32-L2-amsgrad", F32, F32, F32, F32, amsgrad=True, mode=0),
    Sample("fp32-HF-fp16-bf16-moments", F32, F32, F16, BF16, mode=1, maximize=True),
    Sample("fp64-amsgrad-lr-tensor", F64, F64, F64, F64, amsgrad=True, lr_tensor=True),
    Sample("fp16-master-fp16-moments-amsgrad-grad-scale", F16, F16, F16, F16, master=True, amsgrad=True,
           inv_grad_scale=True),
    Sample("bf16-bf16-moments-no-bias-correction", BF16, BF16, BF16, BF16, bias_correction=False),
    Sample("bf16-master-fp32-grads", BF16, F32, F32, F32, master=True, lr_tensor=True),
    Sample("fp32-lr-and-betas-tensors", F32, F32, F32, BF16, amsgrad=True, lr_tensor=True, betas_tensor=True),
    Sample("found-inf-skips", F16, F16, F16, F32, master=True, found_inf=1.0, inv_grad_scale=True),
    Sample("fp32-grads-unscaled-in-place", F32, F32, F32, F32, inv_grad_scale=True, grad_scale=3.0),
    Sample("bf16-grads-unscaled-master", BF16, BF16, F32, F16, master=True, inv_grad_scale=True, grad_scale=64.0),
    Sample("found-inf-leaves-grads-scaled", F32, F16, F32, F32, found_inf=1.0, inv_grad_scale=True, grad_scale=64.0),
    Sample("all-empty", F32, F32, F32, F32, shapes=((0,), (0, 3))),
    Sample("no-params", F32, F32, F32, F32, shapes=()),
]


def _call(module, args, kwargs):
    (module if module is not None else torch.ops.ort_optim).adam_step_(*args, **kwargs)


# ---- opcheck -------------------------------------------------------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
TORCH_24_LIST_MUTATION = ("torch 2.4 cannot compile custom ops that mutate tensor lists (its auto_functionalize "
                          "does not handle Tensor(a!)[] arguments: 'Found a custom (non-ATen) operator whose output "
                          "has alias annotations')")


# test_aot_dispatch_dynamic traces and compiles the op (about 0.6 s a sample): the fast tier compiles the samples that
# between them reach every argument kind (master weights, low-precision moments, amsgrad, tensor hyperparameters,
# grad_scale, found_inf, empty lists); the slow tier compiles every sample.
AOT_FAST_SAMPLES = ("fp16-master-fp16-moments-amsgrad-grad-scale", "fp32-lr-and-betas-tensors",
                    "found-inf-leaves-grads-scaled", "all-empty", "no-params")


def _opcheck_params():
    for util in OPCHECK_UTILS:
        for sample in SAMPLES:
            marks = []
            if util == "test_aot_dispatch_dynamic" and TORCH_VERSION < (2, 5):
                marks = [pytest.mark.skip(reason=TORCH_24_LIST_MUTATION)]
            elif util == "test_aot_dispatch_dynamic" and sample.name not in AOT_FAST_SAMPLES:
                marks = [pytest.mark.slow]
            yield pytest.param(sample, util, marks=marks, id=f"{sample.name}-{util}")


@requires_native
@pytest.mark.parametrize("sample,util", list(_opcheck_params()))
def test_opcheck_adam_step(sample, util):
    args, kwargs = sample.make()

    torch.library.opcheck(torch.ops.ort_optim.adam_step_.default, args, kwargs, test_utils=util)


GRAD_STATS_SAMPLES = {
    "mixed-dtypes": lambda: [torch.randn(5), torch.randn(3, 4).half().t(), torch.randn(70000).bfloat16(),
                             torch.randn((), dtype=torch.float64)],
    "with-inf": lambda: [torch.randn(5), torch.tensor([1.0, float("inf")]).half()],
    "empty-tensors": lambda: [torch.randn(0), torch.randn(0, 2)],
}


@requires_native
@pytest.mark.parametrize("util", OPCHECK_UTILS)
@pytest.mark.parametrize("sample", GRAD_STATS_SAMPLES, ids=str)
def test_opcheck_grad_stats(sample, util):
    torch.library.opcheck(torch.ops.ort_optim.grad_stats.default, (GRAD_STATS_SAMPLES[sample](),), test_utils=util)


# ---- grad_stats ----------------------------------------------------------------------------------------------------


def _grad_stats_reference(tensors):
    total = sum(float((t.double() ** 2).sum()) for t in tensors)
    flag = 0.0 if all(bool(torch.isfinite(t).all()) for t in tensors) else 1.0
    return total, flag


GRAD_STATS_CASES = {
    "fp32": lambda g: [torch.randn(100, generator=g), torch.randn(3, 7, generator=g).t()],
    "fp16-bf16-fp64": lambda g: [torch.randn(1000, generator=g).half(), torch.randn(999, generator=g).bfloat16(),
                                 torch.randn(5, generator=g, dtype=torch.float64)],
    "many-chunks": lambda g: [torch.randn(150_000, generator=g) for _ in range(3)] + [torch.randn(70_001, generator=g)],
    "large-values": lambda g: [torch.full((10,), 60000.0).half(), torch.full((4,), 1e18)],
    "zero-dim-and-empty": lambda g: [torch.randn((), generator=g), torch.randn(0, generator=g), torch.zeros(3)],
}
NON_FINITE = {
    "inf-fp32": (torch.float32, float("inf")),
    "-inf-fp16": (torch.float16, float("-inf")),
    "nan-bf16": (torch.bfloat16, float("nan")),
    "nan-fp64": (torch.float64, float("nan")),
    "inf-in-a-later-chunk": (torch.float32, "late"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", GRAD_STATS_CASES, ids=str)
def test_grad_stats_is_the_float64_sum_of_squares(case, backend, monkeypatch):
    select_backend(monkeypatch, backend)
    tensors = GRAD_STATS_CASES[case](torch.Generator().manual_seed(1))
    stats = backends.grad_stats(tensors)
    assert stats.dtype == torch.float32 and stats.shape == (2,)
    total, flag = _grad_stats_reference(tensors)
    assert float(stats[1]) == flag == 0.0
    # summed in float64 in a fixed order, then rounded once to float32
    assert math.isclose(float(stats[0]), total, rel_tol=2.0**-24), (float(stats[0]), total)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", NON_FINITE, ids=str)
def test_grad_stats_flags_any_inf_or_nan(case, backend, monkeypatch):
    select_backend(monkeypatch, backend)
    dtype, value = NON_FINITE[case]
    tensors = [torch.randn(10), torch.randn(200_000).to(dtype)]
    if value == "late":
        tensors[1][-1] = float("inf")
    else:
        tensors[1][123] = value
    assert float(backends.grad_stats(tensors)[1]) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_stats_of_no_tensors_is_zero(backend, monkeypatch):
    """The op itself needs a tensor to dispatch on; ort_optim.backends.grad_stats answers [0, 0] for an empty list."""
    select_backend(monkeypatch, backend)
    assert backends.grad_stats([]).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_stats_of_a_finite_sum_beyond_float32_is_inf_not_an_error(backend, monkeypatch):
    """grads around 1e20: finite float32 values whose sum of squares exceeds float32's range."""
    select_backend(monkeypatch, backend)
    stats = backends.grad_stats([torch.full((4,), 1e20)])
    assert math.isinf(float(stats[0])) and float(stats[1]) == 0.0


@requires_native
def test_grad_stats_does_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(300_000, generator=g) * 10.0 ** k for k in range(-3, 4)]
    tensors += [torch.randn(200_000, generator=g).half(), torch.randn(131_073, generator=g).bfloat16()]
    tensors += [torch.randn(1000, generator=g) for _ in range(24)]  # (short items: the threads' split by elements)
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 1):
            torch.set_num_threads(threads)
            results.append(torch.ops.ort_optim.grad_stats(tensors))
    finally:
        torch.set_num_threads(previous)
    for r in results[1:]:
        assert_bitwise_equal(r, results[0], "grad_stats with 1, 2 and 3 threads")


# ---- adam_step_: native vs fallback, threads, validation -----------------------------------------------------------


def _clone_args(args):
    return tuple([t.clone() for t in a] if isinstance(a, list) else a.clone() for a in args)


def _assert_args_equal(args, others, what):
    """The op's arguments (tensors and lists of tensors, as _clone_args copies them) bit for bit equal."""
    for a, b in zip(args, others):
        for x, y in zip(a, b) if isinstance(a, list) else [(a, b)]:
            assert_bitwise_equal(x, y, what)


def _dtype_combinations():
    cases = []
    for index, (param_dtype, grad_dtype, m_dtype, v_dtype) in enumerate(
            itertools.product((F32, F16, BF16), (F32, F16, BF16), (F32, BF16, F16), (F32, BF16, F16))):
        for master in ((False, True) if param_dtype in (F16, BF16) else (False,)):
            name = "-".join(str(d).replace("torch.", "") for d in (param_dtype, grad_dtype, m_dtype, v_dtype))
            cases.append(Sample(
                name + ("-master" if master else ""), param_dtype, grad_dtype, m_dtype, v_dtype, master=master,
                # rotate the flags through the combinations
                amsgrad=index % 2 == 0, mode=index % 3, maximize=index % 5 == 1,
                bias_correction=index % 7 != 3, lr_tensor=index % 4 == 1, inv_grad_scale=index % 3 == 2,
                grad_scale=(None, 64.0, None, 3.0)[index % 4],
            ))
    cases.append(Sample("float64", F64, F64, F64, F64, amsgrad=True, inv_grad_scale=True))
    cases.append(Sample("float64-L2", F64, F64, F64, F64, mode=0, maximize=True, lr_tensor=True))
    return cases


ULP = {F32: 2.0**-23, F64: 2.0**-52, F16: 2.0**-10, BF16: 2.0**-7}


@requires_native
@pytest.mark.parametrize("sample", _dtype_combinations(), ids=lambda s: s.name)
def test_native_op_and_fallback_agree_for_every_dtype_combination(sample):
    """Three steps on both. Both compute in float32 (float64); the native kernel may contract a*b+c into one fused
    multiply-add, so stored values may differ by one rounding of their storage dtype."""
    args, kwargs = sample.make(seed=zlib.crc32(sample.name.encode()) % 1000)
    native_args, fallback_args = _clone_args(args), _clone_args(args)
    for _ in range(3):
        torch.ops.ort_optim.adam_step_(*native_args, **kwargs)
        reference_backend.adam_step_(*fallback_args, **kwargs)
    (params, grads, ms, vs, vmaxs, masters, m_scales, v_scales, vmax_scales, steps) = native_args
    (fparams, fgrads, fms, fvs, fvmaxs, fmasters, fm_scales, fv_scales, fvmax_scales, fsteps) = fallback_args
    assert_bitwise_equal(steps, fsteps, "steps")
    for i, (g, fg, g0) in enumerate(zip(grads, fgrads, args[1])):  # unscaled in place three times, or untouched
        expected = g0
        for _ in range(3 if "grad_scale" in kwargs else 0):
            expected = (expected.float() / float(kwargs["grad_scale"])).to(g0.dtype)
        assert_bitwise_equal(g, expected, f"grads[{i}]")
        assert_bitwise_equal(fg, expected, f"fallback grads[{i}]")
    assert torch.equal(steps, args[9] + 3)
    # params and masters: float32 rounding of the updates (a few ulps of the largest update, which the random
    # moments of a first step can make much larger than lr) plus the storage roundings that the two computations
    # send different ways (each flip of a stored moment changes that update by about one state ulp)
    u_state = max(2.0**-11 if d == F16 else ULP[d] / 2 for d in (sample.m_dtype, sample.v_dtype))
    for i, (p, q) in enumerate(zip(params, fparams)):
        assert p.stride() == args[0][i].stride(), "non-contiguous params keep their layout"
        start = (args[5][i] if args[5] else args[0][i]).double()
        moved = float((q.double() - start).abs().max()) if q.numel() else 0.0
        atol = 4 * (ULP[F32] + u_state) * moved + 1e-30
        torch.testing.assert_close(p.double(), q.double(), rtol=2 * ULP[p.dtype], atol=atol)
        if masters:
            torch.testing.assert_close(masters[i], fmasters[i], rtol=4 * ULP[F32], atol=atol)
    for name, nat, fal, ns, fs in (("exp_avg", ms, fms, m_scales, fm_scales),
                                   ("exp_avg_sq", vs, fvs, v_scales, fv_scales),
                                   ("max_exp_avg_sq", vmaxs, fvmaxs, vmax_scales, fvmax_scales)):
        for i, (a, b) in enumerate(zip(nat, fal)):
            if a.dtype == F16:
                a_values, b_values = formats.dequantize_fp16(a, ns[i]), formats.dequantize_fp16(b, fs[i])
            else:
                a_values, b_values = a.double(), b.double()
            magnitude = float(b_values.abs().max()) if b_values.numel() else 0.0
            # one rounding of the storage dtype relative to the block / tensor maximum (fp16 codes: 11 bits)
            unit = 2.0**-11 if a.dtype == F16 else ULP[a.dtype]
            torch.testing.assert_close(a_values.double(), b_values.double(), rtol=0,
                                       atol=4 * unit * magnitude + 1e-30, msg=lambda m: f"{name}[{i}]: {m}")


@requires_native
def test_native_adam_step_does_not_depend_on_the_thread_count():
    """Work is split into 64K-element chunks over all tensors, and the chunks between the threads by their elements
    (many short tensors beside long ones here, so that 2 and 3 threads split them otherwise than by count); each
    element's arithmetic is fixed."""
    sample = Sample("threads", F16, F16, F16, BF16, master=True, amsgrad=True, inv_grad_scale=True,
                    shapes=((150_000,), (7,), (70_001,), (300, 400)) + ((1000,),) * 12)
    args, kwargs = sample.make()
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            run = _clone_args(args)
            torch.ops.ort_optim.adam_step_(*run, **kwargs)
            results.append(run)
    finally:
        torch.set_num_threads(previous)
    for other in results[1:]:
        _assert_args_equal(results[0], other, "1 vs 2 and 3 threads")


BETAS_TENSOR_CASES = [
    Sample("fp32", F32, F32, F32, F32),
    Sample("fp16-master-fp16-moments-amsgrad", F16, F16, F16, F16, master=True, amsgrad=True, mode=0),
    Sample("bf16-bf16-moments-hf", BF16, BF16, BF16, BF16, mode=1, maximize=True),
    Sample("fp64-lr-tensor", F64, F64, F64, F64, lr_tensor=True),
    Sample("fp32-no-bias-correction", F32, F32, F32, F32, bias_correction=False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sample", BETAS_TENSOR_CASES, ids=lambda s: s.name)
def test_betas_tensor_gives_the_float_betas_results_bit_for_bit(sample, backend, monkeypatch):
    """betas_tensor = float64 [beta1, beta2] replaces the float betas, bias corrections included: four steps whose
    beta1 changes at every step (as OneCycleLR's momentum) give the bits of the same steps with float betas."""
    select_backend(monkeypatch, backend)
    args, kwargs = sample.make(seed=5)
    floats, tensors = _clone_args(args), _clone_args(args)
    for beta1 in (0.95, 0.9375, 0.85, 0.9):
        backends.adam_step_(*floats, **dict(kwargs, beta1=beta1, beta2=0.99))
        betas = torch.tensor([beta1, 0.99], dtype=torch.float64)
        backends.adam_step_(*tensors, **dict(kwargs, beta1=0.0, beta2=0.0, betas_tensor=betas))
    _assert_args_equal(tensors, floats, "betas_tensor vs float betas")


WRONG_BETAS = {
    "float32": torch.tensor([0.9, 0.999]),
    "three-elements": torch.tensor([0.9, 0.999, 0.5], dtype=torch.float64),
    "shape-1x2": torch.tensor([[0.9, 0.999]], dtype=torch.float64),
    "0-dim": torch.tensor(0.9, dtype=torch.float64),
    "another-device": torch.empty(2, dtype=torch.float64, device="meta"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", WRONG_BETAS)
def test_a_wrong_betas_tensor_is_refused_before_anything_is_written(case, backend, monkeypatch):
    if backend == "native" and case == "another-device":
        pytest.skip("a meta tensor makes the dispatcher call the op's fake kernel; the native check of the device "
                    "needs a CUDA tensor")
    select_backend(monkeypatch, backend)
    args, kwargs = Sample("errors", F32, F32, F16, F32).make()
    before = _clone_args(args)
    with pytest.raises(RuntimeError, match=r"betas_tensor must be a float64 tensor of shape \[2\] \(beta1, beta2\) "
                                           r"on the steps' device \(cpu\), got"):
        backends.adam_step_(*args, **dict(kwargs, betas_tensor=WRONG_BETAS[case]))
    _assert_args_equal(args, before, "input")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flag", [1.0, -1.0, 0.5, float("inf"), float("nan")], ids=str)
def test_any_non_zero_found_inf_skips_the_step_and_writes_nothing(flag, backend, monkeypatch):
    """found_inf is a flag: any non-zero value (negative, fractional, inf, NaN) skips the step, as torch's fused
    optimizers read it; the gradients stay scaled."""
    select_backend(monkeypatch, backend)
    args, kwargs = Sample("skip", F16, F16, F16, F32, master=True, inv_grad_scale=True, grad_scale=64.0).make()
    before = _clone_args(args)
    backends.adam_step_(*args, **dict(kwargs, found_inf=torch.tensor([flag])))
    _assert_args_equal(args, before, f"input after found_inf={flag}")


BF16_PARAMS = Sample("bf16", BF16, BF16, F32, F32)
WRONG_ROUNDING_KEYS = {  # (sample, rounding keys for its params, what the error says)
    "int32": (BF16_PARAMS, lambda n: torch.zeros(n, dtype=torch.int32), r"rounding_keys must be a"),
    "one-too-many": (BF16_PARAMS, lambda n: torch.zeros(n + 1, dtype=torch.int64), r"rounding_keys must be a"),
    "0-dim": (BF16_PARAMS, lambda n: torch.tensor(0), r"rounding_keys must be a"),
    "fp32-params": (Sample("fp32", F32, F32, F32, F32), lambda n: torch.zeros(n, dtype=torch.int64),
                    r"rounding_keys \(stochastic rounding\) given but params\[0\] is .*float.*; stochastic rounding is "
                    r"for bfloat16 params without master weights"),
    "bf16-params-with-masters": (Sample("bf16-master", BF16, BF16, F32, F32, master=True),
                                 lambda n: torch.zeros(n, dtype=torch.int64),
                                 r"rounding_keys \(stochastic rounding\) given but params\[0\] is .*bfloat16.* with a "
                                 r"master weight; stochastic rounding is for bfloat16 params without master weights"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", WRONG_ROUNDING_KEYS)
def test_wrong_rounding_keys_are_refused_before_anything_is_written(case, backend, monkeypatch):
    """Stochastic rounding takes one int64 key per param, and only for bfloat16 params without master weights (the
    update is rounded into the param itself): anything else is a RuntimeError, with every input as it was."""
    select_backend(monkeypatch, backend)
    sample, keys, message = WRONG_ROUNDING_KEYS[case]
    args, kwargs = sample.make()
    before = _clone_args(args)
    with pytest.raises(RuntimeError, match=r"(?i)ort_optim::adam_step_: " + message):
        backends.adam_step_(*args, **dict(kwargs, rounding_keys=keys(len(args[0]))))
    _assert_args_equal(args, before, "input")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [3, -1])
def test_every_backend_refuses_an_adam_w_mode_it_has_no_update_for(mode, backend, monkeypatch):
    """adam_w_mode is 0, 1 or 2 (AdamWMode): another value is a RuntimeError on every backend, with every input as it
    was, rather than an update that takes none of the three decays."""
    select_backend(monkeypatch, backend)
    args, kwargs = Sample("fp32", F32, F32, F32, F32).make()
    before = _clone_args(args)
    with pytest.raises(RuntimeError, match=rf"ort_optim::adam_step_: adam_w_mode must be 0, 1 or 2, got {mode}"):
        backends.adam_step_(*args, **dict(kwargs, adam_w_mode=mode))
    _assert_args_equal(args, before, "input")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count,shown", [(-1.0, "-1"), (2.5, "2.5"), (-5.0, "-5"), (float("nan"), "nan"),
                                         (2.0**53 + 2, "9.0072e\\+15")], ids=str)
def test_every_backend_refuses_a_step_count_that_is_not_a_whole_number_in_range(count, shown, backend, monkeypatch):
    """A step count is a whole number in [0, 2**53]; one written in place that is not (the last param's here) is a
    ValueError naming it on every backend, with every input as it was (no param stepped before it)."""
    select_backend(monkeypatch, backend)
    args, kwargs = Sample("fp32", F32, F32, F32, F32).make()
    args[9][-1] = count
    before = _clone_args(args)
    last = len(args[0]) - 1
    with pytest.raises(ValueError, match=rf"ort_optim::adam_step_: steps\[{last}\] is {shown}; a step count is a whole "
                                         r"number in \[0, 2\*\*53\]"):
        backends.adam_step_(*args, **kwargs)
    _assert_args_equal(args, before, "input")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options,mutate,words", [c[1:] for c in MALFORMED_OP_CALLS],
                         ids=[c[0] for c in MALFORMED_OP_CALLS])
def test_every_backend_refuses_a_malformed_call_in_the_native_ops_words_before_writing(options, mutate, words, backend,
                                                                                      monkeypatch):
    """A call that breaks one of the op's rules for its inputs' structure (list lengths, shapes, dtypes, contiguity,
    masters, scales, steps, optional tensors: ops/README.md) is a RuntimeError on every backend, in the native op's
    words, with every tensor as it was: the reference and Triton backends make the native op's checks (one Python
    module, backends/_validation.py) before they write anything, as it does. (The native op's steps and rounding_keys
    live on the CPU; the Python backends take them on any device, and their words leave out "CPU".)"""
    select_backend(monkeypatch, backend)
    args, kwargs = op_arguments(**options)
    mutate(args, kwargs)
    before = _clone_args(args)
    expected = "ort_optim::adam_step_: " + (words if backend == "native" else words.replace(" CPU tensor", " tensor"))
    with pytest.raises(RuntimeError) as refused:
        backends.adam_step_(*args, **kwargs)
    assert str(refused.value) == expected
    _assert_args_equal(args, before, "input")


def _without(index):
    def mutate(args, kwargs):
        args[index].pop()
    return mutate


OP_ERRORS = [
    ("grads-list-too-short", _without(1), r"grads has 4 tensors but params has 5"),
    ("scales-for-a-non-fp16-state",
     lambda a, k: a[7].extend(torch.ones(formats.num_blocks(p.numel())) for p in a[0]),
     r"exp_avg_sq_scales\[0\] is given but the state it scales is Float, not float16"),
    ("wrong-number-of-block-scales", lambda a, k: a[6].__setitem__(3, torch.ones(a[6][3].numel() + 1)),
     r"exp_avg_scales\[3\] must be a contiguous float32 tensor of 2 block scales"),
    ("master-for-an-fp32-param", lambda a, k: a[5].extend(p.float() for p in a[0]),
     r"master_params given but params\[0\] is Float"),
    ("steps-not-float64", lambda a, k: a.__setitem__(9, a[9].float()), r"steps must be a contiguous float64 CPU"),
    ("grad-wrong-shape", lambda a, k: a[1].__setitem__(1, torch.zeros(8)),
     r"grads\[1\] has shape \[8\] but params\[1\] has shape \[7\]"),
    # a sparse tensor makes the dispatcher look for a SparseCPU kernel, which the op does not register: it never
    # reaches the kernel's own check (FusedAdam checks in Python and names the param)
    ("sparse-grad", lambda a, k: a[1].__setitem__(1, torch.zeros(7).to_sparse()),
     r"Could not run 'ort_optim::adam_step_' with arguments from the 'SparseCPU' backend"),
    ("non-contiguous-state", lambda a, k: a[2].__setitem__(4, torch.zeros(4, 3).t()),
     r"exp_avgs\[4\] must be contiguous"),
    ("bad-mode", lambda a, k: k.__setitem__("adam_w_mode", 3), r"adam_w_mode must be 0, 1 or 2, got 3"),
    ("float64-mixed-with-float32", lambda a, k: (a[0].append(torch.zeros(2, dtype=F64)),
                                                 a[1].append(torch.zeros(2, dtype=F64)),
                                                 a[2].append(torch.zeros(2, dtype=F64)),
                                                 a[3].append(torch.zeros(2, dtype=F64)),
                                                 a[6].append(torch.ones(1)),
                                                 a[9].__setitem__(slice(None), 0)) and None,
     r"steps must be a contiguous float64 CPU tensor of shape \[6\]"),
]


@requires_native
@pytest.mark.parametrize("mutate,message", [c[1:] for c in OP_ERRORS], ids=[c[0] for c in OP_ERRORS])
def test_the_op_validates_everything_before_writing(mutate, message):
    args, kwargs = Sample("errors", F32, F32, F16, F32).make()
    args = list(args)
    mutate(args, kwargs)
    before = [[t.clone() for t in a] if isinstance(a, list) else a.clone() for a in args]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.ort_optim.adam_step_(*args, **kwargs)
    _assert_args_equal(args, before, "input")


# ---- QUANT_BLOCK ---------------------------------------------------------------------------------------------------


@requires_native
@pytest.mark.parametrize("numel", [1, QUANT_BLOCK - 1, QUANT_BLOCK, QUANT_BLOCK + 1, 3 * QUANT_BLOCK + 7])
def test_the_native_fp16_block_size_equals_quant_block(numel):
    """The op accepts exactly ceil(numel / QUANT_BLOCK) scales per fp16 state, and the scale of block b covers
    elements [b * QUANT_BLOCK, (b + 1) * QUANT_BLOCK)."""
    blocks = math.ceil(numel / QUANT_BLOCK)
    sample = Sample("block", F32, F32, F16, F32, shapes=((numel,),))
    for wrong in (blocks - 1, blocks + 1):
        args, kwargs = sample.make()
        args[6][0] = torch.ones(wrong)
        with pytest.raises(RuntimeError, match=f"of {blocks} block scales"):
            torch.ops.ort_optim.adam_step_(*args, **kwargs)
    args, kwargs = sample.make()
    # each block's gradients have their own magnitude, so every block gets its own scale
    args[1][0] = (torch.randn(numel) * 256.0 ** (torch.arange(numel) // QUANT_BLOCK)).float()
    torch.ops.ort_optim.adam_step_(*args, **kwargs)
    codes, scales = args[2][0], args[6][0]
    assert scales.shape == (blocks,)
    assert_bitwise_equal(scales, formats.fp16_block_scales(formats.dequantize_fp16(codes, scales)), "scales")
    if blocks > 1:
        assert len(set(scales.tolist())) == blocks


def test_the_triton_block_size_equals_quant_block():
    try:
        from ort_optim.backends import triton as triton_backend
    except ImportError as exc:  # pragma: no cover - triton is optional
        pytest.skip(f"ort_optim.backends.triton does not import here: {exc}")
    if not hasattr(triton_backend, "BLOCK"):
        pytest.skip("ort_optim.backends.triton has no BLOCK constant")
    assert triton_backend.BLOCK == QUANT_BLOCK


# ---- params that share memory --------------------------------------------------------------------------------------


def _overlapping_cases():
    def same_buffer_twice():
        base = torch.randn(10)
        return [torch.nn.Parameter(base), torch.nn.Parameter(base)], (0, 1)

    def overlapping_slices():
        base = torch.randn(10)
        return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])], (1, 2)

    def interleaved_views_sharing_an_element():
        base = torch.randn(4, 12)
        return [torch.nn.Parameter(base[:, ::2]), torch.nn.Parameter(base[:, ::3])], (0, 1)

    def expanded_param():
        return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(1).expand(5))], (1, None)

    def param_and_its_transpose_in_two_groups():
        base = torch.randn(3, 4)
        return [{"params": [torch.nn.Parameter(base)]}, {"params": [torch.nn.Parameter(base.t())]}], ((0, 0), (1, 0))

    return {f.__name__.replace("_", "-"): f for f in (same_buffer_twice, overlapping_slices,
                                                       interleaved_views_sharing_an_element, expanded_param,
                                                       param_and_its_transpose_in_two_groups)}


OVERLAPPING = _overlapping_cases()


@pytest.mark.parametrize("backend", ("auto",) + BACKENDS)
@pytest.mark.parametrize("case", OVERLAPPING, ids=str)
def test_params_that_share_memory_are_refused_naming_both(case, backend, monkeypatch):
    """A multi-tensor step would update shared elements twice (or race). Refused at the first step
    with both params named, before anything changes."""
    if backend == "auto":
        monkeypatch.delenv("ORT_OPTIM_BACKEND", raising=False)
    else:
        select_backend(monkeypatch, backend)
    params, (a, b) = OVERLAPPING[case]()
    opt = FusedAdam(params)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones(p.shape)
    a = a if isinstance(a, tuple) else (0, a)
    before = optimizer_snapshot(opt)
    if b is None:
        message = rf"param_groups\[{a[0]}\]\['params'\]\[{a[1]}\] .*: its elements overlap in memory"
    else:
        b = b if isinstance(b, tuple) else (0, b)
        message = (rf"param_groups\[{a[0]}\]\['params'\]\[{a[1]}\] .* and "
                   rf"param_groups\[{b[0]}\]\['params'\]\[{b[1]}\] .* share memory")
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert_same_snapshot(before, optimizer_snapshot(opt))


@pytest.mark.parametrize("skipped", [False, True], ids=["taken", "skipped-by-found-inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_op_refuses_an_expanded_param_before_anything_is_written(backend, skipped, monkeypatch):
    """An expand()ed param cannot receive one value per element: the op itself (for callers other than FusedAdam,
    which refuses it first) says so before any state is written, whether or not found_inf skips the step."""
    select_backend(monkeypatch, backend)
    args, kwargs = Sample("errors", F32, F32, F16, F32).make()
    args[0][1] = torch.randn(1).expand(args[0][1].shape)
    if skipped:
        kwargs = dict(kwargs, found_inf=torch.ones(1))
    before = _clone_args(args)
    with pytest.raises(RuntimeError, match=r"params\[1\] overlaps itself \(an expand\(\)ed tensor\), so it cannot "
                                           r"hold one updated value per element"):
        backends.adam_step_(*args, **kwargs)
    _assert_args_equal(args, before, "input")


@pytest.mark.parametrize("alias", ["itself", "part of it"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_op_refuses_with_grad_scale_a_gradient_in_its_params_memory_before_anything_is_written(backend, alias,
                                                                                                     monkeypatch):
    """A gradient that shares memory with its param (p.grad = p.detach(), or a view over part of its elements)
    cannot take the unscaled gradient the op writes back with grad_scale: the param cannot hold both. The op itself
    (for callers other than FusedAdam, which refuses it first where it steps several buckets) says so before any
    tensor is written."""
    select_backend(monkeypatch, backend)
    args, kwargs = Sample("errors", F32, F32, F32, F32, grad_scale=64.0).make()
    params, grads = args[0], args[1]
    if alias == "itself":
        grads[1] = params[1]
    else:
        buffer = torch.randn(2 * params[1].numel())
        params[1] = buffer[:params[1].numel()]
        grads[1] = buffer[3:3 + params[1].numel()]
    before = _clone_args(args)
    with pytest.raises(RuntimeError, match=r"grads\[1\] shares memory with the param itself \(p.grad = "
                                           r"p.detach\(\), or a view of it\), so a step with grad_scale cannot"):
        backends.adam_step_(*args, **kwargs)
    _assert_args_equal(args, before, "input")


DISJOINT = {
    "contiguous-halves": lambda base: [base[:2], base[2:]],
    "interleaved-columns": lambda base: [base[:, ::2], base[:, 1::2]],
    "rows-and-a-column-block": lambda base: [base[0], base[1:, :3], base[1:, 3:]],
}


@pytest.mark.parametrize("backend", ("auto",) + BACKENDS)
@pytest.mark.parametrize("case", DISJOINT, ids=str)
def test_disjoint_views_of_one_buffer_are_updated_like_separate_params(case, backend, monkeypatch):
    """The supported shared-buffer case (e.g. one flat buffer split into params): bit for bit the result of
    separately allocated params."""
    if backend == "auto":
        monkeypatch.delenv("ORT_OPTIM_BACKEND", raising=False)
    else:
        select_backend(monkeypatch, backend)
    base = torch.randn(4, 6)
    views = [torch.nn.Parameter(v) for v in DISJOINT[case](base)]
    separate = [torch.nn.Parameter(v.detach().clone()) for v in views]
    opts = [FusedAdam(ps, lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.bfloat16) for ps in (views, separate)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p, q in zip(views, separate):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        for o in opts:
            o.step()
    for p, q in zip(views, separate):
        assert_bitwise_equal(p.detach(), q.detach(), "param")
    assert views[0].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# ---- torch.compile -------------------------------------------------------------------------------------------------


COMPILE_SKIP = pytest.mark.skipif(TORCH_VERSION < (2, 5),
                                  reason="torch 2.4 cannot compile custom ops that mutate tensor lists")


@requires_native
@COMPILE_SKIP
@pytest.mark.parametrize("target", ["op", "fused-adam-step"])
def test_torch_compile_gives_the_eager_result(target, monkeypatch):
    _compare_compiled_with_eager(target, monkeypatch)


def _compare_compiled_with_eager(target, monkeypatch):
    monkeypatch.delenv("ORT_OPTIM_BACKEND", raising=False)
    torch._dynamo.reset()
    if target == "op":
        sample = Sample("compile", F16, F16, F16, F32, master=True, amsgrad=True, inv_grad_scale=True)
        args, kwargs = sample.make()
        eager, compiled = _clone_args(args), _clone_args(args)

        def step(*a):
            torch.ops.ort_optim.adam_step_(*a, **kwargs)

        for _ in range(2):
            step(*eager)
            torch.compile(step, fullgraph=True)(*compiled)
        _assert_args_equal(eager, compiled, "compiled vs eager")
    else:
        g = torch.Generator().manual_seed(4)
        values = [torch.randn(40, generator=g), torch.randn(3, 5, generator=g).half()]
        params = {name: [torch.nn.Parameter(v.clone()) for v in values] for name in ("eager", "compiled")}
        opts = {name: FusedAdam(ps, lr=1e-2, weight_decay=0.1, master_weights=True) for name, ps in params.items()}
        compiled_step = torch.compile(opts["compiled"].step)
        for _ in range(3):
            grads = [torch.randn(v.shape, generator=g).to(v.dtype) for v in values]
            for name in params:
                for p, grad in zip(params[name], grads):
                    p.grad = grad.clone()
            opts["eager"].step()
            compiled_step()
        for p, q in zip(params["eager"], params["compiled"]):
            assert_bitwise_equal(p.detach(), q.detach(), "param")
            for key in opts["eager"].state[p]:
                assert_bitwise_equal(opts["eager"].state[p][key], opts["compiled"].state[q][key], key)
