"""Loss scaling, clipping and what a step reports, as a specification.

What ``p.grad`` holds after a scaled step:

* After a TAKEN step with ``grad_scale`` (given to step(), or by torch.amp.GradScaler's protocol), ``p.grad`` holds
  ``g / grad_scale``: a float32 division (float64 for float64 grads) rounded to the gradient's own dtype, neither
  negated for ``maximize`` nor clipped by ``max_grad_norm``: what torch's fused AdamW leaves there (checked against it
  with GradScaler, bit for bit).
* After a SKIPPED step (found_inf, or inf/NaN gradients) ``p.grad`` keeps the scaled values, as torch's fused kernel
  returns early.
* Without ``grad_scale``, ``p.grad`` is never written (``max_grad_norm`` alone does not write the clipped gradients
  back, unlike ``torch.nn.utils.clip_grad_norm_``).

``last_grad_norm`` and ``last_found_inf``:

* ``last_grad_norm`` is ``torch.nn.utils.clip_grad_norm_``'s total norm (2-norm, before clipping) of the unscaled
  gradients, a 0-dim float32 tensor on the params' device; with ``max_grad_norm`` the steps follow
  ``clip_grad_norm_`` then ``torch.optim.AdamW``; torch.amp.GradScaler's recipe gives the same norms and skips; an
  inf/NaN gradient sets ``last_found_inf`` to 1 and changes nothing.
* With a caller's ``found_inf`` and no ``grad_scale`` (GradScaler after ``scaler.unscale_(optimizer)``: torch's recipe
  for clipping under AMP; apex-style overflow buffers): ``last_found_inf`` is a float32 [1] of the optimizer's own,
  1.0/0.0, on the params' device (not the caller's buffer, which it may zero for the next iteration), and
  ``last_grad_norm`` the norm of the gradients the update pass read (NaN for a step that found_inf skipped: that pass
  reads nothing). A step without any gradient reports 0.0, as ``clip_grad_norm_`` does for no gradients.
* With ``step_in_backward``, both stay None for updates made in backward; a step() after backward calls that all ran
  inside ``accumulate()`` is a normal step and reports the norm; one that finishes updates made in backward reports
  None (never a stale or partial norm).

Every backend: the native op and plans, the reference, and (``ORT_OPTIM_BACKEND=triton TRITON_INTERPRET=1``) the Triton
kernels; the write happens inside the fused kernels. Tolerances against torch.optim.AdamW (fp32, ADAMW_TORCH): rtol
1e-5, atol 1e-6 over the run; norms rtol 1e-6.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import pytest
import torch
from conftest import (BACKENDS, assert_bitwise_equal, assert_same_snapshot, assert_tree_bitwise_equal,
                      optimizer_snapshot, select_backend)
from cases import decay_groups, LM_STEPS, lm_tokens, LMCase, Tiny, tiny_loss, TinyLM, train_lm

from ort_optim import AdamWMode, FusedAdam, GradientError, backends
from ort_optim import fused_adam as fused_adam_module
from ort_optim._spec import QUANT_BLOCK

# (a step inside a compiled function is traced from torch 2.13 on; before, it runs eagerly)
_COMPILES_THE_STEP = fused_adam_module._TRACED_STEP and backends.native_available()

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


@pytest.mark.parametrize("scale", [0.0, -0.0, math.inf, -math.inf, math.nan])
def test_a_grad_scale_tensor_that_is_zero_or_not_finite_skips_where_nothing_reads_it(scale):
    """On an accelerator no host code reads a grad_scale tensor (that would synchronise with the device): the skip
    decision itself skips the step for a scale of 0, inf or NaN (inf alone would multiply every gradient by 0 and step
    on momentum and decay alone). On the CPU the op refuses such a scale before it reads the skip flag (the tests of
    step()'s arguments)."""
    stats = torch.tensor([4.0, 0.0])
    for clip in (None, 1.0):
        _, _, skip = backends.scaling(stats, torch.tensor(scale), clip, None)
        assert skip.tolist() == [1.0], (scale, clip)
    _, _, skip = backends.scaling(stats, torch.tensor(2.0), None, None)
    assert skip.tolist() == [0.0]
    # a valid scale whose clip coefficient rounds to 0 (a tiny max_grad_norm, a large norm) is stepped, as without one
    for scale in (None, torch.tensor(2.0)):
        multiplier, _, skip = backends.scaling(torch.tensor([1e36, 0.0]), scale, 1e-30, None)
        assert float(multiplier) == 0.0 and skip.tolist() == [0.0], scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("when", ["first step", "later step"])
def test_an_expanded_gradient_cannot_be_unscaled_in_place_and_is_refused_before_anything_changes(when, backend,
                                                                                                  monkeypatch):
    """Refused before anything changes, the first step's state creation included (its plan refuses it)."""
    select_backend(monkeypatch, backend)
    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], lr=1e-3)
    if when == "later step":
        p.grad = torch.ones(4)
        opt.step(grad_scale=2.0)
    p.grad = torch.full((1,), 8.0).expand(4)
    before = optimizer_snapshot(opt, report=True)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] .*'s grad overlaps itself \(an "
                                         r"expand\(\)ed tensor\), so it cannot be unscaled in place"):
        opt.step(grad_scale=2.0)
    assert_same_snapshot(before, optimizer_snapshot(opt, report=True))
    assert bool(opt.state.get(p)) == (when == "later step")
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


