"""FP16_Optimizer, as a specification.

On one process: the loss-scale policy, skipped steps, fp32 masters, clipping, LR schedulers, checkpoints, the entry
point's dispatch, host reads, and ORTModule (when it is installed).

Under hostile use it keeps its promises: construction all-or-nothing, every option checked against float32's range
(hypothesis over policies: refused naming an option, or the scale stays in range), param groups added after wrapping,
closures, sparse gradients, a step without gradients, strict checkpoint loading (every entry checked before anything
changes), DeepSpeed's plain optimizers.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import math
import threading
import warnings

import pytest
import torch
from cases import configurations, gradient, gradients
from conftest import (assert_bitwise_equal, assert_same_history, assert_tree_bitwise_equal, fuzz_examples,
                      optimizer_snapshot, select_backend)
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from ort_optim import FusedAdam
from ort_optim.fp16_optimizer import SCALE_RANGE, DynamicLossScaler, FP16_Optimizer, LossScaleUnderflowError

LOW = (torch.float16, torch.bfloat16)
# Tests that write gradients by hand (standing for scaled ones) step without a backward through the wrapper: the
# warning that says so (test_a_plain_loss_backward_before_step_is_warned_about_once) is expected there.
pytestmark = pytest.mark.filterwarnings(r"ignore:FP16_Optimizer\.step\(\). no loss was scaled:UserWarning")


# ---- the policy, written out as a plain reference ------------------------------------------------------------------


def reference_scales(flags, init=2.0**16, growth=2.0, backoff=0.5, interval=2000, hysteresis=1,
                     consecutive=False, min_scale=1.0, max_scale=2.0**24, action="raise"):
    """The scale after each step, from guides/fp16-optimizer.md's rules ('raise' as the string 'raise')."""
    scale, tracker, left, out = init, 0, hysteresis, []
    for bad in flags:
        if bad:
            tracker = 0
            if left <= 1:
                if scale <= min_scale and action == "raise":
                    out.append("raise")
                    return out
                scale = max(scale * backoff, min_scale)
            else:
                left -= 1
        else:
            if consecutive:
                left = hysteresis
            tracker += 1
            if tracker >= interval:
                tracker, left = 0, hysteresis
                grown = min(scale * growth, max_scale)
                if math.isfinite(grown) and grown >= scale:
                    scale = grown
        out.append(scale)
    return out


def run_scaler(flags, **kwargs):
    scaler = DynamicLossScaler(**kwargs)
    out = []
    for bad in flags:
        scaler.update(torch.tensor(float(bad)))
        try:
            scaler.check(blocking=True)
        except LossScaleUnderflowError:
            out.append("raise")
            return out, scaler
        out.append(float(scaler.scale))
    return out, scaler


SEQUENCES = {
    "torch-like": ([0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0], dict(init_scale=2.0**10, growth_interval=3)),
    "hysteresis-2": ([0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1], dict(init_scale=2.0**10, growth_interval=3,
                                                                             hysteresis=2)),
    "hysteresis-3-consecutive": ([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1], dict(init_scale=2.0**10, growth_interval=5,
                                                                          hysteresis=3, consecutive_hysteresis=True)),
    "growth-to-max": ([0] * 12, dict(init_scale=2.0**10, growth_interval=2, max_scale=2.0**13)),
    "static": ([0, 1, 0, 0, 1, 0, 0], dict(init_scale=2.0**10, growth_interval=1, dynamic=False)),
}


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_scaler_follows_the_documented_policy(name):
    flags, kwargs = SEQUENCES[name]
    got, scaler = run_scaler(flags, **kwargs)
    ref_kwargs = {
        "init": kwargs["init_scale"], "interval": kwargs.get("growth_interval", 2000),
        "hysteresis": kwargs.get("hysteresis", 1), "consecutive": kwargs.get("consecutive_hysteresis", False),
        "max_scale": kwargs.get("max_scale", 2.0**24),
    }
    if kwargs.get("dynamic") is False:
        expected = [kwargs["init_scale"]] * len(flags)
    else:
        expected = reference_scales(flags, **ref_kwargs)
    assert got == expected
    assert int(scaler.skipped_steps) == sum(flags)
    assert float(scaler.found_inf) == float(flags[-1])


def test_scaler_hand_checked_sequence():
    # hysteresis 2, growth every 2 good steps: overflow absorbed, then back off, stays exhausted until growth refills
    flags = [1, 1, 1, 0, 0, 1, 1]
    got, _ = run_scaler(flags, init_scale=64.0, growth_interval=2, hysteresis=2)
    assert got == [64.0, 32.0, 16.0, 16.0, 32.0, 32.0, 16.0]


def test_a_loaded_state_keeps_this_scalers_hysteresis_policy():
    # A checkpoint of a scaler with hysteresis 3 (two overflows still to absorb) loaded into one with hysteresis 1:
    # every overflow backs off, as this policy says, not only the third.
    saved = DynamicLossScaler(init_scale=64.0, hysteresis=3).state_dict()
    scaler = DynamicLossScaler(init_scale=8.0, hysteresis=1)
    scaler.load_state_dict(saved)
    assert int(scaler.hysteresis_left) == 1
    scales = []
    for _ in range(3):
        scaler.update(torch.tensor(1.0))
        scales.append(float(scaler.scale))
    assert scales == [32.0, 16.0, 8.0]
    # a saved count within this policy is kept as it is
    saved = DynamicLossScaler(init_scale=64.0, hysteresis=2).state_dict()
    scaler = DynamicLossScaler(init_scale=8.0, hysteresis=3)
    scaler.load_state_dict(saved)
    assert int(scaler.hysteresis_left) == 2


def test_scaler_growth_is_counted_from_the_last_overflow():
    # An overflow absorbed by the hysteresis still restarts the growth count.
    got, _ = run_scaler([0, 0, 1, 0, 0, 0], init_scale=8.0, growth_interval=3, hysteresis=2)
    assert got == [8.0, 8.0, 8.0, 8.0, 8.0, 16.0]


def test_scaler_never_grows_past_max_scale():
    # Growth stops at max_scale (at most 2**126, where 1/scale is still a normal float32), also with factors whose
    # product leaves float32's range.
    got, _ = run_scaler([0] * 4, init_scale=2.0**125, growth_interval=1, max_scale=2.0**126, growth_factor=1e30)
    assert got == [2.0**126] * 4
    assert got == reference_scales([0] * 4, init=2.0**125, growth=1e30, interval=1, max_scale=2.0**126)
    got, _ = run_scaler([0] * 6, init_scale=2.0**10, growth_interval=1, growth_factor=3.0, max_scale=2.0**14)
    assert got == [3 * 2.0**10, 9 * 2.0**10, 2.0**14, 2.0**14, 2.0**14, 2.0**14]


def test_scaler_factors_that_are_not_float32_numbers_scale_as_grad_scaler():
    # scale * factor is rounded once to float32, as torch.amp.GradScaler's update (_amp_update_scale_) rounds it: a
    # factor such as 0.7 or 1.1 is not rounded to float32 first (that would make 6330043.0 of GradScaler's 6330043.5)
    flags = [1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1]
    for growth, backoff in ((1.1, 0.7), (3.0, 0.9), (2.0, 0.3)):
        got, _ = run_scaler(flags, init_scale=2.0**24, growth_factor=growth, backoff_factor=backoff,
                            growth_interval=1, min_scale=SCALE_RANGE[0], max_scale=SCALE_RANGE[1])
        scale, tracker, expected = torch.tensor(2.0**24), torch.zeros((), dtype=torch.int32), []
        for bad in flags:
            torch._amp_update_scale_(scale, tracker, torch.tensor(float(bad)), growth, backoff, 1)
            expected.append(float(scale))
        assert got == expected, (growth, backoff)


def test_scaler_min_scale_raise_and_clamp():
    got, scaler = run_scaler([1, 1, 1, 1], init_scale=4.0, min_scale=1.0)
    assert got == [2.0, 1.0, "raise"]
    assert float(scaler.scale) == 1.0 and int(scaler.skipped_steps) == 3
    got, scaler = run_scaler([1, 1, 1, 1, 0], init_scale=4.0, min_scale=1.0, min_scale_action="clamp",
                             growth_interval=1)
    assert got == [2.0, 1.0, 1.0, 1.0, 2.0]
    # backing off from above the floor lands on the floor (no raise yet)
    got, _ = run_scaler([1, 1], init_scale=3.0, min_scale=2.0)
    assert got == [2.0, "raise"]


def test_scaler_raises_once_per_floor_hit_and_a_load_clears_an_unreported_one():
    """A floor hit raises LossScaleUnderflowError once: a caller who catches it goes on, and the next check (with no
    new floor hit) passes. A floor hit not yet reported is part of the run that load_state_dict replaces: after the
    load, check passes."""
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0)
    scaler.update(torch.tensor(1.0))
    with pytest.raises(LossScaleUnderflowError, match=r"already at min_scale=1"):
        scaler.check(blocking=True)
    scaler.check(blocking=True)  # reported once
    scaler.update(torch.tensor(0.0))
    scaler.check(blocking=True)
    scaler.update(torch.tensor(1.0))  # a new floor hit raises again
    with pytest.raises(LossScaleUnderflowError):
        scaler.check(blocking=True)

    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0)
    saved = scaler.state_dict()
    scaler.update(torch.tensor(1.0))  # a floor hit, not reported yet
    scaler.load_state_dict(saved)
    scaler.check(blocking=True)
    assert float(scaler.scale) == 1.0 and int(scaler.skipped_steps) == 0


def test_scaler_rejects_bad_policy():
    for kwargs in (dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0),
                   dict(hysteresis=0), dict(min_scale=0.0), dict(init_scale=0.5, min_scale=1.0),
                   dict(min_scale_action="ignore"), dict(init_scale=float("inf"))):
        with pytest.raises(ValueError):
            DynamicLossScaler(**kwargs)


