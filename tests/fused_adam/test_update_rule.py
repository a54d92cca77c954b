"""FusedAdam's update rule, as a specification.

* Every AdamWMode matches its own float64 formula (tests/reference.py) for 200 steps, for every param dtype (with and
  without fp32 master weights), on both CPU backends, over a parameter set with the shapes that broke other fused
  optimizers (0-dim, empty in the middle and LAST, odd sizes, a param larger than one 64K-element work chunk,
  transposed / strided / channels_last views), with an LR schedule and lr as float or 0-dim tensor.
* The native op and the pure-PyTorch fallback agree bit for bit; any configuration (sizes, layouts, dtypes, moment
  formats, options, clipping, loss scales, gradients with inf and NaN) steps alike on two backends (a property).
* ADAMW_TORCH is torch.optim.AdamW (also with amsgrad and maximize).
* Step counts are per parameter; params without a gradient are skipped entirely.
* Bad hyperparameters and bad gradients raise a clear error naming the option or the parameter, and a failed step
  changes nothing.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from cases import configurations, gradient, gradients
from conftest import (BACKENDS, LONG_RUN_BACKENDS, assert_bitwise_equal, assert_same_history, assert_same_snapshot,
                      assert_same_snapshot_but_nan_bits, fuzz_examples, optimizer_snapshot, select_backend,
                      state_values)
from reference import ReferenceAdam

from ort_optim import AdamWMode, FusedAdam, GradientError

MODES = {"L2": AdamWMode.ADAM_L2_REGULARIZATION, "HF": AdamWMode.ADAMW_TRANSFORMERS, "torch": AdamWMode.ADAMW_TORCH}
STEPS = 200
BASE_LR = 2e-3
WEIGHT_DECAY = 0.1
EPS = 1e-4  # large enough that putting eps on the wrong side of the bias-corrected sqrt fails every tolerance
BETAS = (0.9, 0.999)


def lr_lambda(step: int) -> float:
    """The schedule of the parity runs: linear warm-up over 10 steps, then 1% decay per step."""
    return min(1.0, (step + 1) / 10) * 0.99 ** max(0, step - 10)


# ---- the parameter set ---------------------------------------------------------------------------------------------


def make_params(dtype: torch.dtype, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    """Named params covering the layouts that fused optimizers get wrong (strided, channels-last, empty)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        # magnitude 0.1: a 2e-3 update is larger than a bf16 ulp there, so low-precision params really move
        return (0.1 * torch.randn(shape, generator=g, dtype=torch.float32)).to(dtype)

    big = randn(6, 10)
    return [
        ("zero-dim", torch.nn.Parameter(randn())),
        ("odd-7", torch.nn.Parameter(randn(7))),
        ("empty-middle", torch.nn.Parameter(randn(0))),
        ("matrix-3x5", torch.nn.Parameter(randn(3, 5))),
        ("two-blocks-1025", torch.nn.Parameter(randn(1025))),  # crosses an fp16-state block boundary
        ("large-70001", torch.nn.Parameter(randn(70001))),  # more than one 65536-element work chunk
        ("transposed", torch.nn.Parameter(randn(5, 4).t())),
        ("strided-slice", torch.nn.Parameter(big[:, ::2])),  # non-contiguous view of a bigger buffer
        ("channels-last", torch.nn.Parameter(randn(2, 3, 4, 3).to(memory_format=torch.channels_last))),
        # an empty tensor LAST in the list: a multi-tensor kernel can drop the others
        ("empty-last", torch.nn.Parameter(randn(0, 3))),
    ]


GRAD_SCALES = (1.0, 3e-3, 1.0, 0.5, 2e-2, 1.0, 0.1, 1.0, 0.3, 1.0)  # per-param gradient magnitudes


def make_grads(params: list[torch.Tensor], step: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100003 + step)
    grads = []
    for p, scale in zip(params, GRAD_SCALES):
        grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)
        if p.dim() == 2:
            grad = grad.t().contiguous().t()  # column-major gradients: non-contiguous ones for contiguous params too
        grads.append(grad)
    return grads


# ---- configurations and tolerances ---------------------------------------------------------------------------------


# float32 arithmetic: each step rounds the param and per-step scalars such as (1 - lr*wd) to float32; in the worst case
# those roundings all lean the same way, so after STEPS steps the relative drift from float64 is STEPS * 2 ulps.
FP32_DRIFT = 2 * STEPS * 2.0**-24
FP64_DRIFT = 2 * STEPS * 2.0**-53
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # relative spacing just above a power of two


@dataclass(frozen=True)
class DtypeCase:
    name: str
    dtype: torch.dtype
    master_weights: bool
    # parameter tolerance against the float64 reference after 200 steps. The reference rounds params and moments to
    # their storage dtypes exactly as specified, so what is left is the float32 (float64) arithmetic and the rare
    # storage rounding that this arithmetic sends the other way.
    atol: float
    rtol: float


DTYPE_CASES = [
    DtypeCase("fp32", torch.float32, False, atol=1e-7, rtol=FP32_DRIFT),
    DtypeCase("fp64", torch.float64, False, atol=1e-15, rtol=FP64_DRIFT),
    # fp16/bf16 params without masters hold the value itself: a rounding flipped by float32 noise moves the param
    # by one ulp of its dtype, and a few flips may add up over 200 steps: 4 ulps (atol: 4 ulps at magnitude 2**-4)
    DtypeCase("fp16", torch.float16, False, atol=4 * 2.0**-14, rtol=4 * ULP[torch.float16]),
    DtypeCase("bf16", torch.bfloat16, False, atol=4 * 2.0**-11, rtol=4 * ULP[torch.bfloat16]),
    # with fp32 masters the param is the master rounded once: at most one ulp of the param dtype off
    DtypeCase("fp16-master", torch.float16, True, atol=1e-6, rtol=ULP[torch.float16] + FP32_DRIFT),
    DtypeCase("bf16-master", torch.bfloat16, True, atol=1e-5, rtol=ULP[torch.bfloat16] + FP32_DRIFT),
]


