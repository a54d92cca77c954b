"""The ``lowbit`` section compares a library's step with ours of the same bits only where the library's moments do
have those bits: torchao and bitsandbytes keep tensors under 4096 elements in fp32, so on 2000 x 1K their "8-bit"
step is an fp32-moment step, and a same-bits ratio there would compare unlike work."""

from __future__ import annotations

import pytest
import torch

from ort_optim.bench import lowbit


def test_the_same_bits_ratio_is_given_only_where_the_library_keeps_low_bit_moments(monkeypatch):
    make_optimizer = lowbit.make_optimizer

    def with_a_stand_in(config, params, **hyper):
        if config.library == "bitsandbytes":  # bitsandbytes' rule: fp32 moments for tensors under 4096 elements
            if all(p.numel() >= 4096 for p in params):
                return make_optimizer(lowbit.CONFIGS["uint8"], params, **hyper)
            return torch.optim.AdamW(params, **hyper)
        return make_optimizer(config, params, **hyper)

    monkeypatch.setattr(lowbit, "make_optimizer", with_a_stand_in)
    monkeypatch.setattr(lowbit, "BENCH_CONFIGS", ["fp32", "uint8", "bitsandbytes AdamW8bit"])
    monkeypatch.setattr(lowbit, "_zipf_losses", lambda names, quick: {name: dict(mean_loss=1.0) for name in names})
    monkeypatch.setattr(lowbit, "WORKLOADS", {"gpt2-small": lambda quick: [(4096,), (8192,)],
                                              "2000x1K": lambda quick: [(1024,)] * 4})
    rows = {(row["workload"], row["implementation"]): row for row in lowbit.run(quick=True)}

    large, small = rows["gpt2-small", "bitsandbytes AdamW8bit"], rows["2000x1K", "bitsandbytes AdamW8bit"]
    assert large["state_bytes_per_param"] == pytest.approx(2 * (1 + 4 / 256))
    assert large["ort_optim_same_bits_speedup"] == pytest.approx(
        large["median_ms"] / rows["gpt2-small", "uint8"]["median_ms"])
    assert small["state_bytes_per_param"] == 8
    assert "ort_optim_same_bits_speedup" not in small and "not 8-bit here" in small["note"]
