#!/usr/bin/env python
"""guides/migration.md, "torch.amp.GradScaler -> FP16_Optimizer".

Before: fp32 model under torch.autocast(float16), torch.amp.GradScaler, clip_grad_norm_, torch.optim.AdamW.
After:  fp16 model, FP16_Optimizer(FusedAdam(..., master_weights=True), max_grad_norm=...): dynamic loss scaling
        with GradScaler's rule and defaults (init 2**16, x2 after 2000 good steps, x0.5 on overflow), fp32 master
        weights and moments inside FusedAdam, unscale + inf/NaN check + clipping fused into the step.

The two are different precision recipes (autocast keeps fp32 weights and runs matmuls in fp16; the fp16 model runs
everything in fp16 and keeps fp32 masters in the optimizer), so the losses are not bitwise equal: the script trains
both for STEPS steps from the same initial weights on the same batches and asserts that the per-step losses agree
within LOSS_ATOL, that both skipped no step, and that checkpoints carry the loss scale. It also checks the smaller
migration that keeps autocast and GradScaler and only swaps the optimizer for FusedAdam (GradScaler hands FusedAdam
the scale and the inf flag; the losses then match torch.optim.AdamW's within SWAP_ATOL).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ort_optim import AdamWMode, FusedAdam  # noqa: E402
from ort_optim.fp16_optimizer import FP16_Optimizer  # noqa: E402

STEPS = 60
LOSS_ATOL = 5e-3  # fp16 vs autocast: both round activations to fp16, in different places
# Same recipe, only the optimizer swapped: the parameters agree to ~1e-7, and autocast's fp16 rounding of the
# activations turns that into loss differences of a few 1e-5.
SWAP_ATOL = 2e-4
DEVICE = "cpu"  # the same code runs on "cuda"


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                               torch.nn.Linear(128, 4)).to(DEVICE)


def batches():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 4, generator=g)
    for _ in range(STEPS):
        x = torch.randn(64, 32, generator=g)
        yield x.to(DEVICE), (x @ w).argmax(1).to(DEVICE)


def before(fused: bool = False) -> list[float]:
    """autocast + GradScaler + torch.optim.AdamW; with fused=True only the optimizer is swapped for FusedAdam."""
    model = make_model()
    if fused:  # GradScaler hands the scale and the inf flag to FusedAdam (_step_supports_amp_scaling)
        optimizer = FusedAdam(model.parameters(), lr=3e-3, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8,
                              weight_decay=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(DEVICE)
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    assert scaler.get_scale() == 2.0 ** 16  # no overflow, no growth yet
    return losses


def after() -> list[float]:
    model = make_model().half()
    optimizer = FP16_Optimizer(
        FusedAdam(model.parameters(), lr=3e-3, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2,
                  master_weights=True),
        max_grad_norm=1.0,  # was clip_grad_norm_(..., 1.0) after scaler.unscale_
    )
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x.half()).float(), y)
        optimizer.backward(loss)  # was scaler.scale(loss).backward()
        optimizer.step()  # was unscale_, clip_grad_norm_, scaler.step, scaler.update
        losses.append(loss.item())
    assert optimizer.skipped_steps == 0 and optimizer.loss_scale == 2.0 ** 16
    state = optimizer.state_dict()  # the optimizer's state and the loss scaler's, in one dict
    restored = FP16_Optimizer(FusedAdam(model.parameters(), master_weights=True))
    restored.load_state_dict(state)
    assert restored.loss_scale == optimizer.loss_scale
    return losses


def main() -> int:
    a, b = before(), after()
    swapped = before(fused=True)
    swap_diff = max(abs(x - y) for x, y in zip(a, swapped))
    print(f"autocast + GradScaler with only the optimizer swapped for FusedAdam(ADAMW_TORCH, eps=1e-8, "
          f"weight_decay=1e-2): max per-step |loss difference| {swap_diff:.1e} (tolerance {SWAP_ATOL:.0e})")
    assert swap_diff <= SWAP_ATOL, swap_diff
    diff = max(abs(x - y) for x, y in zip(a, b))
    print(f"autocast + GradScaler + AdamW: loss {a[0]:.4f} -> {a[-1]:.4f}")
    print(f"fp16 model + FP16_Optimizer(FusedAdam(master_weights=True)): loss {b[0]:.4f} -> {b[-1]:.4f}")
    print(f"max per-step |loss difference| over {STEPS} steps: {diff:.4f} (tolerance {LOSS_ATOL})")
    assert diff <= LOSS_ATOL, diff
    assert b[-1] < 0.5 * b[0]
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