def moment_atol(dtype: torch.dtype, magnitude: float) -> float:
    """Absolute tolerance of a moment stored in ``dtype`` whose largest element is ``magnitude``: a few roundings of
    the storage dtype (fp16 codes have 11 significant bits relative to their block's scale), or, for fp32/fp64
    states, the float arithmetic that the second moment's long average accumulates over STEPS steps."""
    per_rounding = {torch.float64: FP64_DRIFT, torch.float32: FP32_DRIFT, torch.float16: 4 * 2.0**-11,
                    torch.bfloat16: 4 * 2.0**-8}[dtype]
    return per_rounding * magnitude + 1e-30


@dataclass(frozen=True)
class Variant:
    name: str
    amsgrad: bool
    maximize: bool
    lr_tensor: bool


VARIANTS = [Variant("plain-float-lr", False, False, False), Variant("amsgrad-maximize-tensor-lr", True, True, True)]


@dataclass(frozen=True)
class ParityConfig:
    case: DtypeCase
    mode: str
    variant: Variant

    @property
    def id(self) -> str:
        return f"{self.case.name}-{self.mode}-{self.variant.name}"


# Each (dtype, mode) pair runs one variant; the variants alternate so that every mode and every dtype sees both.
PARITY_CONFIGS = [
    ParityConfig(case, mode, VARIANTS[(ci + mi) % len(VARIANTS)])
    for ci, case in enumerate(DTYPE_CASES)
    for mi, mode in enumerate(MODES)
]


def _parity_params():
    """PARITY_CONFIGS as test parameters. A config's 200 steps and its float64 reference take about 1.5 s, so the fast
    tier runs one mode per dtype (the modes in turn: every dtype once, every mode with both variants) and the slow
    tier the other pairs."""
    for ci, case in enumerate(DTYPE_CASES):
        for mi, mode in enumerate(MODES):
            config = PARITY_CONFIGS[ci * len(MODES) + mi]
            marks = [] if mi == ci % len(MODES) else [pytest.mark.slow]
            yield pytest.param(config, marks=marks, id=config.id)


@dataclass
class Run:
    names: list[str]
    params: list[torch.Tensor]
    states: list[dict]
    lrs: list[float]


def _lr_value(step: int, lr_tensor: bool) -> float:
    """The lr the scheduler gives at this step (LambdaLR: initial lr times the lambda; for a float32 lr tensor that
    product is a float32 tensor operation)."""
    if lr_tensor:
        return float(torch.tensor(BASE_LR, dtype=torch.float32) * lr_lambda(step))
    return BASE_LR * lr_lambda(step)


@functools.lru_cache(maxsize=None)
def _reference(config: ParityConfig) -> tuple[ReferenceAdam, list[str]]:
    """The float64 reference on the same params and gradients (shared by both backends' tests)."""
    named = make_params(config.case.dtype)
    params = [p for _, p in named]
    reference = ReferenceAdam(
        params, lr=BASE_LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, mode=int(MODES[config.mode]),
        amsgrad=config.variant.amsgrad, maximize=config.variant.maximize,
        master_weights=config.case.master_weights,
    )
    for step in range(STEPS):
        reference.step(make_grads(params, step), lr=_lr_value(step, config.variant.lr_tensor))
    return reference, [n for n, _ in named]