def _param_with_grad_in_its_memory(alias: str) -> torch.nn.Parameter:
    """A param of 6 elements whose gradient shares memory with it: the param itself, a view of all of it, a view of
    one buffer over part of the param's elements (the param is buffer[:6], its gradient buffer[3:9]), or a tensor of
    another storage over the param's memory (made through numpy: what counts is the memory, not torch's storage)."""
    torch.manual_seed(0)
    if alias == "another storage":
        p = torch.nn.Parameter(torch.randn(6))
        p.grad = torch.from_numpy(p.detach().numpy())
        return p
    if alias == "part of it":
        buffer = torch.randn(9)
        p = torch.nn.Parameter(buffer[:6])
        p.grad = buffer[3:9]
        return p
    p = torch.nn.Parameter(torch.randn(6))
    p.grad = p.detach() if alias == "itself" else p.detach().view(2, 3).view(6)
    return p


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [1, 2], ids=["one group", "behind another group"])
@pytest.mark.parametrize("when", ["first step", "later step"])
@pytest.mark.parametrize("alias", ["itself", "a view", "part of it", "another storage"])
def test_a_gradient_in_its_params_memory_cannot_be_unscaled_in_place_and_is_refused_before_anything_changes(
        alias, when, groups, backend, monkeypatch):
    """``p.grad = p.detach()`` (or a view sharing some of the param's elements) with grad_scale: the param cannot hold
    both its update and the unscaled gradient that the step leaves in p.grad (torch's fused AdamW writes both, one
    over the other, on the CPU and on CUDA in opposite orders; torch.amp.GradScaler's unscale_ divides the param
    itself): refused naming the param, before anything changes, the first step's state creation included, and behind
    another param group's params too (each group a bucket of its own: none may write before the refusal)."""
    select_backend(monkeypatch, backend)
    p = _param_with_grad_in_its_memory(alias)
    aliased = p.grad
    other = torch.nn.Parameter(torch.randn(5))
    opt = FusedAdam([p] if groups == 1 else [{"params": [other]}, {"params": [p], "weight_decay": 0.1}], lr=1e-3)
    if when == "later step":
        p.grad, other.grad = torch.ones(6), torch.ones(5)
        opt.step(grad_scale=2.0)
        p.grad = aliased
    other.grad = torch.ones(5)
    before = optimizer_snapshot(opt, report=True)
    for scale in (2.0, torch.tensor(2.0)):
        with pytest.raises(GradientError, match=rf"param_groups\[{groups - 1}\]\['params'\]\[0\] .*'s grad shares "
                                                r"memory with the param itself .* give the gradient its own memory"):
            opt.step(grad_scale=scale)
        assert_same_snapshot(before, optimizer_snapshot(opt, report=True))
        assert bool(opt.state.get(p)) == (when == "later step")
    p.grad = aliased.clone()
    opt.step(grad_scale=2.0)  # its own memory: stepped


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_a_gradient_beside_its_param_in_one_buffer_shares_no_memory_with_it_and_is_unscaled_in_place(layout, backend,
                                                                                                     monkeypatch):
    """Memory is shared where the bytes the elements reach meet, not where they merely border: a gradient that ends
    where its param begins in one buffer (buffer[0:3] beside buffer[3:6]; strided, buffer[0:5:2], whose last element
    is buffer[4], beside buffer[5:8]) steps with grad_scale as a gradient of its own memory does, unscaled in place."""
    select_backend(monkeypatch, backend)
    torch.manual_seed(0)
    buffer = torch.randn(8)
    p = torch.nn.Parameter(buffer[5:8] if layout == "strided" else buffer[3:6])
    p.grad = buffer[0:5:2] if layout == "strided" else buffer[0:3]
    twin = torch.nn.Parameter(p.detach().clone())
    twin.grad = p.grad.clone()
    opt, twin_opt = FusedAdam([p], lr=1e-2), FusedAdam([twin], lr=1e-2)
    opt.step(grad_scale=2.0)
    twin_opt.step(grad_scale=2.0)
    assert_bitwise_equal(p.detach(), twin.detach())
    assert_bitwise_equal(p.grad, twin.grad)  # (unscaled in place)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["plain", "max_grad_norm", "found_inf"])
