"""FusedAdam's param-group options: one rule for each, wherever a value comes in (the constructor, add_param_group, a
write into param_groups before step(), load_state_dict); tensor hyperparameters as torch.optim takes them;
optimizer-wide options refused inside a group; checkpoints of other torch optimizers refused; state_dict() with a
param removed from its group."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import assert_tree_bitwise_equal, fuzz_examples, optimizer_snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ort_optim import AdamWMode, FusedAdam
from ort_optim._spec import to_float32


def _params(n: int = 2) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(n)]


def _stepped(make=None, **options) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """FusedAdam(ADAMW_TORCH, **options), or make(params), after one step with gradients of ones."""
    params = _params()
    opt = make(params) if make is not None else FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, **options)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt, params


# (id, group options, error type, what the message says after the entry's name)
FAULTS = [
    ("betas-not-a-pair", dict(betas=(0.9,)), ValueError, r" must be a pair \(beta1, beta2\)"),
    ("betas-none", dict(betas=None), ValueError, r" must be a pair \(beta1, beta2\), got NoneType None"),
    ("betas-a-list-of-three", dict(betas=[0.9, 0.99, 0.5]), ValueError,
     r" must be a pair \(beta1, beta2\), got list \[0\.9, 0\.99, 0\.5\]"),
    ("beta-out-of-range", dict(betas=(0.9, 1.0)), ValueError, r"\[1\] must be in \[0, 1\), got 1\.0"),
    ("beta-a-string", dict(betas=("0.9", 0.999)), TypeError, r"\[0\] must be a real number, got str"),
    ("lr-negative", dict(lr=-1.0), ValueError, r" must be >= 0, got -1\.0"),
    ("lr-a-string", dict(lr="1e-3"), TypeError, r" must be a real number, got str '1e-3'"),
    ("lr-two-elements", dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, r" must hold exactly one number"),
    ("eps-nan", dict(eps=float("nan")), ValueError, r" must be finite, got nan"),
    ("weight-decay-bool", dict(weight_decay=True), TypeError, r" must be a real number, got bool True"),
    ("amsgrad-string", dict(amsgrad="False"), TypeError, r" must be True or False \(a bool\), got str 'False'"),
    ("adam-w-mode-5", dict(adam_w_mode=5), ValueError, r" must be an AdamWMode \(0, 1 or 2\), got 5"),
    ("adam-w-mode-string", dict(adam_w_mode="ADAMW_TORCH"), TypeError, r" must be an AdamWMode or the int 0, 1 or 2"),
    ("seed-negative", dict(stochastic_rounding_seed=-1), ValueError, r" must be an int in \[0, 2\*\*64\)"),
    ("seed-2**64", dict(stochastic_rounding_seed=2**64), ValueError,
     r" must be an int in \[0, 2\*\*64\), got 18446744073709551616"),
]


def _key(options: dict) -> str:
    return next(iter(options))


@pytest.mark.parametrize("options,error,message", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_each_fault_is_one_error_wherever_the_value_comes_in(options, error, message):
    key = _key(options)
    entries = {
        "constructor": (rf"FusedAdam: {key}", lambda: FusedAdam(_params(), **options)),
        "add_param_group": (rf"param_groups\[1\]: {key}",
                            lambda: FusedAdam(_params()).add_param_group({"params": _params(1), **options})),
    }
    for where, (name, call) in entries.items():
        with pytest.raises(error, match=name + message):
            call()
    # written into a group before a step: refused by the step, nothing changed
    opt, params = _stepped()
    opt.param_groups[0].update(options)
    before = optimizer_snapshot(opt)
    with pytest.raises(error, match=rf"param_groups\[0\]: {key}" + message):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    # in a checkpoint: refused by load_state_dict, nothing changed
    opt, params = _stepped()
    sd = opt.state_dict()
    sd["param_groups"][0].update(options)
    before = optimizer_snapshot(opt)
    with pytest.raises(error, match=rf"state_dict\['param_groups'\]\[0\]\['{key}'\]" + message):
        opt.load_state_dict(sd)
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


# ---- any values, wherever they come in -------------------------------------------------------------------------------

_NUMBERS = [0.0, 1e-3, 0.5, 1, -1e-3, float("nan"), float("inf"), 1e300, 10**400, np.float32(1e-3), True, None, "1e-3",
            torch.tensor(1e-3), torch.tensor(1e-3, dtype=torch.float64), torch.tensor([1e-3, 1e-3]),
            torch.tensor(1), torch.tensor(float("nan")), torch.tensor(1e-3, device="meta")]
OPTION_VALUES = {
    "lr": _NUMBERS,
    "eps": _NUMBERS,
    "weight_decay": _NUMBERS,
    "betas": [(0.9, 0.999), [0.8, 0.99], (0.0, 0.0), (0.9,), (0.9, 0.999, 0.5), (1.0, 0.5), (-0.1, 0.5),
              (0.9, float("nan")), (torch.tensor(0.9), 0.999), (torch.tensor(0.9, device="meta"), 0.999),
              (True, 0.5), ([0.9], 0.5), "0.9", None, 0.9],
    "amsgrad": [True, False, 1, 0, "False", None, torch.tensor(True)],
    "maximize": [True, False, 0.0, "True"],
    "bias_correction": [True, False, 1, None],
    "adam_w_mode": [0, 1, 2, AdamWMode.ADAMW_TORCH, 3, -1, True, 2.0, "2", None],
    "stochastic_rounding_seed": [0, 7, 2**64 - 1, 2**64, -1, 1.5, True, "3", None],
}


def _entry_outcomes(options: dict) -> dict:
    """Each way a group's options come in, given the same options: (accepted, error type, message without the
    entry's name); a refusal must name the entry of one of the options and change nothing."""
    outcomes = {}

    def attempt(where: str, names: dict, call, opt=None) -> None:
        before = None if opt is None else optimizer_snapshot(opt)
        try:
            call()
        except (ValueError, TypeError) as error:
            message = str(error)
            prefix = next((names[key] for key in options if message.startswith(names[key])), None)
            assert prefix is not None, f"{where}: the error names none of {sorted(options)}: {message}"
            if opt is not None:
                assert_tree_bitwise_equal(optimizer_snapshot(opt), before, f"{where}: optimizer")
            outcomes[where] = (False, type(error), message[len(prefix):])
            return
        outcomes[where] = (True, None, None)

    attempt("constructor", {k: f"FusedAdam: {k}" for k in options}, lambda: FusedAdam(_params(), **options))
    # (the stepped optimizers keep amsgrad's max_exp_avg_sq as the options ask: turning amsgrad on over states made
    # without it is refused for those states, test_state_cache.py)
    amsgrad = options.get("amsgrad") is True
    opt, _ = _stepped(amsgrad=amsgrad)
    attempt("add_param_group", {k: f"param_groups[1]: {k}" for k in options},
            lambda: opt.add_param_group({"params": _params(1), **options}), opt)
    opt, _ = _stepped(amsgrad=amsgrad)
    opt.param_groups[0].update(options)
    attempt("step", {k: f"param_groups[0]: {k}" for k in options}, opt.step, opt)
    opt, _ = _stepped(amsgrad=amsgrad)
    sd = opt.state_dict()
    sd["param_groups"][0].update(options)
    attempt("load_state_dict", {k: f"state_dict['param_groups'][0]['{k}']" for k in options},
            lambda: opt.load_state_dict(sd), opt)
    if outcomes["load_state_dict"][0]:  # and the loaded options step
        attempt("step after load_state_dict", {k: f"param_groups[0]: {k}" for k in options}, opt.step, opt)
    return outcomes


