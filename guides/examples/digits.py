#!/usr/bin/env python
"""Digit classification (scikit-learn's bundled 8x8 digits, no download): an MLP under ORTModule + FusedAdam, the
same in fp16 + FP16_Optimizer, and the same model in eager PyTorch + torch.optim.AdamW for comparison.

    .venv/bin/python guides/examples/digits.py              # 300 steps, about half a minute
    .venv/bin/python guides/examples/digits.py --quick      # what the tests run
    .venv-latest/bin/python guides/examples/digits.py --no-ort

Legs (same seed, same initial weights, same minibatches; run one after the other in this process):

* ``eager-adamw``: eager PyTorch, fp32, ``torch.optim.AdamW(lr, eps=1e-8, weight_decay=1e-2)`` (torch's defaults).
* ``ort-fp32``:    ``ORTModule``, fp32, ``FusedAdam(adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2)``:
                   torch's AdamW math, so the losses must track eager-adamw's (checked: see TOLERANCES).
* ``ort-fp16``:    ``ORTModule``, fp16 parameters, ``FP16_Optimizer(FusedAdam(..., master_weights=True))``:
                   dynamic loss scaling, fp32 master weights and fp32 moments inside FusedAdam.
* ``--no-ort`` replaces the two ORT legs by ``eager-fused`` and ``eager-fp16`` (the same optimizers, no ORTModule).

The table shows, per leg, the loss and test accuracy, and where a training step's time goes: forward+backward
versus the optimizer (``step()`` + ``zero_grad()``, for FP16_Optimizer including unscale and the overflow check),
as medians over the steps after the first (the first step of an ORTModule exports the model to ONNX; it is shown
separately).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ort_optim import AdamWMode, FusedAdam  # noqa: E402

LR, BATCH, HIDDEN = 1e-3, 64, 256
BASELINE = "eager-adamw"
# Stated tolerances (checked with --check, which the tests pass):
TOLERANCES = {
    # fp32 legs against eager-adamw: same math, only the kernels' rounding order differs.
    "float32": dict(max_loss_diff=1e-3, accuracy_points=1.0),
    # fp16 legs: fp16 forward/backward (fp32 masters and moments): losses drift further, accuracy must stay close.
    "float16": dict(max_loss_diff=None, final_loss_diff=0.05, accuracy_points=3.0),
}


def ortmodule_status() -> tuple[bool, str]:
    try:
        import onnxruntime.training.ortmodule  # noqa: F401
    except Exception as e:
        return False, (f"onnxruntime-training's ORTModule needs torch 2.4.x; this environment has torch "
                       f"{torch.__version__} ({type(e).__name__})")
    return True, ""


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=seed, stratify=y)
    return Xtr, Xte, ytr, yte


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, 10),
        )

    def forward(self, x):
        return self.net(x)


def run_leg(leg: str, data, steps: int, seed: int) -> dict:
    Xtr, Xte, ytr, yte = data
    use_ort, fp16 = leg.startswith("ort-"), leg.endswith("fp16")
    torch.manual_seed(seed)
    model = MLP()
    dtype = torch.float16 if fp16 else torch.float32
    model = model.to(dtype)
    fused = None
    if leg == BASELINE:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # eps=1e-8, weight_decay=1e-2: torch's defaults
        name = "torch.optim.AdamW"
    else:
        # torch.optim.AdamW's math exactly; FusedAdam's defaults are ORT's (eps=1e-6, HF-style decay, no decay).
        fused = FusedAdam(model.parameters(), lr=LR, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2,
                          master_weights=fp16)
        if fp16:
            from ort_optim.fp16_optimizer import FP16_Optimizer

            optimizer = FP16_Optimizer(fused)
            name = "FP16_Optimizer(FusedAdam(master_weights=True))"
        else:
            optimizer = fused
            name = "FusedAdam(ADAMW_TORCH, eps=1e-8, wd=1e-2)"
    if use_ort:
        from ort_optim.options import wrap

        model = wrap(model)  # = onnxruntime.training.ortmodule.ORTModule(model)

    g = torch.Generator().manual_seed(seed + 1)
    batches = torch.randint(0, len(Xtr), (steps, BATCH), generator=g)
    losses, fwd_bwd, opt_time, grad_norms = [], [], [], []
    model.train()
    for step in range(steps):
        idx = batches[step]
        x, y = Xtr[idx].to(dtype), ytr[idx]
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float(), y)
        if fp16:
            optimizer.backward(loss)  # (loss * loss_scale).backward()
        else:
            loss.backward()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        losses.append(loss.item())
        # The global norm of the unscaled gradients, from a pass that reads them anyway: the one that unscales (fp16:
        # FP16_Optimizer hands FusedAdam its loss scale), or the update itself (fp32, native CPU plan).
        norm = None if fused is None else fused.last_grad_norm
        grad_norms.append(None if norm is None else float(norm))
        fwd_bwd.append(t1 - t0)
        opt_time.append(t2 - t1)

    model.eval()
    with torch.no_grad():  # under ORTModule: the inference graph (exported on this first call)
        logits = model(Xte.to(dtype)).float()
    test_loss = F.cross_entropy(logits, yte).item()
    accuracy = (logits.argmax(1) == yte).float().mean().item() * 100
    fb, op = statistics.median(fwd_bwd[1:]), statistics.median(opt_time[1:])
    return dict(leg=leg, optimizer=name, dtype=str(dtype).replace("torch.", ""), losses=losses,
                final_loss=statistics.mean(losses[-max(1, steps // 10):]), test_loss=test_loss, accuracy=accuracy,
                first_step_s=fwd_bwd[0] + opt_time[0], fwd_bwd_ms=1e3 * fb, optimizer_ms=1e3 * op,
                optimizer_share=op / (fb + op),
                skipped_steps=optimizer.skipped_steps if fp16 else 0,
                grad_norms=grad_norms if any(n is not None for n in grad_norms) else None)


def compare(base: dict, r: dict) -> tuple[bool, str]:
    tol = TOLERANCES[r["dtype"]]
    diffs = [abs(a - b) for a, b in zip(base["losses"], r["losses"])]
    acc = abs(base["accuracy"] - r["accuracy"])
    parts, ok = [], acc <= tol["accuracy_points"]
    if tol.get("max_loss_diff") is not None:
        ok &= max(diffs) <= tol["max_loss_diff"]
        parts.append(f"max per-step |loss diff| {max(diffs):.1e} (tolerance {tol['max_loss_diff']:.0e})")
    if tol.get("final_loss_diff") is not None:
        final = abs(base["final_loss"] - r["final_loss"])
        ok &= final <= tol["final_loss_diff"]
        parts.append(f"final loss diff {final:.4f} (tolerance {tol['final_loss_diff']})")
    parts.append(f"accuracy diff {acc:.2f} points (tolerance {tol['accuracy_points']})")
    return ok, f"{r['leg']} vs {base['leg']}: " + ", ".join(parts) + (": OK" if ok else ": NOT OK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per leg (default 300, batch 64)")
    ap.add_argument("--quick", action="store_true", help="40 steps (for the tests)")
    ap.add_argument("--no-ort", action="store_true", help="eager legs only (automatic when ORTModule is unusable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="exit with status 1 if a leg is outside the tolerances")
    ap.add_argument("--json", help="also write the results (per-step losses included) to this JSON file")
    args = ap.parse_args(argv)
    steps = 40 if args.quick else args.steps

    usable, why = ortmodule_status()
    if not usable and not args.no_ort:
        print(f"ORTModule is not usable here, running the eager legs only: {why}")
    legs = ["eager-adamw", "ort-fp32", "ort-fp16"] if usable and not args.no_ort else \
        ["eager-adamw", "eager-fused", "eager-fp16"]
    data = load_data(args.seed)
    print(f"digits: {len(data[0])} train / {len(data[1])} test images, MLP 64-{HIDDEN}-{HIDDEN}-10, "
          f"batch {BATCH}, {steps} steps, lr {LR}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = []
    for leg in legs:
        t = time.perf_counter()
        results.append(run_leg(leg, data, steps, args.seed))
        print(f"  {leg}: done in {time.perf_counter() - t:.1f} s", flush=True)

    header = ("leg", "optimizer", "dtype", "loss", "test acc %", "fwd+bwd ms", "optim ms", "optim %", "1st step s")
    rows = [header] + [(r["leg"], r["optimizer"], r["dtype"], f"{r['final_loss']:.4f}", f"{r['accuracy']:.2f}",
                        f"{r['fwd_bwd_ms']:.2f}", f"{r['optimizer_ms']:.2f}", f"{100 * r['optimizer_share']:.0f}",
                        f"{r['first_step_s']:.2f}") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print()
    for i, row in enumerate(rows):
        print("  ".join(c.rjust(w) if j >= 3 else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("loss: mean train loss over the last 10% of steps; times: medians per step after the first "
          "(the first step of an ORTModule leg includes the ONNX export)")
    ok, checks = True, {}
    for r in results[1:]:
        leg_ok, line = compare(results[0], r)
        ok &= leg_ok
        checks[r["leg"]] = dict(ok=leg_ok, line=line)
        print(line)
        if r["dtype"] == "float16":
            print(f"  {r['leg']}: {r['skipped_steps']} step(s) skipped for overflow")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            steps=steps, ortmodule_usable=usable, ortmodule_reason=why or None, tolerances=TOLERANCES,
            checks=checks, results={r["leg"]: r for r in results}), indent=1))
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
