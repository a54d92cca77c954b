"""Low-bit moments train as well as fp32 moments, measured with FusedAdam on the quality harness's tasks
(guides/examples/lowbit_quality.py).

In --quick mode (about 15 s, one seed, one thread): one tiny run of each task per moment format, whose mean training
loss must stay within the format's tolerance of the fp32-moment run (8-bit and fp16 moments 1%, 4-bit 1.5%; bf16
params without master weights, stochastically rounded, 2% of the bf16 run with fp32 master weights), with the
state's measured bytes per parameter within test_low_bit.py's limits (2.05 bytes for 8-bit moments, 1.05 for
4-bit). The tasks: the Zipf bag-of-tokens classifier (most embedding rows see rare, tiny gradients: the hard case
for a quantised second moment, 80 steps), the digits MLP (60 steps: where 4-bit moments with sqrt(v) rounded to its
arithmetic nearest level trained 3.5% faster than fp32 moments, a larger effective learning rate, not better
quality) and the GPT (1 layer, 40 steps). The tolerance is symmetric (a format that trains faster than fp32 moments
is as far off the baseline as one that trains slower), except that 4-bit moments may train up to 5% faster: their
stochastic sqrt(v) enlarges the mean update as a 5% larger learning rate would (guides/low-bit-states.md, "The 4-bit second moment"). The state's bytes
are checked on the Zipf task (its 131K params; the quick GPT's tiny tensors pay for partial blocks).

Marked slow (about 3 minutes on one core): at full size, three paired seeds, 4-bit, 8-bit and fp8 moments within
+1.5%, +0.5% and +1% of fp32 moments on the plain digits MLP, Zipf and the GPT. The full experiment (more seeds,
torchao and bitsandbytes alongside) is the harness without --quick; its numbers are in guides/low-bit-states.md.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.examples

EXAMPLES = Path(__file__).resolve().parents[2] / "guides" / "examples"
sys.path.insert(0, str(EXAMPLES))

import lowbit_quality  # noqa: E402

# configuration -> (tolerance on the mean loss, baseline, max state bytes per param)
FORMATS = {
    "fp16 moments": (0.01, "fp32", 4.05),
    "uint8": (0.01, "fp32", 2.05),
    "uint4": (0.015, "fp32", 1.05),
    "bf16 SR + uint8": (0.02, "bf16 + fp32 master", 2.05),
    "bf16 SR + uint4": (0.02, "bf16 + fp32 master", 1.05),
}


TASKS = ("zipf", "digits", "gpt")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lowbit")
    threads = torch.get_num_threads()
    try:
        status = lowbit_quality.main(["--quick", "--tasks", ",".join(TASKS), "--configs", ",".join(FORMATS),
                                      "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the harness runs on one thread
    return status, out, json.loads((out / "lowbit_quality.json").read_text())


def test_quick_mode_writes_the_json_the_table_and_the_plot(quick_run):
    status, out, summary = quick_run
    assert status == 0
    assert (out / "lowbit_quality.png").stat().st_size > 10_000
    table = (out / "lowbit_quality.md").read_text()
    assert table.startswith("Command: `python guides/examples/lowbit_quality.py --quick --tasks zipf,digits,gpt")
    steps = dict(zipf=lowbit_quality.lowbit.ZIPF_SIZES["quick"]["steps"], digits=lowbit_quality.DIGITS_STEPS["quick"],
                 gpt=lowbit_quality.GPT_SIZES["quick"]["steps"])
    for task in TASKS:
        rows = {r["config"]: r for r in summary["summary"] if r["task"] == task}
        assert set(rows) == set(FORMATS) | {"fp32", "bf16 + fp32 master"}  # the baselines are added
        for name, row in rows.items():
            assert "skipped" not in row, f"{task}, {name}: {row.get('skipped')}"
            assert len(summary["results"][task][name]["runs"]["0"]["losses"]) == steps[task]


def _row(summary, task, config):
    return next(r for r in summary["summary"] if r["task"] == task and r["config"] == config)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("config", list(FORMATS))
def test_loss_within_tolerance_of_the_baseline(quick_run, task, config):
    _, _, summary = quick_run
    tolerance, baseline, _ = FORMATS[config]
    row = _row(summary, task, config)
    assert row["baseline"] == baseline and row["tolerance"] == tolerance
    assert not row["diverged"]
    faster = 0.05 if "uint4" in config else tolerance  # (lowbit_quality.FASTER_BY_BITS)
    assert row["tolerance_faster"] == faster
    assert -faster <= row["rel_diff_vs_baseline"] <= tolerance, \
        f"{task}, {config}: mean loss {row['mean_loss']:.4f} is {100 * row['rel_diff_vs_baseline']:+.2f}% from " \
        f"{baseline}'s"
    assert row["within_tolerance"] is True


@pytest.mark.parametrize("config", list(FORMATS))
def test_state_bytes_per_param(quick_run, config):
    """test_low_bit.py's measure: every storage in optimizer.state except step, over the params (the Zipf task's
    131K)."""
    _, _, summary = quick_run
    row = _row(summary, "zipf", config)
    assert row["state_bytes_per_param"] <= FORMATS[config][2], row["state_bytes_per_param"]


def test_the_comparison_can_fail():
    """The tolerance check is not vacuous: a run 5% worse than its baseline is flagged (4-bit: 1.5%)."""
    def runs(mean):
        return {"runs": {0: dict(mean_loss=mean, final_loss=mean, diverged=False, seconds=1.0, losses=[mean],
                                 state_bytes_per_param=1.0, params_and_state_bytes_per_param=5.0)}}

    rows = lowbit_quality.summarize({"zipf": {"fp32": runs(1.0), "uint4": runs(1.05), "uint8": runs(0.995)}})
    by = {r["config"]: r for r in rows}
    assert by["uint4"]["within_tolerance"] is False and by["uint8"]["within_tolerance"] is True
    assert by["uint8"]["within_seed_spread"] is None  # one seed: no spread to compare with


@pytest.mark.parametrize("options, expected", [
    ({}, 28.0),  # p read + write 8, g 4, m and v read + written in fp32: 16
    (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), 12.0 + 4 * (1 + 4 / 256)),
    (dict(exp_avg_dtype=torch.uint4, exp_avg_sq_dtype=torch.uint4), 12.0 + 4 * (0.5 + 2 / 128)),
    (dict(exp_avg_dtype=torch.uint8), 12.0 + 2 * (1 + 4 / 256) + 8.0),
], ids=["fp32", "uint8", "uint4", "uint8 m only"])
def test_limit_probe_bytes_per_param(options, expected):
    """The bytes the limit probe (bench section lowbit_limit) charges a step per fp32 parameter: codes and scales
    from the format's definition, independently written out here."""
    config = lowbit_quality.lowbit._fused("probe", 0, **options)
    assert lowbit_quality.lowbit.moved_bytes_per_param(config) == pytest.approx(expected, rel=1e-12)


