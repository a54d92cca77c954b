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
