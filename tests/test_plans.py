"""FusedAdam's native plans, as a specification.

A FusedAdam on the native CPU backend steps through one native plan per bucket (``ort_optim.backends.AdamPlan``),
which validated the params and states when it was made and reads each param's ``.grad`` itself, instead of handing
four tensor lists to the op. That is a cache, and must be invisible:

* Over many steps, steps through plans give bit-for-bit the params and states that steps through the op give, for
  every state layout, with loss scaling, clipping and skipped steps, with several buckets and param groups, when
  gradients come and go, and when a param is given new memory.
* The plans are really used: no step calls the op, and the plan is built again only when the set of params with
  gradients changed or a param got new memory (params that never get one, frozen ones say, change nothing).
  (tests/test_soundness.py covers everything else that makes a plan stale.)
* A bad step raises naming the param and changes nothing, as through the op.
* An optimizer holding plans can be deep-copied and pickled; the copy keeps its options and steps on its own.
"""

from __future__ import annotations

import copy
import io
import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from conftest import assert_bitwise_equal, assert_same_snapshot, optimizer_snapshot, select_backend

from ort_optim import AdamWMode, FusedAdam, _plan, backends

STEPS = 30


@dataclass
class Scenario:
    make_groups: Callable[[torch.Generator], list[dict]]
    options: dict = field(default_factory=dict)
    step_kwargs: dict = field(default_factory=dict)
    has_grad: Callable[[int, int], bool] = lambda step, index: True  # (step, flat param index)
    poison: Callable[[int, int], bool] = lambda step, index: False  # an inf in this gradient (a skipped step)
    before_step: Callable[[int, list[torch.Tensor]], None] = lambda step, params: None
    build_steps: tuple = (0,)  # the steps that plan: the first, and those where the set of params with grads changed


