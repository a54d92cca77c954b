"""FusedAdam(step_in_backward=True), as a specification.

* Each parameter is updated by a post-accumulate-grad hook as soon as its gradient is complete, and the gradient is
  freed: after backward no gradient is left, and the gradients never all exist at once.
* Over many steps the params and states come out bit for bit as from step() after backward, for every mode and
  state layout (amsgrad, maximize, masters, fp16 and bf16 moments, float64, lr tensors, several groups, a frozen
  param, a param the loss does not use, a param used twice), on every CPU backend.
* step() finishes what the hooks left: params whose gradient was set without backward.
* Gradient accumulation: backward inside ``optimizer.accumulate()`` only accumulates; the backward after it steps
  with the sum, bit for bit as step() after the same backward calls.
* What needs every gradient first is refused with a clear error: max_grad_norm (at construction), grad_scale and
  found_inf (at step(), GradScaler's way in); params that share memory (at construction); a bad gradient raises from
  backward naming the param, with nothing written.
* Under ORTModule (torch 2.4.1, onnxruntime-training 1.19.2) and under torch.compile the hooks fire, and the steps
  equal step()'s.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from conftest import assert_same_snapshot, optimizer_snapshot

from ort_optim import AdamWMode, FusedAdam

STEPS = 12


class Net(torch.nn.Module):
    """A small model with what matters for hooks: stacked layers (a weight is needed for the gradient of what comes
    before it), a weight used twice (its hook fires once, after both contributions), a frozen bias and a param the
    loss never uses (no gradient, no hook call). Params are cast to float32 in forward, so any dtype works."""

    def __init__(self, g: torch.Generator, dtype: torch.dtype):
        super().__init__()

        def param(*shape, requires_grad=True):
            return torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype) * 0.5, requires_grad=requires_grad)

        self.w1, self.b1 = param(6, 5), param(6)
        self.w2, self.b2 = param(6, 6), param(6, requires_grad=False)
        self.scale = param(())
        self.unused = param(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1.float(), self.w2.float()
        h = torch.tanh(x @ w1.t() + self.b1.float())
        h = torch.tanh(h @ w2.t() + self.b2.float())
        h = torch.tanh(h @ w2.t())  # w2 again
        return (h * self.scale.float()).pow(2).mean()


@dataclass
class Case:
    dtype: torch.dtype = torch.float32
    options: dict = field(default_factory=dict)
    groups: Callable[[Net], list] = lambda net: list(net.parameters())


CASES = {
    "adamw-transformers": Case(options=dict(weight_decay=0.1)),
    "adamw-torch-amsgrad-maximize": Case(options=dict(adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.1,
                                                      amsgrad=True, maximize=True)),
    "adam-l2-no-bias-correction": Case(options=dict(adam_w_mode=AdamWMode.ADAM_L2_REGULARIZATION, weight_decay=0.05,
                                                    bias_correction=False)),
    "fp16-masters": Case(torch.float16, dict(master_weights=True, weight_decay=0.01)),
    "bf16-masters-fp16-moments": Case(torch.bfloat16, dict(master_weights=True, exp_avg_dtype=torch.float16,
                                                           exp_avg_sq_dtype=torch.float16, amsgrad=True)),
    "fp32-bf16-moments": Case(options=dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)),
    "float64": Case(torch.float64, dict(adam_w_mode=AdamWMode.ADAMW_TORCH)),
    "two-groups-lr-tensor": Case(groups=lambda net: [
        {"params": [net.w1, net.b1, net.unused], "lr": torch.tensor(3e-3)},
        {"params": [net.w2, net.b2, net.scale], "weight_decay": 0.2, "adam_w_mode": AdamWMode.ADAMW_TORCH}]),
}


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1000 + step))


def _train(case: Case, step_in_backward: bool, steps: int = STEPS, micro_batches: int = 1):
    net = Net(torch.Generator().manual_seed(0), case.dtype)
    opt = FusedAdam(case.groups(net), lr=1e-2, step_in_backward=step_in_backward, **case.options)
    for step in range(steps):
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else opt.accumulate():
                net(_inputs(step * micro_batches + micro)).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


@pytest.mark.parametrize("name", CASES)
def test_steps_in_backward_equal_steps_after_backward_bit_for_bit(name, backend):
    _, stepped = _train(CASES[name], step_in_backward=False)
    _, in_backward = _train(CASES[name], step_in_backward=True)
    assert_same_snapshot(optimizer_snapshot(stepped), optimizer_snapshot(in_backward))


def test_each_gradient_is_freed_as_soon_as_its_param_is_updated():
    net = Net(torch.Generator().manual_seed(0), torch.float32)
    opt = FusedAdam(net.parameters(), step_in_backward=True)
    params = [p for p in net.parameters() if p.requires_grad]
    live = []  # gradients alive whenever a hook after the optimizer's runs

    def count(_):
        live.append(sum(q.grad is not None for q in params))

    for p in params:
        p.register_post_accumulate_grad_hook(count)
    before = [p.detach().clone() for p in params]
    net(_inputs(0)).backward()
    assert live == [0] * (len(params) - 1)  # every param but `unused`, and never a gradient left behind
    assert all(p.grad is None for p in params)
    changed = [not torch.equal(p, b) for p, b in zip(params, before)]
    assert changed == [name != "unused" for name, p in net.named_parameters() if p.requires_grad]
    assert len(opt.state) == len(params) - 1


def test_step_finishes_the_params_whose_hooks_did_not_fire(backend):
    """Gradients set without backward (and a param made trainable after construction, which has no hook) are
    updated by step(), as without step_in_backward."""
    case = Case(options=dict(weight_decay=0.1))
    results = []
    for step_in_backward in (False, True):
        net = Net(torch.Generator().manual_seed(0), torch.float32)
        opt = FusedAdam(net.parameters(), lr=1e-2, step_in_backward=step_in_backward, **case.options)
        net.b2.requires_grad_(True)
        g = torch.Generator().manual_seed(5)
        for step in range(4):
            net(_inputs(step)).backward()
            net.unused.grad = torch.randn(3, generator=g)
            opt.step()
            opt.zero_grad()
        results.append(optimizer_snapshot(opt))
    assert_same_snapshot(*results)


# Hyperparameters changed between iterations (a schedule), in the ways users change them; the hooks validate a
# group's values once and reuse them while they stay the same, so each change must still reach the next update.
SCHEDULES = {
    "lr float": lambda group, step: group.update(lr=1e-2 / (1 + step)),
    "lr tensor in place": lambda group, step: group["lr"].fill_(1e-2 / (1 + step)),
    "betas list in place": lambda group, step: group["betas"].__setitem__(1, 0.99 - 0.01 * step),
    "weight_decay and eps": lambda group, step: group.update(weight_decay=0.01 * step, eps=10.0 ** -(6 + step % 3)),
    "adam_w_mode": lambda group, step: group.update(adam_w_mode=AdamWMode(step % 3)),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_hyperparameters_changed_between_iterations_reach_the_next_update(schedule, backend):
    results = []
    for step_in_backward in (False, True):
        net = Net(torch.Generator().manual_seed(0), torch.float32)
        lr = torch.tensor(1e-2) if schedule == "lr tensor in place" else 1e-2
        opt = FusedAdam([{"params": net.parameters(), "lr": lr, "betas": [0.9, 0.99]}],
                        step_in_backward=step_in_backward)
        for step in range(6):
            SCHEDULES[schedule](opt.param_groups[0], step)
            net(_inputs(step)).backward()
            opt.step()
            opt.zero_grad()
        results.append(optimizer_snapshot(opt))
    assert_same_snapshot(*results)


@pytest.mark.parametrize("name", ["adamw-transformers", "bf16-masters-fp16-moments"])
def test_backward_inside_accumulate_only_accumulates(name, backend):
    _, stepped = _train(CASES[name], step_in_backward=False, steps=4, micro_batches=3)
    _, in_backward = _train(CASES[name], step_in_backward=True, steps=4, micro_batches=3)
    assert_same_snapshot(optimizer_snapshot(stepped), optimizer_snapshot(in_backward))

    net = Net(torch.Generator().manual_seed(0), torch.float32)
    opt = FusedAdam(net.parameters(), step_in_backward=True)
    before = optimizer_snapshot(opt)
    with opt.accumulate():
        net(_inputs(0)).backward()
    assert not opt.state and all(torch.equal(p, before[f"p0.{i}"]) for i, p in enumerate(net.parameters()))
    assert net.w1.grad is not None


def _gradscaler_step(opt, net):
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0) if hasattr(torch.amp, "GradScaler") else None
    if scaler is None:
        pytest.skip("torch.amp.GradScaler('cpu') is not available in this torch")
    scaler.scale(net(_inputs(0))).backward()
    scaler.step(opt)


REFUSED = [
    ("max_grad_norm", dict(max_grad_norm=1.0), None, "max_grad_norm=1.0 clips by the norm of all gradients"),
    ("grad_scale", {}, lambda opt, net: opt.step(grad_scale=8.0), "grad_scale/found_inf"),
    ("found_inf", {}, lambda opt, net: opt.step(found_inf=torch.zeros(1)), "grad_scale/found_inf"),
    ("GradScaler", {}, _gradscaler_step, "grad_scale/found_inf"),
]


@pytest.mark.parametrize("options,action,message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_what_needs_every_gradient_first_is_refused(options, action, message):
    net = Net(torch.Generator().manual_seed(0), torch.float32)
    if action is None:
        with pytest.raises(ValueError, match=message):
            FusedAdam(net.parameters(), step_in_backward=True, **options)
        return
    opt = FusedAdam(net.parameters(), step_in_backward=True, **options)
    with pytest.raises(ValueError, match=message):
        action(opt, net)


def test_params_that_share_memory_are_refused_at_construction():
    flat = torch.zeros(10)
    a, b = torch.nn.Parameter(flat[:6]), torch.nn.Parameter(flat[4:])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*share memory"):
        FusedAdam([a, b], step_in_backward=True)
    opt = FusedAdam([a], step_in_backward=True)
    with pytest.raises(ValueError, match="share memory"):
        opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1


class WithEmbedding(Net):
    def __init__(self, g, dtype):
        super().__init__(g, dtype)
        self.embedding = torch.nn.Embedding(10, 5, sparse=False)

    def forward(self, x):
        return super().forward(x + self.embedding(torch.arange(4)))


def _sparse_embedding(net, opt):
    net.embedding.sparse = True


BAD_STEPS = [  # (what, damage done after a first good step, the param whose hook raises, the error's message)
    ("sparse gradient", _sparse_embedding, 6, r"\['params'\]\[6\] \(shape \(10, 5\).*its gradient is sparse"),
    ("amsgrad switched on", lambda net, opt: opt.param_groups[0].update(amsgrad=True), None,
     r"\['params'\]\[\d\] \(shape .*amsgrad is on but this parameter's state has no max_exp_avg_sq"),
    ("negative lr", lambda net, opt: opt.param_groups[0].update(lr=-1.0), None, r"param_groups\[0\]: lr must be"),
]


@pytest.mark.parametrize("damage,index,message", [c[1:] for c in BAD_STEPS], ids=[c[0] for c in BAD_STEPS])
def test_a_bad_step_raises_from_backward_naming_the_param_and_leaves_it_alone(damage, index, message, backend):
    """The param whose hook raises, and its state, are left as they were. (Params updated by hooks earlier in the
    same backward stay updated: a per-parameter step cannot wait for the others' checks. With a group-wide error,
    the first hook raises and nothing is written.)"""
    net = WithEmbedding(torch.Generator().manual_seed(0), torch.float32)
    opt = FusedAdam(net.parameters(), step_in_backward=True)
    net(_inputs(0)).backward()  # creates the states
    damage(net, opt)
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=message):
        net(_inputs(1)).backward()
    after = optimizer_snapshot(opt)
    for key in before:  # params, states and steps as before (gradients aside: backward delivered them)
        if not key.endswith(".grad") and not key.startswith("group") and (index is None or key.startswith(f"p0.{index}.")
                                                                           or key == f"p0.{index}"):
            assert type(after[key]) is type(before[key]) and (
                after[key].equal(before[key]) if isinstance(after[key], torch.Tensor) else after[key] == before[key]), key


REPOINTED = {  # how a wrapper re-points param_groups -> what the error names
    "fp32 copies": (lambda params: [p.detach().clone().requires_grad_(p.requires_grad) for p in params],
                    r"param_groups\[0\]\['params'\]\[0\] \(shape \(6, 5\).* never hooked"),
    "emptied": (lambda params: [], r"param_groups hold none of the params that step_in_backward=True hooked"),
}


@pytest.mark.parametrize("name", REPOINTED)
def test_param_groups_re_pointed_away_from_the_hooked_params_are_refused_by_the_first_hook_with_nothing_written(name):
    """As mixed-precision and ZeRO wrappers do (DeepSpeed's put fp32 copies or flat fp32 partitions in place of the
    params and set their gradients after backward; ZeRO stage 3 empties the groups between steps): no hook could
    update what they hold, and step() would silently take a normal step. The first hook raises instead. (A param
    merely removed from param_groups keeps its gradient and is not updated, as with step():
    tests/test_practical_acceptance.py.)"""
    repoint, message = REPOINTED[name]
    net = Net(torch.Generator().manual_seed(0), torch.float32)
    opt = FusedAdam(net.parameters(), step_in_backward=True)
    params = list(net.parameters())
    replacements = repoint(params)
    opt.param_groups[0]["params"] = replacements
    before = [t.detach().clone() for t in params + replacements]
    with pytest.raises(ValueError, match=message + r".*re-pointed.*Use step_in_backward=False"):
        net(_inputs(0)).backward()
    assert not opt.state and all(torch.equal(a, b) for a, b in zip(before, params + replacements))


def test_a_copy_hooks_its_own_params_and_a_deleted_optimizer_none():
    net = Net(torch.Generator().manual_seed(0), torch.float32)
    opt = FusedAdam(net.parameters(), step_in_backward=True)
    twin = copy.deepcopy({"net": net, "opt": opt})
    twin["net"](_inputs(0)).backward()
    assert twin["opt"].state and not opt.state and twin["net"].w1.grad is None
    del opt
    net(_inputs(0)).backward()
    assert net.w1.grad is not None  # no optimizer left to step: gradients accumulate as usual


def test_under_ortmodule_the_hooks_fire_and_steps_equal_step():
    ortmodule = pytest.importorskip("onnxruntime.training.ortmodule",
                                    reason="onnxruntime-training's ORTModule is not installed here")
    if not torch.__version__.startswith("2.4."):
        pytest.skip(f"ORTModule needs torch 2.4.x; this environment has torch {torch.__version__}")
    nets, opts = [], []
    for step_in_backward in (False, True):
        net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        net.load_state_dict(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).state_dict()
                            if not nets else nets[0][1].state_dict())
        wrapped = ortmodule.ORTModule(net)
        nets.append((wrapped, net))
        opts.append(FusedAdam(net.parameters(), lr=1e-2, weight_decay=0.1, step_in_backward=step_in_backward))
    for step in range(4):
        for (wrapped, net), opt in zip(nets, opts):
            wrapped(_inputs(step)).pow(2).mean().backward()
            if opt.step_in_backward:
                assert all(p.grad is None for p in net.parameters()), "a hook did not fire under ORTModule"
            opt.step()
            opt.zero_grad()
    for p, q in zip(nets[0][1].parameters(), nets[1][1].parameters()):
        assert torch.equal(p, q)


def test_under_torch_compile_the_hooks_fire_and_steps_equal_step(tmp_path, monkeypatch):
    """A model compiled with torch.compile (its backward an AOTAutograd graph): the params' gradients are still
    accumulated by autograd's engine, so the hooks fire, and the steps equal step()'s after the same compiled model
    bit for bit (an eager model would not do as the reference: inductor's fused kernels round differently)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    nets, opts, compiled = [], [], []
    for step_in_backward in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        nets.append(net)
        opts.append(FusedAdam(net.parameters(), lr=1e-2, weight_decay=0.1, step_in_backward=step_in_backward))
        compiled.append(torch.compile(net))
    for step in range(4):
        for net, opt, model in zip(nets, opts, compiled):
            model(_inputs(step)).pow(2).mean().backward()
            if opt.step_in_backward:
                assert all(p.grad is None for p in net.parameters()), "a hook did not fire under torch.compile"
            opt.step()
            opt.zero_grad()
    assert {int(s["step"]) for s in opts[1].state.values()} == {4}
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(p, q)
