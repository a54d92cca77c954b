"""FP16_Optimizer on one process: the loss-scale policy, skipped steps, fp32 masters, clipping, LR schedulers,
checkpoints, the entry point's dispatch, host reads, and ORTModule (when it is installed)."""

from __future__ import annotations

import io
import math
import threading
import warnings

import pytest
import torch
from torch import nn

from conftest import assert_bitwise_equal, assert_tree_bitwise_equal
from ort_optim import FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer, DynamicLossScaler, LossScaleUnderflowError

LOW = (torch.float16, torch.bfloat16)


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


def test_scaler_rejects_bad_policy():
    for kwargs in (dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0),
                   dict(hysteresis=0), dict(min_scale=0.0), dict(init_scale=0.5, min_scale=1.0),
                   dict(min_scale_action="ignore"), dict(init_scale=float("inf"))):
        with pytest.raises(ValueError):
            DynamicLossScaler(**kwargs)


def test_scaler_matches_deepspeed_dynamic_loss_scaler(monkeypatch):
    """The same flag sequence through DeepSpeed's own DynamicLossScaler (when DeepSpeed imports)."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler",
                                      reason="DeepSpeed is not importable in this environment")
    monkeypatch.setattr(loss_scaler, "dist", type("D", (), {"get_rank": staticmethod(lambda: 0)}))
    flags = [0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    for consecutive in (False, True):
        ds = loss_scaler.DynamicLossScaler(init_scale=2**10, scale_factor=2.0, scale_window=3, min_scale=1,
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
    """Each update (1e-5 relative) is far below half an ulp of the fp16/bf16 param (2**-11 / 2**-8 at 1.0), so a
    low-precision optimizer would never move; the masters must follow an fp32 run (same exact gradients)."""
    n = 257
    coef = torch.linspace(-1, 1, n)  # exactly representable in fp16/bf16 after rounding: use the rounded values
    coef = coef.to(dtype).float()
    lr = 1e-5
    make = {
        "FusedAdam": lambda ps: FusedAdam(ps, lr=lr),
        "SGD": lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.5),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0),
    }[inner]
    low = nn.Parameter(torch.ones(n, dtype=dtype))
    ref = nn.Parameter(torch.ones(n, dtype=torch.float32))
    opt = FP16_Optimizer(make([low]), init_scale=2.0**10)
    ref_opt = make([ref])
    steps = 200
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
    with pytest.raises(TypeError, match="already wrapped"):
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