def test_scaler_matches_deepspeed_dynamic_loss_scaler(deepspeed_loss_scaler):
    """The same flag sequence through DeepSpeed's own DynamicLossScaler (when DeepSpeed imports), where DeepSpeed
    grows the scale after scale_window consecutive good steps, as torch's GradScaler and this scaler do (DeepSpeed
    0.16.9, the ORTModule stack's). DeepSpeed 0.19.8 grows one good step later (its stable interval leaves out the
    first good step after an overflow or the start): there the scales differ by that rule alone (the class docstring
    says so)."""
    probe = deepspeed_loss_scaler.DynamicLossScaler(init_scale=2.0, scale_window=2, min_scale=1, delayed_shift=1,
                                                    consecutive_hysteresis=False)
    probe.update_scale(False)
    probe.update_scale(False)
    if probe.cur_scale == 2.0:
        pytest.skip("this DeepSpeed grows the loss scale one good step after scale_window consecutive ones (DeepSpeed "
                    "0.19), not after scale_window as torch's GradScaler, DeepSpeed 0.16 and ort_optim do")
    flags = [0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    for consecutive in (False, True):
        ds = deepspeed_loss_scaler.DynamicLossScaler(init_scale=2**10, scale_window=3, min_scale=1,
                                                     delayed_shift=2, consecutive_hysteresis=consecutive)
        expected = []
        for bad in flags:
            ds.update_scale(bool(bad))
            expected.append(float(ds.cur_scale))
        got, _ = run_scaler(flags, init_scale=2.0**10, growth_interval=3, hysteresis=2,
                            consecutive_hysteresis=consecutive)
        assert got == expected, f"consecutive_hysteresis={consecutive}"


# ---- models and helpers ----------------------------------------------------------------------------------------------


def make_model(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)


def batch(step, dtype, n=16):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 4, generator=g)
    return x.to(dtype), y


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y)


INNER = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def clone_tree(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):  # keeps the type (an OrderedDict state_dict stays one), as lists and tuples do
        return type(obj)((k, clone_tree(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def full_snapshot(model, opt):
    return {
        "model": clone_tree(dict(model.state_dict())),
        "masters": clone_tree(opt.master_params),
        "inner": clone_tree(opt.optimizer.state_dict()),
    }


# ---- skipped steps through the optimizer --------------------------------------------------------------------------


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("dtype", LOW)
def test_injected_overflow_skips_and_changes_nothing(inner, dtype):
    model = make_model(dtype)
    opt = FP16_Optimizer(INNER[inner](list(model.parameters())), init_scale=2.0**8, growth_interval=2,
                         hysteresis=2)
    inject = {2: "inf", 3: "nan", 4: "-inf", 8: "inf"}
    flags = []
    for step in range(11):
        x, y = batch(step, dtype)
        opt.zero_grad()
        opt.backward(loss_of(model, x, y))
        if step in inject:
            model[3].weight.grad[1, 2] = float(inject[step])
        before = full_snapshot(model, opt)
        opt.step()
        flags.append(int(step in inject))
        assert opt.overflow == opt.skipped == (step in inject)
        if step in inject:
            assert_tree_bitwise_equal(before, full_snapshot(model, opt), f"step {step}")
        else:
            assert not torch.equal(before["model"]["3.weight"], model[3].weight)
    assert opt.skipped_steps == len(inject)
    expected = reference_scales(flags, init=2.0**8, interval=2, hysteresis=2)
    assert opt.loss_scale == expected[-1]


@pytest.mark.parametrize("inner", ["FusedAdam", "SGD", "AdamW-fused"])
def test_min_scale_through_the_optimizer(inner):
    for action in ("raise", "clamp"):
        model = make_model(torch.float16)
        opt = FP16_Optimizer(INNER[inner](list(model.parameters())), init_scale=4.0, min_scale=1.0,
                             min_scale_action=action)
        seen = []
        for step in range(5):
            x, y = batch(step, torch.float16)
            opt.zero_grad()
            opt.backward(loss_of(model, x, y))
            model[0].bias.grad[0] = float("inf")
            try:
                opt.step()
                seen.append(opt.loss_scale)
            except LossScaleUnderflowError:
                seen.append("raise")
        assert opt.skipped_steps == 5
        # raised once per overflow at the floor; a caller who catches it may go on
        assert seen == ([2.0, 1.0, "raise", "raise", "raise"] if action == "raise" else [2.0, 1.0, 1.0, 1.0, 1.0])
        assert all(m.grad is None for m in opt.master_params)


@pytest.mark.parametrize("inner", ["FusedAdam", "SGD", "AdamW-fused"])
def test_overflow_created_by_unscaling_is_caught(inner):
    """With a scale below 1, a finite bf16 gradient can become inf when unscaled: the check must see that."""
    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = FP16_Optimizer(INNER[inner]([p]), init_scale=0.25, min_scale=2.0**-4)
    p.grad = torch.tensor([1.0, 2.0, 1e38, 3.0], dtype=torch.bfloat16)  # finite; 4e38 once unscaled
    before = p.detach().clone()
    opt.step()
    assert opt.skipped and torch.equal(p.detach(), before) and opt.loss_scale == 0.125
    assert all(torch.equal(m, before.float()) for m in opt.master_params)
    p.grad = torch.tensor([1.0, 2.0, 1e15, 3.0], dtype=torch.bfloat16)  # fine once unscaled
    opt.step()
    assert not opt.skipped and not torch.equal(p.detach(), before)


def _train_with_one_overflow(opt, model, batches) -> None:
    """Steps opt over the batches, with an inf in one gradient at the second."""
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        opt.backward(loss_of(model, x, y))
        if step == 1:
            model[3].weight.grad[0, 0] = float("inf")
        opt.step()


def _trained_with_a_scale_below_one(inner: str, default_dtype: torch.dtype) -> dict:
    """The model and its batches made under float32; the optimizer made and stepped under default_dtype."""
    model = make_model(torch.float16)
    batches = [batch(step, torch.float16) for step in range(4)]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        opt = FP16_Optimizer(INNER[inner](list(model.parameters())), init_scale=0.5, min_scale=2.0**-4)
        _train_with_one_overflow(opt, model, batches)
    finally:
        torch.set_default_dtype(previous)
    return {**full_snapshot(model, opt), "scale": opt.loss_scale, "skipped": opt.skipped_steps}


@pytest.mark.parametrize("default_dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inner", ["FusedAdam", "SGD"])
def test_training_does_not_depend_on_torchs_default_dtype(inner, default_dtype):
    """torch.set_default_dtype changes what torch's factory functions make; the unscale, the inf/NaN check (twice
    with a scale below 1) and the steps stay as under float32, bit for bit."""
    expected = _trained_with_a_scale_below_one(inner, torch.float32)
    assert expected["skipped"] == 1
    assert_tree_bitwise_equal(expected, _trained_with_a_scale_below_one(inner, default_dtype))


def _trained_under(context) -> dict:
    """The model and its batches made on the CPU; the optimizer made, stepped (one overflow), given a new scale and
    loaded from its own state_dict inside context."""
    model = make_model(torch.float16)
    batches = [batch(step, torch.float16) for step in range(4)]
    with context:
        opt = FP16_Optimizer(FusedAdam(list(model.parameters()), lr=1e-2), init_scale=0.5, min_scale=2.0**-4)
        _train_with_one_overflow(opt, model, batches)
        opt.loss_scale = 3.0
        opt.load_state_dict(opt.state_dict())
    scaler = opt.scaler
    devices = {name: getattr(scaler, name).device for name in scaler._STATE_NAMES}
    return {**full_snapshot(model, opt), "scale": opt.loss_scale, "skipped": opt.skipped_steps, "devices": devices}


def test_training_does_not_depend_on_torchs_default_device():
    """torch's default device (``with torch.device(...)``, torch.set_default_device) changes where torch's factory
    functions put a tensor: the loss scaler's policy (its bounds rounded to float32), its state and the steps stay
    on the params' device and as without it, bit for bit, as torch.amp.GradScaler's are. The meta device shows any
    tensor made on the default device: it holds no value to read."""
    expected = _trained_under(contextlib.nullcontext())
    assert expected["skipped"] == 1 and expected["scale"] == 3.0
    assert set(expected["devices"].values()) == {torch.device("cpu")}
    assert_tree_bitwise_equal(expected, _trained_under(torch.device("meta")))


def test_overflow_in_an_fp32_param_is_caught_too():
    model = make_model(torch.float16)
    model[2].float()  # LayerNorm in fp32 (a common mixed setup): its grads are unscaled in place
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=16.0)
    x, y = batch(0, torch.float16)
    opt.backward(loss_of(model, x, y))
    model[2].weight.grad[0] = float("nan")
    before = full_snapshot(model, opt)
    opt.step()
    assert opt.overflow and opt.loss_scale == 8.0
    assert_tree_bitwise_equal(before, full_snapshot(model, opt))


def test_natural_overflow_backs_off_then_trains():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2), init_scale=2.0**24, max_scale=2.0**24)
    losses = []
    for step in range(40):
        x, y = batch(step % 4, torch.float16)
        opt.zero_grad()
        loss = loss_of(model, x, y)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    assert opt.skipped_steps >= 1 and opt.loss_scale < 2.0**24
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# ---- masters: tiny updates accumulate -------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["FusedAdam", "SGD", "AdamW"])
@pytest.mark.parametrize("dtype", LOW)
def test_tiny_updates_accumulate_in_the_masters(inner, dtype):
    """Each update (2e-5 relative) is far below half an ulp of the fp16/bf16 param (2**-11 / 2**-8 at 1.0), so a
    low-precision optimizer would never move; the masters must follow an fp32 run (same exact gradients), 100 steps
    moving them by up to 2e-3."""
    n = 257
    coef = torch.linspace(-1, 1, n)  # exactly representable in fp16/bf16 after rounding: use the rounded values
    coef = coef.to(dtype).float()
    lr = 2e-5
    make = {
        "FusedAdam": lambda ps: FusedAdam(ps, lr=lr),
        "SGD": lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.5),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0),
    }[inner]
    low = nn.Parameter(torch.ones(n, dtype=dtype))
    ref = nn.Parameter(torch.ones(n, dtype=torch.float32))
    opt = FP16_Optimizer(make([low]), init_scale=2.0**10)
    ref_opt = make([ref])
    steps = 100
    for _ in range(steps):
        opt.zero_grad()
        opt.backward((low.float() * coef).sum())  # d/dlow = coef exactly, scaled by a power of two
        opt.step()
        ref_opt.zero_grad()
        (ref * coef).sum().backward()
        ref_opt.step()
    assert opt.skipped_steps == 0
    master = opt.master_params[0]
    moved = (ref.detach() - 1).abs()
    assert moved.max() > 1e-3  # the fp32 run did move by far more than one step
    # Stated tolerance: the masters equal the fp32 run to float32 rounding (1e-6 relative to the distance moved).
    torch.testing.assert_close(master, ref.detach(), rtol=0, atol=1e-6 * float(moved.max()) + 1e-7)
    # and the model param is the master rounded to nearest even
    assert_bitwise_equal(low.detach(), master.to(dtype), "param = round(master)")
    assert not torch.equal(low.detach(), torch.ones(n, dtype=dtype))


