#!/usr/bin/env python
"""guides/migration.md, "torch.optim.AdamW -> FusedAdam": which arguments make FusedAdam compute torch's AdamW.

FusedAdam's defaults are ONNX Runtime's (which follow Hugging Face's AdamW), not torch's:

    argument      torch.optim.AdamW   FusedAdam / ORT
    eps           1e-8                1e-6
    weight_decay  1e-2                0.0
    decay rule    p *= 1 - lr*wd      p -= lr*wd*p after the update  (AdamWMode.ADAMW_TRANSFORMERS)
                  first; eps added    and eps added to sqrt(v) before the bias correction
                  after sqrt(v_hat)

So a plain rename changes the training. This script trains two copies of a model for STEPS steps, one with
torch.optim.AdamW and one with FusedAdam(adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2), and
asserts that parameters and losses agree within RTOL/ATOL at every step (the tolerances tests/fused_adam/test_update_rule.py
uses for fp32); it also shows that FusedAdam with its defaults does NOT match, and that FusedAdam.from_optimizer()
converts a torch AdamW in the middle of training, state included, and how a learning-rate scheduler made on the torch
optimizer continues with the converted one.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ort_optim import AdamWMode, FusedAdam  # noqa: E402

STEPS = 50
RTOL, ATOL = 1e-5, 1e-6  # fp32: same math, the fused kernel may round in a different order


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 8))


def train(model, optimizer, steps: int, first_step: int = 0, scheduler=None, lrs=None) -> list[float]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(first_step + steps)]
    losses = []
    for x, y in batches[first_step:]:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if lrs is not None:
            lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def schedule(step: int) -> float:  # linear warm-up, then linear decay
    return (step + 1) / 5 if step < 5 else max(0.0, (STEPS - step) / (STEPS - 5))


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def assert_close(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {name}: {m}")


def main() -> int:
    # --- before ---
    reference = make_model()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)  # eps=1e-8, weight_decay=1e-2 (torch's defaults)
    ref_losses = train(reference, torch_opt, STEPS)

    # --- after: the arguments that make FusedAdam compute torch.optim.AdamW ---
    ours = make_model()
    fused = FusedAdam(ours.parameters(), lr=1e-3, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2)
    our_losses = train(ours, fused, STEPS)
    assert_close(reference, ours, f"FusedAdam(ADAMW_TORCH, eps=1e-8, weight_decay=1e-2) after {STEPS} steps")
    loss_diff = max(abs(a - b) for a, b in zip(ref_losses, our_losses))
    assert loss_diff <= 1e-5, loss_diff
    print(f"FusedAdam(lr=1e-3, adam_w_mode=ADAMW_TORCH, eps=1e-8, weight_decay=1e-2) == torch.optim.AdamW(lr=1e-3) "
          f"over {STEPS} steps: max |param diff| {max_param_diff(reference, ours):.1e}, max |loss diff| "
          f"{loss_diff:.1e} (rtol {RTOL}, atol {ATOL})")

    # --- the trap: a plain rename keeps ORT's defaults (eps=1e-6, HF-style decay, weight_decay=0) ---
    renamed = make_model()
    train(renamed, FusedAdam(renamed.parameters(), lr=1e-3), STEPS)
    diff = max_param_diff(reference, renamed)
    assert diff > 100 * ATOL, diff
    print(f"FusedAdam(lr=1e-3) with ORT's defaults differs from torch.optim.AdamW(lr=1e-3): max |param diff| "
          f"{diff:.1e} after {STEPS} steps")

    # --- converting an existing torch optimizer, mid-training, state included ---
    half = STEPS // 2
    continued = make_model()
    opt = torch.optim.AdamW(continued.parameters(), lr=1e-3)
    train(continued, opt, half)
    opt = FusedAdam.from_optimizer(opt)  # ADAMW_TORCH, same hyperparameters, moments and per-parameter steps
    assert opt.param_groups[0]["adam_w_mode"] == AdamWMode.ADAMW_TORCH and opt.param_groups[0]["eps"] == 1e-8
    train(continued, opt, STEPS - half, first_step=half)
    assert_close(reference, continued, f"torch AdamW for {half} steps, then FusedAdam.from_optimizer")
    print(f"torch.optim.AdamW for {half} steps, then FusedAdam.from_optimizer(it) for {STEPS - half}: matches "
          f"torch.optim.AdamW throughout (max |param diff| {max_param_diff(reference, continued):.1e})")

    # --- with a learning-rate scheduler: it steps the optimizer it was made on, so make it again on the result ---
    scheduled = make_model()
    scheduled_opt = torch.optim.AdamW(scheduled.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled_opt, schedule)
    scheduled_lrs: list[float] = []
    train(scheduled, scheduled_opt, STEPS, scheduler=scheduler, lrs=scheduled_lrs)
    for keep_old_scheduler in (False, True):
        converted = make_model()
        opt = torch.optim.AdamW(converted.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        lrs: list[float] = []
        train(converted, opt, half, scheduler=scheduler, lrs=lrs)
        opt = FusedAdam.from_optimizer(opt)
        if not keep_old_scheduler:
            old = scheduler.state_dict()
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)  # (sets each lr to the schedule's start)
            scheduler.load_state_dict(old)
            for group, lr in zip(opt.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        train(converted, opt, STEPS - half, first_step=half, scheduler=scheduler, lrs=lrs)
        if keep_old_scheduler:  # the old scheduler goes on stepping the torch optimizer: the lr stays where it was
            assert lrs[half:] == [scheduled_lrs[half]] * (STEPS - half), lrs
        else:
            assert lrs == scheduled_lrs, (lrs, scheduled_lrs)
            assert_close(scheduled, converted,
                         f"torch AdamW + LambdaLR for {half} steps, then FusedAdam.from_optimizer")
            remade_diff = max_param_diff(scheduled, converted)
    print(f"a LambdaLR made again on FusedAdam.from_optimizer's result, its state loaded and each lr set to its "
          f"get_last_lr(), continues the schedule (max |param diff| {remade_diff:.1e}); "
          f"the old scheduler left in place leaves the lr at {scheduled_lrs[half]:.1e}")

    # --- checkpoints go both ways: FusedAdam's state_dict is torch's layout ---
    back = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    back.load_state_dict(fused.state_dict())
    assert float(back.state_dict()["state"][0]["step"]) == STEPS
    print("a FusedAdam checkpoint loads into torch.optim.AdamW (and the other way round)")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
