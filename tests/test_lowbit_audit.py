"""8-bit/4-bit moments and bfloat16 stochastic rounding, black box, adversarially: what the formats promise users,
probed where the other low-bit modules (test_lowbit.py, test_lowbit_acceptance.py) do not go.

* A step taken with ``grad_scale`` leaves the unscaled gradient ``g / grad_scale`` in ``p.grad`` for every param,
  bfloat16 params rounded stochastically included (as ``torch.optim.AdamW(fused=True)`` under GradScaler), with
  and without ``max_grad_norm``, and the step itself equals the unscaled one bit for bit.
* ``step_in_backward=True`` with stochastic rounding equals ``step()`` bit for bit after params are added to or
  removed from an earlier param group (which moves the later params' positions, and so their rounding keys).
  Switching ``master_weights`` on under a group with stochastic rounding is refused by the update in backward as by
  ``step()``, before anything changes.
* A NaN gradient that nothing skips (no grad_scale, no max_grad_norm): the kernels and the pure-PyTorch reference
  keep the same bits in every moment format (amsgrad's running maximum ignores a NaN ``v``, as ``std::max``; an
  fp16 moment's block that holds the NaN gets scale 1, as any non-finite block).

The tests that take the ``backend`` fixture run on the native CPU op and the pure-PyTorch reference; with
``ORT_OPTIM_BACKEND=triton TRITON_INTERPRET=1`` on the Triton kernels. Tensors are tiny: the module runs in seconds.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import assert_same_snapshot, bits, optimizer_snapshot, select_backend
from ort_optim import AdamWMode, FusedAdam

MOMENTS = {"u8": torch.uint8, "u4": torch.uint4, "fp32": torch.float32, "bf16": torch.bfloat16,
           "fp16": torch.float16}


def _bf16_params(seed=0, shapes=((7, 37), (5,), ())):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16)) for shape in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


# ---- loss scaling with stochastic rounding -------------------------------------------------------------------------


@pytest.mark.parametrize("max_grad_norm", [None, 1e3], ids=["unclipped", "clip-norm"])
@pytest.mark.parametrize("moments", ["u8", "u4", "fp32"])
def test_a_scaled_step_with_stochastic_rounding_leaves_the_unscaled_gradients(moments, max_grad_norm, backend):
    """bfloat16 params without masters, stochastic_rounding=True: after step(grad_scale=s), p.grad holds g / s (as
    for every other param type), and the params and states equal those of the same step on unscaled gradients."""
    runs = []
    for scale in (1.0, 256.0):
        params = _bf16_params()
        opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8,
                        exp_avg_dtype=MOMENTS[moments], exp_avg_sq_dtype=MOMENTS[moments],
                        stochastic_rounding=True, stochastic_rounding_seed=5, max_grad_norm=max_grad_norm)
        for step in range(2):
            grads = _grads(params, step)
            for p, g in zip(params, grads):
                p.grad = (g.float() * scale).to(torch.bfloat16)  # (exact: a power of two)
            opt.step(grad_scale=scale if scale != 1.0 else None)
            for i, (p, g) in enumerate(zip(params, grads)):
                assert torch.equal(bits(p.grad), bits(g)), f"param {i}: p.grad is not g / grad_scale after step {step}"
        runs.append(optimizer_snapshot(opt))
    assert_same_snapshot(runs[0], runs[1])


# ---- step_in_backward --------------------------------------------------------------------------------------------


def _insert_first(opt, params, extra):
    opt.param_groups[0]["params"].insert(0, extra)


def _append(opt, params, extra):
    opt.param_groups[0]["params"].append(extra)


def _remove(opt, params, extra):
    opt.param_groups[0]["params"].remove(params[0])


@pytest.mark.parametrize("change", [_insert_first, _append, _remove], ids=["inserted", "appended", "removed"])
@pytest.mark.parametrize("moments", ["u8", "u4"])
def test_step_in_backward_with_stochastic_rounding_follows_params_moved_by_an_earlier_group(moments, change,
                                                                                          backend):
    """Two param groups of bf16 params with stochastic rounding; after two steps a param is put into (or taken out of)
    the first group, which moves every param of the second one over all groups. Updating in backward
    (step_in_backward=True, then step() for params without a hook yet) gives step()'s bits for every param."""
    runs = []
    for in_backward in (False, True):
        params = _bf16_params(shapes=((300,), (7, 5), (2, 150)))
        extra = torch.nn.Parameter(torch.linspace(-1, 1, 40).to(torch.bfloat16))
        opt = FusedAdam([{"params": params[:1]}, {"params": params[1:]}], lr=1e-3, exp_avg_dtype=MOMENTS[moments],
                        exp_avg_sq_dtype=MOMENTS[moments], stochastic_rounding=True, stochastic_rounding_seed=9,
                        step_in_backward=in_backward)
        for step in range(4):
            if step == 2:
                change(opt, params, extra)
            trained = [p for group in opt.param_groups for p in group["params"]]
            g = torch.Generator().manual_seed(step)
            loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in trained)
            loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in params + [extra]])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(bits(a), bits(b)), f"param {i}: step_in_backward differs from step()"


