#!/usr/bin/env python
"""ORT's memory optimizer on the GPT of gpt.py: memory_opt_level 0 vs 1, each in its own process.

    .venv/bin/python guides/examples/memory_optimizer.py            # 4 layers, d=256, 4 heads, T=256, batch 16
    .venv/bin/python guides/examples/memory_optimizer.py --quick    # tiny model (what the tests run)

For each level this runs ``gpt.py --config memopt --legs ort-fp32 --memory-opt-level L --ort-log-info`` in a fresh
process (gpt.py applies ``wrap(model, ORTModuleOptions(memory_opt_level=L, log_level="INFO"))``, which leaves the
variables set: ORT reads ORTMODULE_MEMORY_OPT_LEVEL when the ORTModule is constructed and again on its first forward
call; and a process's peak RSS covers that process only), keeps ORT's log, and collects:

* the recompute plans ORT printed (``- Plan N : ON : <cluster>:<strategy>:<count>  freq  max saving  symbolic``);
* the peak RSS of the training process (gpt.py's ``peak_rss_mb()``: ``VmHWM`` from ``/proc/self/status``, which
  starts afresh at exec; ``resource.getrusage``'s ``ru_maxrss`` only where that line is missing), its RSS before
  the first step (``VmRSS``), and the losses.

Writes ``--out``/memory_optimizer.json (default results/) with the numbers and the commands, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLAN = re.compile(r"^\s*- Plan (\d+)\s*:\s*(ON|OFF)\s*:\s*(\S+)\s+(\d+)\s+([\d,]+)\s+(\S.*?)\s*$")


def parse_plans(log: str) -> list[dict]:
    plans = []
    for line in log.splitlines():
        m = PLAN.match(line)
        if m:
            plans.append(dict(plan=m.group(3), enabled=m.group(2) == "ON", frequency=int(m.group(4)),
                              max_saving_bytes=int(m.group(5).replace(",", "")), saving_symbolic=m.group(6)))
    return plans


def run_level(level: int, args, out: Path) -> dict:
    leg_out = out / f"memopt_level{level}"
    cmd = [sys.executable, str(HERE / "gpt.py"), "--config", "quick" if args.quick else "memopt", "--legs", "ort-fp32",
           "--memory-opt-level", str(level), "--ort-log-info", "--no-progress", "--out", str(leg_out)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    print(f"level {level}: {' '.join(Path(c).name if c == sys.executable else c for c in cmd)}", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-4000:])
        raise SystemExit(f"gpt.py failed at memory_opt_level {level} (exit code {proc.returncode})")
    summary = json.loads((leg_out / "gpt_summary.json").read_text())
    r = summary["results"]["ort-fp32"]
    log = (leg_out / f"gpt_ort-fp32_level{level}.log").read_text()
    return dict(
        memory_opt_level=level, command=" ".join(cmd[1:]), ort_env=r["ort_env"], cfg=summary["cfg"],
        plans=[p for p in parse_plans(log) if p["enabled"]],
        peak_rss_mb=round(r["peak_rss_mb"], 1), rss_before_training_mb=round(r["rss_before_training_mb"], 1),
        training_peak_increase_mb=round(r["peak_rss_mb"] - r["rss_before_training_mb"], 1),
        step_s=round(r["step_s"], 3), train_loss=r["train_loss"], load_avg=r["load_avg"], log=str(leg_out),
    )


def run_eager(args, out: Path) -> dict:
    leg_out = out / "memopt_eager"
    cmd = [sys.executable, str(HERE / "gpt.py"), "--config", "quick" if args.quick else "memopt", "--legs",
           "eager-adamw", "--no-progress", "--out", str(leg_out)] + (["--steps", str(args.steps)] if args.steps else [])
    print(f"eager: {' '.join(Path(c).name if c == sys.executable else c for c in cmd)}", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-4000:])
        raise SystemExit(f"gpt.py failed for the eager leg (exit code {proc.returncode})")
    r = json.loads((leg_out / "gpt_summary.json").read_text())["results"]["eager-adamw"]
    return dict(command=" ".join(cmd[1:]), peak_rss_mb=round(r["peak_rss_mb"], 1),
                rss_before_training_mb=round(r["rss_before_training_mb"], 1),
                training_peak_increase_mb=round(r["peak_rss_mb"] - r["rss_before_training_mb"], 1),
                step_s=round(r["step_s"], 3), train_loss=r["train_loss"], load_avg=r["load_avg"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="gpt.py's quick config instead of the 4-layer one")
    ap.add_argument("--steps", type=int, help="training steps per level (default: the config's, 8 for memopt)")
    ap.add_argument("--out", default="results", help="output folder (default results/)")
    ap.add_argument("--with-eager", action="store_true",
                    help="also run the eager PyTorch + AdamW leg of the same model, for its peak RSS")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import gpt

    usable, why = gpt.ortmodule_status()
    if not usable:
        print(f"SKIP: {why}")
        return 77
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [run_level(level, args, out) for level in (0, 1)]
    l0, l1 = levels
    eager = run_eager(args, out) if args.with_eager else None
    loss_diff = max(abs(a - b) for a, b in zip(l0["train_loss"], l1["train_loss"]))
    result = dict(
        model=("gpt.py --config quick" if args.quick else "gpt.py --config memopt") + ": " + json.dumps(l0["cfg"]),
        levels=levels, max_loss_diff_between_levels=loss_diff,
        peak_rss_reduction_mb=round(l0["peak_rss_mb"] - l1["peak_rss_mb"], 1), eager_adamw=eager,
        command=" ".join([Path(sys.executable).name, "guides/examples/memory_optimizer.py"] + (argv or sys.argv[1:])),
    )
    path = out / "memory_optimizer.json"
    path.write_text(json.dumps(result, indent=1))

    print(f"\n{result['model']}")
    print(f"{'level':>5}  {'plans':>5}  {'peak RSS MB':>11}  {'RSS before MB':>13}  {'training peak +MB':>17}  "
          f"{'step s':>6}  final loss")
    for lv in levels:
        print(f"{lv['memory_opt_level']:>5}  {len(lv['plans']):>5}  {lv['peak_rss_mb']:>11.0f}  "
              f"{lv['rss_before_training_mb']:>13.0f}  {lv['training_peak_increase_mb']:>17.0f}  {lv['step_s']:>6.2f}  "
              f"{lv['train_loss'][-1]:.4f}")
    if eager:
        print(f"{'eager':>5}  {'-':>5}  {eager['peak_rss_mb']:>11.0f}  {eager['rss_before_training_mb']:>13.0f}  "
              f"{eager['training_peak_increase_mb']:>17.0f}  {eager['step_s']:>6.2f}  {eager['train_loss'][-1]:.4f}"
              "   (eager PyTorch + torch.optim.AdamW, no ORTModule)")
    print(f"level 1 recompute plans ({len(l1['plans'])}):")
    for p in l1["plans"]:
        print(f"  {p['plan']:<48} freq {p['frequency']:>3}  max saving {p['max_saving_bytes']:>12,} B")
    print(f"max |loss difference| between the levels: {loss_diff:.2e}; peak RSS {l0['peak_rss_mb']:.0f} -> "
          f"{l1['peak_rss_mb']:.0f} MB")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
