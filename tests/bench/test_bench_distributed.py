"""The ``distributed`` section reports what did not run on DTensors as a row that says why, and gives the others
their ratio to FusedAdam's step of the same kind (with clipping or without) where that step ran: one implementation
that fails is a row of the table, not the end of the benchmark."""

from __future__ import annotations

import torch

from ort_optim.bench import distributed


def test_a_fused_adam_that_does_not_run_leaves_rows_without_a_ratio_and_one_that_says_why(monkeypatch):
    medians = {"ort_optim FusedAdam": 0.050, "torch AdamW foreach": 0.300, "torch AdamW fused": 0.060,
               "torch AdamW foreach + clip_grad_norm_": 0.320}
    error = "RuntimeError: not on DTensors"

    def spawn(worker, args, nprocs):  # (rank 0's result, as the worker saves it)
        torch.save({"medians": medians, "errors": {"ort_optim FusedAdam + max_grad_norm": error},
                    "allreduce_bytes": [], "params": 10, "tensors": 2}, f"{args[0]}/result.pt")

    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn)
    rows = {row["impl"]: row for row in distributed.bench_distributed(quick=True)}

    assert rows["torch AdamW fused"]["ours_speedup"] == 0.060 / 0.050
    assert "ours_speedup" not in rows["torch AdamW foreach + clip_grad_norm_"]
    assert rows["ort_optim FusedAdam + max_grad_norm"]["note"] == f"does not run: {error}"
