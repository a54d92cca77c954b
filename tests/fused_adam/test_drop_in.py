"""Migrating to FusedAdam, as a specification: FusedAdam as a drop-in for ORT's FusedAdam and torch.optim.AdamW,
checked from the outside: what their users rely on without reading our code.

Written from ORT's FusedAdam and torch.optim's documented behaviour, against
independent references: torch.optim.AdamW/Adam (``foreach=False``, the plain per-tensor loop) on the same dtype or on
fp32 copies, torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler, the float64 formulas of ``tests/reference.py``,
and ORT 1.19.2's recorded signature. It covers what the other modules leave out:

* the API: ORT's positional order, step()'s signature, ``AdamWMode``, ``repr``; the type of every option (a string
  "False" for a bool, apex's ``adam_w_mode=True``, a bool lr), numpy scalars, step()'s ``grad_scale``/``found_inf``
  when they are wrong (refused naming them, nothing changed);
* the math under change: torch's LR schedulers (OneCycleLR also moves ``betas``) with float and tensor lr and late
  gradients, every hyperparameter rewritten between steps, ``bias_correction=False`` per group in every mode,
  gradients left untouched, closures;
* torch.optim.Optimizer's machinery: step, state-dict and load-state-dict hooks, ``zero_grad`` next to torch's, a
  model and its optimizer copied together;
* checkpoints: through a file and ``torch.load(weights_only=True)`` (numpy lrs included) resuming bit for bit, steps
  past 2**24, torch state moved in process (copied, never shared), ``from_optimizer`` for torch >= 2.5's
  ``Adam(decoupled_weight_decay=True)`` and its keywords, named params, our checkpoint into that Adam;
* mixed precision: masters against torch AdamW on fp32 copies, under GradScaler, with global clipping over groups and
  dtypes; the masters' documented contract when a model checkpoint is written into the params.

Tolerances, per dtype. float32 params against torch's float32 AdamW: ``FP32_VS_TORCH``, a few float32 ulps of the
parameters' magnitude (~1), since torch's per-step scalar expressions (lr / bc1, 1 - lr * wd) round differently in
the last bit from ours (measured: up to 6e-8 after 100 steps; bit for bit with a constant lr of 1e-3). fp16/bf16
params with masters: the fp32 masters keep ``FP32_VS_TORCH`` against torch on fp32 copies, and each param equals its
master rounded to nearest even, bit for bit. float32 params against the float64 reference: ``FP32_VS_FLOAT64``
(measured: under 1e-7). Checkpoint resumes, copies and numpy-vs-float runs: bit for bit.
"""

from __future__ import annotations

import copy
import inspect
import re

import numpy as np
import pytest
import torch
from conftest import (assert_bitwise_equal, assert_same_snapshot, assert_tree_bitwise_equal, fuzz_examples,
                      optimizer_snapshot, select_backend)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import adam_update
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ort_optim import AdamWMode, FusedAdam, GradientError, StateNameError

FP32_VS_TORCH = dict(rtol=0.0, atol=5e-7)  # parameters of magnitude ~1: a few float32 ulps (2**-23 = 1.2e-7)
FP32_VS_FLOAT64 = dict(rtol=1e-6, atol=1e-6)
TORCH_ADAMW = dict(adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2)  # torch.optim.AdamW's math
STEPS = 100

# ---- helpers -------------------------------------------------------------------------------------------------------

SHAPES = [(), (0,), (5,), (3, 4), (7,)]  # 0-dim, empty, odd sizes


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in SHAPES]


def set_grads(params, step, missing=()):
    """Deterministic gradients for `step`; params whose index is in `missing` get none."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        p.grad = None if i in missing else grad


def run_pair(make_ours, make_theirs, make_scheduler=None, steps=STEPS, missing=lambda k: ()):
    """Steps two optimizers over identical params and gradients (none, at step k, for the params in missing(k));
    returns both param lists."""
    ours_params, their_params = make_params(), make_params()
    ours, theirs = make_ours(ours_params), make_theirs(their_params)
    schedulers = [make_scheduler(ours), make_scheduler(theirs)] if make_scheduler else []
    step_pair(ours, ours_params, theirs, their_params, range(steps), missing, schedulers)
    return ours_params, their_params


def step_pair(ours, ours_params, theirs, their_params, steps, missing=lambda k: (), schedulers=()):
    """Steps both optimizers (then the schedulers) at each step k in steps, with identical gradients (none for the
    params in missing(k))."""
    for k in steps:
        set_grads(ours_params, k, missing(k))
        set_grads(their_params, k, missing(k))
        ours.step()
        theirs.step()
        for s in schedulers:
            s.step()


def assert_params_close(ours, theirs, **tolerance):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.detach().double(), b.detach().double(), msg=lambda m: f"param {i}: {m}",
                                   **tolerance)


def one_param_optimizer(**options):
    p = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(3)))
    return p, FusedAdam([p], **options)


# ---- the signature: ORT's, positionally ----------------------------------------------------------------------------

# onnxruntime.training.optim.FusedAdam 1.19.2: names, order and defaults of its eight parameters.
ORT_SIGNATURE = [
    ("params", inspect.Parameter.empty),
    ("lr", 1e-3),
    ("bias_correction", True),
    ("betas", (0.9, 0.999)),
    ("eps", 1e-6),
    ("adam_w_mode", AdamWMode.ADAMW_TRANSFORMERS),
    ("weight_decay", 0.0),
    ("set_grad_none", True),
]


def test_the_first_eight_parameters_are_orts_in_order_with_its_defaults_and_the_rest_are_keyword_only():
    parameters = list(inspect.signature(FusedAdam).parameters.values())
    assert [(p.name, p.default) for p in parameters[:8]] == ORT_SIGNATURE
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in parameters[:8])
    assert all(p.kind == p.KEYWORD_ONLY for p in parameters[8:]), [p.name for p in parameters[8:]]
    assert {"amsgrad", "maximize"} <= {p.name for p in parameters[8:]}


@pytest.mark.parametrize("options", [dict(fused=True), dict(fused=False, foreach=True), dict(foreach=False),
                                     dict(fused=None, foreach=None, differentiable=False)],
                         ids=["fused", "foreach", "for-loop", "defaults"])
def test_torch_adamws_implementation_choices_are_accepted_and_change_nothing(options):
    """Code written for torch.optim.AdamW (``fused=True``, ``foreach=...``, ``differentiable=False``) constructs
    FusedAdam unchanged: the step is one multi-tensor kernel whatever they say, the same bits."""
    results = []
    for kwargs in (options, {}):
        p = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(0)))
        opt = FusedAdam([p], lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2, **kwargs)
        for i in range(5):
            p.grad = torch.randn(64, generator=torch.Generator().manual_seed(i + 1))
            opt.step()
        results.append(p.detach())
    assert_bitwise_equal(results[0], results[1])


def test_step_takes_a_closure_and_keyword_only_grad_scale_and_found_inf():
    """``step(closure=None, *, grad_scale=None, found_inf=None)``."""
    parameters = list(inspect.signature(FusedAdam.step).parameters.values())[1:]
    assert [(p.name, p.kind, p.default) for p in parameters] == [
        ("closure", inspect.Parameter.POSITIONAL_OR_KEYWORD, None),
        ("grad_scale", inspect.Parameter.KEYWORD_ONLY, None),
        ("found_inf", inspect.Parameter.KEYWORD_ONLY, None),
    ]
    assert FusedAdam._step_supports_amp_scaling is True  # torch.amp.GradScaler's protocol for fused optimizers


def test_repr_is_torchs_with_every_group_option():
    p, opt = one_param_optimizer(lr=0.5, weight_decay=0.25)
    text = repr(opt)
    assert text.startswith("FusedAdam (\nParameter Group 0\n")
    for key, value in opt.param_groups[0].items():
        if key != "params":
            assert f"    {key}: {value}\n" in text, key


@pytest.mark.parametrize("name,value", [("ADAM_L2_REGULARIZATION", 0), ("ADAMW_TRANSFORMERS", 1), ("ADAMW_TORCH", 2)])
def test_adamw_mode_has_orts_names_and_int_values(name, value):
    mode = AdamWMode[name]
    assert isinstance(mode, int) and mode == value and AdamWMode(value) is mode
    assert len(AdamWMode) == 3


def test_positional_arguments_land_where_orts_would_put_them():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = FusedAdam([p], 0.5, False, (0.8, 0.7), 1e-3, AdamWMode.ADAM_L2_REGULARIZATION, 0.25, False)
    group = opt.param_groups[0]
    assert (group["lr"], group["bias_correction"], group["betas"], group["eps"], group["adam_w_mode"],
            group["weight_decay"], opt.set_grad_none) == (0.5, False, (0.8, 0.7), 1e-3, 0, 0.25, False)
    with pytest.raises(TypeError):  # a ninth positional argument: the extras are keyword-only
        FusedAdam([p], 0.5, False, (0.8, 0.7), 1e-3, AdamWMode.ADAM_L2_REGULARIZATION, 0.25, False, True)


@pytest.mark.parametrize("arguments", [(1e-3, (0.9, 0.95)), (1e-3, [0.9, 0.95], 1e-8, 0.01)],
                         ids=["lr-betas", "lr-betas-eps-weight-decay"])
def test_torch_adamws_positional_order_is_refused_naming_the_order_and_the_keywords_to_use(arguments):
    """torch.optim.AdamW and TransformerEngine's FusedAdam take betas third; here the third is ORT's bias_correction.
    Their positional call is refused saying so, not only that bias_correction is not a bool."""
    with pytest.raises(TypeError, match=r"bias_correction must be True or False \(a bool\), got .*: FusedAdam takes "
                                        r"ORT's positional order \(params, lr, bias_correction, betas, .*\)"
                                        r".*Pass betas, eps and weight_decay by keyword"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], *arguments)


def test_a_state_dtype_that_transformer_engines_fused_adam_reads_otherwise_is_said_so_in_the_docstring():
    """TransformerEngine's FusedAdam takes exp_avg_dtype=torch.uint8 as fp8 e4m3 codes with one scale per tensor;
    here torch.uint8 is 8-bit blockwise codes, and torch.float8_e4m3fn is fp8. The argument's description says so."""
    described = re.search(r"exp_avg_dtype, exp_avg_sq_dtype:(.*?)stochastic_rounding:", FusedAdam.__doc__, re.S)[1]
    assert re.search(r"torch\.uint8 is 8-bit blockwise codes, not TransformerEngine's FusedAdam's\s+torch\.uint8, "
                     r"which is fp8 e4m3 with one scale per tensor: for fp8 moments pass torch\.float8_e4m3fn",
                     described)