@pytest.mark.parametrize("inner", ["FusedAdam", "SGD"])
def test_mlp_training_tracks_an_fp32_run(inner):
    """A real fp16 MLP (fp16 forward/backward) stays close to the same MLP trained in fp32."""
    model16, model32 = make_model(torch.float16), make_model(torch.float32)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()})
    opt16 = FP16_Optimizer(INNER[inner](list(model16.parameters())))
    opt32 = INNER[inner](list(model32.parameters()))
    for step in range(30):
        x, y = batch(step % 5, torch.float32)
        opt16.zero_grad()
        opt16.backward(loss_of(model16, x.half(), y))
        opt16.step()
        if not opt16.skipped:
            opt32.zero_grad()
            loss_of(model32, x, y).backward()
            opt32.step()
    # Stated tolerance: 2e-2 absolute on O(0.3) weights after 30 steps (fp16 activations and gradients).
    for m16, p32 in zip(opt16.master_params, model32.parameters()):
        torch.testing.assert_close(m16, p32.detach(), rtol=0, atol=2e-2)


# ---- clipping ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
def test_clipping_after_unscaling_exactly_once(inner):
    """Gradients are clipped by their unscaled global norm, once: equal to clip_grad_norm_ on an fp32 twin."""
    torch.manual_seed(3)
    shapes = [(5, 7), (7,), (3, 5)]
    values = [torch.randn(s).half().float() * 4 for s in shapes]  # norm ~ 30, clipped to 1
    low = [nn.Parameter(torch.zeros(s, dtype=torch.float16)) for s in shapes]
    ref = [nn.Parameter(torch.zeros(s)) for s in shapes]
    make = (lambda ps: torch.optim.SGD(ps, lr=1.0)) if inner == "SGD" else \
        (lambda ps: FusedAdam(ps, lr=0.1, eps=1.0))  # a large eps keeps Adam sensitive to the gradient's size
    opt = FP16_Optimizer(make(low), max_grad_norm=1.0, init_scale=2.0**12)
    ref_opt = make(ref)
    if inner == "FusedAdam":
        ref_opt.max_grad_norm = 1.0
    for _ in range(3):
        opt.zero_grad()
        opt.backward(sum((p.float() * v).sum() for p, v in zip(low, values)))
        opt.step()
        ref_opt.zero_grad()
        sum((p * v).sum() for p, v in zip(ref, values)).backward()
        if inner == "SGD":
            torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
    for m, r in zip(opt.master_params, ref):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
    total = math.sqrt(sum(float(v.square().sum()) for v in values))
    assert total > 10  # the clip was active
    # last_grad_norm: the unscaled norm before clipping, as clip_grad_norm_ returns it (on either path)
    assert opt.last_grad_norm.shape == () and opt.last_grad_norm.dtype == torch.float32
    torch.testing.assert_close(float(opt.last_grad_norm), total, rtol=1e-5, atol=0)


def test_last_grad_norm_without_clipping_comes_from_fused_adam_only():
    """With FusedAdam inside the loss scale goes in as its grad_scale, whose pass computes the norm; a torch
    optimizer inside gets no pass over the gradients without max_grad_norm, so no norm."""
    for inner, expected_none in (("FusedAdam", False), ("SGD", True)):
        model = make_model(torch.float16)
        opt = FP16_Optimizer(INNER[inner](list(model.parameters())))
        opt.zero_grad()
        opt.backward(model(torch.randn(4, model[0].in_features, dtype=torch.float16)).float().sum())
        opt.step()
        assert (opt.last_grad_norm is None) == expected_none, inner


# ---- LR schedulers, the optimizer surface --------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["FusedAdam", "SGD"])
def test_lambda_lr_on_the_wrapper(inner):
    model = make_model(torch.float16)
    opt = FP16_Optimizer(INNER[inner](list(model.parameters())))
    base = opt.param_groups[0]["lr"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        for step in range(3):
            x, y = batch(step, torch.float16)
            opt.zero_grad()
            opt.backward(loss_of(model, x, y))
            opt.step()
            sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(base * 0.125)
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state


def test_entry_point_dispatch_and_errors():
    model = make_model(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = FP16_Optimizer(inner)
    assert isinstance(wrapped, FP16_Optimizer) and isinstance(wrapped, torch.optim.Optimizer)
    assert wrapped.optimizer is inner
    with pytest.raises(TypeError, match=r"already wrapped \(it is an FP16_Optimizer\): use it as it is, or wrap "
                                        r"its \.optimizer"):
        FP16_Optimizer(wrapped)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        FP16_Optimizer(object())
    amp_like = torch.optim.SGD(make_model(torch.float16).parameters(), lr=0.1)
    amp_like._amp_stash = object()
    with pytest.raises(TypeError, match="Migrating from Apex amp O2"):
        FP16_Optimizer(amp_like)
    with pytest.raises(ValueError, match="max_grad_norm"):
        FP16_Optimizer(torch.optim.SGD(make_model(torch.float16).parameters(), lr=0.1), max_grad_norm=-1.0)


def test_fused_adam_masters_are_switched_on_or_refused():
    model = make_model(torch.float16)
    fused = FusedAdam(model.parameters(), lr=1e-3)
    FP16_Optimizer(fused, max_grad_norm=2.0)
    assert fused.master_weights and fused.max_grad_norm == 2.0
    model = make_model(torch.float16)
    stale = FusedAdam(model.parameters(), lr=1e-3)
    x, y = batch(0, torch.float16)
    loss_of(model, x, y).backward()
    stale.step()
    with pytest.raises(ValueError, match="master_weights=True"):
        FP16_Optimizer(stale)
    with pytest.raises(ValueError, match="disagrees"):
        FP16_Optimizer(FusedAdam(make_model(torch.float16).parameters(), max_grad_norm=1.0), max_grad_norm=2.0)


def test_existing_inner_state_moves_to_the_masters():
    model = make_model(torch.float16)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(0, torch.float16)
    loss_of(model, x, y).backward()
    sgd.step()
    buf = sgd.state[model[0].weight]["momentum_buffer"].clone()
    opt = FP16_Optimizer(sgd)
    master = opt.master_params[0]
    assert model[0].weight not in sgd.state
    assert sgd.state[master]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(sgd.state[master]["momentum_buffer"], buf.float())


def test_unknown_deepspeed_shape_warns_once_and_changes_nothing():
    Fake = type("DeepSpeedZeroOptimizer", (), {"get_grad_norm_direct": lambda self, g, p: 0.0,
                                                 "step": lambda self: "stepped"})
    Fake.__module__ = "deepspeed.runtime.zero.stage_9"
    fake = Fake()
    with pytest.warns(UserWarning, match="not a DeepSpeed ZeRO optimizer of a known shape"):
        assert FP16_Optimizer(fake) is fake
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FP16_Optimizer(Fake()) is not None  # second time: no warning
    assert "get_grad_norm_direct" not in vars(fake) and fake.step() == "stepped"
    with pytest.raises(TypeError, match="takes no options"):
        FP16_Optimizer(fake, init_scale=4.0)
    # A torch.optim.Optimizer wrapper around a DeepSpeed optimizer (accelerate's) is not given fp32 masters.
    Other = type("BF16_Optimizer", (), {})
    Other.__module__ = "deepspeed.runtime.bf16_optimizer"

    class AcceleratedLike(torch.optim.SGD):
        pass

    wrapper = AcceleratedLike([nn.Parameter(torch.zeros(2, dtype=torch.float16))], lr=0.1)
    wrapper.optimizer = Other()
    with pytest.warns(UserWarning, match="deepspeed.runtime.bf16_optimizer.BF16_Optimizer is not"):
        assert FP16_Optimizer(wrapper) is wrapper


# ---- host reads ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["FusedAdam", "AdamW-fused", "SGD"])
def test_host_reads_per_step_on_cpu(inner, monkeypatch):
    """step() reads at most one device value per step (the min-scale check, or the skip decision for optimizers
    that cannot skip on a device flag); with min_scale_action='clamp' and a fused optimizer: none."""
    for action, limit in (("raise", 1), ("clamp", 1 if inner == "SGD" else 0)):
        model = make_model(torch.float16)
        opt = FP16_Optimizer(INNER[inner](list(model.parameters())), min_scale_action=action)
        x, y = batch(0, torch.float16)
        opt.backward(loss_of(model, x, y))
        opt.step()  # warm-up (lazy state)
        opt.zero_grad()
        opt.backward(loss_of(model, x, y))
        reads = []
        me = threading.get_ident()  # reads by other threads (a library's background thread) are not step()'s
        for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
            original = getattr(torch.Tensor, name)

            def counting(self, *a, _original=original, _name=name, **k):
                if threading.get_ident() == me:
                    reads.append(_name)
                return _original(self, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counting)
        opt.step()
        monkeypatch.undo()
        assert len(reads) <= limit, f"{action}: {reads}"


# ---- checkpoints --------------------------------------------------------------------------------------------------------


def train(model, opt, steps, start, dtype, inject=()):
    for step in range(start, start + steps):
        x, y = batch(step, dtype)
        opt.zero_grad()
        opt.backward(loss_of(model, x, y))
        if step in inject:
            model[0].weight.grad[0, 0] = float("inf")
        opt.step()


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("dtype", LOW)
def test_state_dict_round_trip_resumes_bit_for_bit(inner, dtype):
    kwargs = dict(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    model = make_model(dtype)
    opt = FP16_Optimizer(INNER[inner](list(model.parameters())), **kwargs)
    train(model, opt, 6, 0, dtype, inject={2, 4})
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    train(model, opt, 6, 6, dtype, inject={8})
    expected = full_snapshot(model, opt)
    expected_scaler = opt.scaler.state_dict()

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    untouched = clone_tree(checkpoint)
    model2 = make_model(dtype, seed=1)  # different initial weights: everything must come from the checkpoint
    opt2 = FP16_Optimizer(INNER[inner](list(model2.parameters())), **kwargs)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    opt2.load_state_dict(checkpoint["opt"])  # loading twice equals loading once
    train(model2, opt2, 6, 6, dtype, inject={8})
    assert_tree_bitwise_equal(expected, full_snapshot(model2, opt2), "resumed")
    assert_tree_bitwise_equal(expected_scaler, opt2.scaler.state_dict(), "scaler")
    assert_tree_bitwise_equal(untouched, checkpoint, "the loaded checkpoint")  # never modified nor aliased


@pytest.mark.parametrize("load_optimizer_states", [True, False])
@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
def test_resuming_restores_fp16_params_that_have_not_stepped_yet(inner, load_optimizer_states):
    """A param with no gradient so far (a layer unfrozen later) has no FusedAdam state, hence no master there: the
    checkpoint keeps its value all the same, so the fresh model that loads it holds what the running one holds (as
    with the masters the wrapper keeps for any other optimizer), and resuming equals never stopping."""
    make = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1), "FusedAdam": lambda ps: FusedAdam(ps, lr=0.1)}[inner]

    def model(values):
        return [nn.Parameter(torch.tensor(v, dtype=torch.float16)) for v in values]

    def step(opt, params, both):
        opt.zero_grad()
        opt.backward(params[0].float().sum() * 0.5 + (params[1].float().sum() if both else 0.0))
        opt.step()

    params = model([[4.0], [1.0, 2.0, 3.0]])
    opt = FP16_Optimizer(make(params), init_scale=2.0**10)
    step(opt, params, both=False)  # params[1] has no gradient yet
    checkpoint = opt.state_dict()
    params2 = model([[0.0], [0.0, 0.0, 0.0]])  # everything must come from the checkpoint
    opt2 = FP16_Optimizer(make(params2), init_scale=2.0**10)
    if not load_optimizer_states:
        step(opt2, params2, both=True)  # state of its own, which this load keeps (the masters are replaced)
    opt2.load_state_dict(checkpoint, load_optimizer_states=load_optimizer_states)
    assert_tree_bitwise_equal([p.detach() for p in params], [p.detach() for p in params2], "the loaded params")
    masters = opt.master_params  # (FusedAdam: the stepped param's; SGD: both)
    assert_tree_bitwise_equal(masters, opt2.master_params[:len(masters)], "the masters")
    if load_optimizer_states:
        for _ in range(2):
            step(opt, params, both=True)
            step(opt2, params2, both=True)
        assert_tree_bitwise_equal([p.detach() for p in params], [p.detach() for p in params2], "resumed")
        assert_tree_bitwise_equal(opt.state_dict(), opt2.state_dict(), "the optimizers")


def test_load_restores_model_params_from_masters_and_validates_first():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    train(model, opt, 3, 0, torch.float16)
    sd = opt.state_dict()
    weights = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.zero_()
    opt.load_state_dict(sd)
    assert torch.equal(model[0].weight, weights)
    bad = dict(sd, master_params=sd["master_params"][:-1])
    scale_before = opt.loss_scale
    with pytest.raises(ValueError, match="master_params"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="not an FP16_Optimizer state_dict"):
        opt.load_state_dict(sd["optimizer"])
    assert opt.loss_scale == scale_before


def test_refresh_master_params_after_writing_the_model():
    for inner in ("SGD", "FusedAdam"):
        model = make_model(torch.float16)
        opt = FP16_Optimizer(INNER[inner](list(model.parameters())))
        train(model, opt, 2, 0, torch.float16)
        with torch.no_grad():
            model[0].weight.fill_(0.25)
        opt.refresh_master_params()
        assert torch.equal(opt.master_params[0], torch.full_like(opt.master_params[0], 0.25))


# ---- ORTModule --------------------------------------------------------------------------------------------------------


def _ortmodule():
    try:
        from onnxruntime.training.ortmodule import ORTModule
    except Exception as exc:  # ImportError, or ORT failing against this torch (torch >= 2.5)
        pytest.skip(f"ORTModule is unavailable here ({type(exc).__name__}: {exc}); it needs torch 2.4 + "
                    "onnxruntime-training 1.19 (the .venv environment)")
    return ORTModule


def test_ortmodule_fp16_model_trains_with_fused_adam(monkeypatch):
    ORTModule = _ortmodule()
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # fail rather than run PyTorch instead
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).half()
    model = ORTModule(net)
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=3e-3), max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = x[:, :4] * 0.5 - x[:, 4:8]
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        opt.backward(loss)
        opt.step()
        losses.append(float(loss))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(torch.isfinite(m).all() for m in opt.master_params)
    assert model._torch_module._execution_manager(True)._onnx_models.optimized_model is not None  # ORT ran it