@pytest.mark.parametrize("alias", ["itself", "part of it"])
def test_without_grad_scale_a_gradient_in_its_params_memory_is_read_before_the_param_is_written(alias, how, backend,
                                                                                               monkeypatch):
    """Without grad_scale nothing is written into p.grad: such a gradient steps as torch.optim.AdamW steps a copy of
    it (after clip_grad_norm_ with max_grad_norm), the values before the step."""
    select_backend(monkeypatch, backend)
    p = _param_with_grad_in_its_memory(alias)
    ref = torch.nn.Parameter(p.detach().clone())
    ref.grad = p.grad.clone()
    opt = FusedAdam([p], lr=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8,
                    max_grad_norm=0.5 if how == "max_grad_norm" else None)
    if how == "max_grad_norm":
        torch.nn.utils.clip_grad_norm_([ref], 0.5)
    opt.step(**({"found_inf": torch.zeros(1)} if how == "found_inf" else {}))
    torch.optim.AdamW([ref], lr=0.1, eps=1e-8, weight_decay=0.0).step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.no_interpreter  # (meta params step through the native op's fake kernel, not Triton's interpreter)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("when", ["first step", "later step", "compiled first step"])
@pytest.mark.parametrize("how", ["max_grad_norm", "grad_scale", "grad_scale tensor"])
def test_a_meta_param_beside_a_cpu_param_is_refused_with_a_global_norm_before_anything_changes(how, when, backend,
                                                                                             monkeypatch):
    """grad_scale and max_grad_norm take one norm and one inf/NaN check over every gradient, which a meta param (no
    values) cannot join beside a CPU param (torch.nn.utils.clip_grad_norm_ fails there too, copying out of the meta
    tensor): refused naming both params, before anything changes: no state is made on a first step, none changed on
    a later one (the plan kept from a plain step included), param_groups as they were. A plain step takes them."""
    if when == "compiled first step" and (backend != "native" or not _COMPILES_THE_STEP):
        pytest.skip("the traced step runs on the native library's op, on torch >= 2.13")
    select_backend(monkeypatch, backend)
    torch.manual_seed(0)
    cpu, meta = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.empty(4, device="meta"))
    cpu.grad, meta.grad = torch.ones(4), torch.empty(4, device="meta")
    opt = FusedAdam([{"params": [cpu]}, {"params": [meta]}], lr=1e-2)
    if when == "later step":
        opt.step()
    opt.max_grad_norm = 1.0 if how == "max_grad_norm" else None
    scale = {"max_grad_norm": {}, "grad_scale": {"grad_scale": 2.0},
             "grad_scale tensor": {"grad_scale": torch.tensor(2.0)}}[how]
    before = [cpu.detach().clone(), cpu.grad.clone(), opt.last_grad_norm, opt.last_found_inf]
    saved = opt.state_dict()
    groups = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    step = (lambda: opt.step(**scale))
    if when == "compiled first step":
        torch._dynamo.reset()
        step = torch.compile(step)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .* is on the meta device and "
                                         r"param_groups\[0\]\['params'\]\[0\] .* on cpu: a step with grad_scale or "
                                         r"max_grad_norm .* set max_grad_norm=None and step without grad_scale"):
        step()
    assert_tree_bitwise_equal(before, [cpu.detach(), cpu.grad, opt.last_grad_norm, opt.last_found_inf])
    assert_tree_bitwise_equal(saved, opt.state_dict())
    assert groups == [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    assert len(opt.state) == (0 if when.endswith("first step") else 2)
    opt.max_grad_norm = None
    opt.step()  # a plain step takes them


@pytest.mark.no_interpreter  # (meta params step through the native op's fake kernel, not Triton's interpreter)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["max_grad_norm", "grad_scale"])
def test_a_global_norm_leaves_out_a_meta_param_without_a_gradient_and_takes_params_all_on_the_meta_device(
        how, backend, monkeypatch):
    """Only the params a step updates join its norm: a meta param without a gradient beside a CPU param with one is
    no refusal (the step updates the CPU param, as without the meta one), and neither are meta params alone (their
    gradients share no memory with them, having none: nothing is read or written)."""
    select_backend(monkeypatch, backend)
    scale = {"grad_scale": 2.0} if how == "grad_scale" else {}
    torch.manual_seed(0)
    cpu, meta = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.empty(4, device="meta"))
    twin = torch.nn.Parameter(cpu.detach().clone())
    cpu.grad, twin.grad = torch.ones(4), torch.ones(4)
    options = {"lr": 1e-2, "max_grad_norm": 1.0 if how == "max_grad_norm" else None}
    FusedAdam([{"params": [cpu]}, {"params": [meta]}], **options).step(**scale)
    FusedAdam([twin], **options).step(**scale)
    assert_bitwise_equal(cpu.detach(), twin.detach())
    metas = [torch.nn.Parameter(torch.empty(4, device="meta")) for _ in range(2)]
    for p in metas:
        p.grad = torch.empty(4, device="meta")
    opt = FusedAdam([{"params": metas[:1]}, {"params": metas[1:]}], **options)
    opt.step(**scale)
    assert all(opt.state[p]["exp_avg"].is_meta for p in metas)


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


