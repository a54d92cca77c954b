#!/usr/bin/env python
"""guides/migration.md, "Apex amp O2 -> FP16_Optimizer": the FP16_Optimizer side (Apex cannot be installed).

Apex amp (and apex.fp16_utils) were removed from Apex upstream and Apex is not on PyPI, so the "before" code cannot
run here; the guide shows it as a diff. What amp O2 did, and where each piece goes:

    amp O2                                            ort_optim
    model cast to fp16 (BatchNorm kept fp32)          model.half() (put BatchNorm layers back with .float())
    inputs cast to fp16 by a patched forward          cast them yourself: model(x.half())
    fp32 master weights inside the optimizer          FusedAdam(..., master_weights=True)
    dynamic loss scale, 2**16, x2 every 2000 steps    FP16_Optimizer(..., init_scale=2**16, growth_interval=2000)
    with amp.scale_loss(loss, opt) as s: s.backward() optimizer.backward(loss)
    clip_grad_norm_(amp.master_params(opt), 1.0)      FP16_Optimizer(..., max_grad_norm=1.0)
    amp.state_dict()                                  optimizer.state_dict() (loss scaler included)

The script trains an fp16 model with FP16_Optimizer(FusedAdam(master_weights=True)) and the same model in fp32 with
the same FusedAdam, from the same weights on the same batches, and asserts that the per-step losses agree within
LOSS_ATOL. It also shows that an optimizer prepared by amp (it carries `_amp_stash`) is refused with a pointer to the
guide instead of being patched silently, as ORT's FP16_Optimizer did.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ort_optim import FusedAdam  # noqa: E402
from ort_optim.fp16_optimizer import FP16_Optimizer  # noqa: E402

STEPS = 60
LOSS_ATOL = 5e-3  # fp16 forward/backward with fp32 masters vs fp32 throughout


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                               torch.nn.Linear(128, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 4, generator=g)
    for _ in range(STEPS):
        x = torch.randn(64, 32, generator=g)
        yield x, (x @ w).argmax(1)


def train(fp16: bool) -> tuple[list[float], torch.optim.Optimizer]:
    model = make_model()
    if fp16:
        model = model.half()  # was: amp.initialize(model, optimizer, opt_level="O2")
        optimizer = FP16_Optimizer(FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01, master_weights=True),
                                   init_scale=2.0 ** 16, growth_interval=2000, max_grad_norm=1.0)
    else:
        optimizer = FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    losses = []
    for x, y in batches():
        loss = F.cross_entropy(model(x.half() if fp16 else x).float(), y)
        if fp16:
            optimizer.backward(loss)  # was: with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()
        else:
            loss.backward()
        optimizer.step()  # clipping (was clip_grad_norm_(amp.master_params(optimizer))) happens inside
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def main() -> int:
    fp32, _ = train(fp16=False)
    fp16, optimizer = train(fp16=True)
    diff = max(abs(a - b) for a, b in zip(fp32, fp16))
    masters = optimizer.master_params  # was: amp.master_params(optimizer)
    assert masters and all(m.dtype == torch.float32 for m in masters)
    print(f"fp16 model + FP16_Optimizer(FusedAdam(master_weights=True)): loss {fp16[0]:.4f} -> {fp16[-1]:.4f}, "
          f"{optimizer.skipped_steps} skipped steps, loss scale {optimizer.loss_scale:g}, {len(masters)} fp32 masters")
    print(f"same model in fp32 with FusedAdam: loss {fp32[0]:.4f} -> {fp32[-1]:.4f}; max per-step |loss difference| "
          f"{diff:.4f} (tolerance {LOSS_ATOL})")
    assert diff <= LOSS_ATOL, diff
    assert fp16[-1] < 0.5 * fp16[0]

    # ORT's FP16_Optimizer(optimizer) patched an amp-prepared optimizer; ours refuses it and says where to go.
    amp_prepared = torch.optim.AdamW(make_model().parameters())
    amp_prepared._amp_stash = object()  # what amp.initialize attaches
    try:
        FP16_Optimizer(amp_prepared)
    except TypeError as e:
        print(f"an amp-prepared optimizer is refused: {str(e)[:90]}...")
    else:
        raise AssertionError("FP16_Optimizer accepted an Apex amp optimizer")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