# ---- option types and values ---------------------------------------------------------------------------------------

# What torch or ORT would take silently and then misread, or what the existing error tables do not list. Each must be
# refused naming the option. "False" as a string is truthy: taken as is, amsgrad="False" turned amsgrad on.
BAD_OPTIONS = [
    ("amsgrad-string", dict(amsgrad="False"), TypeError, r"amsgrad must be True or False \(a bool\), got str 'False'"),
    ("maximize-int", dict(maximize=1), TypeError, r"maximize must be True or False \(a bool\), got int 1"),
    ("bias-correction-string", dict(bias_correction="no"), TypeError, r"bias_correction must be True or False"),
    ("set-grad-none-string", dict(set_grad_none="False"), TypeError, r"set_grad_none must be True or False"),
    ("master-weights-string", dict(master_weights="yes"), TypeError, r"master_weights must be True or False"),
    ("capturable-int", dict(capturable=0), TypeError, r"capturable must be True or False"),
    ("adam-w-mode-string", dict(adam_w_mode="torch"), TypeError, r"adam_w_mode must be an AdamWMode or the int"),
    ("lr-bool", dict(lr=True), TypeError, r"lr must be a real number, got bool True"),
    # apex's FusedAdam has adam_w_mode=True/False; True (decoupled, torch's eps placement) once read as mode 1 (HF's)
    ("adam-w-mode-apex-bool", dict(adam_w_mode=True), ValueError,
     r"adam_w_mode must be an AdamWMode \(0, 1 or 2\), got True\. apex's adam_w_mode=True .* is "
     r"AdamWMode\.ADAMW_TORCH"),
    ("lr-nan", dict(lr=float("nan")), ValueError, r"lr must be finite, got nan"),
    ("lr-string", dict(lr="1e-3"), TypeError, r"lr must be a real number, got str '1e-3'"),
    ("lr-none", dict(lr=None), TypeError, r"lr must be a real number, got NoneType None"),
    ("lr-tensor-nan", dict(lr=torch.tensor(float("nan"))), ValueError, r"lr must be finite, got nan"),
    ("eps-nan", dict(eps=float("nan")), ValueError, r"eps must be finite, got nan"),
    ("weight-decay-nan", dict(weight_decay=float("nan")), ValueError, r"weight_decay must be finite, got nan"),
    ("beta1-nan", dict(betas=(float("nan"), 0.999)), ValueError, r"betas\[0\] must be in \[0, 1\), got nan"),
    ("beta2-inf", dict(betas=(0.9, float("inf"))), ValueError, r"betas\[1\] must be in \[0, 1\), got inf"),
    ("betas-none", dict(betas=None), ValueError, r"betas must be a pair \(beta1, beta2\), got None"),
    ("betas-three", dict(betas=(0.9, 0.99, 0.999)), ValueError, r"betas must be a pair"),
    ("max-grad-norm-nan", dict(max_grad_norm=float("nan")), ValueError, r"max_grad_norm must be finite"),
    ("max-grad-norm-beyond-float64", dict(max_grad_norm=10**400), ValueError, r"max_grad_norm must be finite, got inf$"),
    ("max-grad-norm-string", dict(max_grad_norm="1.0"), TypeError, r"max_grad_norm must be None or a real number > 0"),
    ("max-grad-norm-bool", dict(max_grad_norm=True), TypeError, r"max_grad_norm must be None or a real number > 0"),
    ("max-grad-norm-tensor", dict(max_grad_norm=torch.tensor(1.0)), TypeError, r"max_grad_norm must be None or a real"),
    ("max-grad-norm-float32-zero", dict(max_grad_norm=1e-50), ValueError, r"a float > 0 within float32's range"),
    ("fused-string", dict(fused="yes"), TypeError, r"fused must be None, True or False, got 'yes'"),
    ("foreach-int", dict(foreach=1), TypeError, r"foreach must be None, True or False, got 1"),
    ("differentiable", dict(differentiable=True), ValueError, r"differentiable=True is not supported"),
    # TransformerEngine's fp16 masters (kept with a scale) are not offered; TE ignores the option without masters
    ("master-weight-dtype-fp16", dict(master_weights=True, master_weight_dtype=torch.float16), ValueError,
     r"master_weight_dtype must be torch\.float32 \(master weights are kept in float32 only\), got torch\.float16"),
    ("master-weight-dtype-bf16-no-masters", dict(master_weight_dtype=torch.bfloat16), ValueError,
     r"master_weight_dtype must be torch\.float32 .*, got torch\.bfloat16"),
    ("master-weight-dtype-string", dict(master_weight_dtype="float32"), ValueError,
     r"master_weight_dtype must be torch\.float32 .*, got 'float32'"),
]


@pytest.mark.parametrize("options,error,message", [c[1:] for c in BAD_OPTIONS], ids=[c[0] for c in BAD_OPTIONS])
def test_a_bad_option_is_refused_naming_it(options, error, message):
    with pytest.raises(error, match=message):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))], **options)


def test_differentiable_true_is_refused_in_the_same_words_wherever_it_is_given():
    """differentiable=True given to the constructor, put into a param group before a step, or in the group of a torch
    optimizer that from_optimizer converts: one ValueError naming where, with one explanation, the params unchanged."""
    explanation = ("differentiable=True is not supported: the step updates the params in place through its own op, "
                   "which autograd does not differentiate. Set it to False, or use "
                   "torch.optim.AdamW(differentiable=True) to differentiate through optimizer steps")
    params = [torch.nn.Parameter(torch.ones(3))]
    params[0].grad = torch.ones(3)
    with pytest.raises(ValueError) as given:
        FusedAdam(params, differentiable=True)
    assert str(given.value) == "FusedAdam: " + explanation
    opt = FusedAdam(params)
    opt.param_groups[0]["differentiable"] = True
    with pytest.raises(ValueError) as grouped:
        opt.step()
    assert str(grouped.value) == "param_groups[0]: " + explanation
    with pytest.raises(ValueError) as converted:
        FusedAdam.from_optimizer(torch.optim.AdamW(params, differentiable=True))
    assert str(converted.value) == "param_groups[0]: " + explanation
    assert torch.equal(params[0].detach(), torch.ones(3))


GROUP_OPTIONS = [c for c in BAD_OPTIONS if not {"set_grad_none", "master_weights", "master_weight_dtype", "capturable",
                                                  "max_grad_norm", "foreach", "fused", "differentiable"} & set(c[1])]


@pytest.mark.parametrize("options,error,message", [c[1:] for c in GROUP_OPTIONS], ids=[c[0] for c in GROUP_OPTIONS])
def test_a_bad_group_option_is_refused_by_add_param_group_and_not_kept(options, error, message):
    p, opt = one_param_optimizer()
    with pytest.raises(error, match=r"param_groups\[1\]: " + message):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], **options})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("options,error,message", [c[1:] for c in GROUP_OPTIONS], ids=[c[0] for c in GROUP_OPTIONS])
def test_a_bad_option_put_into_a_group_later_fails_the_step_and_changes_nothing(options, error, message, backend):
    p, opt = one_param_optimizer(weight_decay=0.1)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    opt.param_groups[0].update(options)
    p.grad = torch.randn_like(p)
    before = optimizer_snapshot(opt)
    with pytest.raises(error, match=r"param_groups\[0\]: " + message):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


NUMPY_OPTIONS = [
    ("lr", dict(lr=np.float32(1e-2))),
    ("betas", dict(betas=(np.float32(0.8), np.float64(0.99)))),
    ("eps", dict(eps=np.float32(1e-8))),
    ("weight-decay", dict(weight_decay=np.float32(0.5))),
    ("max-grad-norm", dict(max_grad_norm=np.float32(1.0))),
]


@pytest.mark.parametrize("options", [c[1] for c in NUMPY_OPTIONS], ids=[c[0] for c in NUMPY_OPTIONS])
def test_numpy_scalars_are_taken_like_the_python_floats_they_equal(options, backend):
    """torch.optim takes numpy scalars (an LR scheduler's lambda may return numpy.float32, which numpy 2 keeps
    float32): the same steps as with the float values, bit for bit."""
    as_floats = {k: (tuple(float(b) for b in v) if isinstance(v, tuple) else float(v)) for k, v in options.items()}
    ours, theirs = run_pair(lambda ps: FusedAdam(ps, **options), lambda ps: FusedAdam(ps, **as_floats), steps=20)
    for a, b in zip(ours, theirs):
        assert_bitwise_equal(a.detach(), b.detach())


def test_a_scheduler_returning_numpy_float32_keeps_tracking_torch_adamw(backend):
    schedule = lambda step: np.float32(0.97) ** step  # noqa: E731  (numpy 2: stays float32)
    ours, theirs = run_pair(lambda ps: FusedAdam(ps, lr=1e-2, **TORCH_ADAMW),
                            lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
                            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule), steps=60)
    assert_params_close(ours, theirs, **FP32_VS_TORCH)


# ---- LR (and momentum) schedulers over many steps ------------------------------------------------------------------

SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5),
    # cycle_momentum (the default) rewrites group['betas'] at every step: beta1 goes 0.95 -> 0.85 -> 0.95
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.98**step),
    "CosineAnnealingWarmRestarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=7),
}
LR_KINDS = {"float": lambda: 1e-2, "tensor": lambda: torch.tensor(1e-2)}


def late_and_intermittent(step):
    """Param 3 gets its first gradient at step 30; param 4 none at every third step."""
    return {i for i, without in ((3, step < 30), (4, step % 3 == 0)) if without}