# ---- last_grad_norm and last_found_inf -------------------------------------------------------------------------------


# ---- 2. step_in_backward on real models -----------------------------------------------------------------------------


# ---- 4. last_grad_norm and last_found_inf ---------------------------------------------------------------------------

def _torch_twin(model: TinyLM):
    twin = copy.deepcopy(model)
    return twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, foreach=False)


@pytest.mark.no_interpreter
def test_max_grad_norm_steps_follow_clip_grad_norm_then_adamw_and_last_grad_norm_is_its_total_norm():
    model = TinyLM()
    twin, adamw = _torch_twin(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH,
                    max_grad_norm=7.0)
    clipped, norms, totals = 0, [], []
    for step in range(LM_STEPS):  # (the branch has no gradient on odd steps: norms over the gradients that exist)
        model(lm_tokens(step), step).backward()
        twin(lm_tokens(step), step).backward()
        total = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm=7.0)
        clipped += bool(total > 7.0)
        opt.step()
        adamw.step()
        norm = opt.last_grad_norm
        assert norm.shape == () and norm.dtype == torch.float32 and norm.device == model.hidden.weight.device
        norms.append(norm)  # (logged as is: a later step must not overwrite it)
        totals.append(total)
        assert float(opt.last_found_inf) == 0 and not opt.last_step_skipped
        opt.zero_grad()
        adamw.zero_grad()
    torch.testing.assert_close(torch.stack(norms), torch.stack(totals), rtol=1e-6, atol=0)
    assert 0 < clipped < LM_STEPS  # both regimes were exercised
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.no_interpreter
def test_with_torch_amp_gradscaler_the_norm_is_of_the_unscaled_gradients_and_an_overflow_skips():
    """torch's recipe (scale, backward, unscale_, clip_grad_norm_, step, update) against FusedAdam(max_grad_norm)
    stepped by the same GradScaler protocol: the same norms, the same skipped iteration (an inf injected into one
    gradient), the same scale afterwards, and the same params."""
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler is not in this torch")
    model = TinyLM()
    twin, adamw = _torch_twin(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH,
                    max_grad_norm=1.0)
    ours, theirs = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3) for _ in range(2))
    for step in range(8):
        ours.scale(model(lm_tokens(step), step)).backward()
        theirs.scale(twin(lm_tokens(step), step)).backward()
        if step == 4:
            model.hidden.weight.grad[0, 0] = float("inf")
            twin.hidden.weight.grad[0, 0] = float("inf")
        before = optimizer_snapshot(opt)
        theirs.unscale_(adamw)
        total = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm=1.0)
        ours.step(opt)
        theirs.step(adamw)
        if step == 4:
            assert float(opt.last_found_inf) == 1 and opt.last_step_skipped and not torch.isfinite(opt.last_grad_norm)
            after = optimizer_snapshot(opt)
            for key in before:
                if not key.endswith(".grad"):
                    assert_same_snapshot({key: before[key]}, {key: after[key]})
        else:
            assert float(opt.last_found_inf) == 0
            torch.testing.assert_close(opt.last_grad_norm, total, rtol=1e-6, atol=0)
        ours.update()
        theirs.update()
        assert ours.get_scale() == theirs.get_scale()
        opt.zero_grad()
        adamw.zero_grad()
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.no_interpreter
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("how", ["max_grad_norm", "grad_scale"])
def test_an_inf_or_nan_gradient_sets_last_found_inf_and_changes_nothing(bad, how):
    model = TinyLM(torch.bfloat16)
    opt = FusedAdam(decay_groups(model), lr=1e-2, master_weights=True,
                    max_grad_norm=1.0 if how == "max_grad_norm" else None)
    kwargs = dict(grad_scale=4.0) if how == "grad_scale" else {}
    for step in range(3):
        model(lm_tokens(step), step).backward()
        opt.step(**kwargs)
        assert float(opt.last_found_inf) == 0
        opt.zero_grad()
    model(lm_tokens(3), 3).backward()
    model.norm.bias.grad[1] = bad
    before = optimizer_snapshot(opt)
    opt.step(**kwargs)
    assert opt.last_found_inf.shape == (1,) and float(opt.last_found_inf) == 1 and opt.last_step_skipped
    assert not torch.isfinite(opt.last_grad_norm)
    assert_same_snapshot(before, optimizer_snapshot(opt))  # params, masters, moments, steps and gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad,scale,skipped", [(3e19, 1.0, True), (1.5e19, 0.5, False), (1e19, 0.01, False),
                                                (1e37, 0.01, True), (1e18, 1.0, False)],
                         ids=["3e19-at-1", "1.5e19-at-0.5", "1e19-at-0.01", "1e37-at-0.01", "1e18-at-1"])