# ---- under hostile use -----------------------------------------------------------------------------------------------

DEFAULT_SCALE = 2.0**8


def optimizer_picture(opt: torch.optim.Optimizer) -> dict:
    """Everything a failed call must leave alone: which tensor objects the groups hold (identity), the groups'
    options, every state tensor (bits) and FusedAdam's flags."""
    state = {}
    for gi, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            state[(gi, j)] = clone_tree(dict(opt.state.get(p, {})))
    return {
        "ids": [[id(p) for p in g["params"]] for g in opt.param_groups],
        "params": [[p.detach().clone() for p in g["params"]] for g in opt.param_groups],
        "options": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "state": state,
        "state_keys": sorted(id(p) for p in opt.state),
        "flags": {k: getattr(opt, k) for k in ("master_weights", "max_grad_norm") if hasattr(opt, k)},
    }


def wrapper_picture(opt: FP16_Optimizer, model_params) -> dict:
    return {"inner": optimizer_picture(opt.optimizer), "scaler": clone_tree(opt.scaler.state_dict()),
            "model": [p.detach().clone() for p in model_params], "masters": clone_tree(opt.master_params)}


def fp16_params(seed=0, shapes=((4, 3), (3,))):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g).half()) for s in shapes]


# ---- construction is all-or-nothing -------------------------------------------------------------------------------


def _sgd_with_state(extra):
    params = fp16_params()
    sgd = torch.optim.SGD([{"params": params}, {"params": extra}], lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    sgd.step()  # momentum buffers keyed by the fp16 params
    return sgd


BAD_CONSTRUCTIONS = {
    "int param after fp16 ones": (lambda: _sgd_with_state([torch.zeros(3, dtype=torch.int64)]), {},
                                  ValueError, r"param_groups\[1\]\['params'\]\[0\] has dtype torch.int64"),
    "bad option after valid params": (lambda: _sgd_with_state([nn.Parameter(torch.zeros(2))]),
                                      {"init_scale": 1e39}, ValueError, "init_scale must lie in"),
    "bad max_grad_norm": (lambda: _sgd_with_state([nn.Parameter(torch.zeros(2))]), {"max_grad_norm": float("inf")},
                          ValueError, "max_grad_norm must be finite"),
}


@pytest.mark.parametrize("case", list(BAD_CONSTRUCTIONS))
def test_failed_construction_leaves_the_optimizer_bit_identical(case):
    make, kwargs, exc, fragment = BAD_CONSTRUCTIONS[case]
    sgd = make()
    before = optimizer_picture(sgd)
    with pytest.raises(exc, match=fragment):
        FP16_Optimizer(sgd, **kwargs)
    assert_tree_bitwise_equal(before, optimizer_picture(sgd))


def test_duplicate_param_is_refused_before_any_swap():
    params = fp16_params()
    with pytest.warns(UserWarning, match="duplicate"):  # torch accepts it (with a warning) within one group
        sgd = torch.optim.SGD([params[0], params[1], params[0]], lr=0.1)
    before = optimizer_picture(sgd)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] is the same tensor as "
                                         r"param_groups\[0\]\['params'\]\[0\]"):
        FP16_Optimizer(sgd)
    assert_tree_bitwise_equal(before, optimizer_picture(sgd))


def test_a_param_that_is_not_floating_point_is_refused_naming_it_with_apexs_type_too_before_any_swap():
    params = fp16_params()
    sgd = torch.optim.SGD([params[0], torch.zeros(3, dtype=torch.int32)], lr=0.1)
    before = optimizer_picture(sgd)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] has dtype torch\.int32, not a "
                                        r"floating-point type") as refused:  # (apex raises a TypeError for it)
        FP16_Optimizer(sgd)
    assert isinstance(refused.value, ValueError)
    assert_tree_bitwise_equal(before, optimizer_picture(sgd))


def test_fused_adam_flags_unchanged_when_max_grad_norm_conflicts():
    fused = FusedAdam(fp16_params(), lr=1e-3, max_grad_norm=1.0)
    before = optimizer_picture(fused)
    with pytest.raises(ValueError, match="disagrees"):
        FP16_Optimizer(fused, max_grad_norm=2.0)
    assert fused.master_weights is False and fused.max_grad_norm == 1.0
    assert_tree_bitwise_equal(before, optimizer_picture(fused))


@pytest.mark.parametrize("key,value,kwargs", [("max_grad_norm", None, dict(max_grad_norm=1.0)),
                                              ("master_weights", False, {})])
def test_a_fused_adam_whose_groups_repeat_another_value_of_what_fp16_optimizer_sets_is_refused_unchanged(
        key, value, kwargs):
    # (FP16_Optimizer sets the FusedAdam's master_weights and max_grad_norm, which a group may only repeat: refused
    # here, naming the group, rather than at every step after)
    fused = FusedAdam([{"params": fp16_params(), key: value}], lr=1e-3)
    before = optimizer_picture(fused)
    with pytest.raises(ValueError, match=rf"FP16_Optimizer: param_groups\[0\] of this FusedAdam: {key} is set in a "
                                         r"param group, .* may only repeat this optimizer's own value"):
        FP16_Optimizer(fused, **kwargs)
    assert_tree_bitwise_equal(before, optimizer_picture(fused))
    repeating = FusedAdam([{"params": fp16_params(), "max_grad_norm": 1.0, "master_weights": True}], lr=1e-3,
                          max_grad_norm=1.0, master_weights=True)
    opt = FP16_Optimizer(repeating)  # (the values it keeps: accepted, and it steps)
    for p in repeating.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()


def test_lbfgs_is_refused_up_front():
    params = [nn.Parameter(torch.randn(3).half())]
    lbfgs = torch.optim.LBFGS(params)
    before = optimizer_picture(lbfgs)
    with pytest.raises(TypeError, match="LBFGS.step requires a closure that re-evaluates the loss"):
        FP16_Optimizer(lbfgs)
    assert_tree_bitwise_equal(before, optimizer_picture(lbfgs))


