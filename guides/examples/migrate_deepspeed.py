#!/usr/bin/env python
"""guides/migration.md, "DeepSpeed initialize + FP16_Optimizer": the same two lines, with ort_optim's imports.

    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    optimizer = FP16_Optimizer(optimizer)

ORT's FP16_Optimizer patches DeepSpeed's ZeRO stage 1/2 optimizer only when DeepSpeed's functions have the source
text of DeepSpeed 0.9.2; on any newer DeepSpeed it warns and does nothing. ort_optim's recognises the methods by name
and signature and replaces the per-parameter overflow check and gradient-norm loops with its fused multi-tensor op,
keeping DeepSpeed's loss scaler, clipping and all-reduces in charge.

This script runs DeepSpeed in one process on the CPU (gloo, world size 1), ZeRO stage 1, with ort_optim's FusedAdam
as the client optimizer, twice: as DeepSpeed ships it, and with FP16_Optimizer applied; it asserts that the patch
was applied, that every step was taken, and that losses and gradient norms agree (RTOL). DeepSpeed's CPU accelerator
offers fp16 only where oneDNN has fp16 kernels; elsewhere the script uses bf16 (the ZeRO optimizer is the same class
either way). In fp16 the loss scale starts at 2**8: given none of its dynamic-scale keys, DeepSpeed's ZeRO optimizer
starts at 2**32, where this model's scaled gradients overflow fp16 until the scale has halved below 2**25, so every
one of the 8 steps would be skipped and the comparison would hold trivially.

Exit status 77 (the tests report it as a skip) when DeepSpeed cannot be imported, as in .venv-latest, which does not
install it.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ort_optim import AdamWMode, FusedAdam  # noqa: E402
from ort_optim.fp16_optimizer import FP16_Optimizer  # noqa: E402

SKIP = 77
STEPS = 8
RTOL = 1e-4  # the two sum the squares in other orders and precisions (DeepSpeed's in float64 per tensor)


def single_process_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        os.environ.setdefault(key, value)


def run(deepspeed, dtype_key: str, patch: bool) -> tuple[list[float], list[float], bool, str, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8,
                          weight_decay=1e-2)
    ds_config = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        dtype_key: {"enabled": True, **({"initial_scale_power": 8} if dtype_key == "fp16" else {})},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,  # DeepSpeed's whitelist predates ort_optim
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if patch:
        optimizer = FP16_Optimizer(optimizer)  # returns the same DeepSpeed optimizer, patched in place
        assert optimizer is engine.optimizer
    patched = bool(getattr(engine.optimizer, "_ort_optim_fused_checks", False))
    dtype = torch.float16 if dtype_key == "fp16" else torch.bfloat16
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 4, generator=g)
    losses, norms = [], []
    for _ in range(STEPS):
        x = torch.randn(32, 32, generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x.to(dtype)).float(), (x @ w).argmax(1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms, patched, type(engine.optimizer).__name__, engine.skipped_steps


def main() -> int:
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as e:
        print(f"SKIP: DeepSpeed is not importable here ({type(e).__name__}: {e}); see guides/migration.md for the diff")
        return SKIP
    single_process_env()
    if get_accelerator().device_name() == "cpu":
        # One CPU process never uses DeepSpeed's shared-memory all-reduce; skip its ~70 s JIT build.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dtype_key = "fp16" if get_accelerator().is_fp16_supported() else "bf16"
    print(f"DeepSpeed {deepspeed.__version__}, accelerator {get_accelerator().device_name()}, {dtype_key}, "
          f"ZeRO stage 1, client optimizer ort_optim.FusedAdam")
    plain_losses, plain_norms, plain_patched, _, plain_skipped = run(deepspeed, dtype_key, patch=False)
    ours_losses, ours_norms, patched, zero_class, skipped = run(deepspeed, dtype_key, patch=True)
    assert not plain_patched and patched, (plain_patched, patched)
    assert plain_skipped == skipped == 0, f"steps skipped for overflow: {plain_skipped} and {skipped} of {STEPS}"
    torch.testing.assert_close(torch.tensor(ours_norms), torch.tensor(plain_norms), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(plain_losses), rtol=RTOL, atol=0)
    print(f"FP16_Optimizer(optimizer) patched DeepSpeed's {zero_class} in place (overflow check and gradient norm "
          "by ort_optim's fused op)")
    print(f"losses {plain_losses[0]:.4f} -> {plain_losses[-1]:.4f} with and without the patch, every step taken; "
          f"grad norms agree within rtol {RTOL} over {STEPS} steps")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