def test_the_skip_follows_the_scaled_float32_sum_of_squares_then_the_unscaled_norm(grad, scale, skipped, backend,
                                                                                  monkeypatch):
    """guides/fused-adam.md: the gradients' sum of squares is taken in float32 as given (it overflows above a norm
    of about 1.8e19), then the norm is unscaled (a scale below 1 can overflow it): either not finite skips."""
    select_backend(monkeypatch, backend)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = FusedAdam([p], lr=1e-3)
    p.grad = torch.ones(4)
    opt.step()  # (a state to keep)
    p.grad = torch.tensor([grad, 0.0, 0.0, 0.0])
    before = optimizer_snapshot(opt)
    opt.step(grad_scale=scale)
    assert opt.last_step_skipped is skipped
    assert bool(torch.isfinite(opt.last_grad_norm)) is not skipped
    if skipped:
        assert_same_snapshot(before, optimizer_snapshot(opt))
    else:
        torch.testing.assert_close(opt.last_grad_norm, torch.tensor(grad / scale), rtol=1e-6, atol=0)


@pytest.mark.no_interpreter
def test_updates_made_in_backward_leave_the_telemetry_none_as_documented():
    """No pass reads every gradient when each param is updated from its own hook: last_grad_norm and last_found_inf
    stay None (guides/fused-adam.md says so), rather than describing a step() that updated nothing."""
    _, opt = train_lm(LMCase(), step_in_backward=True, steps=2)
    assert opt.last_grad_norm is None and opt.last_found_inf is None
    guide = " ".join((Path(__file__).resolve().parents[2] / "guides" / "fused-adam.md").read_text().split())
    assert "`last_grad_norm` and `last_found_inf` stay None for updates made in backward" in guide