@pytest.mark.parametrize("lr_kind", LR_KINDS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_torch_schedulers_drive_fused_adam_as_they_drive_torch_adamw(scheduler, lr_kind, backend):
    """With late and intermittent gradients: per-param step counts under a schedule, as torch keeps them."""
    ours, theirs = run_pair(lambda ps: FusedAdam(ps, lr=LR_KINDS[lr_kind](), **TORCH_ADAMW),
                            lambda ps: torch.optim.AdamW(ps, lr=LR_KINDS[lr_kind](), foreach=False),
                            SCHEDULERS[scheduler], missing=late_and_intermittent)
    assert_params_close(ours, theirs, **FP32_VS_TORCH)


def test_every_hyperparameter_changed_between_steps_is_read_at_the_next_step_as_torch_reads_it(backend):
    """lr, betas, eps, weight_decay and maximize rewritten in the group before every step, on both sides."""
    def change(opt, k):
        group = opt.param_groups[0]
        group.update(lr=1e-2 * (1 + k % 3), betas=(0.9 - 0.02 * (k % 5), 0.999 - 0.002 * (k % 2)),
                     eps=1e-8 * 10 ** (k % 4), weight_decay=0.05 * (k % 4), maximize=k % 10 < 5)

    ours_params, their_params = make_params(), make_params()
    ours = FusedAdam(ours_params, **TORCH_ADAMW)
    theirs = torch.optim.AdamW(their_params, foreach=False)
    for k in range(STEPS):
        for params, opt in ((ours_params, ours), (their_params, theirs)):
            change(opt, k)
            set_grads(params, k)
            opt.step()
    assert_params_close(ours_params, their_params, **FP32_VS_TORCH)


def test_the_scheduler_parity_check_can_fail(backend):
    """The same run with the scheduler on one side only is far outside FP32_VS_TORCH."""
    ours, theirs = make_params(), make_params()
    opt_ours = FusedAdam(ours, lr=1e-2, **TORCH_ADAMW)
    opt_theirs = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    scheduler = SCHEDULERS["OneCycleLR"](opt_ours)
    for k in range(STEPS):
        set_grads(ours, k)
        set_grads(theirs, k)
        opt_ours.step()
        opt_theirs.step()
        scheduler.step()
    with pytest.raises(AssertionError):
        assert_params_close(ours, theirs, **FP32_VS_TORCH)


@pytest.mark.parametrize("mode", [AdamWMode.ADAM_L2_REGULARIZATION, AdamWMode.ADAMW_TRANSFORMERS], ids=str)
def test_ort_modes_read_betas_changed_by_one_cycle_lr_at_every_step(mode, backend):
    """OneCycleLR moves beta1 every step; each step uses the group's current betas and lr, as the float64 reference
    does (bias correction 1 - beta^t with the current beta, as torch)."""
    params = make_params()
    opt = FusedAdam(params, lr=1e-2, adam_w_mode=mode, weight_decay=0.1)
    scheduler = SCHEDULERS["OneCycleLR"](opt)
    expected = [p.detach().double() for p in params]
    states = [{"step": 0, "m": torch.zeros(p.shape, dtype=torch.float64),
               "v": torch.zeros(p.shape, dtype=torch.float64)} for p in params]
    for k in range(STEPS):
        set_grads(params, k)
        group = opt.param_groups[0]
        for i, p in enumerate(params):
            expected[i] = adam_update(expected[i], p.grad, states[i], lr=float(group["lr"]), beta1=group["betas"][0],
                                      beta2=group["betas"][1], eps=group["eps"], weight_decay=0.1, mode=int(mode))
        opt.step()
        scheduler.step()
    assert_params_close(params, expected, **FP32_VS_FLOAT64)


# ---- bias_correction=False, per group, in every mode ---------------------------------------------------------------


@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("mode", list(AdamWMode), ids=str)
def test_bias_correction_off_in_one_group_and_on_in_the_other_matches_the_float64_formulas(mode, amsgrad, backend):
    """ORT's bias_correction flag (bc1 = bc2 = 1 when off), read per group, in each mode's formula,
    over 100 steps with gradients that come and go."""
    params = make_params()
    opt = FusedAdam([{"params": params[:3], "bias_correction": False}, {"params": params[3:]}], 1e-2,
                    adam_w_mode=mode, weight_decay=0.1, amsgrad=amsgrad)
    expected = [p.detach().double() for p in params]
    zeros = lambda p: torch.zeros(p.shape, dtype=torch.float64)  # noqa: E731
    states = [{"step": 0, "m": zeros(p), "v": zeros(p), "vmax": zeros(p)} for p in params]
    for k in range(STEPS):
        set_grads(params, k, missing={k % 5})
        for i, p in enumerate(params):
            if p.grad is not None:
                expected[i] = adam_update(expected[i], p.grad, states[i], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                                          weight_decay=0.1, mode=int(mode), amsgrad=amsgrad,
                                          bias_correction=i >= 3)
        opt.step()
    assert_params_close(params, expected, **FP32_VS_FLOAT64)


@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("mode", list(AdamWMode), ids=str)
def test_a_step_leaves_the_gradient_as_it_was_in_every_mode(mode, maximize, backend):
    """ORT's L2 term is not written back to .grad; maximize negates a copy of the gradient. (With
    grad_scale the unscaled gradient is written back, as torch's fused AdamW does: test_scaling.py.)"""
    params = make_params()
    opt = FusedAdam(params, adam_w_mode=mode, weight_decay=0.1, maximize=maximize, amsgrad=True, max_grad_norm=0.5)
    for k in range(3):
        set_grads(params, k)
        grads = [p.grad.clone() for p in params]
        opt.step()
        for i, (p, g) in enumerate(zip(params, grads)):
            assert_bitwise_equal(p.grad, g, f"step {k}, grad {i}")


def test_step_runs_the_closure_with_grad_enabled_and_returns_its_loss_as_torch_does(backend):
    results = []
    for make in (lambda ps: FusedAdam(ps, **TORCH_ADAMW), lambda ps: torch.optim.AdamW(ps, foreach=False)):
        params = make_params()
        opt = make(params)
        x = torch.linspace(-1, 1, 12).view(3, 4)

        def closure():
            opt.zero_grad()
            loss = sum((p * p).sum() for p in params) + (params[3] * x).sum()
            loss.backward()
            return loss

        with torch.no_grad():  # step() turns grad mode on for the closure
            losses = [float(opt.step(closure)) for _ in range(20)]
        results.append((losses, params))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    assert_params_close(results[0][1], results[1][1], **FP32_VS_TORCH)


def _grad_data(p, value):
    p.grad = torch.zeros_like(p)
    p.grad.data = value  # (assigning .grad itself checks the shape and dtype; .data does not)


BAD_GRADIENTS = {  # what torch.optim.AdamW raises a RuntimeError for
    "sparse": lambda p: setattr(p, "grad", torch.ones_like(p).to_sparse()),
    "of another dtype": lambda p: _grad_data(p, torch.zeros(p.shape, dtype=torch.float64)),
    "of another shape": lambda p: _grad_data(p, torch.zeros(p.numel() + 1)),
}


@pytest.mark.parametrize("bad", BAD_GRADIENTS)
def test_a_gradient_torch_adamw_raises_a_runtime_error_for_raises_one_here_too(bad, backend):
    """GradientError is a RuntimeError (torch's, apex's and ORT's type for a sparse gradient) and a ValueError (ours
    for every refused input); it names the param and leaves everything as it was."""
    for make in (lambda ps: FusedAdam(ps, **TORCH_ADAMW), lambda ps: torch.optim.AdamW(ps, foreach=False)):
        params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
        opt = make(params)
        params[0].grad, params[1].grad = torch.ones(4), torch.ones(3)
        opt.step()
        BAD_GRADIENTS[bad](params[1])
        before = optimizer_snapshot(opt)
        with pytest.raises(RuntimeError) as raised:
            opt.step()
        if isinstance(opt, FusedAdam):
            assert isinstance(raised.value, GradientError) and isinstance(raised.value, ValueError)
            assert "param_groups[0]['params'][1]" in str(raised.value)
            assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_a_low_precision_gradient_on_a_float32_param_steps_as_its_float32_value_where_torch_adamw_raises(
        grad_dtype, backend):
    """Only float64 against another dtype is a gradient dtype the step cannot use: a float16 or bfloat16 gradient on a
    float32 param is read in float32, the step torch.optim.AdamW takes with that gradient converted to float32
    (given the low-precision gradient itself, torch's step raises)."""
    ours, theirs = make_params(), make_params()
    our_opt = FusedAdam(ours, lr=1e-2, **TORCH_ADAMW)
    their_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            grad = torch.randn(p.shape, generator=g).to(grad_dtype)
            _grad_data(p, grad)
            q.grad = grad.float()
        our_opt.step()
        their_opt.step()
        assert all(p.grad.dtype == grad_dtype for p in ours)
    assert_params_close(ours, theirs, **FP32_VS_TORCH)
    _grad_data(theirs[2], torch.ones(theirs[2].shape, dtype=grad_dtype))
    with pytest.raises(RuntimeError):
        their_opt.step()


def test_a_wrapper_subclass_param_or_gradient_without_memory_of_its_own_is_refused_naming_it(backend):
    """A __torch_dispatch__ wrapper (torch's TwoTensor here; torchao's quantized tensors are others) keeps its values
    in the tensors it wraps: there is no memory for the fused op to update. Such a param is refused when the optimizer
    gets it, and when it reaches a step through a params list written by hand; such a gradient, by the step. Each
    names the param and what to do, and leaves everything as it was."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")

    def wrapped():
        return torch.nn.Parameter(two_tensor.TwoTensor(torch.ones(3), torch.ones(3)))

    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] .*is a TwoTensor.*torch.optim.AdamW"):
        FusedAdam([torch.nn.Parameter(torch.ones(2)), wrapped()], **TORCH_ADAMW)
    plain = torch.nn.Parameter(torch.ones(2))
    opt = FusedAdam([plain], **TORCH_ADAMW)
    plain.grad = torch.ones(2)
    opt.step()
    late = wrapped()
    late.grad = two_tensor.TwoTensor(torch.ones(3), torch.ones(3))
    opt.param_groups[0]["params"].append(late)
    plain.grad = torch.ones(2)
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] .*is a TwoTensor"):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    opt.param_groups[0]["params"].pop()
    plain.grad = two_tensor.TwoTensor(torch.ones(2), torch.ones(2))
    before = optimizer_snapshot(opt)
    with pytest.raises(GradientError, match=r"param_groups\[0\]\['params'\]\[0\] .*its gradient is a TwoTensor"):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    plain.grad = torch.ones(2)
    opt.step()  # (planned for these params and gradients: the next step checks them against that plan)
    plain.grad = two_tensor.TwoTensor(torch.ones(2), torch.ones(2))
    before = optimizer_snapshot(opt)
    with pytest.raises(GradientError, match=r"param_groups\[0\]\['params'\]\[0\] .*its gradient is a TwoTensor"):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


def test_a_sparse_param_is_refused_naming_it_and_what_to_do(backend):
    """A sparse param's values are no strided block of memory that the fused op could update: refused when the
    optimizer gets it, naming the param and its layout (not taken for a tensor subclass), with what to do."""
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] .*is a torch.sparse_coo tensor.*"
                                         r"give it a dense tensor"):
        FusedAdam([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.eye(3).to_sparse())])


def test_a_meta_param_next_to_a_cpu_param_steps_as_torch_adamw_steps_them(backend):
    """A meta param (deferred initialisation) with a meta gradient gets meta states and holds no values to update;
    the CPU param next to it, in a bucket of its own, is stepped as torch.optim.AdamW steps it."""
    results = []
    for make in (lambda ps: FusedAdam(ps, lr=1e-2, **TORCH_ADAMW),
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)):
        cpu = torch.nn.Parameter(torch.linspace(-1, 1, 5))
        meta = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
        opt = make([cpu, meta])
        for step in range(3):
            cpu.grad = torch.randn(5, generator=torch.Generator().manual_seed(step))
            meta.grad = torch.empty(4, 3, device="meta")
            opt.step()
        assert opt.state[meta]["exp_avg"].is_meta and opt.state[meta]["exp_avg_sq"].is_meta
        results.append(cpu)
    assert_params_close(results[:1], results[1:], **FP32_VS_TORCH)


def test_a_complex_param_kept_as_its_real_pairs_trains_as_torch_adamw_trains_the_complex_param(backend):
    """FusedAdam refuses complex params; the recipe its error gives (the param is the real view, the forward takes
    its complex view) steps what torch.optim.AdamW steps for the complex param, whose update runs on the real view."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    x = torch.randn(3, 5, dtype=torch.complex64, generator=g)
    theirs = torch.nn.Parameter(w.clone())
    ours = torch.nn.Parameter(torch.view_as_real(w).clone())
    their_opt = torch.optim.AdamW([theirs], lr=1e-2, foreach=False)
    our_opt = FusedAdam([ours], lr=1e-2, **TORCH_ADAMW)
    for _ in range(STEPS):
        for opt, weight in ((their_opt, lambda: theirs), (our_opt, lambda: torch.view_as_complex(ours))):
            opt.zero_grad()
            (weight() @ x).abs().square().sum().backward()
            opt.step()
    torch.testing.assert_close(torch.view_as_complex(ours.detach()), theirs.detach(), **FP32_VS_TORCH)
    with pytest.raises(ValueError, match=r"can't optimize a non-leaf Tensor"):  # (why the param is not view_as_real(w))
        FusedAdam([torch.view_as_real(torch.nn.Parameter(w.clone()))])


def test_a_lazy_modules_params_taken_before_its_first_forward_train_as_torch_adamw_trains_them(backend):
    """An optimizer made over a lazy module's UninitializedParameters, before the forward that materialises them
    (torch.optim takes them), saves a state_dict and steps without gradients before that forward, and steps them as
    torch.optim.AdamW does from then on. step_in_backward, which hooks each param when the optimizer is made, refuses
    them naming the param and what to do."""
    def model():
        torch.manual_seed(1)  # (the Linear after the lazy one is initialised here, the same for both)
        return torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Linear(3, 2))

    models = [model(), model()]
    optimizers = [FusedAdam(models[0].parameters(), lr=1e-2, **TORCH_ADAMW),
                  torch.optim.AdamW(models[1].parameters(), lr=1e-2, foreach=False)]
    for opt in optimizers:
        assert opt.state_dict()["state"] == {}
        opt.step()  # (no gradients yet: nothing to do)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(uninitialized.*lazy module.*run one "
                                         r"forward first"):
        FusedAdam(torch.nn.LazyLinear(3).parameters(), step_in_backward=True)
    for step in range(5):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for model, opt in zip(models, optimizers):
            torch.manual_seed(0)  # (the first forward initialises the params from torch's generator)
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for ours, theirs in zip(*(model.parameters() for model in models)):
        torch.testing.assert_close(ours.detach(), theirs.detach(), **FP32_VS_TORCH)
    assert sorted(optimizers[0].state_dict()["state"]) == [0, 1, 2, 3]


