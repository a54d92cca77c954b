"""The low-bit quality harness (guides/examples/lowbit_quality.py) in its --quick mode: one tiny training task per
moment format, whose mean training loss must stay within the format's tolerance of the fp32-moment run (8-bit and
fp16 moments 1%, 4-bit 3%; bf16 params without master weights, stochastically rounded, 2% of the bf16 run with fp32
master weights), with the state's measured bytes per parameter within issue 13's limits.

The task is the Zipf bag-of-tokens classifier (most embedding rows see rare, tiny gradients: the hard case for a
quantised second moment), 80 steps, one seed, one thread: a few seconds. The full experiment (3 tasks x 3 seeds,
torchao and bitsandbytes alongside) is the harness without --quick; its numbers are in guides/low-bit-states.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "guides" / "examples"
sys.path.insert(0, str(EXAMPLES))

import lowbit_quality  # noqa: E402

# configuration -> (tolerance on the mean loss, baseline, max state bytes per param)
FORMATS = {
    "fp16 moments": (0.01, "fp32", 4.05),
    "uint8": (0.01, "fp32", 2.05),
    "uint4": (0.03, "fp32", 1.05),
    "bf16 SR + uint8": (0.02, "bf16 + fp32 master", 2.05),
    "bf16 SR + uint4": (0.02, "bf16 + fp32 master", 1.05),
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lowbit")
    threads = torch.get_num_threads()
    try:
        status = lowbit_quality.main(["--quick", "--tasks", "zipf", "--configs", ",".join(FORMATS), "--out",
                                      str(out)])
    finally:
        torch.set_num_threads(threads)  # the harness runs on one thread
    return status, out, json.loads((out / "lowbit_quality.json").read_text())


def test_quick_mode_writes_the_json_the_table_and_the_plot(quick_run):
    status, out, summary = quick_run
    assert status == 0
    assert (out / "lowbit_quality.png").stat().st_size > 10_000
    table = (out / "lowbit_quality.md").read_text()
    assert table.startswith("Command: `python guides/examples/lowbit_quality.py --quick --tasks zipf")
    rows = {r["config"]: r for r in summary["summary"]}
    assert set(rows) == set(FORMATS) | {"fp32", "bf16 + fp32 master"}  # the baselines are added
    for name, row in rows.items():
        assert "skipped" not in row, f"{name}: {row.get('skipped')}"
        assert len(summary["results"]["zipf"][name]["runs"]["0"]["losses"]) == lowbit_quality.lowbit.ZIPF_SIZES[
            "quick"]["steps"]


@pytest.mark.parametrize("config", list(FORMATS))
def test_loss_within_tolerance_of_the_baseline(quick_run, config):
    _, _, summary = quick_run
    tolerance, baseline, _ = FORMATS[config]
    row = next(r for r in summary["summary"] if r["config"] == config)
    assert row["baseline"] == baseline and row["tolerance"] == tolerance
    assert not row["diverged"]
    assert abs(row["rel_diff_vs_baseline"]) <= tolerance, \
        f"{config}: mean loss {row['mean_loss']:.4f} is {100 * row['rel_diff_vs_baseline']:+.2f}% from {baseline}'s"
    assert row["within_tolerance"] is True


@pytest.mark.parametrize("config", list(FORMATS))
def test_state_bytes_per_param(quick_run, config):
    """Issue 13's measure: every storage in optimizer.state except step, over the params (here 131K of them)."""
    _, _, summary = quick_run
    row = next(r for r in summary["summary"] if r["config"] == config)
    assert row["state_bytes_per_param"] <= FORMATS[config][2], row["state_bytes_per_param"]


def test_the_comparison_can_fail():
    """The tolerance check is not vacuous: a run 5% worse than its baseline is flagged (4-bit: 3%)."""
    def runs(mean):
        return {"runs": {0: dict(mean_loss=mean, final_loss=mean, diverged=False, seconds=1.0, losses=[mean],
                                 state_bytes_per_param=1.0, params_and_state_bytes_per_param=5.0)}}

    rows = lowbit_quality.summarize({"zipf": {"fp32": runs(1.0), "uint4": runs(1.05), "uint8": runs(0.995)}})
    by = {r["config"]: r for r in rows}
    assert by["uint4"]["within_tolerance"] is False and by["uint8"]["within_tolerance"] is True
    assert by["uint8"]["within_seed_spread"] is None  # one seed: no spread to compare with
