"""What ``p.grad`` holds after a scaled step (issue 11, traps.md #21), as a specification.

* After a TAKEN step with ``grad_scale`` (given to step(), or by torch.amp.GradScaler's protocol), ``p.grad`` holds
  ``g / grad_scale``: a float32 division (float64 for float64 grads) rounded to the gradient's own dtype, neither
  negated for ``maximize`` nor clipped by ``max_grad_norm``: what torch's fused AdamW leaves there (checked against it
  with GradScaler, bit for bit).
* After a SKIPPED step (found_inf, or inf/NaN gradients) ``p.grad`` keeps the scaled values, as torch's fused kernel
  returns early.
* Without ``grad_scale``, ``p.grad`` is never written (``max_grad_norm`` alone does not write the clipped gradients
  back, unlike ``torch.nn.utils.clip_grad_norm_``).

Every backend: the native op and plans, the reference, and (``ORT_OPTIM_BACKEND=triton TRITON_INTERPRET=1``) the Triton
kernels; the write happens inside the fused kernels.
"""

from __future__ import annotations

import pytest
import torch
from conftest import BACKENDS, assert_bitwise_equal, assert_same_snapshot, optimizer_snapshot, select_backend

from ort_optim import AdamWMode, FusedAdam
from ort_optim._spec import QUANT_BLOCK

# param dtype, grad dtype, master weights
GRAD_CASES = {
    "fp32": (torch.float32, torch.float32, False),
    "fp16-master": (torch.float16, torch.float16, True),
    "fp16-no-master": (torch.float16, torch.float16, False),
    "bf16-master": (torch.bfloat16, torch.bfloat16, True),
    "fp64": (torch.float64, torch.float64, False),
}
# shapes that exercise every path: a full and a partial 1024-block, 0-dim, empty, and a non-contiguous grad
SHAPES = [(QUANT_BLOCK + 7,), (), (0,), (6, 5)]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in SHAPES]


def _scaled_grads(params, grad_dtype, scale, step):
    """Gradients times scale, in grad_dtype; the 2-D one non-contiguous (a transposed view)."""
    g = torch.Generator().manual_seed(100 + step)
    grads = []
    for p in params:
        values = (torch.randn(p.shape, generator=g, dtype=torch.float64) * scale).to(grad_dtype)
        if p.dim() == 2:
            values = values.t().contiguous().t()
            assert not values.is_contiguous()
        grads.append(values)
    return grads