@functools.lru_cache(maxsize=None)
def _run(config: ParityConfig, backend: str) -> Run:
    """200 steps of FusedAdam with an LR schedule (cached: the agreement test compares the backends' runs)."""
    named = make_params(config.case.dtype)
    params = [p for _, p in named]
    lr = torch.tensor(BASE_LR) if config.variant.lr_tensor else BASE_LR
    opt = FusedAdam(
        params, lr=lr, betas=BETAS, eps=EPS, adam_w_mode=MODES[config.mode], weight_decay=WEIGHT_DECAY,
        amsgrad=config.variant.amsgrad, maximize=config.variant.maximize,
        master_weights=config.case.master_weights,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    lrs = []
    for step in range(STEPS):
        for p, g in zip(params, make_grads(params, step)):
            p.grad = g
        group_lr = opt.param_groups[0]["lr"]
        assert isinstance(group_lr, torch.Tensor) == config.variant.lr_tensor  # the scheduler keeps a tensor lr
        assert math.isclose(float(group_lr), _lr_value(step, config.variant.lr_tensor), rel_tol=1e-6), step
        lrs.append(float(group_lr))
        opt.step()
        scheduler.step()
    states = [{k: (state_values(opt, p, k) if "exp_avg" in k else v).clone() for k, v in opt.state[p].items()
               if not k.endswith("_scale")} for p in params]
    return Run([n for n, _ in named], [p.detach().clone() for p in params], states, lrs)


def run_parity(config: ParityConfig, backend: str, monkeypatch) -> Run:
    select_backend(monkeypatch, backend)
    return _run(config, backend)


@pytest.mark.parametrize("backend", LONG_RUN_BACKENDS)
@pytest.mark.parametrize("config", list(_parity_params()))
def test_every_mode_and_dtype_matches_the_float64_reference_for_200_steps(config, backend, monkeypatch):
    run = run_parity(config, backend, monkeypatch)
    reference, _ = _reference(config)
    case = config.case
    for i, (name, p) in enumerate(zip(run.names, run.params)):
        assert p.dtype == case.dtype
        expected = reference.param(i)
        torch.testing.assert_close(p.double(), expected, atol=case.atol, rtol=case.rtol,
                                   msg=lambda m: f"param {name!r}: {m}")
        assert float(run.states[i]["step"]) == STEPS, name
    # the moments, within their storage dtype's precision (the reference rounds them the same way)
    for i, name in enumerate(run.names):
        ref_state = reference.states[i]
        m_dtype, v_dtype, _ = reference.layouts[i]
        for key, ref_key, dtype in (("exp_avg", "m", m_dtype), ("exp_avg_sq", "v", v_dtype),
                                    ("max_exp_avg_sq", "vmax", v_dtype)):
            if key not in run.states[i]:
                assert key == "max_exp_avg_sq" and not config.variant.amsgrad, (name, key)
                continue
            expected = ref_state[ref_key]
            magnitude = float(expected.abs().max()) if expected.numel() else 0.0
            torch.testing.assert_close(run.states[i][key].double(), expected, rtol=0,
                                       atol=moment_atol(dtype, magnitude), msg=lambda m: f"{key} of {name!r}: {m}")


@pytest.mark.parametrize("config", list(_parity_params()))
def test_native_op_and_fallback_agree_bit_for_bit_for_200_steps(config, monkeypatch):
    """Both CPU backends round every multiply and add on its own (the native kernel is built without floating-point
    contraction), in the same order, so 200 steps leave the same bits in every param and moment."""
    native = run_parity(config, "native", monkeypatch)
    fallback = run_parity(config, "torch", monkeypatch)
    assert native.lrs == fallback.lrs
    for name, a, b, state_a, state_b in zip(native.names, native.params, fallback.params, native.states,
                                             fallback.states):
        assert_bitwise_equal(a, b, f"param {name!r}")
        assert state_a.keys() == state_b.keys(), name
        for key in state_a:
            assert_bitwise_equal(state_a[key], state_b[key], f"{key} of {name!r}")
        assert float(state_a["step"]) == STEPS, name


# The two backends the property compares: the native kernel and the reference backend; in the Triton suite
# (ORT_OPTIM_BACKEND=triton, Triton's interpreter), the Triton kernels and the native kernel, fewer examples.
PROPERTY_BACKENDS = ("triton", "native") if BACKENDS == ("triton",) else ("native", "torch")


@settings(max_examples=fuzz_examples(30 if BACKENDS == ("triton",) else 150), deadline=None, derandomize=True,
          database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_property_any_configuration_steps_alike_on_two_backends(data):
    """Any mix of param sizes (around every block and vector width the kernels split by), layouts, param dtypes,
    master weights, moment dtypes, modes, per-group options, clipping, loss scales and gradients (tiny, huge,
    overflowing v, with inf and NaN elements, missing): two backends (PROPERTY_BACKENDS) take every step to the same
    bits in every param, gradient and state and report the same found_inf and skip (and gradient norm, within
    float32 summation order, where both report one), or both refuse it with the same exception and message, changing
    nothing. (A NaN is compared as NaN: its sign and payload are not specified.)"""
    config = data.draw(configurations(), "configuration")
    steps = [(data.draw(gradients(len(config.sizes)), "gradients"),
              data.draw(st.sampled_from((None, 1024.0, 0.5, "tensor")), "grad_scale"))
             for _ in range(data.draw(st.integers(1, 3), "steps"))]

    histories, norms = [], []
    for backend in PROPERTY_BACKENDS:
        with pytest.MonkeyPatch.context() as patch:
            select_backend(patch, backend)
            history, reported = _drawn_steps(config, steps)
        histories.append(history)
        norms.append(reported)
    assert_same_history(*histories)
    # the norm where both backends report one (the reference backend does not in a plain step), each summed in its
    # own order
    for a, b in zip(*norms):
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0, equal_nan=True)


def _drawn_steps(config, steps) -> tuple[list, list]:
    """The drawn configuration stepped with each drawn gradient list and grad_scale on the selected backend: per step
    a snapshot with found_inf and the skip flag (or ("refused", type, message), ending the run, after checking that
    the refused step changed nothing), and the reported gradient norm."""
    params = config.params()
    try:
        opt = FusedAdam(config.param_groups(params), **config.options)
    except (ValueError, TypeError) as error:
        return [("refused", type(error), str(error))], []
    history, norms = [], []
    for k, (grads, grad_scale) in enumerate(steps):
        for i, (p, grad) in enumerate(zip(params, grads)):
            p.grad = None if grad is None else gradient(p, grad, 1000 * k + i)
        scale = torch.tensor(4096.0) if grad_scale == "tensor" else grad_scale
        before = optimizer_snapshot(opt)
        try:
            opt.step(**({} if scale is None else {"grad_scale": scale}))
        except (ValueError, TypeError, RuntimeError) as error:
            assert_same_snapshot_but_nan_bits(optimizer_snapshot(opt), before)
            history.append(("refused", type(error), str(error)))
            break
        found_inf, norm = opt.last_found_inf, opt.last_grad_norm
        history.append(optimizer_snapshot(opt) | {"last_found_inf": None if found_inf is None else found_inf.clone(),
                                                  "last_step_skipped": opt.last_step_skipped})
        norms.append(None if norm is None else norm.clone())
    return history, norms


def test_the_parity_tolerances_can_tell_the_modes_apart():
    """Guards the parity test's power: swapping the weight-decay mode or the eps placement moves the params far
    beyond the fp32 tolerance within 20 steps."""
    params = [p for _, p in make_params(torch.float32)][:5]
    finals = {}
    for mode in MODES.values():
        reference = ReferenceAdam(params, lr=BASE_LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, mode=int(mode))
        for step in range(20):
            reference.step(make_grads(params, step))
        finals[mode] = torch.cat([reference.param(i).reshape(-1) for i in range(len(params))])
    fp32 = DTYPE_CASES[0]
    for a in MODES.values():
        for b in MODES.values():
            if a < b:
                gap = (finals[a] - finals[b]).abs() - (fp32.atol + fp32.rtol * finals[b].abs())
                assert float(gap.max()) > 100 * fp32.atol, (a, b)


# ---- torch.optim.AdamW ---------------------------------------------------------------------------------------------

TORCH_VARIANTS = {
    "plain": dict(amsgrad=False, maximize=False),
    "amsgrad": dict(amsgrad=True, maximize=False),
    "maximize": dict(amsgrad=False, maximize=True),
    "amsgrad-maximize": dict(amsgrad=True, maximize=True),
}
# Both run float32 (float64) arithmetic but torch divides sqrt(v) by sqrt(bc2) and uses addcdiv where the kernel
# folds differently, so each step may differ by an ulp or two.
TORCH_TOLERANCES = {torch.float32: dict(atol=1e-7, rtol=FP32_DRIFT), torch.float64: dict(atol=1e-15, rtol=FP64_DRIFT)}


def _torch_mode_params():
    """(dtype, variant, backend) for the 300-step comparison with torch.optim.AdamW (0.5-2.7 s each): the fast tier
    runs every variant on every backend, the dtypes in turn; the slow tier the other dtype."""
    dtypes = {"fp32": torch.float32, "fp64": torch.float64}
    for di, (dtype_id, dtype) in enumerate(dtypes.items()):
        for vi, variant in enumerate(TORCH_VARIANTS):
            for bi, backend in enumerate(BACKENDS):
                marks = [] if di == (vi + bi) % len(dtypes) else [pytest.mark.slow]
                yield pytest.param(dtype, variant, backend, marks=marks, id=f"{dtype_id}-{variant}-{backend}")


@pytest.mark.parametrize("dtype,variant,backend", list(_torch_mode_params()))
def test_adamw_torch_mode_is_torch_optim_adamw(dtype, variant, backend, monkeypatch):
    """FusedAdam(adam_w_mode=ADAMW_TORCH, eps=1e-8, weight_decay=1e-2) == torch.optim.AdamW(foreach=False) over 300
    steps with an LR schedule, on the full parameter set."""
    select_backend(monkeypatch, backend)
    ours = [p for _, p in make_params(dtype)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = dict(lr=1e-3, betas=BETAS, **TORCH_VARIANTS[variant])
    opt = FusedAdam(ours, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2, **kwargs)
    ref = torch.optim.AdamW(theirs, eps=1e-8, weight_decay=1e-2, foreach=False, **kwargs)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in (opt, ref)]
    for step in range(300):
        for a, b, g in zip(ours, theirs, make_grads(ours, step)):
            a.grad, b.grad = g, g.clone()
        opt.step()
        ref.step()
        for s in schedules:
            s.step()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b.detach(), **TORCH_TOLERANCES[dtype], msg=lambda m: f"param {i}: {m}")
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kwargs["amsgrad"] else ()):
            expected = ref.state[b][key]
            magnitude = float(expected.abs().max()) if expected.numel() else 0.0
            torch.testing.assert_close(opt.state[a][key], expected, rtol=0, atol=moment_atol(dtype, magnitude))
        assert float(opt.state[a]["step"]) == float(ref.state[b]["step"]) == 300