@settings(max_examples=fuzz_examples(300), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(sorted(OPTION_VALUES)), st.integers(0, 10**6), min_size=1, max_size=3))
def test_property_any_options_are_accepted_or_refused_alike_wherever_they_come_in(choices):
    """Values of every kind (numbers in and out of range, NaN, bools, strings, None, tensors of other dtypes, shapes
    and devices), up to three options at once: the constructor, add_param_group, a write into param_groups before
    step() and load_state_dict all accept them, or all refuse them with the same exception and message after the
    name of the entry (whichever option check_group's fixed order meets first), changing nothing; accepted options
    step."""
    options = {key: OPTION_VALUES[key][index % len(OPTION_VALUES[key])] for key, index in choices.items()}
    outcomes = _entry_outcomes(options)
    assert outcomes.pop("step after load_state_dict", (True,))[0], "loaded options that do not step"
    assert len(set(outcomes.values())) == 1, f"{options}: {outcomes}"


# ---- options changed between steps ----------------------------------------------------------------------------------
# A step validates a group's options again whenever any of them differs from what the last step accepted (in value or
# in type), and reads them as they are now.

# (id, group options written before the first step, the change after two steps, error type, message after the
# entry's name)
CHANGES_REFUSED = [
    ("betas-list-edited-in-place", dict(betas=[0.9, 0.999]),
     lambda opt: opt.param_groups[0]["betas"].__setitem__(1, 1.0), ValueError, r"betas\[1\] must be in \[0, 1\)"),
    ("amsgrad-0-for-False", {}, lambda opt: opt.param_groups[0].__setitem__("amsgrad", 0), TypeError,
     r"amsgrad must be True or False \(a bool\), got int 0"),
    ("maximize-0.0-for-False", {}, lambda opt: opt.param_groups[0].__setitem__("maximize", 0.0), TypeError,
     r"maximize must be True or False \(a bool\), got float 0\.0"),
    ("weight-decay-True-for-1", dict(weight_decay=1), lambda opt: opt.param_groups[0].__setitem__("weight_decay", True),
     TypeError, r"weight_decay must be a real number, got bool True"),
    ("lr-numpy-nan", {}, lambda opt: opt.param_groups[0].__setitem__("lr", np.float64("nan")), ValueError,
     r"lr must be finite, got nan"),
    ("stochastic-rounding-then-master-weights", dict(stochastic_rounding=True),
     lambda opt: setattr(opt, "master_weights", True), ValueError,
     r"stochastic_rounding=True is for bfloat16 params without master weights"),
    ("differentiable-0-for-False", dict(differentiable=False),
     lambda opt: opt.param_groups[0].__setitem__("differentiable", 0), TypeError,
     r"differentiable must be True or False \(a bool\), got int 0"),
    ("decoupled-weight-decay-1-for-True", dict(decoupled_weight_decay=True),
     lambda opt: opt.param_groups[0].__setitem__("decoupled_weight_decay", 1), TypeError,
     r"decoupled_weight_decay must be True or False \(a bool\), got int 1"),
]