# ---- optimizer hooks, as torch.optim.Optimizer provides them -------------------------------------------------------


def test_step_hooks_per_optimizer_and_global_fire_around_every_step():
    p, opt = one_param_optimizer()
    calls = []
    handles = [
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt))),
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt))),
        register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append(("global-pre", o is opt))),
        register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append(("global-post", o is opt))),
    ]
    try:
        for _ in range(2):
            p.grad = torch.ones_like(p)
            opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [("global-pre", True), ("pre", True), ("post", True), ("global-post", True)] * 2


def test_a_step_pre_hook_may_replace_the_arguments_and_must_return_them_as_torch_optim_says():
    p, opt = one_param_optimizer()
    p.grad = torch.ones_like(p)
    handle = opt.register_step_pre_hook(lambda o, args, kwargs: ((o,), {"closure": lambda: torch.tensor(7.0)}))
    assert float(opt.step()) == 7.0  # (the closure the hook put in)
    handle.remove()
    for o in (opt, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])):
        handle = o.register_step_pre_hook(lambda o, args, kwargs: "not a pair")
        before = optimizer_snapshot(o)
        with pytest.raises(RuntimeError, match=r"must return None or a tuple of \(new_args, new_kwargs\), but got "
                                               r"not a pair\."):
            o.step()
        handle.remove()
        assert_tree_bitwise_equal(optimizer_snapshot(o), before, "optimizer")


def test_each_step_is_labelled_for_the_profiler_as_torch_optim_labels_its_optimizers():
    """torch.profiler shows ``Optimizer.step#FusedAdam.step`` once per step, in the scope of torch's own label
    (``Optimizer.step#AdamW.step``: a user annotation); a step that raises closes its label."""
    p, opt = one_param_optimizer()
    q = torch.nn.Parameter(torch.zeros(3))
    ref = torch.optim.AdamW([q])
    with torch.profiler.profile() as prof:
        for _ in range(2):
            p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
            opt.step()
            ref.step()
        opt.param_groups[0]["lr"] = -1.0
        with pytest.raises(ValueError, match=r"param_groups\[0\]: lr must be >= 0"):
            opt.step()
    labels = [e for e in prof.events() if e.name.startswith("Optimizer.step#")]
    ours = [e for e in labels if e.name == "Optimizer.step#FusedAdam.step"]
    theirs = [e for e in labels if e.name == "Optimizer.step#AdamW.step"]
    assert len(ours) == 3 and len(theirs) == 2, [e.name for e in labels]
    assert {e.scope for e in ours} == {e.scope for e in theirs}


def test_state_dict_hooks_run_and_the_post_hook_sees_the_canonical_form():
    """register_state_dict_post_hook's hook gets what state_dict() returns (here: unscaled float32 moments, no
    block scales, although the optimizer stores fp16 codes), and what it returns is returned."""
    p, opt = one_param_optimizer(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    p.grad = torch.randn_like(p)
    opt.step()
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))

    def post(o, sd):
        seen.append(("post", sorted(sd["state"][0]), sd["state"][0]["exp_avg"].dtype))
        return {**sd, "param_groups": [{**g, "tag": "mine"} for g in sd["param_groups"]]}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert seen == ["pre", ("post", ["exp_avg", "exp_avg_sq", "step"], torch.float32)]
    assert sd["param_groups"][0]["tag"] == "mine"


def test_state_dict_pre_hooks_run_first_as_in_torch_so_one_may_drop_the_state_of_a_param_taken_out():
    """torch.optim's state_dict() runs its pre hooks before it reads anything: a pre hook that drops the state of a
    param taken out of param_groups (freezing it) lets the checkpoint be saved, for FusedAdam as for torch."""
    saved = []
    for make in (lambda ps: FusedAdam(ps, **TORCH_ADAMW), lambda ps: torch.optim.AdamW(ps)):
        kept, frozen = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
        opt = make([kept, frozen])
        kept.grad, frozen.grad = torch.ones(2), torch.ones(3)
        opt.step()
        del opt.param_groups[0]["params"][1]
        calls = []

        def forget_params_taken_out(o):
            calls.append("pre")
            listed = {id(p) for group in o.param_groups for p in group["params"]}
            for t in [t for t in o.state if id(t) not in listed]:
                del o.state[t]

        opt.register_state_dict_pre_hook(forget_params_taken_out)
        saved.append((sorted(opt.state_dict()["state"]), calls))
    assert saved[0] == saved[1] == ([0], ["pre"])


def test_a_state_dict_post_hook_registered_by_a_pre_hook_runs_in_that_call_as_in_torch():
    runs = []
    for make in (lambda ps: FusedAdam(ps, **TORCH_ADAMW), lambda ps: torch.optim.AdamW(ps)):
        opt = make([torch.nn.Parameter(torch.ones(2))])
        calls = []

        def register_a_post_hook(o):
            calls.append("pre")
            o.register_state_dict_post_hook(lambda o, sd: calls.append("post"))

        opt.register_state_dict_pre_hook(register_a_post_hook)
        opt.state_dict()
        opt.state_dict()
        runs.append(calls)
    assert runs[0] == runs[1] == ["pre", "post", "pre", "post", "post"]


def test_load_state_dict_hooks_run_and_what_the_pre_hook_returns_is_loaded(backend):
    p, opt = one_param_optimizer(**TORCH_ADAMW)
    p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    calls = []

    def pre(o, sd):
        calls.append("pre")
        sd["param_groups"] = [{**g, "lr": 0.5} for g in sd["param_groups"]]  # on the copy it is given
        return sd

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("post", o.param_groups[0]["lr"])))
    opt.load_state_dict(saved)
    assert calls == ["pre", ("post", 0.5)]
    assert saved["param_groups"][0]["lr"] == 1e-3  # the caller's dict: its top level is not the hook's copy
    # torch.optim.AdamW does the same with the same hooks
    their = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())])
    their.register_load_state_dict_pre_hook(pre)
    their.load_state_dict(saved)
    assert their.param_groups[0]["lr"] == 0.5


# ---- zero_grad next to torch's -------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # (a grad with a graph, on purpose)
@pytest.mark.parametrize("set_grad_none,argument", [(True, None), (False, None), (True, False), (False, True)],
                         ids=["ort-default", "set_grad_none=False", "set_to_none=False", "set_to_none=True"])