@pytest.mark.parametrize("backend", BACKENDS)
def test_amsgrads_running_maximum_turns_nan_where_torchs_does(backend, monkeypatch):
    """A NaN gradient that nothing skips makes v NaN in both; amsgrad's running maximum then turns NaN where
    torch.optim.AdamW's torch.maximum does, and stays NaN (params finite elsewhere, both optimizers alike)."""
    select_backend(monkeypatch, backend)
    g = torch.Generator().manual_seed(5)
    ours = [torch.nn.Parameter(torch.randn(40, generator=g))]
    theirs = [torch.nn.Parameter(ours[0].detach().clone())]
    opt = FusedAdam(ours, lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2, amsgrad=True)
    ref = torch.optim.AdamW(theirs, lr=1e-2, eps=1e-8, weight_decay=1e-2, amsgrad=True, foreach=False)
    for step in range(5):
        grad = torch.randn(40, generator=g)
        if step == 2:
            grad[[3, 17]] = float("nan")
        ours[0].grad, theirs[0].grad = grad, grad.clone()
        opt.step()
        ref.step()
    expected = ref.state[theirs[0]]["max_exp_avg_sq"]
    assert expected[[3, 17]].isnan().all()
    ours_vmax = opt.state[ours[0]]["max_exp_avg_sq"]
    assert torch.equal(ours_vmax.isnan(), expected.isnan())
    assert torch.equal(ours[0].isnan(), theirs[0].isnan())
    finite = ~expected.isnan()
    torch.testing.assert_close(ours_vmax[finite], expected[finite], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[0][finite], theirs[0].detach()[finite], **TORCH_TOLERANCES[torch.float32])