# ---- options against float32's range -----------------------------------------------------------------------------

# kwargs, exception, message (each names the option)
BAD_OPTIONS = [
    (dict(init_scale=1e39, max_scale=float("inf")), ValueError, "init_scale must lie in [2**-126, 2**126]"),
    (dict(init_scale=1e39), ValueError, "init_scale must lie in [2**-126, 2**126]"),
    (dict(init_scale=float("inf")), ValueError, "init_scale must be finite"),
    (dict(init_scale=float("nan")), ValueError, "init_scale must be finite"),
    (dict(init_scale="65536"), TypeError, "init_scale must be a real number"),
    (dict(init_scale=True), TypeError, "init_scale must be a real number"),
    (dict(init_scale=torch.tensor(2.0)), TypeError, "init_scale must be a real number"),
    (dict(max_scale=float("inf")), ValueError, "max_scale must be finite"),
    (dict(max_scale=2.0**127), ValueError, "max_scale must lie in [2**-126, 2**126]"),
    (dict(min_scale=0.0), ValueError, "min_scale must lie in"),
    (dict(min_scale=1e-39, init_scale=1.0), ValueError, "min_scale must lie in"),
    (dict(min_scale=4.0, max_scale=2.0, init_scale=2.0), ValueError, "min_scale=4.0 must be <= max_scale=2.0"),
    (dict(init_scale=0.5), ValueError, "init_scale=0.5 must lie in [min_scale, max_scale]"),
    (dict(init_scale=0.5), ValueError, "to start there, pass min_scale=0.5 or less"),
    (dict(init_scale=2.0**32), ValueError, "to start there, pass max_scale=4294967296.0 or more"),  # DeepSpeed's
    (dict(growth_factor=1.0), ValueError, "growth_factor must be > 1 in float32"),
    (dict(growth_factor=1.0 + 1e-9), ValueError, "growth_factor must be > 1 in float32"),
    (dict(growth_factor=1e39), ValueError, "growth_factor must be > 1 in float32 (and finite)"),
    (dict(growth_factor=float("nan")), ValueError, "growth_factor must be finite"),
    (dict(backoff_factor=1.0 - 1e-9), ValueError, "backoff_factor must lie in (0, 1) in float32"),
    (dict(backoff_factor=1e-50), ValueError, "backoff_factor must lie in (0, 1) in float32"),
    (dict(backoff_factor=0.0), ValueError, "backoff_factor must lie in (0, 1)"),
    (dict(growth_interval=0), ValueError, "growth_interval must be an int in [1, 2147483647]"),
    (dict(growth_interval=2**31), ValueError, "growth_interval must be an int in [1, 2147483647]"),
    (dict(growth_interval=2.0), TypeError, "growth_interval must be an int"),
    (dict(growth_interval=True), TypeError, "growth_interval must be an int"),
    (dict(hysteresis=0), ValueError, "hysteresis must be an int in [1, 2147483647]"),
    (dict(hysteresis="2"), TypeError, "hysteresis must be an int"),
    (dict(consecutive_hysteresis="False"), TypeError, "consecutive_hysteresis must be True or False"),
    (dict(dynamic=1), TypeError, "dynamic must be True or False"),
    (dict(min_scale_action="ignore"), ValueError, "min_scale_action must be one of ('raise', 'clamp')"),
    (dict(min_scale_action=None), ValueError, "min_scale_action must be one of"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm must be None or a float > 0"),
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm must be None or a float > 0"),
    (dict(max_grad_norm=1e39), ValueError, "max_grad_norm must be None or a float > 0 within float32's range"),
    (dict(max_grad_norm=1e-50), ValueError, "max_grad_norm must be None or a float > 0 within float32's range"),
    (dict(max_grad_norm=float("inf")), ValueError, "max_grad_norm must be finite"),
    (dict(max_grad_norm="1.0"), TypeError, "max_grad_norm must be None or a real number > 0"),
    (dict(model_parallel_groups=5), TypeError, "model_parallel_groups must be a sequence"),
    (dict(model_parallel_groups=[[0, 1]]), TypeError, "model_parallel_groups[0] must be None or a torch.distributed"),
    (dict(process_group="gloo"), TypeError, "process_group must be None or a torch.distributed ProcessGroup"),
    (dict(init_scal=2.0), TypeError, "unexpected keyword arguments ['init_scal']"),
    (dict(device="cpu"), TypeError, "unexpected keyword arguments ['device']"),
]


@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("kwargs, exc, fragment", BAD_OPTIONS, ids=[repr(c[0])[:60] for c in BAD_OPTIONS])
def test_bad_option_names_it_and_changes_nothing(inner, kwargs, exc, fragment):
    params = fp16_params()
    optimizer = torch.optim.SGD(params, lr=0.1) if inner == "SGD" else FusedAdam(params, lr=1e-3)
    before = optimizer_picture(optimizer)
    with pytest.raises(exc) as info:
        FP16_Optimizer(optimizer, **kwargs)
    assert fragment in str(info.value)
    assert_tree_bitwise_equal(before, optimizer_picture(optimizer))


def test_the_constructor_takes_the_loss_scalers_options_with_its_defaults():
    """FP16_Optimizer(optimizer, *, <DynamicLossScaler's options>, max_grad_norm, process_group,
    model_parallel_groups, <DeepSpeed's and apex's arguments, None: not given>), as help() shows it, and a wrapper
    made without options has the scaler's defaults."""
    scaler = inspect.signature(DynamicLossScaler).parameters
    shown = list(inspect.signature(FP16_Optimizer.__init__).parameters.values())
    theirs = ["static_loss_scale", "dynamic_loss_scale", "dynamic_loss_args", "initial_dynamic_scale", "clip_grad",
               "verbose"]
    assert [p.name for p in shown] == (["self", "optimizer"] + [name for name in scaler if name != "device"]
                                       + ["max_grad_norm", "process_group", "model_parallel_groups"] + theirs)
    own = shown[2:-3 - len(theirs)]
    for p in own:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == scaler[p.name].default, p.name
    for p in shown[-len(theirs):]:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None, p.name
    opt = FP16_Optimizer(torch.optim.SGD(fp16_params(), lr=0.1))
    for p in own:
        assert getattr(opt.scaler, p.name) == p.default, p.name


def test_the_class_shows_the_constructors_options_as_its_signature():
    """inspect.signature(FP16_Optimizer), which help() prints under the class name and editors show for a call, is
    the constructor's spelled-out signature, not that of the __new__ that dispatches DeepSpeed optimizers."""
    shown = inspect.signature(FP16_Optimizer)
    assert list(shown.parameters.values()) == list(inspect.signature(FP16_Optimizer.__init__).parameters.values())[1:]
    assert "init_scale" in shown.parameters and "max_grad_norm" in shown.parameters

    class Subclass(FP16_Optimizer):
        def __init__(self, optimizer, extra: int = 1, **kwargs):
            super().__init__(optimizer, **kwargs)

    assert list(inspect.signature(Subclass).parameters) == ["optimizer", "extra", "kwargs"]  # (its own __init__'s)


@pytest.mark.parametrize("kwargs", [dict(init_scale=2.0**126, max_scale=2.0**126), dict(init_scale=2.0**-126,
                                    min_scale=2.0**-126), dict(growth_factor=1.0 + 2**-20, backoff_factor=1 - 2**-20),
                                    dict(max_grad_norm=1e-30, growth_interval=2**31 - 1, hysteresis=2**31 - 1)])
def test_edge_options_are_accepted_and_stay_finite(kwargs):
    params = fp16_params()
    opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1), **kwargs)
    assert math.isfinite(float(opt.scaler.inv_scale())) and float(opt.scaler.inv_scale()) > 0


def test_scale_bounds_are_float32_numbers_so_the_scale_never_leaves_the_given_range():
    # found by the property test below: the float32 scale started at float32(1.00001) = 1.0000100136 > max_scale
    scaler = DynamicLossScaler(init_scale=1.00001, max_scale=1.00001, min_scale=1.000001)
    for overflow in (False, True, False):
        scaler.update(torch.tensor(float(overflow)))
        assert 1.000001 <= scaler.min_scale <= float(scaler.scale) <= scaler.max_scale <= 1.00001
    assert scaler.max_scale == float(torch.tensor(scaler.max_scale, dtype=torch.float32))
    with pytest.raises(ValueError, match="min_scale=1.00000001 and max_scale=1.00000005 hold no float32 number"):
        DynamicLossScaler(init_scale=1.00000002, min_scale=1.00000001, max_scale=1.00000005)


OPTION_NAMES = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                "consecutive_hysteresis", "min_scale", "max_scale", "min_scale_action", "dynamic")
ANY_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=2.0**-130, max_value=2.0**130),
    st.integers(min_value=-2, max_value=2**32), st.booleans(), st.sampled_from(["raise", "clamp", "1.0", ""]),
)


@settings(max_examples=fuzz_examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(OPTION_NAMES), ANY_VALUE, max_size=4),
       st.lists(st.booleans(), min_size=1, max_size=12))
def test_property_every_policy_is_refused_naming_an_option_or_keeps_the_scale_in_range(kwargs, overflows):
    try:
        scaler = DynamicLossScaler(**kwargs, min_scale_action="clamp") if "min_scale_action" not in kwargs \
            else DynamicLossScaler(**kwargs)
    except (TypeError, ValueError) as e:
        assert any(name in str(e) for name in kwargs), (kwargs, str(e))
        return
    for overflow in overflows:
        scaler.update(torch.tensor(float(overflow)))
        scale, inv = float(scaler.scale), float(scaler.inv_scale())
        assert scaler.min_scale <= scale <= scaler.max_scale and SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]
        assert math.isfinite(inv) and inv >= 2.0**-126  # 1/scale is a normal float32: unscaling is exact to rounding


# ---- param groups added after wrapping --------------------------------------------------------------------------


def _train_step(opt, params, coef, inf_at=None):
    opt.zero_grad()
    opt.backward(sum((p.float() * c).sum() for p, c in zip(params, coef)))
    if inf_at is not None:
        params[inf_at].grad.view(-1)[0] = float("inf")
    opt.step()


