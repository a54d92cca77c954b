"""FP16_Optimizer is a torch optimizer to hook-based tools (schedulers, profilers, EMA, logging): every hook that
torch.optim.Optimizer offers fires on the wrapper, with the wrapper as argument, on taken and skipped steps.

torch 2.4.1 and 2.13 both provide the same set (checked in their torch/optim/optimizer.py): per instance
register_step_pre_hook, register_step_post_hook, register_state_dict_pre_hook/post_hook (with prepend),
register_load_state_dict_pre_hook/post_hook (with prepend); global torch.optim.optimizer.register_optimizer_step_pre_hook
and register_optimizer_step_post_hook. The wrapped optimizer's own hooks fire when its step() runs, as under
torch.amp.GradScaler: on taken steps only for optimizers that cannot skip on a device flag (SGD here), on every step
for those that can (FusedAdam, torch's fused AdamW).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ort_optim import FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer

INNER = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}
# Whether the inner optimizer's step() runs on a skipped step (it skips on a device flag itself).
INNER_STEPS_WHEN_SKIPPED = {"SGD": False, "FusedAdam": True, "AdamW-fused": True}


def make(inner: str):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3).half()), nn.Parameter(torch.randn(3))]  # fp16 with master, fp32
    return params, FP16_Optimizer(INNER[inner](params), init_scale=2.0**8)


def backward(opt, params, overflow: bool) -> None:
    opt.zero_grad()
    opt.backward(sum((p.float() ** 2).sum() for p in params))
    if overflow:
        params[1].grad[0] = float("inf")


OVERFLOWS = [False, True, False]  # taken, skipped, taken


@pytest.mark.parametrize("inner", list(INNER))
def test_step_hooks_fire_on_the_wrapper_on_taken_and_skipped_steps(inner):
    params, opt = make(inner)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o, o.skipped_steps)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o, o.skipped)))
    for overflow in OVERFLOWS:
        backward(opt, params, overflow)
        opt.step()
    assert [c[0] for c in calls] == ["pre", "post"] * 3
    assert all(c[1] is opt for c in calls)
    assert [c[2] for c in calls if c[0] == "post"] == OVERFLOWS  # a post hook sees whether the step was skipped
    assert [c[2] for c in calls if c[0] == "pre"] == [0, 0, 1]  # skipped steps counted so far


@pytest.mark.parametrize("inner", list(INNER))
def test_global_step_hooks_see_the_wrapper_every_step_and_the_inner_when_it_steps(inner):
    params, opt = make(inner)
    calls = []

    def name(o):
        return "wrapper" if o is opt else "inner" if o is opt.optimizer else repr(o)

    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("pre", name(o)))),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", name(o))))]
    try:
        for overflow in OVERFLOWS:
            backward(opt, params, overflow)
            opt.step()
    finally:
        for handle in handles:
            handle.remove()
    expected = []
    for overflow in OVERFLOWS:
        inner_steps = not overflow or INNER_STEPS_WHEN_SKIPPED[inner]
        expected += [("pre", "wrapper")] + ([("pre", "inner"), ("post", "inner")] if inner_steps else []) + \
            [("post", "wrapper")]
    assert calls == expected


def test_step_pre_hook_may_replace_the_arguments_and_handles_remove():
    params, opt = make("SGD")
    sentinel = object()

    def closure():
        opt.backward(sum((p.float() ** 2).sum() for p in params))
        return sentinel

    handle = opt.register_step_pre_hook(lambda o, args, kwargs: ((o,), {"closure": closure}))
    opt.zero_grad()
    assert opt.step() is sentinel  # the hook handed a closure in, as torch's machinery allows
    handle.remove()
    backward(opt, params, False)
    assert opt.step() is None
    seen = []
    handle = opt.register_step_post_hook(lambda o, a, k: seen.append(o))
    handle.remove()
    backward(opt, params, False)
    opt.step()
    assert seen == []


def test_post_hooks_do_not_fire_when_step_raises():
    params, opt = make("SGD")
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="no parameter has a gradient"):
        opt.step()
    assert calls == ["pre"]  # as torch: the post hooks run after a step that returned


@pytest.mark.parametrize("inner", ["SGD", "FusedAdam"])
def test_state_dict_and_load_state_dict_hooks(inner):
    params, opt = make(inner)
    backward(opt, params, False)
    opt.step()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd-pre", o)))
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd-pre-first", o)), prepend=True)

    def add_extra(o, sd):
        calls.append(("sd-post", o))
        return {**sd, "my_epoch": 3}  # a replacement dict, as torch allows

    opt.register_state_dict_post_hook(add_extra)
    sd = opt.state_dict()
    assert sd["my_epoch"] == 3 and sd["format"] == "ort_optim.FP16_Optimizer/1"

    def drop_extra(o, sd):
        calls.append(("load-pre", o, sd.pop("my_epoch")))  # the wrapper's checks then see its own keys only

    opt.register_load_state_dict_pre_hook(drop_extra)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load-post", o)))
    opt.load_state_dict(sd)
    assert sd["my_epoch"] == 3  # the hook edited a shallow copy, as torch's load_state_dict gives it
    assert [c[0] for c in calls] == ["sd-pre-first", "sd-pre", "sd-post", "load-pre", "load-post"]
    assert all(c[1] is opt for c in calls)
    assert calls[3][2] == 3


def test_a_load_state_dict_pre_hook_that_returns_no_dict_is_refused_naming_it_and_changes_nothing():
    """A load_state_dict pre hook may return a replacement dict; one that returns something else (a list, a
    string) is a TypeError saying so, raised before anything is loaded."""
    params, opt = make("FusedAdam")
    backward(opt, params, False)
    opt.step()
    sd = opt.state_dict()
    backward(opt, params, False)
    opt.step()
    before = ([p.detach().clone() for p in params], float(opt.scaler.scale), opt.state_dict())
    opt.register_load_state_dict_pre_hook(lambda o, sd: list(sd))
    with pytest.raises(TypeError, match=r"a load_state_dict pre hook returned list, not a dict"):
        opt.load_state_dict(sd)
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, before[0]))
    assert float(opt.scaler.scale) == before[1]
    after = opt.state_dict()["optimizer"]["state"]
    assert all(torch.equal(after[k]["exp_avg"], v["exp_avg"]) for k, v in before[2]["optimizer"]["state"].items())


def test_lr_scheduler_and_hooks_together():
    params, opt = make("SGD")
    post = []
    opt.register_step_post_hook(lambda o, a, k: post.append(o.param_groups[0]["lr"]))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for overflow in OVERFLOWS:
        backward(opt, params, overflow)
        opt.step()
        sched.step()
    assert post == [0.1, 0.05, 0.025]


# FP16_Optimizer when a step raises: after an exception from the wrapped optimizer (a step pre or post hook, or its
# step), the loss scale and every gradient are left so that a retry updates as torch.amp.GradScaler's retry does,
# whichever way the fp32 masters are kept (FusedAdam's own, or the wrapper's around any torch optimizer).
SCALE = 1024.0
LR = 0.1
X = torch.tensor([1.0, 0.5])  # the gradient of both params (of the unscaled loss)
POINTS = ("inner pre-hook", "inner step", "inner post-hook", "wrapper pre-hook", "wrapper post-hook")
# How many updates a failure at each point followed by one retry makes: a post hook fails after its step updated.
UPDATES = {"inner pre-hook": 1, "inner step": 1, "inner post-hook": 2, "wrapper pre-hook": 1, "wrapper post-hook": 2}
# name -> (the optimizer FP16_Optimizer wraps, the one torch.amp.GradScaler drives on fp32 copies of the params)
OPTIMIZERS = {
    "SGD (the wrapper keeps the masters)": (lambda params: torch.optim.SGD(params, lr=LR),
                                            lambda params: torch.optim.SGD(params, lr=LR)),
    "FusedAdam (keeps its own masters)": (lambda params: FusedAdam(params, lr=LR),
                                          lambda params: torch.optim.Adam(params, lr=LR, foreach=False)),
}


class Injected(RuntimeError):
    pass


def _fail_once(point: str, inner: torch.optim.Optimizer, outer: torch.optim.Optimizer) -> None:
    """Makes `point` raise Injected the first time it runs. `outer` is what the training loop steps: the
    FP16_Optimizer, or, for torch.amp.GradScaler, the optimizer itself (whose hooks then stand for the wrapper's)."""
    left = [1]

    def maybe_fail(*_):
        if left[0]:
            left[0] -= 1
            raise Injected(point)

    if point == "inner step":
        step = inner.step

        def failing_step(*args, **kwargs):
            maybe_fail()
            return step(*args, **kwargs)

        inner.step = failing_step
    else:
        target = inner if point.startswith("inner") else outer
        if point.endswith("pre-hook"):
            target.register_step_pre_hook(maybe_fail)
        else:
            target.register_step_post_hook(maybe_fail)


def _loss(w16: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
    return (w16.float() * X).sum() + (w32 * X).sum()


def _ours(make, point: str):
    w16 = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float16))
    w32 = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    inner = make([w16, w32])
    opt = FP16_Optimizer(inner, init_scale=SCALE)
    _fail_once(point, inner, opt)
    opt.backward(_loss(w16, w32))
    with pytest.raises(Injected):
        opt.step()
    after_failure = {"loss_scale": opt.loss_scale, "skipped_steps": opt.skipped_steps}
    opt.step()  # the retry
    return w16.detach().float(), w32.detach().clone(), after_failure, opt