def _unscaled(g: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's fused AdamW: grad / grad_scale in the compute dtype (float32, float64 for float64), then rounded."""
    compute = torch.float64 if g.dtype == torch.float64 else torch.float32
    return (g.to(compute) / torch.tensor(scale, dtype=torch.float32).to(compute)).to(g.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_grad_norm", [None, 0.1], ids=["no-clip", "clip"])
@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("scale", [1024.0, 3.0], ids=["power-of-two", "three"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_a_taken_step_leaves_the_unscaled_gradient_in_p_grad(case, scale, maximize, max_grad_norm, backend,
                                                              monkeypatch):
    """Three steps (the second and third go through the native plans where there are any); after each, p.grad is
    g / scale bit for bit, in its own dtype and layout, whatever maximize and max_grad_norm."""
    select_backend(monkeypatch, backend)
    param_dtype, grad_dtype, master = GRAD_CASES[case]
    params = _params(param_dtype)
    opt = FusedAdam(params, lr=1e-3, master_weights=master, maximize=maximize, max_grad_norm=max_grad_norm)
    for step in range(3):
        grads = _scaled_grads(params, grad_dtype, scale, step)
        for p, g in zip(params, grads):
            p.grad = g.clone() if g.is_contiguous() else g.t().clone().t()
        objects = [p.grad for p in params]
        opt.step(grad_scale=torch.tensor(scale) if step % 2 else scale)
        assert not opt.last_step_skipped
        for i, (p, g) in enumerate(zip(params, grads)):
            assert p.grad is objects[i], "written in place: the same tensor"
            assert p.grad.stride() == g.stride()
            assert_bitwise_equal(p.grad, _unscaled(g, scale), f"step {step} grad {i}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("why", ["found_inf", "inf-grad", "nan-grad"])
def test_a_skipped_step_leaves_p_grad_scaled(why, backend, monkeypatch):
    """Two buckets (fp32 and fp16 params in one group) so that the skip is decided before either is written."""
    select_backend(monkeypatch, backend)
    params = _params(torch.float32) + _params(torch.float16, seed=1)
    opt = FusedAdam(params, lr=1e-3, master_weights=True)
    for step in range(2):
        for p, g in zip(params, _scaled_grads(params[:4], torch.float32, 64.0, step) +
                        _scaled_grads(params[4:], torch.float16, 64.0, step)):
            p.grad = g
        opt.step(grad_scale=64.0)
    for p, g in zip(params, _scaled_grads(params[:4], torch.float32, 64.0, 9) +
                    _scaled_grads(params[4:], torch.float16, 64.0, 9)):
        p.grad = g
    found_inf = None
    if why == "found_inf":
        found_inf = torch.ones(1)
    else:
        params[4].grad[3] = float("inf") if why == "inf-grad" else float("nan")
    before = optimizer_snapshot(opt)  # includes every p.grad
    opt.step(grad_scale=64.0, found_inf=found_inf)
    assert opt.last_step_skipped
    assert_same_snapshot(before, optimizer_snapshot(opt))


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_grad_scale_p_grad_is_never_written_not_even_clipped(backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params = _params(torch.float32)
    opt = FusedAdam(params, lr=1e-3, max_grad_norm=1e-3)
    for step in range(2):
        grads = _scaled_grads(params, torch.float32, 1.0, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, g in zip(params, grads):
            assert_bitwise_equal(p.grad, g, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_expanded_gradient_cannot_be_unscaled_in_place_and_is_refused_before_anything_changes(backend,
                                                                                                  monkeypatch):
    select_backend(monkeypatch, backend)
    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], lr=1e-3)
    p.grad = torch.ones(4)
    opt.step(grad_scale=2.0)
    p.grad = torch.full((1,), 8.0).expand(4)
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] .*'s grad overlaps itself \(an "
                                         r"expand\(\)ed tensor\), so it cannot be unscaled in place"):
        opt.step(grad_scale=2.0)
    assert_same_snapshot(before, optimizer_snapshot(opt))
    opt.step()  # without a scale it is only read: fine
    assert p.grad.tolist() == [8.0] * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_expanded_gradient_in_a_later_bucket_is_refused_before_the_first_bucket_writes(backend, monkeypatch):
    """Two buckets (fp32 and bf16 params): the bf16 param's expanded gradient is found before the fp32 bucket steps."""
    select_backend(monkeypatch, backend)
    first = torch.nn.Parameter(torch.randn(4))
    second = torch.nn.Parameter(torch.randn(4).bfloat16())
    opt = FusedAdam([first, second], lr=1e-3, master_weights=True)
    first.grad, second.grad = torch.ones(4), torch.ones(4, dtype=torch.bfloat16)
    opt.step(grad_scale=2.0)
    first.grad, second.grad = torch.ones(4), torch.full((1,), 8.0, dtype=torch.bfloat16).expand(4)
    before = optimizer_snapshot(opt)
    grads_before = [first.grad.clone(), second.grad.clone()]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] .*'s grad overlaps itself"):
        opt.step(grad_scale=2.0)
    assert_same_snapshot(before, optimizer_snapshot(opt))
    assert torch.equal(first.grad, grads_before[0]) and torch.equal(second.grad, grads_before[1])


# ---- against torch's fused AdamW under torch.amp.GradScaler -------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_grad_scaler_leaves_p_grad_exactly_as_with_torchs_fused_adamw(dtype, maximize, backend, monkeypatch):
    """The same GradScaler protocol drives torch.optim.AdamW(fused=True) and FusedAdam over identical params and
    gradients (backward of a scaled loss): after taken steps both leave the same bits in p.grad, after the skipped
    step (an inf injected into one gradient) both leave the scaled gradient untouched."""
    select_backend(monkeypatch, backend)
    torch.manual_seed(0)
    ours_model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).to(dtype)
    torch_model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).to(dtype)
    torch_model.load_state_dict(ours_model.state_dict())
    ours = FusedAdam(ours_model.parameters(), lr=1e-3, maximize=maximize, eps=1e-8, weight_decay=1e-2,
                     adam_w_mode=AdamWMode.ADAMW_TORCH)
    theirs = torch.optim.AdamW(torch_model.parameters(), lr=1e-3, maximize=maximize, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(16, 8, generator=gen).to(dtype)
        inject = step == 3
        scaled = []
        for model, opt, scaler in ((ours_model, ours, scalers[0]), (torch_model, theirs, scalers[1])):
            opt.zero_grad()
            scaler.scale(model(x).float().square().mean()).backward()
            if inject:
                model[0].weight.grad[0, 0] = float("inf")
            # identical gradients to start from: torch's own, copied into ours
            scaled.append([p.grad.clone() for p in model.parameters()])
        for p, g in zip(ours_model.parameters(), scaled[1]):
            p.grad.copy_(g)
        for opt, scaler in ((ours, scalers[0]), (theirs, scalers[1])):
            scaler.step(opt)
            scaler.update()
        assert ours.last_step_skipped == inject
        assert scalers[0].get_scale() == scalers[1].get_scale()
        for i, (a, b) in enumerate(zip(ours_model.parameters(), torch_model.parameters())):
            assert a.grad.dtype == b.grad.dtype == dtype
            assert_bitwise_equal(a.grad, b.grad, f"step {step}: p.grad {i}")
            if inject:
                assert_bitwise_equal(a.grad, scaled[1][i], f"step {step}: p.grad {i} stays scaled")