@pytest.mark.parametrize("options,change,error,message", [c[1:] for c in CHANGES_REFUSED],
                         ids=[c[0] for c in CHANGES_REFUSED])
def test_an_option_changed_after_accepted_steps_is_refused_at_every_step_until_changed_back(
        options, change, error, message, backend):
    """A value equal to the accepted one but of another type (0 for False, True for 1), a betas list edited in place,
    a NaN, stochastic rounding once the optimizer has master weights: each step refuses it with the error of the
    constructor, naming the group, and leaves everything as it was; changed back, the optimizer steps again."""
    params = _params()
    opt = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH)
    opt.param_groups[0].update(copy.deepcopy(options))
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    accepted = ({**opt.param_groups[0], "betas": list(opt.param_groups[0]["betas"])}, opt.master_weights)
    change(opt)
    before = optimizer_snapshot(opt)
    for _ in range(2):
        with pytest.raises(error, match=r"param_groups\[0\]: " + message):
            opt.step()
        assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    opt.param_groups[0].update(accepted[0], params=opt.param_groups[0]["params"])
    opt.master_weights = accepted[1]
    opt.step()
    assert not torch.equal(params[0].detach(), before["p0.0"])


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
HOST_NUMBERS = [0.0, -0.0, 1e-3, 0.1, -0.1, 1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24, 1e-46, 1e-45, -1e-45, 1.2e-38,
                FLOAT32_MAX, FLOAT32_MAX * (1 + 2.0**-25), FLOAT32_MAX * (1 + 2.0**-24), -FLOAT32_MAX * 1.01, 1e39,
                -1e300, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("x", HOST_NUMBERS, ids=repr)
def test_host_numbers_are_rounded_to_float32_as_torch_rounds_them(x):
    """The numbers read in float32 on the host (max_grad_norm, grad_scale, a loss scaler's options, the low-bit
    formats' levels) are rounded by one rule: torch's conversion to float32, to nearest even, inf (with the sign)
    beyond float32's range and 0 below its smallest subnormal."""
    expected = float(torch.tensor(x, dtype=torch.float64).float())
    got = to_float32(x)
    assert (got == expected and math.copysign(1, got) == math.copysign(1, expected)) or (got != got and x != x)


@pytest.mark.parametrize("decoupled", [True, False])
def test_without_weight_decay_either_decoupled_weight_decay_is_accepted_in_every_mode(decoupled):
    """Without weight decay the decoupled and the L2 decay are the same update, so a group's decoupled_weight_decay
    (torch's key, carried in by a wrapper or a checkpoint) is accepted whatever adam_w_mode is, and the step is the
    one without it; with weight decay it must agree with the mode (test_checkpoints.py)."""
    for mode in AdamWMode:
        params, plain = _params(), _params()
        opt = FusedAdam(params, adam_w_mode=mode, weight_decay=0.0)
        reference = FusedAdam(plain, adam_w_mode=mode, weight_decay=0.0)
        opt.param_groups[0]["decoupled_weight_decay"] = decoupled
        for _ in range(2):
            for p, q in zip(params, plain):
                p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
            opt.step()
            reference.step()
        for p, q in zip(params, plain):
            assert torch.equal(p.detach(), q.detach()), mode
        sd = reference.state_dict()
        sd["param_groups"][0]["decoupled_weight_decay"] = decoupled
        FusedAdam(_params(), adam_w_mode=mode, weight_decay=0.0).load_state_dict(sd)


def test_options_changed_between_steps_take_effect_as_in_torch():
    """Each step reads the options as they are then: values replaced, and a betas list edited in place (against
    torch.optim.AdamW with the same changes: rtol 1e-5, atol 1e-7 over 6 fp32 steps)."""
    changes = [
        lambda group: None,
        lambda group: group.update(lr=0.05),
        lambda group: group["betas"].__setitem__(0, 0.5),
        lambda group: group.update(weight_decay=0.3, eps=1e-3),
        lambda group: group.update(maximize=True, bias_correction=True),
        lambda group: (group.update(lr=np.float64(0.01)), group["betas"].__setitem__(1, 0.9)),
    ]
    ours, theirs = _params(), _params()
    opt = FusedAdam(ours, lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH)
    ref = torch.optim.AdamW(theirs, lr=1e-3, eps=1e-8, weight_decay=1e-2, foreach=False)
    for o in (opt, ref):
        o.param_groups[0]["betas"] = [0.9, 0.999]  # (a list, edited in place below)
    g = torch.Generator().manual_seed(1)
    for change in changes:
        for o in (opt, ref):
            change(o.param_groups[0])
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7)


