"""Autograd's view of a step: every tensor FusedAdam writes is marked as modified in place (its version counter), as
torch's own optimizers mark what their in-place ops write.

Autograd saves a tensor's version with the tensor; a backward that finds the version changed raises "one of the
variables needed for gradient computation has been modified by an inplace operation" rather than compute with the
new values. ort_optim's kernels write through data pointers, which autograd does not see: before this module, a plain
``step()`` on the native and Triton backends left every version as it was, so a second backward over a retained graph
that saved a param, or a ``p.detach()`` saved by a later forward, silently computed with the updated param where
``torch.optim.AdamW`` raises (step_in_backward already marked the param, not its states).

The oracle is ``torch.optim.AdamW`` under the same scenario: its foreach and for-loop steps (in-place torch ops) mark
the params and states, so the scenario raises with FusedAdam exactly when it raises with them, for fp32 params, fp16
params with fp32 masters and a loss scale, and 8-bit moments. torch's fused kernel (``torch._fused_adamw_``, torch
2.4.1 and 2.13.0) marks no param or moment, so with it these scenarios compute silently: where it raises, FusedAdam
raises too, and where it does not, FusedAdam follows the foreach step (the error is the point).

What a step marks (ops/README.md, "Autograd"; ort_optim/_versions.py): the params, moments, masters, block scales and
step counts, and the gradients when ``grad_scale`` has them written back unscaled; nothing when the step is skipped.
Tensors without a version counter (made under ``torch.inference_mode()``) are stepped as before, unmarked.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ort_optim import AdamWMode, FusedAdam, backends
from ort_optim.fp16_optimizer import FP16_Optimizer

MODIFIED = "modified by an inplace operation"
SCALE = 1024.0
# (param dtype, FusedAdam options, loss scale)
CASES = {
    "fp32": (torch.float32, {}, None),
    "fp16 with masters and grad_scale": (torch.float16, dict(master_weights=True), SCALE),
    "8-bit moments": (torch.float32, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), None),
}
TORCH_STEPS = {"foreach": dict(foreach=True), "for-loop": dict(foreach=False), "fused": dict(fused=True)}


def make_params(dtype: torch.dtype) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter((torch.randn(8, 8) * 0.3).to(dtype)), nn.Parameter((torch.randn(8, 4) * 0.3).to(dtype))]


def inputs(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(dtype)


def two_layers(params, x):
    """``tanh(x @ w1) @ w2``: the second matmul saves w2 (for the gradient of the hidden activations)."""
    w1, w2 = params
    return ((x @ w1).tanh() @ w2).float().square().sum()


def one_layer(params, x):
    """``x @ w1``: only x is saved (w1's gradient needs x, and x needs none): no param is."""
    return (x @ params[0]).float().square().sum()


def run_scenario(scenario: str, params, step, dtype, scale) -> bool:
    """Whether the scenario raises autograd's in-place error: a graph built, `step` taken, the graph used again."""
    x = inputs(dtype)
    y = nn.Parameter(torch.ones(4))
    loss = (one_layer if scenario == "retained graph, no param saved" else two_layers)(params, x)
    later = (params[1].detach() * y.to(dtype)).float().sum()  # saves p.detach() (which shares p's version)
    (loss * (scale or 1.0)).backward(retain_graph=True)
    step()
    try:
        if scenario == "saved p.detach()":
            later.backward()
        else:
            loss.backward()
    except RuntimeError as exc:
        if MODIFIED in str(exc):
            return True
        raise
    return False


def ours(case: str, scenario: str) -> tuple[bool, list[int]]:
    dtype, options, scale = CASES[case]
    params = make_params(dtype)
    opt = FusedAdam(params, lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2, **options)
    before = [p._version for p in params]
    raised = run_scenario(scenario, params, lambda: opt.step(grad_scale=scale), dtype, scale)
    return raised, [p._version - v for p, v in zip(params, before) if p.grad is not None]  # (the stepped ones)


def torchs(case: str, scenario: str, kind: str) -> bool:
    dtype, _, scale = CASES[case]
    params = make_params(dtype)
    opt = torch.optim.AdamW(params, lr=1e-2, **TORCH_STEPS[kind])

    def step():  # torch's recipe for a loss scale: unscale the gradients, then step
        if scale is not None:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(scale)
        opt.step()

    return run_scenario(scenario, params, step, dtype, scale)


@pytest.mark.parametrize("scenario", ["retained graph", "saved p.detach()", "retained graph, no param saved"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_graph_that_saved_a_param_raises_after_a_step_exactly_as_with_torch_adamw(backend, case, scenario):
    raised, bumps = ours(case, scenario)
    by_torch = {kind: torchs(case, scenario, kind) for kind in TORCH_STEPS}
    assert raised == by_torch["foreach"] == by_torch["for-loop"], (raised, by_torch)
    assert raised or not by_torch["fused"]  # (torch's fused kernel marks nothing: it never raises where we do not)
    assert raised == (scenario != "retained graph, no param saved")  # (the scenarios are what they say)
    assert all(b >= 1 for b in bumps), bumps  # every param's version went up with the step


def _versions(opt, params) -> dict:
    """Every tensor's version, by name: the params, their gradients and each state tensor (state['step'] too)."""
    out = {}
    for i, p in enumerate(params):
        out[f"params[{i}]"] = p._version
        out[f"params[{i}].grad"] = p.grad._version
        for key, t in opt.state[p].items():
            out[f"state[{i}][{key!r}]"] = t._version
    return out


def _set_grads(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1 * (scale or 1.0)).to(p.dtype)


@pytest.mark.parametrize("case", list(CASES) + ["fp16 moments, amsgrad"])
def test_a_step_marks_each_tensor_it_writes_and_a_skipped_step_marks_none(backend, case):
    """Through the step's cached plan (the second step, on the native backend: AdamPlan), with every state kind: the
    params, moments, masters, block scales and step counts each go up; the gradients only when written back unscaled
    (grad_scale). A step skipped by found_inf writes nothing and marks nothing."""
    if case == "fp16 moments, amsgrad":
        dtype, options, scale = torch.float32, dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16,
                                                    amsgrad=True), None
    else:
        dtype, options, scale = CASES[case]
    params = make_params(dtype)
    opt = FusedAdam(params, lr=1e-2, **options)
    for step in range(2):
        _set_grads(params, scale, step)
        before = _versions(opt, params)
        opt.step(grad_scale=scale)
        after = _versions(opt, params)
        unmarked = sorted(k for k in after if k in before and after[k] <= before[k] and not k.endswith(".grad"))
        assert not unmarked, f"step {step}: not marked {unmarked}"
        grads = {k: after[k] > before[k] for k in after if k.endswith(".grad")}
        assert all(v == (scale is not None) for v in grads.values()), grads
    _set_grads(params, scale, 2)
    before = _versions(opt, params)
    opt.step(grad_scale=scale, found_inf=torch.ones(1))
    assert _versions(opt, params) == before


def test_the_op_marks_what_it_writes_on_every_backend(backend):
    """backends.adam_step_ (the op itself, outside FusedAdam's plans: step_in_backward's first update, torch.compile,
    DTensor buckets), fp16 params with masters and a loss scale: params, masters, moments, steps and, unscaled,
    the gradients."""
    torch.manual_seed(0)
    params = [torch.randn(300, dtype=torch.float16), torch.randn(7, 5, dtype=torch.float16)]
    grads = [torch.randn(p.shape, dtype=torch.float16) for p in params]
    masters = [p.float() for p in params]
    moments = [torch.zeros(p.shape) for p in params], [torch.zeros(p.shape) for p in params]
    steps = torch.zeros(2, dtype=torch.float64)
    written = [*params, *grads, *masters, *moments[0], *moments[1], steps]
    before = [t._version for t in written]
    backends.adam_step_(params, grads, *moments, [], masters, [], [], [], steps, lr=1e-2, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.0, adam_w_mode=int(AdamWMode.ADAMW_TORCH), bias_correction=True,
                        maximize=False, inv_grad_scale=torch.full((1,), 0.5), grad_scale=torch.full((1,), 2.0))
    assert all(t._version > v for t, v in zip(written, before)), [t._version - v for t, v in zip(written, before)]
    assert steps.tolist() == [1.0, 1.0]


def test_step_in_backward_marks_the_param_and_its_states(backend):
    """The hooks' updates (the first through the op, later ones through each param's plan on the native backend)
    mark the param and its states, as step() does."""
    params = make_params(torch.float32)
    opt = FusedAdam(params, lr=1e-2, step_in_backward=True)
    x = inputs(torch.float32)
    for step in range(3):
        states = {k: t._version for i, p in enumerate(params) for k, t in
                  ((f"{i}.{key}", t) for key, t in opt.state[p].items())}
        versions = [p._version for p in params]
        two_layers(params, x).backward()
        assert all(p._version > v for p, v in zip(params, versions)), step
        assert all(t._version > states[f"{i}.{key}"] for i, p in enumerate(params)
                   for key, t in opt.state[p].items() if f"{i}.{key}" in states), step
        assert all(opt.state[p]["step"] == step + 1 for p in params)


def test_tensors_without_a_version_counter_are_stepped_unmarked(backend):
    """State loaded under torch.inference_mode() (inference tensors have no version counter: marking them would
    raise): the step runs as before and marks the params."""
    params = make_params(torch.float32)
    opt = FusedAdam(params, lr=1e-2)
    _set_grads(params, None, 0)
    opt.step()
    sd = opt.state_dict()
    with torch.inference_mode():
        opt.load_state_dict(sd)
    assert all(t.is_inference() for p in params for t in opt.state[p].values())
    _set_grads(params, None, 1)
    versions = [p._version for p in params]
    opt.step()
    assert all(p._version > v for p, v in zip(params, versions))
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)


@pytest.mark.parametrize("inner", ["FusedAdam", "FusedAdam with masters", "AdamW"])
def test_fp16_optimizer_steps_mark_the_fp16_params(inner):
    """FP16_Optimizer writes the fp16 params from the masters with torch ops, or lets its FusedAdam write them: either
    way a retained graph that saved a param raises after its step, as with torch's AdamW."""
    params = make_params(torch.float16)
    make = {"FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2),
            "FusedAdam with masters": lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True),
            "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[inner]
    opt = FP16_Optimizer(make(params), init_scale=SCALE)
    x = inputs(torch.float16)
    loss = two_layers(params, x)
    opt.backward(loss, retain_graph=True)
    versions = [p._version for p in params]
    opt.step()
    assert not opt.overflow
    assert all(p._version > v for p, v in zip(params, versions))
    with pytest.raises(RuntimeError, match=MODIFIED):
        loss.backward()