@pytest.mark.parametrize("how", ["inner", "wrapper"])
@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
def test_group_added_after_wrapping_is_unscaled_checked_and_gets_masters(inner, how):
    """Progressive unfreezing: the new group's update equals an fp32 optimizer's with the unscaled gradients, an inf in
    it skips the whole step, and its fp16 params get fp32 masters."""
    make = {"SGD": lambda ps, **kw: torch.optim.SGD(ps, lr=0.5, **kw),
            "FusedAdam": lambda ps, **kw: FusedAdam(ps, lr=1e-2, **kw)}[inner]
    first, late = fp16_params(0, ((5,),)), fp16_params(1, ((3, 2), (4,)))
    late_fp32 = nn.Parameter(torch.randn(2))
    coef = [torch.linspace(-1, 1, 5).half().float(), torch.full((3, 2), 0.25), torch.full((4,), -0.5),
            torch.tensor([0.5, 2.0])]
    opt = FP16_Optimizer(make(first), init_scale=2.0**10)
    ref_params = [nn.Parameter(p.detach().float().clone()) for p in first + late] + \
        [nn.Parameter(late_fp32.detach().clone())]
    ref = make(ref_params[:1])
    _train_step(opt, first, coef[:1])
    ref.zero_grad()
    (ref_params[0] * coef[0]).sum().backward()
    ref.step()
    group = {"params": late + [late_fp32], "lr": 0.25 if inner == "SGD" else 2e-2}
    (opt.optimizer if how == "inner" else opt).add_param_group(group)
    ref.add_param_group({"params": ref_params[1:], "lr": group["lr"]})
    everything = first + late + [late_fp32]
    before = [p.detach().clone() for p in everything]
    _train_step(opt, everything, coef, inf_at=2)  # inf in the new group's fp16 param: nothing moves
    assert opt.skipped and all(torch.equal(a, p.detach()) for a, p in zip(before, everything))
    for _ in range(3):
        _train_step(opt, everything, coef)
        ref.zero_grad()
        sum((p * c).sum() for p, c in zip(ref_params, coef)).backward()
        ref.step()
    assert opt.skipped_steps == 1
    masters = opt.master_params
    assert len(masters) == 3 and all(m.dtype == torch.float32 for m in masters)
    # Stated tolerance: the masters equal the fp32 optimizer on the same (exactly unscaled) gradients to float32
    # rounding; the fp16 params are the masters rounded.
    for m, r in zip(masters, ref_params[:3]):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(late_fp32.detach(), ref_params[3].detach(), rtol=1e-6, atol=1e-6)
    for p, m in zip(first + late, masters):
        assert torch.equal(p.detach(), m.half())


@pytest.mark.parametrize("inner", ["SGD", "AdamW", "FusedAdam"])
def test_fp32_params_cast_to_fp16_in_place_after_wrapping_get_masters_at_the_next_step(inner):
    """model.half() after wrapping gives the same Parameter objects fp16 data: the next step makes their fp32 masters
    from them, moves the wrapped optimizer's state to the masters, and updates as an fp32 optimizer does on the
    unscaled gradients (without masters, torch's AdamW would step the fp16 params with eps=1e-8, which is 0 there)."""
    make = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.25, momentum=0.9),
            "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
            "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=2, eps=1e-8, weight_decay=1e-2)}[inner]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(net.parameters())
    coef = [torch.linspace(-1, 1, p.numel()).reshape(p.shape).half().float() for p in params]
    coef[1][0] = 0.0  # a zero gradient element: where fp16 AdamW without a master divides 0 by 0
    opt = FP16_Optimizer(make(params), init_scale=2.0**10)
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    ref = make(ref_params)

    def ref_step():
        ref.zero_grad()
        sum((p * c).sum() for p, c in zip(ref_params, coef)).backward()
        ref.step()

    _train_step(opt, params, coef)  # an fp32 step: state of the fp32 params, no masters
    ref_step()
    assert opt.master_params == []
    net.half()
    with torch.no_grad():
        for r, p in zip(ref_params, params):
            r.copy_(p.float())  # the master starts from the fp16 value
    for _ in range(3):
        _train_step(opt, params, coef)
        ref_step()
    assert opt.skipped_steps == 0
    masters = opt.master_params
    assert len(masters) == len(params) and all(m.dtype == torch.float32 for m in masters)
    for p, m, r in zip(params, masters, ref_params):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-6)
        assert p.dtype == torch.float16 and torch.equal(p.detach(), m.half())


def test_group_that_cannot_be_scaled_is_refused_naming_it_before_any_write():
    params = fp16_params()
    opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), init_scale=16.0)
    _train_step(opt, params, [torch.ones(4, 3), torch.ones(3)])
    bad = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] has dtype torch.int32"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2).half()), bad]})
    assert len(opt.param_groups) == 1  # not added
    # Added to the inner optimizer behind the wrapper's back: refused at the next step, before anything is written.
    opt.optimizer.add_param_group({"params": [bad]})
    for p in params:
        p.grad = torch.ones_like(p)
    before = wrapper_picture(opt, params)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] has dtype torch.int32"):
        opt.step()
    assert_tree_bitwise_equal(before, wrapper_picture(opt, params))
    opt.optimizer.param_groups.pop()
    # The fp16 model param again, while its master is in group 0.
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] is the model parameter whose fp32 "
                                         r"master is param_groups\[0\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [params[0]]})
    assert len(opt.param_groups) == 1


# ---- closures ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
def test_a_plain_loss_backward_before_step_is_warned_about_once(inner):
    """Code written for ONNX Runtime's FP16_Optimizer (which returned a torch optimizer unwrapped) calls
    loss.backward(): the gradients are unscaled all the same, and the update would be loss_scale times too small
    without a word. The first such step warns; backward through the wrapper (opt.backward, opt.scale_loss) does not."""
    params = fp16_params()
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if inner == "SGD" else (lambda ps: FusedAdam(ps, lr=1e-3))
    opt = FP16_Optimizer(make(params), init_scale=64.0)

    def loss():
        return sum((p.float() ** 2).sum() for p in params)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for backward in (lambda: opt.backward(loss()), lambda: opt.scale_loss(loss()).backward()):
            opt.zero_grad()
            backward()
            opt.step()
    message = r"FP16_Optimizer.step\(\): no loss was scaled through this wrapper .* Call opt.backward\(loss\)"
    opt.zero_grad()
    loss().backward()
    with pytest.warns(UserWarning, match=message):
        opt.step()
    with warnings.catch_warnings():  # once per wrapper
        warnings.simplefilter("error")
        opt.zero_grad()
        loss().backward()
        opt.step()


def test_closure_is_called_once_before_unscaling():
    results = []
    for use_closure in (False, True):
        params = fp16_params()
        opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1), init_scale=64.0)
        calls = []

        def closure():
            calls.append(1)
            opt.zero_grad()
            loss = sum((p.float() ** 2).sum() for p in params)
            opt.backward(loss)
            return loss

        if use_closure:
            loss = opt.step(closure)
            assert calls == [1] and float(loss) > 0
        else:
            closure()
            assert opt.step() is None
        results.append([p.detach().clone() for p in params])
    assert_tree_bitwise_equal(results[0], results[1])


def test_closure_that_raises_changes_nothing():
    params = fp16_params()
    opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1))
    _train_step(opt, params, [torch.ones(4, 3), torch.ones(3)])
    before = wrapper_picture(opt, params)

    def closure():
        raise KeyError("data loader failed")

    with pytest.raises(KeyError):
        opt.step(closure)
    assert_tree_bitwise_equal(before, wrapper_picture(opt, params))


# ---- sparse gradients --------------------------------------------------------------------------------------------------


def _sparse(indices, values, rows, dtype):
    values = torch.tensor(values, dtype=torch.float32)
    return torch.sparse_coo_tensor(torch.tensor([indices]), values, (rows, 2), check_invariants=True).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_gradients_are_unscaled_and_checked(dtype):
    """Uncoalesced sparse gradients (duplicate rows), scaled by 2**10: the update equals SGD's on the unscaled,
    summed rows (exactly: the scale is a power of two); an inf value skips the step."""
    scale = 2.0**10
    weight = nn.Parameter(torch.arange(8, dtype=torch.float32).reshape(4, 2).to(dtype))
    opt = FP16_Optimizer(torch.optim.SGD([weight], lr=0.5), init_scale=scale)
    rows = [[0.25, -1.0], [0.5, 0.5], [2.0, 1.0]]
    weight.grad = _sparse([1, 3, 1], [[v * scale for v in r] for r in rows], 4, dtype)
    expected = weight.detach().float().clone()
    expected[1] -= 0.5 * torch.tensor([0.25 + 2.0, -1.0 + 1.0])
    expected[3] -= 0.5 * torch.tensor([0.5, 0.5])
    opt.step()
    assert not opt.skipped
    assert torch.equal(weight.detach(), expected.to(dtype))
    before = weight.detach().clone()
    weight.grad = _sparse([2, 0], [[1.0, float("inf")], [1.0, 1.0]], 4, dtype)
    opt.step()
    assert opt.skipped and opt.loss_scale == scale / 2 and torch.equal(weight.detach(), before)


def test_fp16_sparse_duplicates_are_summed_in_fp32():
    """Two duplicate rows of 40000 each: summed in fp16 (GradScaler coalesces fp16 sparse grads before checking)
    they overflow to inf; summed in fp32 they are 80000, finite once unscaled by 1/2."""
    weight = nn.Parameter(torch.zeros(3, 2, dtype=torch.float16))
    opt = FP16_Optimizer(torch.optim.SGD([weight], lr=1e-5), init_scale=2.0, min_scale=1.0)
    weight.grad = _sparse([1, 1], [[40000.0, 0.0], [40000.0, 0.0]], 3, torch.float16)
    opt.step()
    assert not opt.skipped
    assert float(opt.master_params[0][1, 0]) == pytest.approx(-1e-5 * 40000.0, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_embedding_trains(dtype):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True).to(dtype)
    opt = FP16_Optimizer(torch.optim.SGD(emb.parameters(), lr=0.1), init_scale=2.0**12)
    idx = torch.tensor([1, 3, 3, 7])
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = emb(idx).float().square().sum()
        opt.backward(loss)
        assert emb.weight.grad.is_sparse
        opt.step()
        losses.append(float(loss))
    assert opt.skipped_steps == 0 and losses[-1] < 0.1 * losses[0]
    untouched = [i for i in range(10) if i not in (1, 3, 7)]
    torch.manual_seed(0)
    initial = nn.Embedding(10, 4).to(dtype).weight.detach()
    assert torch.equal(emb.weight.detach()[untouched], initial[untouched])


