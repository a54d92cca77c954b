"""An adversarial audit of 8-bit/4-bit moments and bfloat16 stochastic rounding (h19), black box: what the issue
promised users, probed where the other low-bit modules (test_lowbit.py, test_lowbit_acceptance.py) do not go.

* A step taken with ``grad_scale`` leaves the unscaled gradient ``g / grad_scale`` in ``p.grad`` for every param,
  bfloat16 params rounded stochastically included (as ``torch.optim.AdamW(fused=True)`` under GradScaler), with
  and without ``max_grad_norm``, and the step itself equals the unscaled one bit for bit.

The tests that take the ``backend`` fixture run on the native CPU op and the pure-PyTorch reference; with
``ORT_OPTIM_BACKEND=triton TRITON_INTERPRET=1`` on the Triton kernels. Tensors are tiny: the module runs in seconds.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_snapshot, bits, optimizer_snapshot
from ort_optim import AdamWMode, FusedAdam

MOMENTS = {"u8": torch.uint8, "u4": torch.uint4, "fp32": torch.float32, "bf16": torch.bfloat16}


def _bf16_params(seed=0, shapes=((7, 37), (5,), ())):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16)) for shape in shapes]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


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