def _layouts(g: torch.Generator, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """0-dim, empty, odd-sized, transposed (non-contiguous) and larger than one 64K-element work chunk."""
    shapes = [(), (0,), (5, 3), (70_001,)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in shapes]
    params.append(torch.nn.Parameter(torch.randn(7, 4, generator=g).to(dtype).t()))
    return params


SCENARIOS = {
    "fp32-every-layout": Scenario(
        lambda g: [{"params": _layouts(g, torch.float32)}],
        options=dict(adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.1, amsgrad=True, maximize=True),
    ),
    "bf16-master-fp16-moments": Scenario(
        lambda g: [{"params": _layouts(g, torch.bfloat16)}],
        options=dict(master_weights=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16, amsgrad=True,
                     weight_decay=0.01),
    ),
    "fp16-scaled-clipped-with-skips": Scenario(
        lambda g: [{"params": _layouts(g, torch.float16)}],
        options=dict(master_weights=True, exp_avg_sq_dtype=torch.bfloat16, max_grad_norm=0.5),
        step_kwargs=dict(grad_scale=1024.0),
        poison=lambda step, index: step in (7, 8) and index == 2,
    ),
    "fp32-scaled-by-tensors-maximize-fp16-moments": Scenario(  # a lone plan's scaled step (AdamPlan.step_scaled)
        lambda g: [{"params": _layouts(g, torch.float32)}],
        options=dict(max_grad_norm=0.3, maximize=True, amsgrad=True, exp_avg_dtype=torch.float16,
                     exp_avg_sq_dtype=torch.float16),
        step_kwargs=dict(grad_scale=torch.tensor(4.0, dtype=torch.float64), found_inf=torch.zeros(1)),
        poison=lambda step, index: step == 4 and index == 3,
    ),
    "two-groups-four-buckets": Scenario(
        lambda g: [
            {"params": _layouts(g, torch.float32)[:3] + _layouts(g, torch.float16)[2:]},
            {"params": _layouts(g, torch.bfloat16)[2:] + [torch.nn.Parameter(torch.randn(9, generator=g))],
             "lr": torch.tensor(3e-3), "adam_w_mode": AdamWMode.ADAM_L2_REGULARIZATION, "weight_decay": 0.2},
        ],
        options=dict(master_weights=True, weight_decay=0.1, max_grad_norm=2.0),
    ),
    "grads-come-and-go": Scenario(
        lambda g: [{"params": _layouts(g, torch.float32)}, {"params": _layouts(g, torch.float16)}],
        options=dict(master_weights=True),
        has_grad=lambda step, index: not (5 <= step < 9 and index == 2) and not (index == 8 and step < 12),
        build_steps=(0, 5, 9, 12),
    ),
    "one-bucket-scaled-grads-come-and-go": Scenario(  # the lone plan finds the change in grad_stats, before writing
        lambda g: [{"params": _layouts(g, torch.float32)}],
        options=dict(max_grad_norm=0.5),
        step_kwargs=dict(grad_scale=8.0),
        has_grad=lambda step, index: not (5 <= step < 9 and index == 2),
        build_steps=(0, 5, 9),
    ),
    "frozen-params": Scenario(
        lambda g: [{"params": _layouts(g, torch.float32)}, {"params": _layouts(g, torch.bfloat16)}],
        options=dict(max_grad_norm=1.0),
        has_grad=lambda step, index: index not in (1, 3, 7),
    ),
    "param-given-new-memory": Scenario(
        lambda g: [{"params": _layouts(g, torch.float32)}],
        before_step=lambda step, params: step == 6 and setattr(params[2], "data", params[2].data.clone()),
        build_steps=(0, 6),
    ),
}


def _run(scenario: Scenario, planned: bool, monkeypatch, skips: list | None = None
         ) -> tuple[FusedAdam, list[int], list[int]]:
    """STEPS steps of the scenario; returns the optimizer and, per step, the op calls and the plan builds it made
    (and appends each step's last_found_inf and last_grad_norm to skips, when given)."""
    calls, builds = [0], [0]
    op, build = backends.adam_step_, _plan.build

    def counting_op(*args, **kwargs):
        calls[-1] += 1
        return op(*args, **kwargs)

    def counting_build(*args):
        builds[-1] += 1
        return build(*args)

    monkeypatch.setattr(backends, "adam_step_", counting_op)
    monkeypatch.setattr(_plan, "build", counting_build)
    if not planned:  # the native op without plans (as while torch.compile traces)
        monkeypatch.setattr(backends, "runs_natively", lambda device: False)
    g = torch.Generator().manual_seed(0)
    opt = FusedAdam(scenario.make_groups(g), lr=1e-2, **scenario.options)
    params = [p for group in opt.param_groups for p in group["params"]]
    per_step, builds_per_step = [], []
    for step in range(STEPS):
        scenario.before_step(step, params)
        for index, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            if scenario.poison(step, index) and grad.numel():
                grad.view(-1)[0] = float("inf")
            p.grad = grad if scenario.has_grad(step, index) else None
        calls.append(0)
        builds.append(0)
        opt.step(**scenario.step_kwargs)
        per_step.append(calls[-1])
        builds_per_step.append(builds[-1])
        if skips is not None:
            skips.append(tuple(None if t is None else t.clone() for t in (opt.last_found_inf, opt.last_grad_norm)))
    monkeypatch.undo()
    return opt, per_step, builds_per_step


@pytest.mark.parametrize("name", SCENARIOS)
def test_steps_through_plans_equal_steps_through_the_op_bit_for_bit(name, monkeypatch):
    select_backend(monkeypatch, "native")
    scenario = SCENARIOS[name]
    planned, planned_calls, builds = _run(scenario, planned=True, monkeypatch=monkeypatch)
    select_backend(monkeypatch, "native")
    through_op, op_calls, _ = _run(scenario, planned=False, monkeypatch=monkeypatch)
    assert_same_snapshot(optimizer_snapshot(through_op), optimizer_snapshot(planned))
    assert all(calls > 0 for calls in op_calls)
    assert not any(planned_calls), planned_calls
    assert tuple(step for step, count in enumerate(builds) if count) == scenario.build_steps, builds


@pytest.mark.parametrize("name", ["fp16-scaled-clipped-with-skips", "fp32-scaled-by-tensors-maximize-fp16-moments"])
def test_a_scaled_step_through_a_plan_reports_its_skips_as_through_the_op(name, monkeypatch):
    """last_found_inf (the skip flag) and last_grad_norm are the same tensors, step by step, whichever path unscaled
    and clipped (AdamPlan.step_scaled, or _scaling's tensor ops and the op)."""
    select_backend(monkeypatch, "native")
    planned, through_op = [], []
    _run(SCENARIOS[name], planned=True, monkeypatch=monkeypatch, skips=planned)
    select_backend(monkeypatch, "native")
    _run(SCENARIOS[name], planned=False, monkeypatch=monkeypatch, skips=through_op)
    for (skip, norm), (op_skip, op_norm) in zip(planned, through_op):
        assert_bitwise_equal(skip, op_skip, "last_found_inf")
        assert_bitwise_equal(norm, op_norm, "last_grad_norm")
    assert any(skip.item() for skip, _ in planned)  # the poisoned steps were skipped


def test_a_param_given_new_memory_is_updated_there_and_its_old_memory_is_left_alone(monkeypatch):
    select_backend(monkeypatch, "native")
    p = torch.nn.Parameter(torch.ones(4))
    opt = FusedAdam([p], lr=0.1)
    for _ in range(3):
        p.grad = torch.ones(4)
        opt.step()
    old = p.data
    old_values = old.clone()
    p.data = torch.full((4,), 5.0)
    p.grad = torch.ones(4)
    opt.step()
    assert torch.equal(old, old_values)
    assert (p.detach() < 5.0).all()


def _planned_fp32(monkeypatch):
    """One group of fp32 params, no scaling or clipping, 3 steps taken: the next step is one plan call."""
    select_backend(monkeypatch, "native")
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn(6, generator=g))]
    opt = FusedAdam(params, weight_decay=0.1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    assert opt._plan.groups[0].native
    return opt, params


def _float64_grad(p):
    p.grad.data = torch.zeros(p.shape, dtype=torch.float64)


def _new_shape(p):
    p.data = torch.zeros(p.numel() + 1)
    p.grad = torch.zeros_like(p)


def _float64_param(p):
    p.data = p.data.double()
    p.grad = torch.zeros_like(p)


BAD_STEPS = [
    ("float64-grad", _float64_grad, r"its gradient has dtype torch\.float64"),
    ("param-changed-shape", _new_shape, r"its optimizer state was made for shape \(6,\)"),
    ("param-became-float64", _float64_param, r"cannot switch to or from float64"),
]


@pytest.mark.parametrize("damage,message", [c[1:] for c in BAD_STEPS], ids=[c[0] for c in BAD_STEPS])
def test_a_bad_step_through_a_plan_names_the_param_and_changes_nothing(damage, message, monkeypatch):
    opt, params = _planned_fp32(monkeypatch)
    for p in params:
        p.grad = torch.ones_like(p)
    damage(params[1])
    before = optimizer_snapshot(opt)
    with pytest.raises((ValueError, RuntimeError), match=re.escape("param_groups[0]['params'][1] (shape") + ".*" + message):
        opt.step()
    assert_same_snapshot(before, optimizer_snapshot(opt))


def test_plans_are_native_cpu_only(monkeypatch):
    opt, _ = _planned_fp32(monkeypatch)
    assert all(bucket.native is not None for bucket in opt._plan.groups[0].buckets)
    select_backend(monkeypatch, "torch")
    p = torch.nn.Parameter(torch.ones(3))
    other = FusedAdam([p])
    for _ in range(2):
        p.grad = torch.ones(3)
        other.step()
    assert not other._plan.groups[0].native and other._plan.groups[0].buckets[0].native is None


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_an_optimizer_with_plans_copies_with_its_options_and_the_copy_steps_alone(how, monkeypatch):
    select_backend(monkeypatch, "native")
    params = [torch.nn.Parameter(torch.randn(4).half()) for _ in range(2)]
    opt = FusedAdam(params, master_weights=True, exp_avg_dtype=torch.float16, max_grad_norm=1.0)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(4).half()
        opt.step()
    if how == "deepcopy":
        clone = copy.deepcopy(opt)
    else:
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    assert (clone.master_weights, clone.exp_avg_dtype, clone.max_grad_norm) == (True, torch.float16, 1.0)
    before = optimizer_snapshot(opt)
    clone_params = [p for p in clone.param_groups[0]["params"]]
    for p in clone_params:
        p.grad = torch.ones(4).half()
    clone.step()
    assert_same_snapshot(before, optimizer_snapshot(opt))
    assert float(clone.state[clone_params[0]]["step"]) == 4


def test_a_param_appended_to_a_group_list_directly_is_not_ignored(monkeypatch):
    opt, params = _planned_fp32(monkeypatch)
    late = torch.nn.Parameter(torch.ones(3))
    opt.param_groups[0]["params"].append(late)
    for p in params + [late]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert float(opt.state[late]["step"]) == 1 and (late.detach() < 1).all()


def test_plans_are_not_used_once_another_backend_is_selected(monkeypatch):
    opt, params = _planned_fp32(monkeypatch)
    select_backend(monkeypatch, "torch")
    calls = []
    op = backends.adam_step_
    monkeypatch.setattr(backends, "adam_step_", lambda *a, **k: calls.append(1) or op(*a, **k))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == [1]