def _torch_run(make_options, steps: int = 6) -> list[torch.Tensor]:
    params = _params()
    torch_opt = torch.optim.AdamW(params, **make_options())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        torch_opt.step()
    return [p.detach().clone() for p in params]


def _fused_run(make_options, steps: int = 6, convert_after: int = 0) -> list[torch.Tensor]:
    """The same run with FusedAdam: converted from a torch AdamW after convert_after steps (from_optimizer), or built
    with the options directly (convert_after=None)."""
    params = _params()
    g = torch.Generator().manual_seed(1)
    if convert_after is None:
        opt = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, **{"eps": 1e-8, "weight_decay": 1e-2,
                                                                       **make_options()})
    else:
        opt = torch.optim.AdamW(params, **make_options())
    for step in range(steps):
        if convert_after is not None and step == convert_after:
            opt = FusedAdam.from_optimizer(opt)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


TENSOR_OPTIONS = {
    "betas": lambda: dict(betas=(torch.tensor(0.9), torch.tensor(0.999))),
    "lr-and-betas": lambda: dict(lr=torch.tensor(1e-2), betas=(torch.tensor(0.8), torch.tensor(0.99))),
    # one-element tensors of any shape, as torch.optim takes them
    "lr-and-betas-of-shape-1x1": lambda: dict(lr=torch.tensor([[1e-2]]),
                                              betas=(torch.tensor([[0.8]]), torch.tensor([[0.99]]))),
}