def _grad_scaler(make, point: str):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))  # fp32 stand-ins for both params
    v = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = make([w, v])
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    _fail_once(point.replace("wrapper", "inner") if point != "inner step" else point, opt, opt)
    scaler.scale(_loss(w, v)).backward()
    with pytest.raises(Injected):
        scaler.step(opt)
    scaler.step(opt)  # the retry
    scaler.update()
    return w.detach().clone(), v.detach().clone()


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("name", OPTIMIZERS)
# (a retry after a wrapper post hook raised steps again without a new backward, as GradScaler's: warned about)
@pytest.mark.filterwarnings(r"ignore:FP16_Optimizer\.step\(\). no loss was scaled:UserWarning")
def test_a_retry_after_an_exception_updates_as_grad_scalers_retry(name, point):
    make, make_reference = OPTIMIZERS[name]
    w16, w32, after_failure, _ = _ours(make, point)
    ref16, ref32 = _grad_scaler(make_reference, point)
    # fp32 param: as GradScaler's (SGD: the same float32 operations; FusedAdam's Adam against torch's, a few ulps)
    torch.testing.assert_close(w32, ref32, rtol=1e-5, atol=1e-5)
    # fp16 param: its fp32 master took the same updates, rounded to fp16 (one fp16 ulp at 1-2: 2**-10 to 2**-9)
    torch.testing.assert_close(w16, ref16.half().float(), rtol=0, atol=2.0**-9)
    if name.startswith("SGD"):  # the numbers: every update moves each param by lr * its gradient
        expected = torch.tensor([1.0, 2.0]) - UPDATES[point] * LR * X
        torch.testing.assert_close(w32, expected)
        torch.testing.assert_close(w16, expected.half().float())
    # a failed step changed neither the loss scale nor the skip count (a wrapper post hook runs after a whole step)
    assert after_failure == {"loss_scale": SCALE, "skipped_steps": 0}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_new_gradients_after_a_failed_step_are_unscaled_afresh(name):
    """zero_grad() and a new backward after the failure: the step equals one that never failed."""
    make = OPTIMIZERS[name][0]
    results = []
    for fail in (True, False):
        w16 = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float16))
        w32 = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        inner = make([w16, w32])
        opt = FP16_Optimizer(inner, init_scale=SCALE)
        if fail:
            _fail_once("inner pre-hook", inner, opt)
            opt.backward(_loss(w16, w32))
            with pytest.raises(Injected):
                opt.step()
            opt.zero_grad()
        opt.backward(_loss(w16, w32))
        opt.step()
        results.append((w16.detach().clone(), w32.detach().clone(), opt.loss_scale))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_new_gradients_set_by_the_model_after_a_failed_step_are_unscaled_afresh():
    """model.zero_grad() (not the wrapper's) and a new backward: the gradients are new tensors, unscaled once."""
    w16 = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float16))
    w32 = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    inner = torch.optim.SGD([w16, w32], lr=LR)
    opt = FP16_Optimizer(inner, init_scale=SCALE)
    _fail_once("inner step", inner, opt)
    opt.backward(_loss(w16, w32))
    with pytest.raises(Injected):
        opt.step()
    w16.grad = w32.grad = None
    opt.backward(_loss(w16, w32))
    opt.step()
    expected = torch.tensor([1.0, 2.0]) - LR * X
    torch.testing.assert_close(w32.detach(), expected)
    torch.testing.assert_close(w16.detach().float(), expected.half().float())