# ---- per-parameter steps -------------------------------------------------------------------------------------------


def _two_params(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(6, generator=g, dtype=dtype)),
            torch.nn.Parameter(torch.randn(3, 2, generator=g, dtype=dtype))]


def _lerp_f32(m: np.ndarray, g: np.ndarray, beta1: float) -> np.ndarray:
    """torch's lerp of m towards g by the weight w = float32(1 - beta1), every operation rounded to float32 on its
    own: m + w * (g - m) for w < 0.5, else g + (w - 1) * (g - m) (as torch's vectorised lerp forms it)."""
    w = np.float32(1.0 - beta1)
    if w < 0.5:
        return m + w * (g - m)
    return g + (w - np.float32(1.0)) * (g - m)


@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.5, 0.6, 0.9])
def test_exp_avg_is_torchs_lerp_of_the_gradient_for_every_beta1(beta1, backend):
    """exp_avg.lerp_(grad, 1 - beta1), as torch.optim.AdamW forms it: for weights of 0.5 and more (beta1 <= 0.5) torch's
    lerp takes the form grad - (1 - w) * (grad - exp_avg), which keeps a small gradient after a huge one where
    exp_avg + w * (grad - exp_avg) cancels it: with beta1 = 0, exp_avg is the gradient itself, bit for bit. Bit for bit
    the separately rounded float32 formula of each form, and within float32 rounding of torch's own lerp_ (which
    fuses the multiply-add)."""
    gen = torch.Generator().manual_seed(5)
    grads = [1e8 * torch.randn(300, generator=gen), torch.randn(300, generator=gen), torch.randn(300, generator=gen)]
    p = torch.nn.Parameter(torch.zeros(300))
    opt = FusedAdam([p], lr=1e-3, betas=(beta1, 0.999), adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8)
    expected, torchs = np.zeros(300, dtype=np.float32), torch.zeros(300)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        expected = _lerp_f32(expected, g.numpy(), beta1)
        torchs.lerp_(g, 1 - beta1)
        assert_bitwise_equal(opt.state[p]["exp_avg"], torch.from_numpy(expected), f"exp_avg, beta1={beta1}")
        torch.testing.assert_close(opt.state[p]["exp_avg"], torchs, rtol=4e-7, atol=0)  # (3 ulps)
    if beta1 == 0.0:
        assert_bitwise_equal(opt.state[p]["exp_avg"], grads[-1], "exp_avg with beta1 = 0")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_frozen_for_10_steps_then_unfrozen_gets_torchs_first_update(backend, monkeypatch):
    """The late param's first update is bias-corrected with its own t=1, as torch does (ORT's per-group
    step would make it about 3x too large)."""
    select_backend(monkeypatch, backend)
    ours = _two_params()
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedAdam(ours, lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, eps=1e-8, weight_decay=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(4)
    for step in range(15):
        frozen = step < 10
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g, g.clone()
        if frozen:
            ours[1].grad = theirs[1].grad = None
        before = ours[1].detach().clone()
        opt.step()
        ref.step()
        if frozen:
            assert ours[1] not in opt.state or not opt.state[ours[1]], "a param without grad must get no state"
            assert torch.equal(ours[1], before)
        if step == 10:  # the first update of the late param: |delta| is about lr, not 3x lr
            assert float(opt.state[ours[1]]["step"]) == 1
            delta = (ours[1].detach() - before * (1 - 1e-2 * 1e-2)).abs()
            assert float(delta.max()) < 1.01e-2
        torch.testing.assert_close(ours[0], theirs[0].detach(), atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(ours[1], theirs[1].detach(), atol=1e-7, rtol=1e-6)
    assert float(opt.state[ours[0]]["step"]) == 15
    assert float(opt.state[ours[1]]["step"]) == 5


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_are_counted_per_parameter_in_every_mode(mode, backend, monkeypatch):
    """Against the float64 reference, with a param that joins late and one that pauses mid-run."""
    select_backend(monkeypatch, backend)
    params = _two_params() + [torch.nn.Parameter(torch.randn(4, dtype=torch.float32))]
    reference = ReferenceAdam(params, lr=1e-2, eps=1e-8, weight_decay=0.1, mode=int(MODES[mode]))
    opt = FusedAdam(params, lr=1e-2, eps=1e-8, weight_decay=0.1, adam_w_mode=MODES[mode])
    gen = torch.Generator().manual_seed(5)
    for step in range(30):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        if step < 10:
            grads[1] = None  # joins at step 10
        if 15 <= step < 20:
            grads[2] = None  # pauses for 5 steps
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        reference.step(grads)
        assert [int(opt.state[p]["step"]) if opt.state.get(p) else 0 for p in params] == reference.steps()
    for i, p in enumerate(params):
        torch.testing.assert_close(p.double(), reference.param(i), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_params_without_grad_get_no_state_and_no_step(backend, monkeypatch):
    select_backend(monkeypatch, backend)
    with_grad, never = _two_params()
    opt = FusedAdam([with_grad, never], weight_decay=0.1, master_weights=True)
    before = never.detach().clone()
    for _ in range(3):
        with_grad.grad = torch.ones_like(with_grad)
        opt.step()
    assert not opt.state.get(never), "no state for a param that never had a gradient"
    assert torch.equal(never, before), "and no weight decay either"
    assert set(opt.state_dict()["state"]) == {0}
    assert float(opt.state[with_grad]["step"]) == 3
    # a step where no param has a gradient is a no-op
    with_grad.grad = None
    snap = optimizer_snapshot(opt)
    opt.step()
    assert_same_snapshot(snap, optimizer_snapshot(opt))
    assert not opt.last_step_skipped


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_whose_grad_is_none_mid_run_keeps_its_state_untouched(backend, monkeypatch):
    select_backend(monkeypatch, backend)
    a, b = _two_params(torch.float16)
    opt = FusedAdam([a, b], weight_decay=0.1, master_weights=True, exp_avg_dtype=torch.float16)
    for _ in range(5):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
    frozen = {k: v.clone() for k, v in opt.state[b].items()}
    b_value = b.detach().clone()
    for _ in range(5):
        a.grad, b.grad = torch.randn_like(a), None
        opt.step()
    assert opt.state[b].keys() == frozen.keys()
    for key, value in frozen.items():
        assert_bitwise_equal(opt.state[b][key], value, key)
    assert_bitwise_equal(b.detach(), b_value, "param")
    assert float(opt.state[a]["step"]) == 10 and float(opt.state[b]["step"]) == 5
    b.grad = torch.randn_like(b)
    opt.step()
    assert float(opt.state[b]["step"]) == 6


# ---- errors --------------------------------------------------------------------------------------------------------

CONSTRUCTOR_ERRORS = [
    ("negative-lr", dict(lr=-1e-3), r"lr must be >= 0, got -0\.001"),
    ("negative-lr-tensor", dict(lr=torch.tensor(-1e-3)), r"lr must be >= 0"),
    ("lr-tensor-with-two-elements", dict(lr=torch.tensor([1e-3, 1e-3])), r"lr must hold exactly one number"),
    ("negative-eps", dict(eps=-1e-8), r"eps must be >= 0, got -1e-08"),
    ("beta1-equal-to-1", dict(betas=(1.0, 0.999)), r"betas\[0\] must be in \[0, 1\), got 1\.0"),
    ("beta1-negative", dict(betas=(-0.1, 0.999)), r"betas\[0\] must be in \[0, 1\), got -0\.1"),
    ("beta2-equal-to-1", dict(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\), got 1\.0"),
    ("beta2-above-1", dict(betas=(0.9, 1.5)), r"betas\[1\] must be in \[0, 1\), got 1\.5"),
    ("beta2-negative", dict(betas=(0.9, -0.5)), r"betas\[1\] must be in \[0, 1\)"),
    ("betas-not-a-pair", dict(betas=(0.9,)), r"betas must be a pair"),
    ("negative-weight-decay", dict(weight_decay=-0.01), r"weight_decay must be >= 0, got -0\.01"),
    ("adam-w-mode-3", dict(adam_w_mode=3), r"adam_w_mode must be an AdamWMode \(0, 1 or 2\), got 3"),
    ("exp-avg-dtype-int8", dict(exp_avg_dtype=torch.int8), r"exp_avg_dtype must be None, torch\.float32, .*int8"),
    ("exp-avg-dtype-float64", dict(exp_avg_dtype=torch.float64), r"exp_avg_dtype must be .*float64"),
    ("exp-avg-sq-dtype-int8", dict(exp_avg_sq_dtype=torch.int8), r"exp_avg_sq_dtype must be .*int8"),
    ("max-grad-norm-zero", dict(max_grad_norm=0.0), r"max_grad_norm must be None or a float > 0"),
    ("max-grad-norm-negative", dict(max_grad_norm=-1.0), r"max_grad_norm must be None or a float > 0"),
]


@pytest.mark.parametrize("kwargs,message", [c[1:] for c in CONSTRUCTOR_ERRORS], ids=[c[0] for c in CONSTRUCTOR_ERRORS])
def test_bad_options_raise_a_clear_error_naming_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))], **kwargs)