@pytest.mark.parametrize("make_options", TENSOR_OPTIONS.values(), ids=TENSOR_OPTIONS.keys())
@pytest.mark.parametrize("convert_after", [0, 3, None], ids=["converted-fresh", "converted-after-3", "built"])
def test_tensor_hyperparameters_are_taken_as_torch_takes_them(make_options, convert_after):
    """from_optimizer(torch.optim.AdamW(..., betas=(tensor, tensor))) converts, and the run continues as torch's."""
    try:
        expected = _torch_run(make_options)
    except TypeError:  # (torch 2.4's AdamW takes only 0-dim tensor betas: the same values as 0-dim tensors)
        if convert_after is not None:
            pytest.skip("this torch's AdamW does not take tensor betas of this shape")
        expected = _torch_run(lambda: {key: tuple(b.reshape(()) for b in value) if key == "betas" else
                                       value.reshape(()) for key, value in make_options().items()})
    for ours, theirs in zip(_fused_run(make_options, convert_after=convert_after), expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_tensor_eps_and_weight_decay_step_as_the_floats_they_hold(backend):
    tensors = dict(betas=(torch.tensor(0.8), torch.tensor(0.99)), eps=torch.tensor(1e-6),
                   weight_decay=torch.tensor(0.1))
    # (a float32 tensor holds its value rounded to float32: the floats it steps as are those values)
    floats = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    floats = {key: tuple(float(torch.tensor(b)) for b in value) if key == "betas" else float(torch.tensor(value))
              for key, value in floats.items()}
    runs = [_fused_run(lambda options=options: options, convert_after=None) for options in (floats, tensors)]
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("options,name", [
    (dict(betas=(torch.tensor(0.9, device="meta"), 0.999)), r"betas\[0\]"),
    (dict(eps=torch.tensor(1e-8, device="meta")), "eps"),
    (dict(weight_decay=torch.tensor(0.0, device="meta")), "weight_decay"),
], ids=["beta1", "eps", "weight-decay"])
def test_hyperparameter_tensors_on_an_accelerator_are_refused_saying_so(options, name):
    """The op reads betas, eps and weight_decay on the host at every step: a device tensor there would cost a
    synchronisation per step (the meta device stands in for an accelerator)."""
    with pytest.raises(ValueError, match=rf"{name}: a tensor on meta is not supported"):
        FusedAdam(_params(), **options)


def test_an_lr_tensor_without_data_is_refused_wherever_it_comes_from():
    """An lr tensor may live on an accelerator (the kernel reads it there), but one on the meta device (a checkpoint
    loaded with map_location="meta") holds no value that any step could read: refused at construction,
    add_param_group, load_state_dict and step, naming the entry, and nothing changes."""
    meta_lr = torch.tensor(1e-3, device="meta")
    message = "is a tensor on the meta device, which holds no value"
    with pytest.raises(ValueError, match=rf"FusedAdam: lr {message}"):
        FusedAdam(_params(), lr=meta_lr)
    opt, params = _stepped()
    sd = opt.state_dict()
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: lr {message}"):
        opt.add_param_group({"params": _params(1), "lr": meta_lr})
    sd["param_groups"][0]["lr"] = meta_lr
    with pytest.raises(ValueError, match=rf"state_dict\['param_groups'\]\[0\]\['lr'\] {message}"):
        opt.load_state_dict(sd)
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    opt.param_groups[0]["lr"] = meta_lr  # written later: the step refuses it before anything changes
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: lr {message}"):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


@pytest.mark.parametrize("name,value,error,message", [
    ("max_grad_norm", -1.0, ValueError, "max_grad_norm must be None or a float > 0"),
    ("max_grad_norm", "1", TypeError, "max_grad_norm must be None or a real number > 0"),
    ("master_weights", 1, TypeError, "master_weights must be True or False"),
    ("exp_avg_dtype", "uint8", ValueError, "exp_avg_dtype must be None, torch.float32"),
    ("exp_avg_sq_dtype", torch.int8, ValueError, "exp_avg_sq_dtype must be None, torch.float32"),
    ("set_grad_none", "False", TypeError, "set_grad_none must be True or False, got 'False'"),
    ("set_grad_none", None, TypeError, "set_grad_none must be True or False, got None"),
    ("capturable", "False", TypeError, "capturable must be True or False, got 'False'"),
], ids=["max-grad-norm-negative", "max-grad-norm-string", "master-weights-int", "exp-avg-dtype-string",
        "exp-avg-sq-dtype-int8", "set-grad-none-string", "set-grad-none-none", "capturable-string"])
def test_an_optimizer_wide_option_set_between_steps_is_checked_when_set(name, value, error, message):
    """FP16_Optimizer sets master_weights and max_grad_norm on the FusedAdam it wraps, a run may move its moments
    to another dtype between steps, and code written for apex's FusedAdam sets set_grad_none: a bad value is refused
    where it is set, as at construction, and nothing changes (it once stepped with a negative max_grad_norm, or
    failed inside the step; a set_grad_none of "False" made zero_grad() set the gradients to None)."""
    opt, params = _stepped()
    before = (optimizer_snapshot(opt), getattr(opt, name))
    with pytest.raises(error, match=message):
        setattr(opt, name, value)
    assert_tree_bitwise_equal((optimizer_snapshot(opt), getattr(opt, name)), before, "optimizer")


def test_moment_dtypes_changed_between_steps_are_checked_together_at_the_step():
    """Each moment dtype may be set alone (one at a time); a 4-bit exp_avg needs a 4-bit exp_avg_sq, checked at the
    next step before anything changes, and the pair then converts the states."""
    opt, params = _stepped()
    opt.exp_avg_dtype = torch.uint4
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match="set exp_avg_sq_dtype=torch.uint4 too"):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    opt.exp_avg_sq_dtype = torch.uint4
    opt.step()
    assert all(state["exp_avg"].dtype == torch.uint8 and state["exp_avg_scale"].dtype == torch.bfloat16
               for state in opt.state.values())