def test_fused_adam_refuses_sparse_gradients_naming_the_param():
    weight = nn.Parameter(torch.zeros(3, 2))
    opt = FP16_Optimizer(FusedAdam([weight], lr=1e-3))
    weight.grad = _sparse([0], [[1.0, 1.0]], 3, torch.float32)
    before = wrapper_picture(opt, [weight])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*sparse"):
        opt.step()
    assert_tree_bitwise_equal(before, wrapper_picture(opt, [weight]))


# ---- no gradients; max_grad_norm set later -------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["SGD", "FusedAdam", "AdamW-fused"])
def test_step_without_any_gradient_raises_like_grad_scaler_and_changes_nothing(inner):
    params = fp16_params()
    make = {"SGD": lambda: torch.optim.SGD(params, lr=0.1), "FusedAdam": lambda: FusedAdam(params),
            "AdamW-fused": lambda: torch.optim.AdamW(params, fused=True)}[inner]
    opt = FP16_Optimizer(make(), growth_interval=1)
    before = wrapper_picture(opt, params)
    with pytest.raises(RuntimeError, match="no parameter has a gradient.*No inf checks were recorded"):
        opt.step()
    assert_tree_bitwise_equal(before, wrapper_picture(opt, params))  # the scale did not grow


@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
def test_max_grad_norm_set_after_construction_is_honoured(inner):
    values = [torch.full((4, 3), 3.0), torch.full((3,), 4.0)]

    def run(set_later):
        params = [nn.Parameter(torch.zeros(4, 3).half()), nn.Parameter(torch.zeros(3).half())]
        make = torch.optim.SGD(params, lr=1.0) if inner == "SGD" else FusedAdam(params, lr=0.1, eps=1.0)
        opt = FP16_Optimizer(make, init_scale=2.0**8, max_grad_norm=None if set_later else 0.5)
        if set_later:
            opt.max_grad_norm = 0.5
        for _ in range(2):
            _train_step(opt, params, values)
        return opt

    later, given_ = run(True), run(False)
    assert later.max_grad_norm == 0.5 and (inner == "SGD" or later.optimizer.max_grad_norm == 0.5)
    assert_tree_bitwise_equal(given_.master_params, later.master_params)
    with pytest.raises(ValueError, match="max_grad_norm"):
        later.max_grad_norm = -1.0
    assert later.max_grad_norm == 0.5


# ---- load_state_dict: every entry checked before anything changes ---------------------------------------------------


def _trained(inner):
    params = fp16_params() + [nn.Parameter(torch.randn(2))]
    optimizer = {"SGD": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                 "AdamW": lambda: torch.optim.AdamW(params, lr=1e-2),
                 "FusedAdam": lambda: FusedAdam(params, lr=1e-2)}[inner]()
    opt = FP16_Optimizer(optimizer, init_scale=2.0**10, max_scale=2.0**12, growth_interval=2)
    coef = [torch.ones(4, 3), torch.ones(3), torch.ones(2)]
    for step in range(4):
        _train_step(opt, params, coef, inf_at=0 if step == 1 else None)
    return opt, params, coef


def _set(path, value):
    def mutate(sd):
        target = sd
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return mutate


_DELETE = object()
# mutation, exception, the entry named in the message
BAD_CHECKPOINTS = {
    "growth_tracker NaN": (_set(["loss_scaler", "growth_tracker"], torch.tensor(float("nan"))), TypeError,
                           "state_dict['loss_scaler']['growth_tracker'] must be an integer tensor"),
    "growth_tracker too large": (_set(["loss_scaler", "growth_tracker"], torch.tensor(2**31)), ValueError,
                                 "state_dict['loss_scaler']['growth_tracker'] must be finite and lie in"),
    "found_inf two elements": (_set(["loss_scaler", "found_inf"], torch.tensor([0.0, 1.0])), ValueError,
                               "state_dict['loss_scaler']['found_inf'] must be a 0-dim tensor (one value), got "
                               "shape (2,)"),
    "found_inf 0.5": (_set(["loss_scaler", "found_inf"], torch.tensor(0.5)), ValueError,
                      "state_dict['loss_scaler']['found_inf'] must be 0 or 1"),
    "scale inf": (_set(["loss_scaler", "scale"], torch.tensor(float("inf"))), ValueError,
                  "state_dict['loss_scaler']['scale'] must be finite"),
    "scale above max_scale": (_set(["loss_scaler", "scale"], torch.tensor(2.0**20)), ValueError,
                              "state_dict['loss_scaler']['scale'] must be finite and lie in [1.0, 4096.0], got "
                              "1048576.0 (this scaler's min_scale/max_scale"),
    "scale below min_scale": (_set(["loss_scaler", "scale"], torch.tensor(0.5)), ValueError,
                              "state_dict['loss_scaler']['scale'] must be finite and lie in [1.0, 4096.0]"),
    "scale a float": (_set(["loss_scaler", "scale"], 1024.0), TypeError,
                      "state_dict['loss_scaler']['scale'] must be a 0-dim tensor, got float"),
    "scale an int tensor": (_set(["loss_scaler", "scale"], torch.tensor(1024)), TypeError,
                            "state_dict['loss_scaler']['scale'] must be a floating-point tensor"),
    "hysteresis_left 0": (_set(["loss_scaler", "hysteresis_left"], torch.tensor(0, dtype=torch.int32)), ValueError,
                          "state_dict['loss_scaler']['hysteresis_left'] must be finite and lie in [1,"),
    "skipped_steps negative": (_set(["loss_scaler", "skipped_steps"], torch.tensor(-1)), ValueError,
                               "state_dict['loss_scaler']['skipped_steps']"),
    "skipped_steps bool": (_set(["loss_scaler", "skipped_steps"], torch.tensor(True)), TypeError,
                           "state_dict['loss_scaler']['skipped_steps'] must be an integer tensor"),
    "scaler key missing": (_set(["loss_scaler", "hysteresis_left"], _DELETE), ValueError,
                           "state_dict['loss_scaler'] must hold exactly"),
    "scaler key extra": (_set(["loss_scaler", "cur_scale"], torch.tensor(2.0)), ValueError,
                         "unexpected ['cur_scale']"),
    "policy not a dict": (_set(["loss_scaler", "policy"], "dynamic"), TypeError,
                          "state_dict['loss_scaler']['policy'] must be a dict"),
    "loss_scaler a list": (_set(["loss_scaler"], []), TypeError, "state_dict['loss_scaler'] must be a dict"),
    "format wrong": (_set(["format"], "ort_optim.FP16_Optimizer/0"), ValueError, "state_dict['format'] must be"),
    "optimizer a string": (_set(["optimizer"], "adam"), TypeError, "state_dict['optimizer'] must be a dict"),
    "extra top-level key": (_set(["epoch"], 3), ValueError, "unexpected ['epoch']"),
    "master_params missing": (_set(["master_params"], _DELETE), ValueError, "missing ['master_params']"),
    "master_params None": (_set(["master_params"], None), TypeError, "state_dict['master_params'] must be a list"),
    "inner group count": (_set(["optimizer", "param_groups"], []), ValueError, "groups"),  # the inner's own message
}
SGD_ONLY = {
    "master fp16": (lambda sd: sd["master_params"].__setitem__(0, sd["master_params"][0].half()), ValueError,
                    "state_dict['master_params'][0] must be a dense float32 tensor of shape (4, 3)"),
    "master shape": (lambda sd: sd["master_params"].__setitem__(1, torch.zeros(4)), ValueError,
                     "state_dict['master_params'][1] must be a dense float32 tensor of shape (3,)"),
    "master for fp32 param": (lambda sd: sd["master_params"].__setitem__(2, torch.zeros(2)), ValueError,
                              "state_dict['master_params'][2] must be None"),
    "master a string": (lambda sd: sd["master_params"].__setitem__(0, "w"), TypeError,
                        "state_dict['master_params'][0] must be the fp32 master"),
    "one master too few": (lambda sd: sd["master_params"].pop(), ValueError,
                           "state_dict['master_params'] must list 3 entries"),
    "no masters (FusedAdam's checkpoint)": (_set(["master_params"], []), ValueError,
                                            "must list 3 entries (one per parameter), got 0 (an FP16_Optimizer "
                                            "around FusedAdam saves its masters in FusedAdam's state"),
}
FUSED_ONLY = {
    "masters with FusedAdam": (lambda sd: sd["master_params"].append(torch.zeros(3)), ValueError,
                               "must hold no fp32 masters with FusedAdam inside"),
    "unstepped values, one too few": (_set(["master_params"], [None, {"param": torch.zeros(3)}]), ValueError,
                                      "state_dict['master_params'] must list 3 entries (one per parameter) or none"),
    "unstepped value of a wrong shape": (_set(["master_params"], [{"param": torch.zeros(3)}, None, None]),
                                         ValueError, "state_dict['master_params'][0] must be None or {'param': a "
                                         "dense float32 tensor of shape (4, 3)}"),
    "unstepped value in fp16": (_set(["master_params"], [None, {"param": torch.zeros(3).half()}, None]),
                                ValueError, "state_dict['master_params'][1] must be None or {'param'"),
    "unstepped value for an fp32 param": (_set(["master_params"], [None, None, {"param": torch.zeros(2)}]),
                                          ValueError, "state_dict['master_params'][2] must be None (a torch.float32 "
                                          "parameter)"),
    "unstepped value for a param whose state holds a master": (
        _set(["master_params"], [{"param": torch.zeros(4, 3)}, None, None]), ValueError,
        "state_dict['master_params'][0] holds the value of a param that had no FusedAdam state, but the checkpoint's "
        "FusedAdam state of that param holds a master_param"),
}
# torch.optim.AdamW's load_state_dict replaces its state, then reads each state's 'step' (a KeyError): the wrapper
# puts the state back and names what is missing
ADAMW_ONLY = {
    "inner state without its step": (lambda sd: sd["optimizer"]["state"][0].pop("step"), ValueError,
                                     "state_dict['optimizer'] cannot be loaded into AdamW: an entry lacks the key "
                                     "'step'"),
}
ONLY = {"SGD": SGD_ONLY, "FusedAdam": FUSED_ONLY, "AdamW": ADAMW_ONLY}


def _cases(inner, names=None):
    return [(inner, name) for name in names or {**BAD_CHECKPOINTS, **ONLY[inner]}]