def test_zero_grad_does_what_torch_zero_grad_does_with_the_same_set_to_none(set_grad_none, argument):
    """set_to_none defaults to set_grad_none (ORT's option, True by default); given explicitly, it wins. Zeroing
    keeps the gradient tensor (in place) and detaches one made with create_graph=True, as torch does."""
    set_to_none = set_grad_none if argument is None else argument
    results = []
    for make in (lambda ps: FusedAdam(ps, set_grad_none=set_grad_none),
                 lambda ps: torch.optim.AdamW(ps)):
        p = torch.nn.Parameter(torch.ones(3))
        unused = torch.nn.Parameter(torch.ones(2))
        opt = make([p, unused])
        (p**3).sum().backward(create_graph=True)
        grad = p.grad
        if isinstance(opt, FusedAdam):
            opt.zero_grad() if argument is None else opt.zero_grad(set_to_none=argument)
        else:
            opt.zero_grad(set_to_none=set_to_none)
        results.append((p.grad is None, p.grad is grad, None if p.grad is None else p.grad.requires_grad,
                        None if p.grad is None else p.grad.tolist(), unused.grad))
    assert results[0] == results[1]
    assert results[0][0] == set_to_none


# ---- copies of the optimizer ---------------------------------------------------------------------------------------

COPY_SETUPS = {
    "fp16-masters-fp16-moments-clip": dict(dtype=torch.float16, options=dict(master_weights=True, max_grad_norm=1.0,
                                                                             exp_avg_dtype=torch.float16)),
    "step-in-backward": dict(dtype=torch.float32, options=dict(step_in_backward=True)),
}


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("setup", COPY_SETUPS)
def test_a_model_and_its_optimizer_copied_together_train_on_exactly_as_the_original(setup, how, backend, tmp_path):
    """copy.deepcopy((model, optimizer)) or torch.save of both (snapshots, EMA teachers, forked runs): the copy's
    optimizer holds the copy's params (with step_in_backward: its hooks are on them) and every option, and from
    then on it steps bit for bit as the original does."""
    dtype, options = COPY_SETUPS[setup]["dtype"], COPY_SETUPS[setup]["options"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).to(dtype)
    opt = FusedAdam(model.parameters(), lr=torch.tensor(1e-2), amsgrad=True, weight_decay=0.1, **options)
    x = torch.linspace(-1, 1, 32).view(8, 4).to(dtype)

    def train(m, o, k):
        o.zero_grad()
        m(x * (k + 1)).square().mean().backward()
        if not o.step_in_backward:
            o.step()

    for k in range(3):
        train(model, opt, k)
    if how == "deepcopy":
        model_copy, opt_copy = copy.deepcopy((model, opt))
    else:
        torch.save((model, opt), tmp_path / "both.pt")
        model_copy, opt_copy = torch.load(tmp_path / "both.pt", weights_only=False)
    assert all(a is b for a, b in zip(opt_copy.param_groups[0]["params"], model_copy.parameters()))
    for k in range(3, 13):
        train(model, opt, k)
        train(model_copy, opt_copy, k)
    for a, b in zip(model.parameters(), model_copy.parameters()):
        assert_bitwise_equal(a.detach(), b.detach())
    assert_tree_bitwise_equal(opt.state_dict(), opt_copy.state_dict(), "state_dict")


# ---- step()'s grad_scale and found_inf when they are wrong ---------------------------------------------------------

BAD_STEP_ARGUMENTS = [
    ("grad-scale-string", dict(grad_scale="2"), TypeError, r"grad_scale must be a float or a one-element tensor"),
    ("grad-scale-bool", dict(grad_scale=True), TypeError, r"grad_scale must be a float or a one-element tensor"),
    ("grad-scale-two-elements", dict(grad_scale=torch.tensor([2.0, 2.0])), ValueError,
     r"grad_scale must be a float or a one-element floating-point tensor, got a torch\.float32 tensor of shape"),
    # (a tensor of a dtype that holds no scale is of the wrong type, as an lr tensor of that dtype)
    ("grad-scale-int-tensor", dict(grad_scale=torch.tensor([2])), TypeError,
     r"grad_scale must be a float or a one-element floating-point tensor, got a torch\.int64 tensor of shape \(1,\)"),
    ("grad-scale-bool-tensor", dict(grad_scale=torch.tensor(True)), TypeError, r"got a torch\.bool tensor"),
    ("grad-scale-nan", dict(grad_scale=float("nan")), ValueError, r"grad_scale must be finite"),
    # (a zero or NaN scale makes the unscaled norm non-finite: it must not pass as an overflow that skips the step)
    ("grad-scale-tensor-zero", dict(grad_scale=torch.tensor(0.0)), ValueError,
     r"^grad_scale must be finite and non-zero, got 0"),
    ("grad-scale-tensor-minus-zero", dict(grad_scale=torch.tensor(-0.0)), ValueError, r"got -0"),
    ("grad-scale-tensor-nan", dict(grad_scale=torch.tensor(float("nan"))), ValueError, r"grad_scale must be finite"),
    ("grad-scale-tensor-inf", dict(grad_scale=torch.tensor(float("inf"))), ValueError, r"grad_scale must be finite"),
    ("grad-scale-tensor-float32-underflow", dict(grad_scale=torch.tensor(1e-50, dtype=torch.float64)), ValueError,
     r"grad_scale must be finite and non-zero, got 0"),
    ("found-inf-float", dict(found_inf=1.0), TypeError, r"found_inf must be a one-element tensor .*got 1\.0"),
    ("found-inf-two-elements", dict(found_inf=torch.zeros(2)), ValueError,
     r"found_inf must be a one-element tensor, got shape \(2,\)"),
]


@pytest.mark.parametrize("arguments,error,message", [c[1:] for c in BAD_STEP_ARGUMENTS],
                         ids=[c[0] for c in BAD_STEP_ARGUMENTS])
def test_bad_grad_scale_or_found_inf_is_refused_naming_it_and_changes_nothing(arguments, error, message, backend):
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3).half())]
    opt = FusedAdam(params, master_weights=True, max_grad_norm=1.0)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    before = optimizer_snapshot(opt, report=True)
    assert before["last_grad_norm"] is not None  # (the report of the last step, which a refused one keeps)
    with pytest.raises(error, match=message):
        opt.step(**arguments)
    assert_tree_bitwise_equal(optimizer_snapshot(opt, report=True), before, "optimizer")


@pytest.mark.parametrize("when", ["first step", "after a moment dtype switch"])
@pytest.mark.parametrize("scale", [0.0, float("inf"), float("nan")])
def test_a_tensor_grad_scale_refused_at_a_step_that_plans_creates_and_converts_no_state(scale, when, backend):
    """A step that plans (the first, or one after an option changed) creates missing states and converts states to new
    moment dtypes before the op runs; a CPU tensor grad_scale that the op would refuse is read first."""
    params = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(5))]
    opt = FusedAdam(params)
    if when != "first step":
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.exp_avg_dtype = opt.exp_avg_sq_dtype = torch.uint8
    for p in params:
        p.grad = torch.randn_like(p)
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"grad_scale must be finite and non-zero"):
        opt.step(grad_scale=torch.tensor(scale))
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    opt.step(grad_scale=torch.tensor(2.0))  # (the same step with a good scale plans and converts)
    assert all(opt.state[p]["exp_avg"].dtype == (torch.float32 if when == "first step" else torch.uint8)
               for p in params)


GRAD_SCALES = [None, 2.0, 0.5, 1, 0.0, -2.0, float("inf"), float("nan"), 1e-300, 1e300, 10**400, True, "2",
               np.float32(4.0),
               torch.tensor(2.0), torch.tensor(2.0, dtype=torch.float64), torch.tensor(2.0).half(), torch.tensor([8.0]),
               torch.tensor([2.0, 3.0]), torch.tensor(2), torch.tensor(0.0), torch.tensor(-1.0),
               torch.tensor(float("inf")), torch.tensor(float("nan")), torch.tensor(2.0, device="meta")]
FOUND_INFS = [None, torch.zeros(1), torch.ones(1), torch.tensor(0.0), torch.tensor(3), torch.tensor(True),
              torch.tensor(False), torch.zeros(2), 1.0, 0, torch.tensor(float("nan")), torch.zeros(1).half(),
              torch.zeros(1, device="meta")]


@settings(max_examples=fuzz_examples(200), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.sampled_from(range(len(GRAD_SCALES))), st.sampled_from(range(len(FOUND_INFS))), st.booleans())
def test_property_any_grad_scale_and_found_inf_give_the_same_step_on_both_cpu_backends_or_one_refusal(
        scale_index, found_index, clipped):
    """Step arguments of every kind (numbers in and out of range, bools, strings, tensors of other dtypes, shapes and
    devices): the native and the reference backend take the step alike, bit for bit (and last_found_inf alike), or
    both refuse it with the same exception and message, which names the argument, changing nothing."""
    outcomes = []
    for name in ("native", "torch"):
        with pytest.MonkeyPatch.context() as patch:
            select_backend(patch, name)
            params = [torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(0))),
                      torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(1)).half())]
            opt = FusedAdam(params, master_weights=True, max_grad_norm=1.0 if clipped else None)
            for k in range(2):
                for i, p in enumerate(params):
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * k + i)).to(p.dtype)
                opt.step()
            before = optimizer_snapshot(opt)
            arguments = dict(grad_scale=GRAD_SCALES[scale_index], found_inf=FOUND_INFS[found_index])
            try:
                opt.step(**{key: value for key, value in arguments.items() if value is not None})
            except (ValueError, TypeError) as error:
                assert re.search(r"\b(grad_scale|found_inf)\b", str(error)), str(error)
                assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
                outcomes.append((type(error), str(error)))
                continue
            outcomes.append((optimizer_snapshot(opt), opt.last_found_inf))
    (a, a_flag), (b, b_flag) = outcomes
    if isinstance(a, type) or isinstance(b, type):
        assert outcomes[0] == outcomes[1], outcomes
        return
    assert_same_snapshot(a, b)
    assert (a_flag is None) == (b_flag is None) and (a_flag is None or torch.equal(a_flag, b_flag)), (a_flag, b_flag)


# ---- from_optimizer and checkpoints --------------------------------------------------------------------------------

needs_decoupled_adam = pytest.mark.skipif(
    "decoupled_weight_decay" not in inspect.signature(torch.optim.Adam).parameters,
    reason=f"torch.optim.Adam(decoupled_weight_decay=) arrived in torch 2.5; this is torch {torch.__version__}")