def test_moment_dtypes_changed_between_steps_convert_each_state_at_its_params_next_step_with_a_gradient():
    """The step reads only the params with a gradient: a frozen param's state stays as it was (its values in
    state_dict()) until it trains again; loading the optimizer's own checkpoint converts every state at once."""
    opt, params = _stepped()
    frozen_before = copy.deepcopy(opt.state_dict()["state"][1])
    opt.exp_avg_dtype = opt.exp_avg_sq_dtype = torch.uint8
    params[0].grad, params[1].grad = torch.ones_like(params[0]), None
    opt.step()
    assert [opt.state[p]["exp_avg"].dtype for p in params] == [torch.uint8, torch.float32]
    assert_tree_bitwise_equal(opt.state_dict()["state"][1], frozen_before, "the frozen param's state")
    opt.load_state_dict(opt.state_dict())
    assert all(opt.state[p]["exp_avg"].dtype == torch.uint8 for p in params)
    assert all(opt.state[p]["exp_avg_sq"].dtype == torch.uint8 for p in params)


@pytest.mark.parametrize("change", ["appended-without-defaults", "lr-deleted"])
def test_a_group_missing_an_option_is_refused_naming_the_group_and_the_option(change):
    """A group appended to param_groups directly has none of the defaults (add_param_group fills them in); torch's
    step raises a bare KeyError there. Refused, naming the group and the option, and nothing changes."""
    opt, params = _stepped()
    extra = _params(1)
    for p in extra:
        p.grad = torch.ones_like(p)
    if change == "appended-without-defaults":
        opt.param_groups.append({"params": extra})
        where = r"param_groups\[1\]: lr is missing"
    else:
        del opt.param_groups[0]["lr"]
        where = r"param_groups\[0\]: lr is missing"
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=where + r": .*optimizer.add_param_group"):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


@pytest.mark.parametrize("key,value", [("exp_avg_dtype", torch.uint8), ("exp_avg_sq_dtype", torch.bfloat16),
                                       ("master_weights", True), ("max_grad_norm", 1e-3)])
