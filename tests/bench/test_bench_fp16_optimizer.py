"""The FP16_Optimizer section times every implementation on the same work at every call: an fp16 step from the same
scaled gradients, as after a backward. FP16_Optimizer writes FusedAdam's gradients back unscaled and does not unscale
them twice, so a benchmark that left them so would time a step without its unscale."""

from __future__ import annotations

import torch

from ort_optim.bench import fp16_optimizer
from ort_optim.fused_adam import FusedAdam


def test_every_timed_fused_adam_step_starts_from_the_scaled_gradients(monkeypatch):
    monkeypatch.setattr(fp16_optimizer, "_shapes", lambda quick: [(64, 32), (32,), (1000,)])
    grads_seen = []
    step = FusedAdam.step

    def recording_step(self, *args, **kwargs):
        grads_seen.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(FusedAdam, "step", recording_step)
    rows = fp16_optimizer.bench_step(quick=True)

    assert [row["impl"] for row in rows] == list(fp16_optimizer.STEP_IMPLS)
    assert len(grads_seen) == 2 + 31  # warm-ups and timed calls
    scaled = [p.grad for p in fp16_optimizer._fp16_params([(64, 32), (32,), (1000,)], 0)]
    for grads in grads_seen:
        assert all(torch.equal(g, s) for g, s in zip(grads, scaled))
