#!/usr/bin/env python
"""guides/migration.md, "onnxruntime.training.optim -> ort_optim": same names, same defaults, three differences.

1. Same names and positional signature: FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay,
   set_grad_none) and AdamWMode (ADAM_L2_REGULARIZATION=0, ADAMW_TRANSFORMERS=1, ADAMW_TORCH=2). Checked against the
   installed onnxruntime-training when it can be imported, else against ORT 1.19.2's signature recorded below.
2. eps defaults to 1e-6 in both (ORT's docstring says 1e-8; its code says 1e-6). Keep the default to keep ORT's
   behaviour; pass eps=1e-8 if you relied on the docstring.
3. Step counts: ORT keeps one step per param group and advances it for every param, with a gradient or not; a
   parameter that first gets a gradient late is then bias-corrected as if it had been trained all along, and its
   first update is up to 1/sqrt(1 - beta2) * (1 - beta1) ~ 3.2x too large. ort_optim counts steps per parameter
   (as torch does). This script shows the first update of a late parameter under both rules: ORT's is computed from
   its formula, since ORT's FusedAdam runs on CUDA only.
4. (Not a difference in results.) ORT's FusedAdam checkpoints (one 'step' per group) load into ort_optim's FusedAdam.
"""

from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ort_optim import AdamWMode, FusedAdam  # noqa: E402  (was: from onnxruntime.training.optim import ...)

# onnxruntime-training 1.19.2's FusedAdam signature (read from the wheel), for environments without ORT.
ORT_1_19_2_SIGNATURE = [
    ("params", inspect.Parameter.empty), ("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)),
    ("eps", 1e-6), ("adam_w_mode", 1), ("weight_decay", 0.0), ("set_grad_none", True),
]
ORT_ADAMW_MODES = {"ADAM_L2_REGULARIZATION": 0, "ADAMW_TRANSFORMERS": 1, "ADAMW_TORCH": 2}
LATE = 2000  # the second parameter gets its first gradient at step LATE + 1


def ort_signature():
    try:
        from onnxruntime.training.optim import AdamWMode as OrtMode
        from onnxruntime.training.optim import FusedAdam as OrtFusedAdam
    except Exception as e:  # not installed (.venv-latest), or not importable with this torch
        print(f"onnxruntime.training.optim is not importable here ({type(e).__name__}); comparing with ORT 1.19.2's "
              "recorded signature")
        return ORT_1_19_2_SIGNATURE, ORT_ADAMW_MODES
    params = inspect.signature(OrtFusedAdam).parameters.values()
    return [(p.name, p.default) for p in params], {m.name: int(m) for m in OrtMode}


def check_names_and_defaults() -> None:
    ort_params, ort_modes = ort_signature()
    ours = [(p.name, p.default) for p in inspect.signature(FusedAdam).parameters.values()
            if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert [n for n, _ in ours] == [n for n, _ in ort_params], (ours, ort_params)
    for (name, default), (_, ort_default) in zip(ours, ort_params):
        assert default == ort_default or int(default) == int(ort_default), (name, default, ort_default)
    assert {m.name: int(m) for m in AdamWMode} == ort_modes
    print("FusedAdam's positional signature and defaults, and AdamWMode's names and values, equal ORT's: "
          + ", ".join(f"{n}={d!r}" for n, d in ours[1:]))
    print("eps defaults to 1e-6 in both (ORT's docstring says 1e-8): pass eps=1e-8 if you relied on the docstring")


def ort_first_update(lr: float, betas: tuple[float, float], eps: float, g: torch.Tensor, group_step: int):
    """|update| ORT's FusedAdam (ADAMW_TRANSFORMERS, no decay) makes for a parameter whose first gradient g arrives
    when the group's step counter reads group_step (m = (1-b1) g, v = (1-b2) g^2, bias-corrected with group_step)."""
    b1, b2 = betas
    m, v = (1 - b1) * g, (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** group_step, 1 - b2 ** group_step
    return (lr * math.sqrt(bc2) / bc1) * m / (v.sqrt() + eps)


def check_per_parameter_steps() -> None:
    torch.manual_seed(0)
    early = torch.nn.Parameter(torch.randn(64))
    late = torch.nn.Parameter(torch.randn(64))  # e.g. an embedding row or a head unused until a later stage
    lr = 1e-3
    opt = FusedAdam([early, late], lr=lr)  # ORT's defaults: ADAMW_TRANSFORMERS, eps=1e-6, weight_decay=0
    for _ in range(LATE):
        early.grad = torch.randn(64)
        opt.step()
    g = torch.randn(64)
    before = late.detach().clone()
    early.grad, late.grad = torch.randn(64), g
    opt.step()
    ours = (late.detach() - before).abs()
    ort = ort_first_update(lr, (0.9, 0.999), 1e-6, g, group_step=LATE + 1).abs()
    assert float(opt.state[late]["step"]) == 1 and float(opt.state[early]["step"]) == LATE + 1
    # Adam's first step moves each element by lr * |g| / (|g| + eps / sqrt(1 - beta2)) ~ lr.
    torch.testing.assert_close(ours, torch.full_like(ours, lr), rtol=1e-3, atol=0)
    ratio = (ort / ours).mean().item()
    assert 2.5 < ratio < 3.2, ratio
    print(f"a parameter whose first gradient comes at step {LATE + 1}: ort_optim moves it by lr ({ours.mean():.2e}, "
          f"its own step 1); ORT's per-group step ({LATE + 1}) would move it by {ort.mean():.2e}, {ratio:.2f}x lr")


def check_ort_checkpoint() -> None:
    """An ORT FusedAdam state_dict: torch's layout with one 'step' per param group and none per parameter."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    ort_state = {
        "state": {0: {"exp_avg": torch.randn(8, 4) * 1e-2, "exp_avg_sq": torch.rand(8, 4) * 1e-4},
                  1: {"exp_avg": torch.randn(4) * 1e-2, "exp_avg_sq": torch.rand(4) * 1e-4}},
        "param_groups": [{"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-6,
                          "weight_decay": 0.0, "step": 7, "params": [0, 1]}],
    }
    opt = FusedAdam(params)
    opt.load_state_dict(ort_state)
    assert [float(opt.state[p]["step"]) for p in params] == [7.0, 7.0]
    torch.testing.assert_close(opt.state[params[0]]["exp_avg"], ort_state["state"][0]["exp_avg"])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    print("an ORT FusedAdam checkpoint (per-group 'step': 7) loads: each parameter continues at step 8")


def main() -> int:
    check_names_and_defaults()
    check_per_parameter_steps()
    check_ort_checkpoint()
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