PARAM_ERRORS = [
    ("complex", lambda: torch.zeros(3, dtype=torch.complex64), {}, r"not torch.complex64 \(complex params: "
                                                                    r"make the param the real pairs"),
    ("int32", lambda: torch.zeros(3, dtype=torch.int32), {}, r"bfloat16 params, not torch.int32"),
    ("float8", lambda: torch.zeros(3, dtype=torch.float8_e4m3fn), {}, r"not torch.float8_e4m3fn .*float8 params: "
                                                                      r"train bfloat16 or float32 weights"),
    ("int64", lambda: torch.zeros(3, dtype=torch.int64), {}, r"FusedAdam supports float32, float64, float16 and "),
]


@pytest.mark.parametrize("make,kwargs,message", [c[1:] for c in PARAM_ERRORS], ids=[c[0] for c in PARAM_ERRORS])
def test_unsupported_params_raise_a_clear_error_naming_the_param(make, kwargs, message):
    good = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(3,\), .*\): .*" + message):
        FusedAdam([good, make()], **kwargs)
    # add_param_group validates the same way and does not keep the refused group
    opt = FusedAdam([good], **kwargs)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [make()]})
    assert len(opt.param_groups) == 1


UNSUPPORTED_DTYPES = [
    ("fp16-masters", lambda good: FusedAdam([good], master_weights=True, master_weight_dtype=torch.float16),
     r"master_weight_dtype must be torch\.float32"),
    ("int8-exp-avg", lambda good: FusedAdam([good], exp_avg_dtype=torch.int8), r"exp_avg_dtype must be None"),
    ("float64-exp-avg-sq", lambda good: FusedAdam([good], exp_avg_sq_dtype=torch.float64),
     r"exp_avg_sq_dtype must be None"),
    ("int8-exp-avg-set-later", lambda good: setattr(FusedAdam([good]), "exp_avg_dtype", torch.int8),
     r"exp_avg_dtype must be None"),
    ("int32-param", lambda good: FusedAdam([good, torch.zeros(3, dtype=torch.int32)]),
     r"param_groups\[0\]\['params'\]\[1\] .*not torch\.int32"),
    ("complex-param-added", lambda good: FusedAdam([good]).add_param_group(
        {"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))]}),
     r"param_groups\[1\]\['params'\]\[0\] .*not torch\.complex64"),
]


@pytest.mark.parametrize("refuse,message", [c[1:] for c in UNSUPPORTED_DTYPES], ids=[c[0] for c in UNSUPPORTED_DTYPES])
def test_an_unsupported_dtype_raises_a_value_error_that_is_also_the_runtime_error_of_the_fused_adams_it_replaces(
        refuse, message):
    # TransformerEngine's FusedAdam raises a RuntimeError for a master or moment dtype it does not support; apex's,
    # DeepSpeed's and ONNX Runtime's for a param dtype
    with pytest.raises(RuntimeError, match=message) as refused:
        refuse(torch.nn.Parameter(torch.zeros(2)))
    assert isinstance(refused.value, ValueError)


def test_a_param_already_in_a_group_is_refused_naming_both_places_and_changing_nothing():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] \(shape \(2,\), torch\.float32\) is "
                                         r"param_groups\[0\]\['params'\]\[0\] .* listed again: each parameter "
                                         r"belongs to one param group"):
        FusedAdam([{"params": params[:1]}, {"params": params[1:2] + params[:1]}])
    opt = FusedAdam(params[:2])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .* is "
                                         r"param_groups\[0\]\['params'\]\[1\] "):
        opt.add_param_group({"params": iter([params[1], params[2]]), "lr": 0.5})
    assert len(opt.param_groups) == 1
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params[:2]]