@pytest.mark.parametrize("inner, case", _cases("SGD") + _cases("FusedAdam") + _cases("AdamW", ADAMW_ONLY))
def test_bad_checkpoint_names_the_entry_and_changes_nothing(inner, case):
    mutate, exc, fragment = {**BAD_CHECKPOINTS, **SGD_ONLY, **FUSED_ONLY, **ADAMW_ONLY}[case]
    opt, params, coef = _trained(inner)
    checkpoint = opt.state_dict()
    _train_step(opt, params, coef)  # the live state now differs from the checkpoint's
    mutate(checkpoint)
    untouched = clone_tree(checkpoint)
    before = wrapper_picture(opt, params)
    with pytest.raises(exc) as info:
        opt.load_state_dict(checkpoint)
    assert fragment in str(info.value)
    assert_tree_bitwise_equal(before, wrapper_picture(opt, params), "the wrapper after a refused load")
    assert_tree_bitwise_equal(untouched, checkpoint, "the checkpoint")


SCALER_TENSORS = st.builds(
    lambda dtype, shape, value: torch.full(shape, value).to(dtype),
    st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.bool]),
    st.sampled_from([(), (1,), (2,)]),
    st.one_of(st.sampled_from([0.0, 1.0, -1.0, 2.0, 1024.0, 4096.0, 2.0**31, float("nan"), float("inf")]),
              st.floats(min_value=-1e6, max_value=1e6)),
)


@settings(max_examples=fuzz_examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                     HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["scale", "growth_tracker", "hysteresis_left", "skipped_steps", "found_inf"]),
                       SCALER_TENSORS, min_size=1, max_size=3))
def test_property_loss_scaler_entry_loads_exactly_or_is_refused_naming_it(changes):
    opt, params, coef = _OPT_FOR_FUZZ
    checkpoint = _CHECKPOINT_FOR_FUZZ.copy()
    checkpoint["loss_scaler"] = {**checkpoint["loss_scaler"], **changes}
    before = wrapper_picture(opt, params)
    try:
        opt.load_state_dict(checkpoint)
    except (TypeError, ValueError) as e:
        assert "state_dict['loss_scaler'][" in str(e), str(e)
        assert_tree_bitwise_equal(before, wrapper_picture(opt, params))
        return
    for key, value in checkpoint["loss_scaler"].items():
        if key == "hysteresis_left":  # (never above this scaler's policy)
            assert opt.scaler.hysteresis_left.item() == min(value.item(), opt.scaler.hysteresis)
        elif key != "policy":
            assert getattr(opt.scaler, key).item() == value.item(), key


_OPT_FOR_FUZZ = _trained("SGD")
_CHECKPOINT_FOR_FUZZ = _OPT_FOR_FUZZ[0].state_dict()


# ---- DeepSpeed's plain optimizers are torch optimizers ---------------------------------------------------------------


def test_deepspeed_plain_optimizer_class_is_wrapped_like_any_torch_optimizer():
    """A torch.optim.Optimizer from DeepSpeed's module tree (DeepSpeedCPUAdam, deepspeed.ops.adam.FusedAdam,
    FusedLamb): wrapped, with options, masters and loss scaling; no DeepSpeed import or op build needed."""
    CPUAdamLike = type("DeepSpeedCPUAdam", (torch.optim.AdamW,), {})
    CPUAdamLike.__module__ = "deepspeed.ops.adam.cpu_adam"
    params = fp16_params()
    inner = CPUAdamLike(params, lr=1e-2)
    opt = FP16_Optimizer(inner, init_scale=2.0**6, max_grad_norm=1.0)
    assert isinstance(opt, FP16_Optimizer) and opt.optimizer is inner and len(opt.master_params) == 2
    _train_step(opt, params, [torch.ones(4, 3), torch.ones(3)])
    assert not opt.skipped and opt.loss_scale == 2.0**6


@pytest.mark.slow
def test_deepspeed_cpu_adam_real():
    """The real DeepSpeedCPUAdam (its op is JIT-built on first use, about 90 s, then cached): wrapped, and its
    masters follow torch's AdamW on the same unscaled gradients."""
    cpu_adam = pytest.importorskip("deepspeed.ops.adam", reason="DeepSpeed is not importable here")
    params = fp16_params()
    try:
        inner = cpu_adam.DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.0, adamw_mode=True)
    except Exception as e:  # the op's JIT build (compiler, headers) is the environment's, not ours
        pytest.skip(f"DeepSpeedCPUAdam's op could not be built here: {type(e).__name__}: {e}")
    opt = FP16_Optimizer(inner, init_scale=2.0**8)
    ref = [nn.Parameter(p.detach().float().clone()) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, eps=1e-8)
    coef = [torch.linspace(-1, 1, 12).reshape(4, 3), torch.tensor([0.5, -2.0, 1.0])]
    for step in range(4):
        _train_step(opt, params, coef, inf_at=1 if step == 1 else None)
        if not opt.skipped:
            ref_opt.zero_grad()
            sum((p * c).sum() for p, c in zip(ref, coef)).backward()
            ref_opt.step()
    assert opt.skipped_steps == 1
    # Stated tolerance: DeepSpeed's CPU kernel against torch's AdamW in fp32, 3 steps: 1e-6.
    for m, r in zip(opt.master_params, ref):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-6)


# FP16_Optimizer around FusedAdam: what it refuses at construction leaves the FusedAdam as the user built it.
def _bf16_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g).bfloat16()),
            torch.nn.Parameter(torch.randn(3, generator=g).bfloat16())]


def _step(params, opt):
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    opt.step()


def _snapshot(params, opt):
    groups = [({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]]) for g in opt.param_groups]
    return (copy.deepcopy(opt.defaults), copy.deepcopy(groups), copy.deepcopy(opt.state_dict()),
            opt.master_weights, opt.max_grad_norm, [p.detach().clone() for p in params])


@pytest.mark.parametrize("stepped_before", [False, True])
def test_stochastic_rounding_is_refused_up_front_and_the_fused_adam_is_left_as_it_was(stepped_before):
    params = _bf16_params()
    opt = FusedAdam(params, lr=1e-2, stochastic_rounding=True)
    if stepped_before:
        _step(params, opt)
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\] of this FusedAdam has stochastic_rounding=True.*"
                                         r"was not changed"):
        FP16_Optimizer(opt, init_scale=1024.0, max_grad_norm=1.0)
    after = _snapshot(params, opt)
    assert after[:2] == before[:2] and after[3:5] == before[3:5]
    torch.testing.assert_close(after[2], before[2], rtol=0, atol=0)
    torch.testing.assert_close(after[5], before[5], rtol=0, atol=0)
    # The FusedAdam still steps alone, bit for bit as an identical one that was never offered to FP16_Optimizer.
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = FusedAdam(twin_params, lr=1e-2, stochastic_rounding=True)
    twin.load_state_dict(before[2])
    _step(params, opt)
    _step(twin_params, twin)
    torch.testing.assert_close([p.detach() for p in params], [p.detach() for p in twin_params], rtol=0, atol=0)


def test_stochastic_rounding_in_a_later_group_is_refused_naming_it():
    params = _bf16_params()
    opt = FusedAdam([{"params": params[:1]}, {"params": params[1:], "stochastic_rounding": True}], lr=1e-2)
    with pytest.raises(ValueError, match=r"param_groups\[1\] of this FusedAdam has stochastic_rounding=True"):
        FP16_Optimizer(opt)
    assert opt.master_weights is False
    fp16 = FP16_Optimizer(FusedAdam(params[:1], lr=1e-2))  # wrapped: a group added later with it is refused
    with pytest.raises(ValueError, match="stochastic_rounding"):
        fp16.add_param_group({"params": params[1:], "stochastic_rounding": True})
    assert len(fp16.param_groups) == 1


# ---- any configuration ----------------------------------------------------------------------------------------------


def _wrapped_run(config, iterations, scaler: dict, max_grad_norm) -> list:
    """FP16_Optimizer(FusedAdam(config)) over drawn gradients (the loss sum((p * c).sum()) gives p the gradient c,
    times the loss scale): a snapshot with the loss scale, overflow flag and skipped steps per iteration, or
    ("refused", type, message)."""
    params = config.params()
    try:
        opt = FP16_Optimizer(FusedAdam(config.param_groups(params), **config.options), max_grad_norm=max_grad_norm,
                             **scaler)
    except (ValueError, TypeError) as error:
        return [("refused", type(error), str(error))]
    history = []
    for k, grads in enumerate(iterations):
        try:
            opt.zero_grad()
            terms = [(p * gradient(p, grad, 1000 * k + i).detach()).sum()
                     for i, (p, grad) in enumerate(zip(params, grads)) if grad is not None]
            if terms:
                opt.backward(torch.stack([t.float() for t in terms]).sum())
            opt.step()
        except (ValueError, TypeError, RuntimeError) as error:
            history.append(("refused", type(error), str(error)))
            break
        history.append(optimizer_snapshot(opt.optimizer) | {"loss_scale": opt.loss_scale, "overflow": opt.overflow,
                                                             "skipped_steps": opt.skipped_steps})
    return history


@settings(max_examples=fuzz_examples(100), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_property_any_wrapped_configuration_steps_alike_on_both_cpu_backends(data):
    """FP16_Optimizer around FusedAdam of any drawn configuration (param and moment dtypes, master weights, options),
    with a drawn loss-scale policy and clipping, over 1-4 iterations of drawn gradients (tiny to overflowing, inf and
    NaN elements: skipped steps and backoffs): the native and the reference backend give the same params, gradients,
    states, loss scale, overflow flags and skipped steps, bit for bit, or the same refusal."""
    config = data.draw(configurations(clipping=False), "configuration")
    scaler = dict(init_scale=data.draw(st.sampled_from((1.0, 2.0**10, 2.0**16)), "init_scale"),
                  growth_interval=data.draw(st.sampled_from((1, 2, 2000)), "growth_interval"),
                  hysteresis=data.draw(st.sampled_from((1, 2)), "hysteresis"), min_scale_action="clamp")
    max_grad_norm = data.draw(st.sampled_from((None, 1.0)), "max_grad_norm")
    iterations = [data.draw(gradients(len(config.sizes)), "gradients")
                  for _ in range(data.draw(st.integers(1, 4), "iterations"))]
    outcomes = []
    for backend in ("native", "torch"):
        with pytest.MonkeyPatch.context() as patch:
            select_backend(patch, backend)
            outcomes.append(_wrapped_run(config, iterations, scaler, max_grad_norm))
    assert_same_history(*outcomes)
