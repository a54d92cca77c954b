#!/usr/bin/env python
"""guides/migration.md, "Hugging Face Trainer": pass FusedAdam to Trainer as `optimizers=(optimizer, scheduler)`.

transformers is not installed in this project's environments, so this script does not import it. It builds the
(optimizer, scheduler) pair exactly as the guide tells you to build it for Trainer, and drives it the way Trainer's
training loop does in each step:

    loss.backward()
    clip_grad_norm_(model.parameters(), args.max_grad_norm)    # skipped when args.max_grad_norm is 0
    optimizer.step()
    lr_scheduler.step()
    model.zero_grad()

Checked here, over STEPS steps of a small model (RTOL/ATOL):

1. Trainer's default optimizer (optim="adamw_torch": torch.optim.AdamW with Trainer's param groups, eps=1e-8) and
   get_linear_schedule_with_warmup (rebuilt below with torch's LambdaLR, the same function transformers uses) give
   the same parameters as FusedAdam(adam_w_mode=ADAMW_TORCH) with the same groups and scheduler.
2. Clipping inside FusedAdam (max_grad_norm=1.0, with TrainingArguments(max_grad_norm=0) so Trainer does not clip
   again) equals Trainer's clip_grad_norm_(..., 1.0) before the step.
3. optim="adamw_ort_fused" built ORT's FusedAdam(lr, betas, eps=args.adam_epsilon) with ORT's default
   ADAMW_TRANSFORMERS decay; FusedAdam with the same arguments reproduces that rule. With Trainer's eps=1e-8 it
   differs from 1. only in second-order terms (the script prints by how much).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402

from ort_optim import AdamWMode, FusedAdam  # noqa: E402

STEPS, WARMUP = 40, 8
RTOL, ATOL = 1e-5, 1e-6
# TrainingArguments' defaults, except the weight decay (0.0 by default) so that the decay rule matters.
ARGS = dict(learning_rate=5e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            max_grad_norm=1.0)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    """transformers.get_linear_schedule_with_warmup: linear warm-up from 0, then linear decay to 0."""

    def lr_lambda(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))

    return LambdaLR(optimizer, lr_lambda)


def trainer_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainer.create_optimizer's groups: decay everything except biases and LayerNorm weights."""
    no_decay = set()
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if name == "bias" or isinstance(module, torch.nn.LayerNorm):
                no_decay.add(full)
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n not in no_decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
    ]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 16))


def build_fused(model: torch.nn.Module, mode: AdamWMode, max_grad_norm=None):
    """The pair to hand to Trainer(..., optimizers=(optimizer, scheduler))."""
    optimizer = FusedAdam(
        trainer_param_groups(model, ARGS["weight_decay"]),
        lr=ARGS["learning_rate"], betas=(ARGS["adam_beta1"], ARGS["adam_beta2"]), eps=ARGS["adam_epsilon"],
        adam_w_mode=mode, max_grad_norm=max_grad_norm,
    )
    return optimizer, get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)


def trainer_loop(model, optimizer, scheduler, max_grad_norm: float) -> list[float]:
    g = torch.Generator().manual_seed(1)
    lrs = []
    for _ in range(STEPS):
        x = torch.randn(32, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.flip(1))
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        model.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def assert_same(a: torch.nn.Module, b: torch.nn.Module, what: str) -> float:
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def main() -> int:
    # The guide's shorter rule (decay the parameters with dim >= 2) gives Trainer's groups for this model.
    model = make_model()
    by_trainer = [[id(p) for p in g["params"]] for g in trainer_param_groups(model, 0.01)]
    by_dim = [[id(p) for p in model.parameters() if p.dim() >= 2], [id(p) for p in model.parameters() if p.dim() < 2]]
    assert by_trainer == by_dim

    # 1. Trainer's default, optim="adamw_torch"
    reference = make_model()
    torch_opt = torch.optim.AdamW(trainer_param_groups(reference, ARGS["weight_decay"]), lr=ARGS["learning_rate"],
                                  betas=(ARGS["adam_beta1"], ARGS["adam_beta2"]), eps=ARGS["adam_epsilon"])
    ref_lrs = trainer_loop(reference, torch_opt, get_linear_schedule_with_warmup(torch_opt, WARMUP, STEPS),
                           ARGS["max_grad_norm"])

    ours = make_model()
    optimizer, scheduler = build_fused(ours, AdamWMode.ADAMW_TORCH)
    lrs = trainer_loop(ours, optimizer, scheduler, ARGS["max_grad_norm"])
    assert lrs == ref_lrs
    diff = assert_same(reference, ours, "FusedAdam(ADAMW_TORCH) vs Trainer's default AdamW")
    print(f"Trainer(optimizers=(FusedAdam(ADAMW_TORCH), linear warm-up schedule)) == Trainer's default AdamW over "
          f"{STEPS} steps: max |param diff| {diff:.1e}; lr {max(lrs):.1e} peak at step {WARMUP}, {lrs[-1]:g} at the end")

    # 2. clipping inside the fused step, TrainingArguments(max_grad_norm=0)
    fused_clip = make_model()
    optimizer, scheduler = build_fused(fused_clip, AdamWMode.ADAMW_TORCH, max_grad_norm=ARGS["max_grad_norm"])
    trainer_loop(fused_clip, optimizer, scheduler, max_grad_norm=0.0)
    diff = assert_same(reference, fused_clip, "FusedAdam(max_grad_norm=1.0) vs clip_grad_norm_ + AdamW")
    print(f"FusedAdam(max_grad_norm=1.0) with TrainingArguments(max_grad_norm=0) == Trainer's clip_grad_norm_: "
          f"max |param diff| {diff:.1e}")

    # 3. what optim="adamw_ort_fused" built: ORT's FusedAdam, HF-style decay (ADAMW_TRANSFORMERS)
    ort_like = make_model()
    optimizer, scheduler = build_fused(ort_like, AdamWMode.ADAMW_TRANSFORMERS)
    trainer_loop(ort_like, optimizer, scheduler, ARGS["max_grad_norm"])
    moved = max((pa - pb).abs().max().item() for pa, pb in zip(reference.parameters(), ort_like.parameters()))
    assert moved > 0, moved
    print(f"optim='adamw_ort_fused' (ADAMW_TRANSFORMERS, eps=1e-8) differs from Trainer's default by max |param diff| "
          f"{moved:.1e}: decay after vs before the update, eps inside vs outside the bias correction, both "
          "second-order here; adam_w_mode=ADAMW_TRANSFORMERS reproduces it")
    print("transformers is not installed here: the Trainer call itself is shown in guides/migration.md")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