def test_a_bad_param_group_is_refused_and_not_kept():
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"param_groups\[1\]: betas\[1\] must be in \[0, 1\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (0.9, 1.0)})
    assert len(opt.param_groups) == 1


def _sparse_grad(p):
    p.grad = torch.zeros_like(p).to_sparse()


def _wrong_shape_grad(p):
    p.grad = torch.zeros_like(p)
    p.grad.data = torch.zeros(p.numel() + 1, dtype=p.dtype)  # assigning .grad refuses a wrong shape; .data does not


def _float64_grad(p):
    p.grad = torch.zeros_like(p)
    p.grad.data = torch.zeros(p.shape, dtype=torch.float64)


STEP_ERRORS = [
    ("sparse-grad", _sparse_grad, r"its gradient is sparse"),
    ("wrong-shape-grad", _wrong_shape_grad, r"its gradient has shape \(7,\), not the parameter's"),
    ("float64-grad-for-float32-param", _float64_grad, r"its gradient has dtype torch\.float64"),
]


def _multi_bucket_setup():
    """Two groups, fp32 and fp16 params (several op calls per step), 3 steps taken, then a new param without state.
    The bad gradient goes to param_groups[1]['params'][1]: a step that validated bucket by bucket would already have
    updated the params before it."""
    g = torch.Generator().manual_seed(7)
    group0 = [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g).half())]
    group1 = [torch.nn.Parameter(torch.randn(3, generator=g).bfloat16()), torch.nn.Parameter(torch.randn(6, generator=g))]
    opt = FusedAdam([{"params": group0}, {"params": group1, "lr": 1e-2}], weight_decay=0.1, master_weights=True,
                    exp_avg_sq_dtype=torch.float16, amsgrad=True)
    for _ in range(3):
        for p in group0 + group1:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    late = torch.nn.Parameter(torch.randn(2, generator=g))
    opt.add_param_group({"params": [late]})
    for p in group0 + group1 + [late]:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    return opt, group1[1]


def _single_call_setup():
    """One group of fp32 params, 3 steps taken: each step is one cached op call (the native op's fast path)."""
    g = torch.Generator().manual_seed(8)
    params = [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn(6, generator=g))]
    opt = FusedAdam(params, weight_decay=0.1, max_grad_norm=1.0)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt, params[1]


@pytest.mark.parametrize("setup", [_multi_bucket_setup, _single_call_setup], ids=["several-op-calls", "one-op-call"])
@pytest.mark.parametrize("backend", ("auto",) + BACKENDS)
@pytest.mark.parametrize("make_grad,message", [c[1:] for c in STEP_ERRORS], ids=[c[0] for c in STEP_ERRORS])
def test_a_bad_gradient_raises_naming_the_param_and_changes_nothing(make_grad, message, backend, setup, monkeypatch):
    """The native op reports list indices; FusedAdam names the param. Whichever layer finds it (Python's checks or the
    op), the error is a GradientError (a ValueError and a RuntimeError, what torch's AdamW raises for a sparse
    gradient) and nothing is mutated: params, grads, states (no new state either), steps."""
    if backend == "auto":
        monkeypatch.delenv("ORT_OPTIM_BACKEND", raising=False)
    else:
        select_backend(monkeypatch, backend)
    opt, victim = setup()
    where = next(f"param_groups[{gi}]['params'][{i}]" for gi, group in enumerate(opt.param_groups)
                 for i, p in enumerate(group["params"]) if p is victim)
    make_grad(victim)
    before = optimizer_snapshot(opt)
    for grad_scale in (None, 128.0):  # the grad_scale path runs grad_stats over the grads first
        with pytest.raises(GradientError, match=re.escape(where) + r" \(shape .*\): " + message):
            opt.step(grad_scale=grad_scale)
        assert_same_snapshot(before, optimizer_snapshot(opt))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "key,value,message",
    [("lr", -1.0, r"param_groups\[1\]: lr must be >= 0"),
     ("betas", (0.9, 1.0), r"param_groups\[1\]: betas\[1\] must be in \[0, 1\)"),
     ("eps", -1.0, r"param_groups\[1\]: eps must be"),
     ("weight_decay", -1.0, r"param_groups\[1\]: weight_decay must be"),
     ("adam_w_mode", 7, r"param_groups\[1\]: adam_w_mode must be")],
    ids=["lr", "betas", "eps", "weight_decay", "adam_w_mode"],
)
def test_a_hyperparameter_made_invalid_after_construction_fails_the_step_and_changes_nothing(
        key, value, message, backend, monkeypatch):
    select_backend(monkeypatch, backend)
    opt, _ = _multi_bucket_setup()
    opt.param_groups[1][key] = value
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert_same_snapshot(before, optimizer_snapshot(opt))