# ---- with a caller's found_inf, with step_in_backward, without gradients ---------------------------------------------


# ---- 4. found_inf without grad_scale ----------------------------------------------------------------------------------

@pytest.mark.no_interpreter
@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="torch.amp.GradScaler is not in this torch")
def test_gradscaler_with_unscale_reports_the_norm_the_step_read_and_nan_for_a_skipped_step(backend):
    """torch's AMP clipping recipe: scale, backward, ``scaler.unscale_(opt)``, ``clip_grad_norm_``, ``scaler.step``.
    GradScaler then hands the step found_inf alone (the gradients are unscaled already). The update pass reads them:
    last_grad_norm is their norm (clip_grad_norm_'s total where it did not clip, max_norm where it did),
    last_found_inf 0.0; an overflow skips the step with last_found_inf 1.0, last_grad_norm NaN and nothing changed.
    The pure-PyTorch backend reports no plain-step norm (None), as for any plain step."""
    model = Tiny()
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    max_norms = [1e9, 1e9, 0.5, 1e9, 0.5]
    for step, max_norm in enumerate(max_norms):
        scaler.scale(tiny_loss(model, step)).backward()
        if step == 3:
            model.a.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        before = optimizer_snapshot(opt)
        scaler.step(opt)
        scaler.update()
        flag = opt.last_found_inf
        assert flag is not None and flag.shape == (1,) and flag.dtype == torch.float32
        if step == 3:
            assert float(flag) == 1 and opt.last_step_skipped
            assert_same_snapshot(before, optimizer_snapshot(opt))
            assert backend == "torch" or torch.isnan(opt.last_grad_norm)
        else:
            assert float(flag) == 0 and not opt.last_step_skipped
            if backend == "torch":
                assert opt.last_grad_norm is None
            else:
                norm = opt.last_grad_norm
                assert norm.shape == () and norm.dtype == torch.float32
                torch.testing.assert_close(norm, torch.clamp(total, max=max_norm), rtol=1e-5, atol=0)
        opt.zero_grad()