def _takes_named_params() -> bool:
    try:
        torch.optim.SGD([("w", torch.nn.Parameter(torch.zeros(1)))], lr=0.1)
    except TypeError:
        return False
    return True


needs_named_params = pytest.mark.skipif(
    not _takes_named_params(),
    reason=f"torch.optim takes named parameters from torch 2.6; this is torch {torch.__version__}")


@needs_decoupled_adam
def test_from_optimizer_takes_adam_with_decoupled_weight_decay_and_continues_as_torch_would(backend):
    """torch >= 2.5: Adam(decoupled_weight_decay=True) is AdamW's math, so it converts (to ADAMW_TORCH) where Adam
    with L2 decay is refused; two groups, the second with its own lr, amsgrad and maximize."""
    def make(params):
        return torch.optim.Adam([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3, "amsgrad": True,
                                                          "maximize": True}],
                                lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, foreach=False)

    their_params = make_params(seed=1)
    theirs = make(their_params)
    for k in range(5):
        set_grads(their_params, k)
        theirs.step()
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in their_params]
    twin = make(twin_params)
    twin.load_state_dict(theirs.state_dict())
    ours = FusedAdam.from_optimizer(theirs)  # over their_params
    assert [g["adam_w_mode"] for g in ours.param_groups] == [AdamWMode.ADAMW_TORCH] * 2
    step_pair(ours, their_params, twin, twin_params, range(5, 5 + STEPS))
    assert_params_close(their_params, twin_params, **FP32_VS_TORCH)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: decoupled_weight_decay=False with "
                                         r"weight_decay=0\.1 is torch\.optim\.Adam's L2"):
        FusedAdam.from_optimizer(torch.optim.Adam(make_params(), weight_decay=0.1, decoupled_weight_decay=False))


@needs_decoupled_adam
def test_an_adamw_torch_checkpoint_loads_into_adam_with_decoupled_weight_decay_and_continues_as_we_do(backend):
    """A group saved without decoupled_weight_decay reads as False in torch >= 2.5's Adam: our ADAMW_TORCH groups
    say True, so torch.optim.Adam(decoupled_weight_decay=True) goes on with AdamW's math, not L2 decay."""
    ours_params = make_params()
    ours = FusedAdam(ours_params, lr=1e-2, **{**TORCH_ADAMW, "weight_decay": 0.1})
    for k in range(5):
        set_grads(ours_params, k)
        ours.step()
    their_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    theirs = torch.optim.Adam(their_params, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, foreach=False)
    theirs.load_state_dict(ours.state_dict())
    assert theirs.param_groups[0]["decoupled_weight_decay"] is True
    step_pair(ours, ours_params, theirs, their_params, range(5, 5 + STEPS))
    assert_params_close(ours_params, their_params, **FP32_VS_TORCH)


@pytest.mark.parametrize("keyword,value", [("lr", 0.5), ("weight_decay", 0.0), ("betas", (0.8, 0.9)), ("eps", 1e-6),
                                           ("amsgrad", True), ("maximize", True), ("bias_correction", False),
                                           ("adam_w_mode", AdamWMode.ADAMW_TRANSFORMERS)])
def test_from_optimizer_refuses_keywords_that_the_groups_would_silently_override(keyword, value):
    """Passed through to the constructor, these are only defaults, which every converted group overrides with
    torch's value: FusedAdam.from_optimizer(adamw, weight_decay=0.0) kept weight_decay=0.01 without a word."""
    torch_optimizer = torch.optim.AdamW(make_params())
    with pytest.raises(TypeError, match=rf"FusedAdam\.from_optimizer: {keyword} come from the optimizer's param "):
        FusedAdam.from_optimizer(torch_optimizer, **{keyword: value})
    assert FusedAdam.from_optimizer(torch_optimizer, master_weights=True).master_weights  # the other options pass


@needs_named_params
def test_named_params_checkpoints_go_both_ways_with_torch_adamw(backend):
    model = torch.nn.Linear(3, 2)
    twin = copy.deepcopy(model)
    theirs = torch.optim.AdamW(model.named_parameters(), foreach=False)
    ours = FusedAdam(twin.named_parameters(), **TORCH_ADAMW)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    for optimizer, module in ((theirs, model), (ours, twin)):
        for _ in range(3):
            optimizer.zero_grad()
            module(x).square().sum().backward()
            optimizer.step()
    assert ours.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]
    torch_then_ours = FusedAdam(copy.deepcopy(model).named_parameters(), **TORCH_ADAMW)
    torch_then_ours.load_state_dict(theirs.state_dict())
    ours_then_torch = torch.optim.AdamW(copy.deepcopy(twin).named_parameters(), foreach=False)
    ours_then_torch.load_state_dict(ours.state_dict())
    assert torch_then_ours.param_groups[0]["param_names"] == ours_then_torch.param_groups[0]["param_names"]


@pytest.mark.parametrize("moments", [None, torch.float16, torch.uint8], ids=["fp32-moments", "fp16", "8-bit"])
def test_a_torch_adamw_state_moved_in_process_is_copied_never_shared(moments, backend):
    """torch's state_dict() hands out its live state tensors: FusedAdam.load_state_dict must copy them (also when
    the dtypes match and aliasing would be possible), so that neither optimizer's steps reach the other."""
    their_params = make_params()
    theirs = torch.optim.AdamW(their_params, amsgrad=True, foreach=False)
    for k in range(5):
        set_grads(their_params, k)
        theirs.step()
    ours_params = [torch.nn.Parameter(p.detach().clone()) for p in their_params]
    ours = FusedAdam(ours_params, amsgrad=True, exp_avg_dtype=moments, exp_avg_sq_dtype=moments, **TORCH_ADAMW)
    transferred = theirs.state_dict()
    ours.load_state_dict(transferred)
    before = optimizer_snapshot(theirs)
    for k in range(5, 15):
        set_grads(ours_params, k)
        ours.step()
    assert_tree_bitwise_equal(optimizer_snapshot(theirs), before, "torch's optimizer")
    ours_before = ours.state_dict()
    for k in range(5, 15):
        set_grads(their_params, k)
        theirs.step()
    assert_tree_bitwise_equal(ours.state_dict(), ours_before, "FusedAdam after torch stepped on")


CHECKPOINT_CONFIGS = {
    "lr-tensor-amsgrad": dict(lr=torch.tensor(1e-2), amsgrad=True),
    "ort-l2-mode": dict(adam_w_mode=AdamWMode.ADAM_L2_REGULARIZATION, bias_correction=False),
    "masters-fp16-moments": dict(master_weights=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
    "masters-bf16-moments": dict(master_weights=True, exp_avg_dtype=torch.bfloat16),
    "8-bit-moments": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
}


@pytest.mark.parametrize("config", CHECKPOINT_CONFIGS)
def test_a_checkpoint_through_torch_save_and_weights_only_load_resumes_bit_for_bit(config, backend, tmp_path):
    """The file a user writes (torch.save of state_dict()) loads with torch.load(weights_only=True) and the run goes
    on exactly as the uninterrupted one, for every group option and state layout above."""
    def build(params):
        options = dict(CHECKPOINT_CONFIGS[config])
        if isinstance(options.get("lr"), torch.Tensor):
            options["lr"] = options["lr"].clone()
        return FusedAdam([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}], **options)

    dtype = torch.bfloat16 if "masters" in config else torch.float32
    params, resumed_params = make_params(dtype), make_params(dtype)
    opt, resumed = build(params), build(resumed_params)
    for k in range(10):
        set_grads(params, k)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    with torch.no_grad():
        for p, q in zip(params, resumed_params):
            q.copy_(p)
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    for k in range(10, 40):
        set_grads(params, k)
        set_grads(resumed_params, k)
        opt.step()
        resumed.step()
    for i, (p, q) in enumerate(zip(params, resumed_params)):
        assert_bitwise_equal(p.detach(), q.detach(), f"param {i}")
    assert_tree_bitwise_equal(opt.state_dict(), resumed.state_dict(), "state_dict")


