"""guides/examples: each example runs end to end in its --quick mode, in a subprocess, and its numbers hold.

Each script runs once per test session (module-scoped fixtures); the tests then read its JSON. ORTModule costs an
ONNX export per construction, so the quick runs construct as few as possible: gpt.py 2 (ort-fp32, ort-fp16),
digits.py 2, memory_optimizer.py 2. Where ORTModule is not usable (.venv-latest: torch 2.13), the scripts run their
eager legs by themselves and the ORT checks skip with the reason.

guides/examples/distributed.py runs under torchrun, as the guide launches it: gpt.py's GPT trained by FSDP2 on 2 CPU
ranks with FusedAdam (torch >= 2.6), saved with torch.distributed.checkpoint and resumed in one process; where FSDP2
cannot run (torch 2.4, .venv), the DDP mode instead.

Every test here is marked ``examples`` (tens of seconds each): ``make check`` leaves them out, ``make test`` runs them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.examples

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "guides" / "examples"
sys.path.insert(0, str(EXAMPLES))

import gpt  # noqa: E402  (constants only: tolerances, leg names; importing it loads neither ORT nor data)

TIMEOUT = 300
SKIP = 77  # exit status of an example that cannot run here (it prints the reason)


def no_ortmodule_reason() -> str:
    return f"onnxruntime-training's ORTModule needs torch 2.4.x; this environment has torch {torch.__version__}"


def run(script: str, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    if proc.returncode not in (0, SKIP):
        pytest.fail(f"{script} {' '.join(args)} exited with {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


# ---- gpt.py ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt")
    proc = run("gpt.py", "--quick", "--no-progress", "--check", "--out", str(tmp / "out"), tmp=tmp)
    summary = json.loads((tmp / "out" / "gpt_summary.json").read_text())
    return proc, summary, tmp / "out"


def test_gpt_quick_trains_every_leg(gpt_run):
    proc, summary, out = gpt_run
    expected = gpt.ORT_LEGS if summary["ortmodule_usable"] else gpt.NO_ORT_LEGS
    assert summary["legs"] == list(expected)
    for leg, r in summary["results"].items():
        losses = r["train_loss"]
        assert len(losses) == summary["cfg"]["steps"] and all(math.isfinite(x) for x in losses), leg
        assert losses[-1] < losses[0] - 1.0, (leg, losses)  # byte-level: ln(256) = 5.5 -> below 4.5 in 16 steps
        assert r["final_val_loss"] is not None and math.isfinite(r["final_val_loss"])
        assert r["fwd_bwd_s"] > 0 and r["optimizer_s"] > 0 and 0 < r["optimizer_share"] < 1
        assert r["peak_rss_mb"] >= r["rss_before_training_mb"] > 0
        assert r["corpus"]["files"] > 100 and r["corpus"]["val_bytes"] > 0
    # the final table and the plot
    assert "optim %" in proc.stdout and "peak RSS MB" in proc.stdout
    png = out / "gpt_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert summary["plot"] == str(png)


def test_gpt_fp32_legs_track_eager_adamw(gpt_run):
    """Same init, same batches, same AdamW math: ours (FusedAdam, under ORTModule where usable) tracks eager AdamW."""
    _, summary, _ = gpt_run
    assert summary["parity"], "no fp32 leg was compared"
    for leg, c in summary["parity"].items():
        assert c["max_abs_diff_first_steps"] <= gpt.PARITY_ATOL_FIRST, (leg, c)
        assert c["final_rel_diff"] <= gpt.PARITY_RTOL_FINAL, (leg, c)
        assert c["ok"]


def test_gpt_ortmodule_legs(gpt_run):
    _, summary, _ = gpt_run
    if not summary["ortmodule_usable"]:
        assert "ORTModule" in summary["ortmodule_reason"]
        pytest.skip(no_ortmodule_reason())
    results = summary["results"]
    assert results["ort-fp32"]["ortmodule"] and results["ort-fp16"]["ortmodule"]
    assert "ort-fp32" in summary["parity"]
    # the fp32 ORT leg is not merely close at the end: its first steps agree to float rounding
    assert summary["parity"]["ort-fp32"]["max_abs_diff_first_steps"] < 1e-4


def test_gpt_fp16_leg_tracks_fp32(gpt_run):
    _, summary, _ = gpt_run
    leg = "ort-fp16" if summary["ortmodule_usable"] else "eager-fp16"
    fp16, base = summary["results"][leg], summary["results"][gpt.BASELINE]
    assert fp16["dtype"] == "float16" and "FP16_Optimizer" in fp16["optimizer"]
    assert fp16["skipped_steps"] <= 2
    assert abs(fp16["final_train_loss"] - base["final_train_loss"]) <= 0.05 * base["final_train_loss"]


def test_gpt_no_ort_flag_runs_eager_legs_only(tmp_path):
    """--no-ort: what .venv-latest runs; here with one short eager leg, to keep the suite fast."""
    proc = run("gpt.py", "--quick", "--no-ort", "--legs", "eager-adamw,ort-fp32", "--steps", "4", "--no-progress",
               "--out", str(tmp_path / "out"), tmp=tmp_path)
    summary = json.loads((tmp_path / "out" / "gpt_summary.json").read_text())
    assert summary["legs"] == ["eager-adamw"] and "skipping ort-fp32" in proc.stdout


# ---- digits.py ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("digits")
    proc = run("digits.py", "--quick", "--check", "--json", str(tmp / "digits.json"), tmp=tmp)
    return proc, json.loads((tmp / "digits.json").read_text())


def test_digits_quick(digits_run):
    proc, summary = digits_run
    assert proc.returncode == 0
    results = summary["results"]
    assert list(results)[0] == "eager-adamw" and len(results) == 3
    for leg, r in results.items():
        assert r["accuracy"] >= 85.0, (leg, r["accuracy"])  # 40 steps of batch 64 on 8x8 digits
        assert r["fwd_bwd_ms"] > 0 and r["optimizer_ms"] > 0
    for leg, check in summary["checks"].items():
        assert check["ok"], check["line"]
    assert "fwd+bwd ms" in proc.stdout and "optim %" in proc.stdout


def _assert_logs_grad_norms(results: dict, steps_key: str, norms_key: str) -> None:
    """The FusedAdam legs record FusedAdam.last_grad_norm at every step (the fp16 legs from the unscaling pass, the
    fp32 ones from the native update pass): positive, finite on the steps that were not skipped (every fp32 step);
    torch.optim.AdamW's leg records none."""
    for leg, r in results.items():
        norms = r[norms_key]
        if leg == "eager-adamw":
            assert norms is None, leg
            continue
        assert norms is not None and len(norms) == len(r[steps_key]) and all(n is not None for n in norms), leg
        if leg.endswith("fp16"):
            assert any(math.isfinite(n) and n > 0 for n in norms), (leg, norms)
        else:
            assert all(math.isfinite(n) and n > 0 for n in norms), (leg, norms)