@pytest.mark.parametrize("case", ["float-grad-scale", "lr-tensor-on-another-device"])
def test_capturable_refusals_come_before_anything_changes(case):
    """capturable=True (CUDA graphs) refuses a float grad_scale and an lr tensor on another device than the params
    (here a fake CUDA tensor, which has a device and no data, stands in for one); like every failed step, it changes
    nothing."""
    opt, _ = _multi_bucket_setup()
    capturable = FusedAdam([p for group in opt.param_groups for p in group["params"]], lr=torch.tensor(1e-3),
                           capturable=True)
    capturable.zero_grad()
    for p in capturable.param_groups[0]["params"][:2]:
        p.grad = torch.ones_like(p)
    capturable.step(grad_scale=torch.tensor(2.0))
    assert len([p for p in capturable.param_groups[0]["params"] if capturable.state.get(p)]) == 2
    for p in capturable.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)  # and the others get their first gradient (state would be created)
    kwargs = {}
    if case == "float-grad-scale":
        kwargs["grad_scale"] = 2.0
        message = r"capturable=True: pass grad_scale as a tensor"
    else:
        with FakeTensorMode():
            capturable.param_groups[0]["lr"] = torch.empty((), device="cuda")
        message = r"param_groups\[0\]: capturable=True needs lr on the params' device \(cpu\), got a tensor on cuda"
    before = optimizer_snapshot(capturable)
    with pytest.raises(ValueError, match=message):
        capturable.step(**kwargs)
    assert_same_snapshot(before, optimizer_snapshot(capturable))


def test_fresh_states_are_aligned_views_of_one_buffer_per_kind():
    """Params first stepped together get their moments (and masters) as views of one flat buffer per kind and
    dtype, each a multiple of 256 bytes from the buffer's (64-byte aligned) start, so the kernel streams contiguous memory; the views never overlap."""
    params = [torch.nn.Parameter(torch.randn(n).half()) for n in (5, 1000, 3)] + [torch.nn.Parameter(torch.randn(()))]
    opt = FusedAdam(params, master_weights=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        views = [opt.state[p][key] for p in params[:3]]
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1, key
        starts = [v.data_ptr() for v in views]
        base = views[0].untyped_storage().data_ptr()
        assert base % 64 == 0 and all((start - base) % 256 == 0 for start in starts), key
        ends = [v.data_ptr() + v.numel() * v.element_size() for v in views]
        assert all(end <= start for end, start in zip(ends, starts[1:])), key
    for p in params[:3]:
        assert torch.equal(opt.state[p]["master_param"].half(), p.detach())


def test_turning_amsgrad_on_after_state_exists_is_refused_before_anything_changes():
    params = [torch.nn.Parameter(torch.randn(4))]
    opt = FusedAdam(params)
    params[0].grad = torch.ones(4)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    param_before = params[0].detach().clone()
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"amsgrad is on but this parameter's state has no max_exp_avg_sq"):
        opt.step()
    assert torch.equal(params[0].detach(), param_before)
    assert set(opt.state[params[0]]) == set(before)
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in before.items())


def test_state_dtype_options_leave_float64_params_with_float64_states(backend):
    """exp_avg_dtype/exp_avg_sq_dtype apply to float32/float16/bfloat16 params; a float64 param beside them keeps
    float64 moments, and each param is updated exactly as it would be in an optimizer of its own."""
    g = torch.Generator().manual_seed(11)
    options = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16)
    wide, narrow = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(7, generator=g)
    together = [torch.nn.Parameter(wide.clone()), torch.nn.Parameter(narrow.clone())]
    alone = [torch.nn.Parameter(wide.clone()), torch.nn.Parameter(narrow.clone())]
    opt = FusedAdam(together, **options)
    opts_alone = [FusedAdam([p], **options) for p in alone]
    for _ in range(50):
        for a, b in zip(together, alone):
            a.grad = torch.randn(a.shape, generator=g, dtype=a.dtype)
            b.grad = a.grad.clone()
        opt.step()
        for o in opts_alone:
            o.step()
    assert opt.state[together[0]]["exp_avg"].dtype == opt.state[together[0]]["exp_avg_sq"].dtype == torch.float64
    assert opt.state[together[1]]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[together[1]]["exp_avg_sq"].dtype == torch.float16
    for a, b, o in zip(together, alone, opts_alone):
        assert_bitwise_equal(a.detach(), b.detach(), "param")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(opt.state[a][key], o.state[b][key], key)