def test_a_checkpoint_loads_with_weights_only_after_a_scheduler_computed_the_lr_with_numpy(backend, tmp_path):
    """A cosine LambdaLR written with numpy puts numpy.float64 into group['lr']; torch.save pickles that as a numpy
    object, which torch.load(weights_only=True) refuses (torch.optim.AdamW's checkpoint then fails to load). The
    saved form holds Python numbers instead."""
    params = make_params()
    opt = FusedAdam(params, betas=(np.float32(0.9), 0.999), **TORCH_ADAMW)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1 + np.cos(np.pi * k / 10)))
    for k in range(3):
        set_grads(params, k)
        opt.step()
        scheduler.step()
    assert isinstance(opt.param_groups[0]["lr"], np.floating)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    loaded = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    group = loaded["param_groups"][0]
    assert type(group["lr"]) is float and group["lr"] == opt.param_groups[0]["lr"]
    assert type(group["betas"][0]) is float and group["betas"][0] == np.float32(0.9)
    twin = FusedAdam(make_params(), **TORCH_ADAMW)
    twin.load_state_dict(loaded)
    assert twin.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_steps_keep_counting_exactly_beyond_float32s_2_to_the_24(backend):
    """Trap 1: a float32 step counter stops at 2**24; FusedAdam's per-param step keeps counting (and the bias
    corrections stay exact: at such steps they are 1)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], **TORCH_ADAMW)
    saved = opt.state_dict()
    saved["state"] = {0: {"step": torch.tensor(2.0**24, dtype=torch.float64), "exp_avg": torch.full((3,), 0.1),
                          "exp_avg_sq": torch.full((3,), 0.01)}}
    opt.load_state_dict(saved)
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.step()
    assert float(opt.state[p]["step"]) == 2.0**24 + 3 == float(opt.state_dict()["state"][0]["step"])


# ---- master weights ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_master_weights_track_torch_adamw_on_fp32_copies(dtype, backend):
    """The fp32 master of a low-precision param follows torch.optim.AdamW run on an fp32 copy with the same
    (low-precision) gradients; the param is its master rounded to nearest even, bit for bit, after every step."""
    params = make_params(dtype)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in params]
    # (TransformerEngine's call: its master_weight_dtype default given explicitly, fp32 moments)
    ours = FusedAdam(params, lr=1e-2, master_weights=True, master_weight_dtype=torch.float32,
                     exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, **TORCH_ADAMW)
    theirs = torch.optim.AdamW(fp32, lr=1e-2, foreach=False)
    for k in range(STEPS):
        set_grads(params, k)
        for p, q in zip(params, fp32):
            q.grad = p.grad.float()
        ours.step()
        theirs.step()
        for p in params:
            assert_bitwise_equal(p.detach(), ours.state[p]["master_param"].to(dtype), f"step {k}")
    assert_params_close([ours.state[p]["master_param"] for p in params], fp32, **FP32_VS_TORCH)


def test_grad_scaler_with_fp16_params_and_masters_equals_grad_scaler_with_torch_adamw_on_fp32_copies(backend):
    """torch.amp.GradScaler drives FusedAdam(master_weights=True) on an fp16 model through the fused protocol
    (unscale inside the step, skip on inf) as it drives torch.optim.AdamW on an fp32 copy fed the same gradients: the
    same skipped steps, the same scale history and step counts, masters within float32 rounding of torch's params."""
    gen = torch.Generator().manual_seed(5)
    half = [torch.nn.Parameter(torch.randn(s, generator=gen).half()) for s in [(4,), (2, 3), ()]]
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in half]
    ours = FusedAdam(half, lr=1e-2, master_weights=True, **TORCH_ADAMW)
    theirs = torch.optim.AdamW(fp32, lr=1e-2, foreach=False)
    # (growth_interval: the scale stays where x * scale fits in fp16; above 65504 the fp16 grads, not the fp32
    # copy's, would overflow and the two runs would rightly part)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=8) for _ in range(2)]
    history = []
    for k in range(40):
        xs = [torch.randn(p.shape, generator=gen).half() for p in half]
        if k in (3, 4, 17):
            xs[k % 3].view(-1)[0] = float("inf") if k != 4 else float("nan")
        for params, opt, scaler in ((half, ours, scalers[0]), (fp32, theirs, scalers[1])):
            opt.zero_grad()
            loss = sum((p * x.to(p.dtype)).sum() for p, x in zip(params, xs))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        history.append((scalers[0].get_scale(), scalers[1].get_scale()))
    assert all(a == b for a, b in history), history
    assert [float(ours.state[p]["step"]) for p in half] == [float(theirs.state[q]["step"]) for q in fp32] == [37.0] * 3
    assert_params_close([ours.state[p]["master_param"] for p in half], fp32, **FP32_VS_TORCH)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_global_clipping_over_groups_and_dtypes_equals_clip_grad_norm_then_torch_adamw(low, backend):
    """max_grad_norm clips by the norm over all params of the optimizer: here two groups with their own
    lr and weight decay, fp32 params in one and low-precision params with masters in the other, against
    clip_grad_norm_ over fp32 copies of all of them followed by torch.optim.AdamW with the same groups. The norm is
    summed in another order than torch's (the clip coefficient may differ in its last bit), hence FP32_VS_TORCH."""
    gen = torch.Generator().manual_seed(9)
    fp32 = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(5,), (3, 4)]]
    lows = [torch.nn.Parameter(torch.randn(s, generator=gen).to(low)) for s in [(6,), (), (2, 3)]]
    copies = [torch.nn.Parameter(p.detach().float()) for p in fp32 + lows]
    groups = lambda a, b: [{"params": a}, {"params": b, "lr": 3e-3, "weight_decay": 0.1}]  # noqa: E731
    ours = FusedAdam(groups(fp32, lows), lr=1e-2, master_weights=True, max_grad_norm=1.0, **TORCH_ADAMW)
    theirs = torch.optim.AdamW(groups(copies[:2], copies[2:]), lr=1e-2, foreach=False)
    clipped = 0
    for k in range(STEPS):
        for p, q in zip(fp32 + lows, copies):
            p.grad = (torch.randn(p.shape, generator=gen) * (0.2 + k % 3)).to(p.dtype)
            q.grad = p.grad.float().clone()  # (a copy: clip_grad_norm_ below clips it in place)
        clipped += float(torch.nn.utils.clip_grad_norm_(copies, 1.0)) > 1.0
        ours.step()
        theirs.step()
    assert 0 < clipped < STEPS  # both regimes were exercised
    assert_params_close(fp32 + [ours.state[p]["master_param"] for p in lows], copies, **FP32_VS_TORCH)


def test_a_value_written_into_a_param_with_a_master_is_overwritten_unless_copied_into_the_master_as_documented(
        backend):
    """FusedAdam's docstring (master_weights): the master is what the optimizer updates; after writing the params
    (a model-only checkpoint) copy them into the masters."""
    p = torch.nn.Parameter(torch.randn(4).half())
    opt = FusedAdam([p], master_weights=True, lr=0.0)  # lr 0: a step only writes the master back into the param
    p.grad = torch.ones_like(p)
    opt.step()
    before = p.detach().clone()
    loaded = torch.full_like(p, 5.0)
    with torch.no_grad():
        p.copy_(loaded)
    opt.step()
    assert_bitwise_equal(p.detach(), before, "the master wins")
    with torch.no_grad():
        p.copy_(loaded)
        opt.state[p]["master_param"].copy_(p)
    opt.step()
    assert_bitwise_equal(p.detach(), loaded, "the documented recipe")
    assert "model.load_state_dict" in FusedAdam.__doc__ and "['master_param'].copy_(p)" in FusedAdam.__doc__


# ---- TransformerEngine's state accessors: get_unscaled_state and set_scaled_state ----------------------------------

_MOMENT_FORMATS = {
    "fp32": {}, "bf16": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    "fp16 scaled": {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16},
    "8-bit": {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8},
    "4-bit": {"exp_avg_dtype": torch.uint4, "exp_avg_sq_dtype": torch.uint4},
    "fp8": {"exp_avg_dtype": torch.float8_e4m3fn, "exp_avg_sq_dtype": torch.float8_e5m2},
    "bf16 params with masters, amsgrad": {"master_weights": True, "amsgrad": True},
}


def _stepped(options: dict, steps: int = 2) -> tuple[torch.nn.Parameter, FusedAdam]:
    """A param of 70 x 90 (several blocks of every format) after `steps` steps of FusedAdam(**options)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(70, 90, dtype=torch.bfloat16 if options.get("master_weights") else None))
    opt = FusedAdam([p], lr=1e-2, **options)
    for _ in range(steps):
        p.grad = torch.randn_like(p)
        opt.step()
    return p, opt


def _names(opt: FusedAdam, p: torch.Tensor) -> list[str]:
    return [key for key in ("exp_avg_sq", "max_exp_avg_sq", "exp_avg", "master_param") if key in opt.state[p]]


@pytest.mark.parametrize("moments", list(_MOMENT_FORMATS), ids=list(_MOMENT_FORMATS))
def test_get_unscaled_state_is_the_decoded_state_that_state_dict_saves_as_a_copy(moments):
    """TransformerEngine's get_unscaled_state(param, state_name): float32 values, here decoded from every format
    (what state_dict() saves, bit for bit), and always a copy (TE hands back a float32 state itself)."""
    p, opt = _stepped(_MOMENT_FORMATS[moments])
    saved = opt.state_dict()["state"][0]
    for name in _names(opt, p):
        value = opt.get_unscaled_state(p, name)
        assert value.dtype == torch.float32 and value.shape == p.shape, name
        assert_bitwise_equal(value, saved[name], name)
        before = optimizer_snapshot(opt)
        value.fill_(7.0)
        assert_same_snapshot(before, optimizer_snapshot(opt))


@pytest.mark.parametrize("moments", list(_MOMENT_FORMATS), ids=list(_MOMENT_FORMATS))
def test_set_scaled_state_encodes_values_as_a_loaded_checkpoint_does_and_round_trips(moments):
    """TransformerEngine's set_scaled_state(param, state_name, unscaled_state): the values encoded into the state's
    own format, as load_state_dict encodes a checkpoint holding them (bit for bit: the same state tensors, and a 4-bit
    exp_avg kept as near as it is when exp_avg_sq changes under it); setting what get_unscaled_state returned changes
    no bit; the input is only read."""
    p, opt = _stepped(_MOMENT_FORMATS[moments])
    for name in _names(opt, p):
        before = optimizer_snapshot(opt)
        opt.set_scaled_state(p, name, opt.get_unscaled_state(p, name))
        assert_same_snapshot(before, optimizer_snapshot(opt))
        torch.manual_seed(1)
        values = torch.rand(p.shape) * 0.01 + (p.detach().float() if name == "master_param" else 0)
        given = values.clone()
        checkpoint = opt.state_dict()
        checkpoint["state"][0][name] = values.clone()
        opt.set_scaled_state(p, name, values)
        assert torch.equal(values, given)
        _, loaded = _stepped(_MOMENT_FORMATS[moments])
        loaded.load_state_dict(checkpoint)
        assert_tree_bitwise_equal(loaded.state_dict(), opt.state_dict())
        assert_bitwise_equal(opt.get_unscaled_state(p, name), loaded.state_dict()["state"][0][name], name)
    p.grad = torch.randn_like(p)
    opt.step()  # steps from the values set


def test_set_scaled_state_makes_a_missing_state_as_the_first_step_does_then_writes_it():
    """As TE's makes a missing state: a param not stepped yet gets step 0, zero moments (and its master), then the
    values; its first step then starts from them, as from a loaded checkpoint holding them. Getting a state not
    made yet raises a KeyError, as TE's (a StateNameError, also a ValueError)."""
    assert issubclass(StateNameError, KeyError) and issubclass(StateNameError, ValueError)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    opt = FusedAdam([p], lr=1e-2, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    with pytest.raises(KeyError, match=r"get_unscaled_state: param_groups\[0\]\['params'\]\[0\] .* has no "
                                         r"'exp_avg' state yet"):
        opt.get_unscaled_state(p, "exp_avg")
    opt.set_scaled_state(p, "exp_avg_sq", torch.full((8,), 0.25))
    assert float(opt.state[p]["step"]) == 0
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg"), torch.zeros(8))
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg_sq"), torch.full((8,), 0.25))



def test_a_4bit_exp_avg_is_set_after_its_exp_avg_sq_and_one_it_cannot_code_is_refused():
    """A 4-bit exp_avg is coded relative to its exp_avg_sq as stored (its codes hold m / sqrt(v)): values set where
    sqrt(v) is 0, as in a state not made yet (TE's order, exp_avg first), cannot be held at all, and are refused
    naming the order that works, changing nothing; set after exp_avg_sq (the order load_state_dict writes them in),
    they are held as a loaded checkpoint holding both holds them."""
    options = _MOMENT_FORMATS["4-bit"]
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(70, 90))
    opt = FusedAdam([p], lr=1e-2, **options)
    exp_avg, exp_avg_sq = torch.randn(70, 90) * 0.01, torch.rand(70, 90) * 1e-3
    with pytest.raises(ValueError, match=r"set_scaled_state\(param_groups\[0\]\['params'\]\[0\] .*, 'exp_avg'\): "
                                         r"a 4-bit exp_avg is coded relative to its exp_avg_sq .* set 'exp_avg_sq' "
                                         r"first"):
        opt.set_scaled_state(p, "exp_avg", exp_avg)
    assert len(opt.state) == 0
    opt.set_scaled_state(p, "exp_avg_sq", exp_avg_sq)
    opt.set_scaled_state(p, "exp_avg", exp_avg)
    loaded = FusedAdam([torch.nn.Parameter(p.detach().clone())], lr=1e-2, **options)
    checkpoint = opt.state_dict()
    checkpoint["state"][0].update(exp_avg=exp_avg.clone(), exp_avg_sq=exp_avg_sq.clone())
    loaded.load_state_dict(checkpoint)
    assert_tree_bitwise_equal(loaded.state_dict(), opt.state_dict())