def test_examples_log_the_gradient_norm(gpt_run, digits_run):
    _assert_logs_grad_norms(gpt_run[1]["results"], "train_loss", "grad_norm")
    _assert_logs_grad_norms(digits_run[1]["results"], "losses", "grad_norms")


def test_digits_ortmodule_legs(digits_run):
    _, summary = digits_run
    if not summary["ortmodule_usable"]:
        pytest.skip(no_ortmodule_reason())
    results = summary["results"]
    assert set(results) == {"eager-adamw", "ort-fp32", "ort-fp16"}
    diffs = [abs(a - b) for a, b in zip(results["eager-adamw"]["losses"], results["ort-fp32"]["losses"])]
    assert max(diffs) <= summary["tolerances"]["float32"]["max_loss_diff"]


# ---- memory_optimizer.py -----------------------------------------------------------------------------------------


def test_memory_optimizer_quick(tmp_path):
    proc = run("memory_optimizer.py", "--quick", "--steps", "6", "--out", str(tmp_path / "out"), tmp=tmp_path)
    if proc.returncode == SKIP:
        pytest.skip(no_ortmodule_reason())
    result = json.loads((tmp_path / "out" / "memory_optimizer.json").read_text())
    level0, level1 = result["levels"]
    assert level0["ort_env"]["ORTMODULE_MEMORY_OPT_LEVEL"] == "0" and level1["ort_env"]["ORTMODULE_MEMORY_OPT_LEVEL"] == "1"
    assert level0["plans"] == [] and len(level1["plans"]) >= 3, level1["plans"]
    assert all(p["plan"].count(":") >= 2 and p["frequency"] >= 1 for p in level1["plans"])
    assert any(p["plan"].startswith("Gelu+") for p in level1["plans"])
    # recomputation changes memory, not results
    assert result["max_loss_diff_between_levels"] <= 1e-5


# ---- distributed.py under torchrun -----------------------------------------------------------------------------------

EXAMPLE = ROOT / "guides" / "examples" / "distributed.py"
FSDP2 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


def torchrun(tmp_path: Path, nproc: int, *args: str) -> dict:
    out = tmp_path / f"summary-{len(list(tmp_path.glob('summary-*')))}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE),
           *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_example_trains_saves_and_resumes_on_another_world_size(tmp_path):
    parallel = ["--parallel", "fsdp2", "--model", "gpt"] if FSDP2 else ["--parallel", "ddp"]
    first = torchrun(tmp_path, 2, *parallel, "--steps", "8", "--save", str(tmp_path / "ckpt"))
    assert first["world"] == 2 and first["finite"]
    assert first["final_loss"] < first["first_loss"]
    resumed = torchrun(tmp_path, 1, *parallel, "--steps", "2", "--load", str(tmp_path / "ckpt"))
    assert resumed["start"] == 8 and resumed["world"] == 1 and math.isfinite(resumed["final_loss"])
    # the optimizer state came back: the resumed loss continues from where training stopped, not from scratch
    assert resumed["first_loss"] < first["first_loss"]