def test_master_weights_switched_on_under_stochastic_rounding_is_refused_in_backward(backend):
    """optimizer.master_weights = True after steps with stochastic_rounding=True and step_in_backward=True: the next
    update in backward raises the ValueError step() raises, naming the group and the option, and changes nothing
    (no master appears, the param keeps its bits)."""
    params = _bf16_params()
    opt = FusedAdam(params, lr=1e-2, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint4,
                    stochastic_rounding=True, step_in_backward=True)
    for step in range(2):
        sum(p.float().sum() * (step + 1) for p in params).backward()
        opt.zero_grad()
    opt.master_weights = True
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: stochastic_rounding=True .* master weights"):
        sum(p.float().sum() for p in params).backward()
    for p in params:
        p.grad = None  # (the gradients the refused update left)
    assert_same_snapshot(before, optimizer_snapshot(opt))


# ---- the backends agree ----------------------------------------------------------------------------------------------

# the kernel that ships here (the Triton one under ORT_OPTIM_BACKEND=triton), checked against the reference
KERNEL = "triton" if os.environ.get("ORT_OPTIM_BACKEND") == "triton" else "native"


def _snapshot_nan_equal(opt):
    """optimizer_snapshot with every NaN made the same NaN (their sign and payload bits are not specified)."""
    snap = optimizer_snapshot(opt)
    return {key: torch.where(value.isnan(), torch.full_like(value, float("nan")).abs(), value)
            if isinstance(value, torch.Tensor) and value.is_floating_point() else value for key, value in snap.items()}


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("moments", [("u8", "u8"), ("u4", "u4"), ("fp16", "u4"), ("u8", "fp16"), ("fp32", "bf16")],
                         ids="-".join)
def test_a_nan_gradient_that_nothing_skips_leaves_the_same_bits_on_every_backend(moments, amsgrad, monkeypatch):
    """A gradient holding a NaN that nothing skips (no grad_scale, no max_grad_norm: as torch, the step is taken)
    leaves the kernel and the reference with the same params and states: amsgrad's running maximum (a NaN v keeps
    the old maximum, as std::max), and the block scale of an fp16 moment whose block holds the NaN (1, as for any
    non-finite block)."""
    runs = []
    for backend in ("torch", KERNEL):
        select_backend(monkeypatch, backend)
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(300, generator=g)), torch.nn.Parameter(torch.randn(7, 5, generator=g))]
        opt = FusedAdam(params, lr=1e-2, amsgrad=amsgrad, exp_avg_dtype=MOMENTS[moments[0]],
                        exp_avg_sq_dtype=MOMENTS[moments[1]])
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 1:
                params[0].grad[3] = float("nan")
            opt.step()
        runs.append(_snapshot_nan_equal(opt))
    assert_same_snapshot(runs[0], runs[1])