def test_optimizer_wide_options_in_a_group_are_refused_naming_the_key_and_the_group(key, value):
    message = rf"param_groups\[1\]: {key} is set in a param group, but FusedAdam takes it for the whole optimizer"
    with pytest.raises(ValueError, match=message):
        FusedAdam([{"params": _params(1)}, {"params": _params(1), key: value}])
    opt, params = _stepped()
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": _params(1), key: value})
    assert len(opt.param_groups) == 1
    opt.param_groups[0][key] = value  # written later: the step refuses it before anything changes
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {key} is set in a param group"):
        opt.step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


def test_a_group_may_repeat_the_optimizers_max_grad_norm_and_a_checkpoint_with_another_is_refused():
    # (torch's ZeroRedundancyOptimizer stores its keyword arguments, max_grad_norm among them, in every group)
    clipped = FusedAdam([{"params": _params(1), "max_grad_norm": 1}], max_grad_norm=1.0)
    plain = FusedAdam(_params(1), max_grad_norm=1.0)
    for opt in (clipped, plain):
        opt.param_groups[0]["params"][0].grad = torch.full((4, 3), 100.0)
        opt.step()
    assert torch.equal(clipped.param_groups[0]["params"][0], plain.param_groups[0]["params"][0])
    saved = clipped.state_dict()
    other = FusedAdam(_params(1), max_grad_norm=2.0)
    other.param_groups[0]["params"][0].grad = torch.ones(4, 3)
    other.step()
    before = optimizer_snapshot(other)
    with pytest.raises(ValueError, match=r"state_dict\['param_groups'\]\[0\]\['max_grad_norm'\] is set in a param "
                                         r"group, .*clips the norm of all gradients together.*own value "
                                         r"\(2.0\), not int 1"):
        other.load_state_dict(saved)
    assert_tree_bitwise_equal(optimizer_snapshot(other), before, "optimizer")


FOREIGN = {"RAdam": torch.optim.RAdam, "NAdam": torch.optim.NAdam, "Adamax": torch.optim.Adamax}


@pytest.mark.parametrize("make", FOREIGN.values(), ids=FOREIGN.keys())
def test_checkpoints_of_other_torch_optimizers_are_refused(make):
    foreign, params = _stepped(make)
    opt = FusedAdam(params)
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"state_dict\['param_groups'\]\[0\].*(torch.optim's NAdam, not of Adam|"
                                         r"other than Adam)"):
        opt.load_state_dict(foreign.state_dict())
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_checkpoints_of_torch_adam_and_adamw_still_load(make):
    torch_opt, params = _stepped(make)
    opt = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH)
    opt.load_state_dict(torch_opt.state_dict())
    assert float(opt.state[params[0]]["step"]) == 1


def test_state_dict_refuses_the_state_of_a_param_removed_from_its_group_naming_it():
    """torch.optim raises a bare KeyError here (torch 2.4 and 2.13)."""
    opt, params = _stepped()
    opt.param_groups[0]["params"].pop()
    with pytest.raises(ValueError, match=r"state_dict\(\): optimizer\.state holds the state of a tensor of shape "
                                         r"\(4, 3\), torch\.float32 that is in no param group"):
        opt.state_dict()
    del opt.state[params[1]]  # as the error says
    sd = opt.state_dict()
    assert list(sd["state"]) == [0]


def test_state_dict_refuses_state_keyed_by_something_other_than_a_param_saying_so():
    """torch.optim saves an entry such as optimizer.state["global"] = {...} as it is; FusedAdam keeps per-param state
    only and refuses it, saying what it is and what to do, with nothing changed."""
    opt, params = _stepped()
    opt.state["global"] = {"n": 1}
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"state_dict\(\): optimizer\.state\['global'\] is keyed by something other "
                                         r"than a param"):
        opt.state_dict()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    del opt.state["global"]  # as the error says
    assert list(opt.state_dict()["state"]) == [0, 1]


def test_state_dict_drops_an_empty_state_of_a_removed_param():
    opt, params = _stepped()
    extra = torch.nn.Parameter(torch.zeros(2))
    assert not opt.state[extra]  # (reading optimizer.state[p] leaves an empty entry, as in torch)
    assert list(opt.state_dict()["state"]) == [0, 1]