def test_a_step_that_raised_while_unscaling_refuses_the_gradients_it_left_until_they_are_new():
    """An exception inside the unscale pass (here: the overflow flag's all-reduce) leaves the fp32 gradients unscaled or
    not: the next step() refuses them, changing nothing, until zero_grad() and a new backward."""
    w16 = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float16))
    w32 = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = FP16_Optimizer(torch.optim.SGD([w16, w32], lr=LR), init_scale=SCALE)
    reduce = opt._reduce_found_inf

    def failing_reduce(found_inf):
        opt._reduce_found_inf = reduce
        raise Injected("all-reduce")

    opt._reduce_found_inf = failing_reduce
    opt.backward(_loss(w16, w32))
    with pytest.raises(Injected):
        opt.step()
    before = (w16.detach().clone(), w32.detach().clone(), w32.grad.clone())
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[1\].*zero_grad\(\)"):
        opt.step()
    torch.testing.assert_close((w16.detach(), w32.detach(), w32.grad), before, rtol=0, atol=0)
    assert opt.loss_scale == SCALE
    opt.zero_grad()
    opt.backward(_loss(w16, w32))
    opt.step()
    expected = torch.tensor([1.0, 2.0]) - LR * X
    torch.testing.assert_close(w32.detach(), expected)
    torch.testing.assert_close(w16.detach().float(), expected.half().float())