@pytest.mark.parametrize("call, error, message", [
    (lambda opt, p: opt.get_unscaled_state(p, "exp_avg_sqr"), StateNameError,
     r"get_unscaled_state: state_name must be one of 'exp_avg', 'exp_avg_sq', 'master_param', 'max_exp_avg_sq', "
     r"got 'exp_avg_sqr'"),
    (lambda opt, p: opt.set_scaled_state(p, "step", torch.zeros(())), StateNameError, r"state_name must be one of"),
    (lambda opt, p: opt.set_scaled_state(torch.zeros(70, 90), "exp_avg", torch.zeros(70, 90)), ValueError,
     r"param must be one of this optimizer's params .* got a tensor of shape \(70, 90\)"),
    (lambda opt, p: opt.set_scaled_state(p, "exp_avg", torch.zeros(90, 70)), ValueError,
     r"set_scaled_state\(param_groups\[0\]\['params'\]\[0\] .*, 'exp_avg'\): unscaled_state has shape \(90, 70\), "
     r"the param \(70, 90\)"),
    (lambda opt, p: opt.set_scaled_state(p, "exp_avg", torch.zeros(70, 90, dtype=torch.bfloat16)), TypeError,
     r"unscaled_state must be a dense torch.float32 tensor .* got torch.bfloat16"),
    (lambda opt, p: opt.set_scaled_state(p, "exp_avg", [0.0]), TypeError, r"unscaled_state must be a tensor"),
    (lambda opt, p: opt.set_scaled_state(p, "exp_avg_sq", -torch.ones(70, 90)), ValueError,
     r"holds negative values; a second moment is a mean of squares"),
    (lambda opt, p: opt.set_scaled_state(p, "master_param", torch.zeros(70, 90)), ValueError,
     r"this optimizer keeps no such state for it \(master_weights=False"),
    (lambda opt, p: opt.set_scaled_state(p, "max_exp_avg_sq", torch.zeros(70, 90)), ValueError,
     r"keeps no such state for it \(amsgrad=False\)"),
    (lambda opt, p: opt.get_unscaled_state(p, "master_param"), StateNameError, r"has no 'master_param' state"),
], ids=["unknown name", "step", "not a param", "shape", "dtype", "not a tensor", "negative v", "no masters",
        "no amsgrad", "get a missing master"])
def test_the_state_accessors_refuse_what_they_cannot_take_naming_it_and_change_nothing(call, error, message):
    p, opt = _stepped(_MOMENT_FORMATS["8-bit"])
    before = optimizer_snapshot(opt)
    with pytest.raises(error, match=message):
        call(opt, p)
    assert_same_snapshot(before, optimizer_snapshot(opt))
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"}


def test_a_4bit_exp_avg_set_where_its_stored_exp_avg_sq_is_zero_is_refused_and_changes_nothing():
    """In a state already made, a 4-bit exp_avg is refused where its stored exp_avg_sq is 0 and the values are not
    (codes of m / sqrt(v) cannot hold them), as for a state not made yet, naming the order that works; zeros there
    are held. (A 4-bit exp_avg_sq holds 0 in a block of zeros, 128 elements: rows 0 to 19 hold 14 of them.)"""
    p, opt = _stepped(_MOMENT_FORMATS["4-bit"])
    exp_avg_sq = torch.rand(p.shape) * 1e-3
    exp_avg_sq[:20] = 0.0
    opt.set_scaled_state(p, "exp_avg_sq", exp_avg_sq)
    before = optimizer_snapshot(opt)
    values = torch.randn(p.shape) * 0.01
    with pytest.raises(ValueError, match=r"set_scaled_state\(param_groups\[0\]\['params'\]\[0\] .*, 'exp_avg'\): "
                                         r"a 4-bit exp_avg is coded relative to its exp_avg_sq .* sqrt\(v\) is 0 where "
                                         r"unscaled_state is not: set 'exp_avg_sq' first"):
        opt.set_scaled_state(p, "exp_avg", values)
    assert_same_snapshot(before, optimizer_snapshot(opt))
    values[:20] = 0.0
    opt.set_scaled_state(p, "exp_avg", values)
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg")[:20], torch.zeros(20, 90))


def test_set_scaled_state_refuses_a_negative_amsgrad_maximum_as_a_second_moment():
    """max_exp_avg_sq is a maximum of second moments: negative values are refused as for exp_avg_sq, changing
    nothing."""
    p, opt = _stepped(_MOMENT_FORMATS["bf16 params with masters, amsgrad"])
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"set_scaled_state\(param_groups\[0\]\['params'\]\[0\] .*, "
                                         r"'max_exp_avg_sq'\): unscaled_state holds negative values"):
        opt.set_scaled_state(p, "max_exp_avg_sq", -torch.ones(p.shape))
    assert_same_snapshot(before, optimizer_snapshot(opt))


@pytest.mark.parametrize("switched", ["amsgrad off", "amsgrad on", "master_weights on"])
def test_the_state_accessors_follow_options_switched_since_the_state_was_made(switched):
    """A state the optimizer keeps (it holds it, or its options now call for it) is got and set whatever the options
    were when the state was made: a max_exp_avg_sq kept after amsgrad was switched off (as a load keeps it, for
    switching it on again); a max_exp_avg_sq or master that amsgrad or master_weights, switched on since, calls for
    and no step has made yet is made, as the next step would make it, then written."""
    torch.manual_seed(0)
    bf16 = switched == "master_weights on"
    p = torch.nn.Parameter(torch.randn(70, 90, dtype=torch.bfloat16 if bf16 else None))
    opt = FusedAdam([p], lr=1e-2, amsgrad=switched == "amsgrad off")
    p.grad = torch.randn_like(p)
    opt.step()
    if bf16:
        opt.master_weights = True
    else:
        opt.param_groups[0]["amsgrad"] = switched == "amsgrad on"
    name = "master_param" if bf16 else "max_exp_avg_sq"
    assert (name in opt.state[p]) == (switched == "amsgrad off")
    values = torch.rand(p.shape) * 1e-3 + (p.detach().float() if name == "master_param" else 0)
    opt.set_scaled_state(p, name, values)
    assert torch.equal(opt.get_unscaled_state(p, name), values)


def test_the_state_accessors_take_an_empty_state_entry_as_no_state_yet():
    """Reading ``optimizer.state[p]`` for a param not stepped yet makes an empty entry (torch.optim's state is a
    defaultdict): the accessors take it as no state, as a step does (get: not made yet; set: made as the first step
    makes it, then written)."""
    p = torch.nn.Parameter(torch.randn(8))
    opt = FusedAdam([p], lr=1e-2, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    assert not opt.state[p]
    with pytest.raises(StateNameError, match=r"has no 'exp_avg' state yet \(its first step makes it\)"):
        opt.get_unscaled_state(p, "exp_avg")
    opt.set_scaled_state(p, "exp_avg_sq", torch.full((8,), 0.25))
    assert float(opt.state[p]["step"]) == 0
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg"), torch.zeros(8))
    p.grad = torch.ones(8)
    opt.step()


def test_a_state_name_error_reads_as_its_message_not_as_a_quoted_key():
    """StateNameError is a KeyError, whose str() is the repr of its key ('...' in quotes): its text is the message
    itself, as every other refusal's."""
    p, opt = _stepped(_MOMENT_FORMATS["fp32"])
    with pytest.raises(StateNameError) as info:
        opt.get_unscaled_state(p, "master_param")
    assert str(info.value).startswith("get_unscaled_state: param_groups[0]['params'][0] "), str(info.value)
    assert str(info.value).endswith("has no 'master_param' state"), str(info.value)


@pytest.mark.parametrize("state_name", ["exp_avg", "exp_avg_sq"])
def test_set_scaled_state_refuses_finite_values_its_storage_cannot_hold_as_a_load_refuses_them(state_name):
    """float32's largest values round to inf in bfloat16 moments: set_scaled_state refuses them, naming the storage,
    as load_state_dict refuses a checkpoint holding them (the same rule), and changes nothing. inf and NaN given as
    such are stored as they are, with a warning, as a load stores and warns about them."""
    p, opt = _stepped(_MOMENT_FORMATS["bf16"])
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=rf"set_scaled_state\(param_groups\[0\]\['params'\]\[0\] .*, '{state_name}'\): "
                                         rf"unscaled_state holds values beyond the range of this optimizer's "
                                         rf"torch.bfloat16 {state_name} storage"):
        opt.set_scaled_state(p, state_name, torch.full(tuple(p.shape), 3.4e38))
    assert_same_snapshot(before, optimizer_snapshot(opt))
    sd = opt.state_dict()
    sd["state"][0][state_name] = torch.full(tuple(p.shape), 3.4e38)
    with pytest.raises(ValueError, match="holds values beyond the range of this optimizer's torch.bfloat16"):
        opt.load_state_dict(sd)
    with pytest.warns(RuntimeWarning, match=rf"set_scaled_state\(.*'{state_name}'\): unscaled_state holds inf or NaN; "
                                            "stored as given"):
        opt.set_scaled_state(p, state_name, torch.full(tuple(p.shape), float("inf")))
    assert bool(torch.isinf(opt.get_unscaled_state(p, state_name)).all())
