#!/usr/bin/env python
"""guides/low-bit-states.md, "Migrating from torchao and bitsandbytes": a run trained with torchao's or bitsandbytes'
low-bit AdamW continues on FusedAdam from the source optimizer's own checkpoint.

For each source optimizer that is installed (torchao's AdamW8bit, AdamW4bit, AdamWFp8; bitsandbytes' Adam8bit,
AdamW8bit, PagedAdamW8bit), the script trains a small MLP for BEFORE steps, saves the optimizer's state_dict with
torch.save and loads it back with torch.load(weights_only=True), then continues AFTER steps three ways from the same
params: with the source optimizer, with FusedAdam loading the checkpoint (fp32, 8-bit, 4-bit and fp8 moments), and with
a fresh FusedAdam (same hyperparameters, moments restarted from zero). It prints the mean |loss difference| from the
source's own continuation per step and asserts that the migrated runs stay much closer than the restart. Exits with
77 ("SKIP: ...") where neither library is installed (the torch 2.4.1 environment).

    .venv-latest/bin/python guides/examples/migrate_lowbit.py
"""

from __future__ import annotations

import copy
import io
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ort_optim import AdamWMode, FusedAdam  # noqa: E402

BEFORE, AFTER = 30, 30
HYPER = dict(lr=3e-3, weight_decay=0.01)  # the source optimizer's; the checkpoint carries them over
CLOSER = 5.0  # a migrated run must be at least this many times closer to the source's continuation than a restart
# FusedAdam's moment dtypes the checkpoint is loaded into (None: fp32)
TARGETS = {"fp32 moments": None, "8-bit moments": torch.uint8, "4-bit moments": torch.uint4,
           "fp8 moments": torch.float8_e4m3fn}


def sources() -> dict:
    found = {}
    try:
        import torchao.optim as ao
        found.update({f"torchao {name}": getattr(ao, name) for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8")})
    except Exception as error:  # noqa: BLE001 (any reason it cannot be imported: it is not used then)
        print(f"torchao: not usable here ({type(error).__name__})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb
        found.update({f"bitsandbytes {name}": getattr(bnb.optim, name)
                      for name in ("Adam8bit", "AdamW8bit", "PagedAdamW8bit")})
    except Exception as error:  # noqa: BLE001
        print(f"bitsandbytes: not usable here ({type(error).__name__})")
    return found


def task():
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=g)
    batches = []
    for _ in range(BEFORE + AFTER):
        x = torch.randn(64, 32, generator=g)
        batches.append((x, (x @ teacher).argmax(1)))
    torch.manual_seed(0)
    # 4096- and 8192-element weights get quantised moments; the biases and the last layer stay float32 in both libraries
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 10))
    return model, batches


def train(model, optimizer, batches) -> list[float]:
    losses = []
    # torchao compiles its step with inductor, which takes minutes on a CPU: run the same ops eagerly
    with torch.compiler.set_stance("force_eager"):
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def main() -> int:
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    found = sources()
    if not found:
        print("SKIP: neither torchao nor bitsandbytes is installed here (they are in .venv-latest)")
        return 77
    warnings.filterwarnings("ignore", "Paged optimizers are not supported on CPU")  # bitsandbytes runs them unpaged
    rows = []
    for label, cls in found.items():
        model, batches = task()
        source = cls(model.parameters(), **HYPER)
        train(model, source, batches[:BEFORE])

        # --- the migration: the source's checkpoint, as saved, into FusedAdam ---
        buffer = io.BytesIO()
        torch.save(source.state_dict(), buffer)
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=True)
        at_save = copy.deepcopy(model)
        distances = {}
        theirs = train(model, source, batches[BEFORE:])
        for leg, options, load in [(leg, dict(exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype), True)
                                   for leg, dtype in TARGETS.items()] + [("restart", {}, False)]:
            resumed = copy.deepcopy(at_save)
            if load:
                optimizer = FusedAdam(resumed.parameters(), **options)
                optimizer.load_state_dict(checkpoint)  # lr, betas, eps, weight_decay, steps, AdamW's update: mapped
            else:  # without the checkpoint: the same hyperparameters spelled out, moments from zero
                optimizer = FusedAdam(resumed.parameters(), adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, **HYPER)
            ours = train(resumed, optimizer, batches[BEFORE:])
            distances[leg] = sum(abs(a - b) for a, b in zip(ours, theirs)) / AFTER
        rows.append((label, theirs[-1], distances))

    print(f"\n{BEFORE} steps with the source optimizer, then {AFTER} more: "
          "mean |loss - the source's continuation| per step")
    legs = list(TARGETS) + ["restart"]
    print(f"{'source':<30}{'final loss':>11}" + "".join(f"{leg:>15}" for leg in legs))
    for label, final, d in rows:
        print(f"{label:<30}{final:>11.4f}" + "".join(f"{d[leg]:>15.5f}" for leg in legs))
    for label, _, d in rows:
        for leg in TARGETS:
            assert d[leg] * CLOSER < d["restart"], (label, leg, d)
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