# ---- the issue's bound on three kinds of task, >= 3 paired seeds ---------------------------------------------------

# moment format -> the largest allowed paired mean of (mean loss / fp32 moments' mean loss - 1), one-sided
BOUNDS = {"uint8": 0.005, "fp8": 0.01, "uint4": 0.015}
# How much lower than fp32 moments' a format's mean loss may be: a larger effective learning rate shows as faster
# training (4-bit sqrt(v) at the arithmetic midpoints of its levels trained digits 6% faster), and is caught too.
FASTER_BOUND = -0.05
SEEDS = (0, 1, 2)


@functools.lru_cache(maxsize=None)
def _mean_loss(task: str, seed: int, config: str) -> float:
    """FusedAdam (the backend that runs: the native CPU kernel where it is built) on one of the harness's tasks, one
    seed, one thread: the training loss averaged over all steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = lowbit_quality.CONFIGS[config]
        result = lowbit_quality.lowbit.train(lowbit_quality.TASKS[task](seed, config.param_dtype), config)
    finally:
        torch.set_num_threads(threads)
    assert not result["diverged"]
    return result["mean_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("moments", list(BOUNDS))
@pytest.mark.parametrize("task", ["digits-plain", "zipf", "gpt"])
def test_low_bit_moments_train_within_the_bound_of_fp32_moments(task, moments):
    """Seeds 0, 1, 2 paired (the same weights and batches for both; 300 steps of each task at its default size): the
    mean over seeds of the relative difference of the mean training loss to fp32 moments' is at most +1.5% for 4-bit
    moments, +0.5% for 8-bit, +1% for fp8 (float8_e4m3fn), and not below -5%. The tasks: the plain MLP on digits (a
    dense classifier as a new user writes one: no LayerNorm, lr 3e-3, where 4-bit sqrt(v) rounded to its nearest
    level stuck and trained 4.7% slower), the Zipf bag-of-tokens classifier (rare, tiny gradients of most embedding
    rows) and the small GPT. Measured on more seeds (10, 10 and 5; guides/low-bit-states.md, "Quality"), seed
    averages against fp32 moments': 4-bit -2.24%, +0.57%, -0.93%; 8-bit +0.19%, +0.06%, -0.04%; fp8 +0.02%, +0.04%,
    +0.13%. The stochastic roundings draw their bits from a hash of the state, so a seed's losses repeat exactly from
    run to run: what is bounded is the mean of three fixed paired differences, with no margin added for noise."""
    diffs = [_mean_loss(task, seed, moments) / _mean_loss(task, seed, "fp32") - 1 for seed in SEEDS]
    mean = sum(diffs) / len(diffs)
    assert FASTER_BOUND <= mean <= BOUNDS[moments], [f"{100 * d:+.2f}%" for d in diffs]