@pytest.mark.no_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool], ids=str)
def test_last_found_inf_is_a_float32_flag_of_its_own_not_the_callers_found_inf(dtype, backend):
    """apex's pattern: one overflow buffer, written by the overflow check, read by the step, zeroed before the next
    iteration. last_found_inf is this step's verdict as the docstring says (float32, shape [1], params' device),
    and keeps it after the caller zeroes or reuses the buffer."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = FusedAdam([p], lr=0.1)
    overflow = torch.zeros((), dtype=dtype)
    verdicts = []
    for step, value in enumerate([1, 0, 1, 0]):
        p.grad = torch.full_like(p, 0.5)
        overflow.fill_(value)
        opt.step(found_inf=overflow)
        flag = opt.last_found_inf
        assert flag is not overflow and flag.dtype == torch.float32 and flag.shape == (1,) and flag.device == p.device
        assert opt.last_step_skipped == bool(value)
        verdicts.append(flag)
        overflow.zero_()  # (the next iteration's buffer)
        assert float(flag) == value, step
    assert [float(f) for f in verdicts] == [1.0, 0.0, 1.0, 0.0]
    assert int(opt.state[p]["step"]) == 2


# ---- 4. last_grad_norm with step_in_backward ------------------------------------------------------------------------

@pytest.mark.no_interpreter
def test_with_step_in_backward_a_step_after_accumulate_reports_the_norm_and_one_after_updates_in_backward_none(
        backend):
    """Every micro-batch's backward inside accumulate(): step() is a normal step over every gradient (bit for bit the
    optimizer without step_in_backward's), and reports the same last_grad_norm (clip_grad_norm_'s total). An
    iteration whose last backward updates the params in backward leaves it None again: never the previous
    iteration's norm, never the norm of the few params step() finished."""
    models = [Tiny(), Tiny()]
    opts = [FusedAdam(m.parameters(), lr=1e-2, step_in_backward=in_backward) for m, in_backward in
            zip(models, (False, True))]
    for iteration in range(4):
        accumulate_all = iteration % 2 == 0
        for micro in range(2):
            for model, opt in zip(models, opts):
                outside = micro == 1 and not accumulate_all
                with opt.accumulate() if not outside else contextlib.nullcontext():
                    tiny_loss(model, 2 * iteration + micro).backward()
        total = (torch.nn.utils.get_total_norm if hasattr(torch.nn.utils, "get_total_norm") else
                 lambda grads: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))(
            [p.grad for p in models[0].parameters()])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_same_snapshot(optimizer_snapshot(opts[0]), optimizer_snapshot(opts[1]))
        reference, in_backward = (opt.last_grad_norm for opt in opts)
        if backend == "torch":
            assert reference is None and in_backward is None
        elif accumulate_all:
            assert torch.equal(in_backward, reference), iteration
            torch.testing.assert_close(in_backward, total, rtol=1e-6, atol=0)
        else:
            assert in_backward is None, iteration


# ---- 4. last_grad_norm of a step without gradients -------------------------------------------------------------------

@pytest.mark.no_interpreter
@pytest.mark.parametrize("how", ["plain", "max_grad_norm", "grad_scale"])
def test_a_step_without_any_gradient_reports_a_zero_norm_as_clip_grad_norm_does(how, backend):
    """Every param without a gradient (a frozen phase, an empty param group beside them): nothing is updated or
    checked, and the norm is clip_grad_norm_'s for no gradients, 0.0 (float32, params' device), not None and not
    the previous step's; last_found_inf None. (A plain step on the pure-PyTorch backend reports no norm at all.)"""
    params = [torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]
    opt = FusedAdam([{"params": params}, {"params": []}], lr=1e-2, master_weights=True,
                    max_grad_norm=1.0 if how == "max_grad_norm" else None)
    kwargs = dict(grad_scale=8.0) if how == "grad_scale" else {}
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step(**kwargs)
    for p in params:
        p.grad = None
    before = optimizer_snapshot(opt)
    opt.step(**kwargs)
    assert_same_snapshot(before, optimizer_snapshot(opt))
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    if backend == "torch" and how == "plain":
        assert opt.last_grad_norm is None
    else:
        norm = opt.last_grad_norm
        assert norm.shape == () and norm.dtype == torch.float32 and norm.device == params[0].device
        assert float(norm) == float(expected) == 0.0
    assert opt.last_found_inf is None
