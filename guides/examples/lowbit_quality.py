#!/usr/bin/env python
"""Do 8-bit, fp8 and 4-bit Adam moments train as well as fp32 ones? Four tasks x three seeds x every configuration.

    python guides/examples/lowbit_quality.py                 # the full experiment: tens of minutes on 2 cores
    python guides/examples/lowbit_quality.py --quick         # tiny sizes, one seed: seconds (CI smoke test)
    python guides/examples/lowbit_quality.py --tasks zipf --configs fp32,uint8,uint4 --seeds 0,1,2

Tasks (each seed changes the initialisation and the data order; every configuration of a seed sees the same
initial weights and the same batches):

* ``gpt``: the GPT of ``gpt.py`` (byte-level, the Python standard library's source, the same model, init, param
  groups, warm-up + cosine schedule, betas (0.9, 0.95)), small: 2 layers x 64, context 64, batch 16, 300 steps.
* ``digits``: the MLP of ``digits.py`` on scikit-learn's 8x8 digits, batch 64, 300 steps, lr 1e-3.
* ``digits-plain``: a dense classifier as a new user writes one: an MLP 64-256-256-10 with GELU and no LayerNorm on
  all of scikit-learn's digits (pixels / 16), lr 3e-3, weight decay 0.01, batches of 64 drawn with ``torch.randint``
  (a generator seeded 1000 + seed), 300 steps.
* ``zipf``: a bag-of-tokens classifier whose token frequencies follow Zipf's law
  (``ort_optim.bench.lowbit.zipf_task``): most embedding rows see a gradient rarely, and a tiny one.

Configurations (``ort_optim.bench.lowbit.CONFIGS``; torch.optim.AdamW's math everywhere): FusedAdam with fp32
moments (the baseline), fp16 moments, ``exp_avg_dtype=exp_avg_sq_dtype=torch.uint8`` and ``torch.uint4``; bf16 params
with fp32 master weights (the baseline of the bf16 rows), bf16 params without master weights (round to nearest, and
with ``stochastic_rounding=True`` and 8-bit or 4-bit moments: the lowest-memory configuration); torchao's
``AdamW8bit``/``AdamW4bit`` (also with ``bf16_stochastic_round``) and bitsandbytes' ``AdamW8bit`` where installed.
A configuration that cannot run here is reported with the reason.

Reported per task and configuration: the mean training loss over all steps for every seed; the relative difference
of its seed average to the baseline's on the same seeds; whether that is within the tolerance (8-bit and 16-bit
moments 1%, 4-bit 1.5%, bf16 without master weights 2% of the bf16 run with fp32 masters; 4-bit moments may train
up to 5% faster, FASTER_BY_BITS) and within the seed-to-seed spread (the range, max - min, of the baseline's
per-seed mean losses); the final loss (last 10% of steps); the state's bytes per parameter, measured from
``optimizer.state`` (distinct storages, step counts excluded). Written to ``--out`` (default ``results/``):
``lowbit_quality.json`` (everything, per-step losses to 5 significant digits), ``lowbit_quality.md`` (the tables)
and ``lowbit_quality.png`` (loss curves, mean over seeds, and their difference to the baseline).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
REPO = EXAMPLES.parents[1]
for path in (str(REPO), str(EXAMPLES)):
    if path not in sys.path:
        sys.path.insert(0, path)  # run from a checkout without installing the package; gpt.py and digits.py

import torch  # noqa: E402

from ort_optim.bench import lowbit  # noqa: E402
from ort_optim.bench.lowbit import CONFIGS, TrainingRun, Unavailable  # noqa: E402

DEFAULT_CONFIGS = ["fp32", "fp16 moments", "uint8", "uint4", "bf16 + fp32 master", "bf16 no master",
                   "bf16 SR + uint8", "bf16 SR + uint4", "torchao AdamW8bit", "torchao AdamW4bit",
                   "torchao AdamW8bit bf16 SR", "bitsandbytes AdamW8bit"]
TASK_NAMES = ("gpt", "digits", "digits-plain", "zipf")
# Relative tolerance on the seed-averaged mean training loss against the baseline, by moment bits; bf16 params
# without master weights against the bf16 run with fp32 master weights (2% on the GPT example).
TOLERANCE_BY_BITS = {16: 0.01, 8: 0.01, 4: 0.015}
TOLERANCE_NO_MASTER = 0.02
# How much faster than its baseline a configuration may train, where that differs from its tolerance: 4-bit moments
# round sqrt(v) stochastically in a step (unbiased in v), and on 16 levels that raises the mean update by a few
# percent (E[1/sqrt(v)] > 1/sqrt(E[v])): on dense MLPs training runs 2-3.4% faster than with fp32 moments, as fp32
# moments at a 5% larger learning rate do (guides/low-bit-states.md, "The 4-bit second moment"). That is the bound:
# faster by as much as a 5% larger learning rate, a change well inside any learning-rate tuning; slower keeps 1.5%.
FASTER_BY_BITS = {4: 0.05}

GPT_SIZES = {
    "quick": dict(n_layer=1, d_model=32, n_head=2, block=32, batch=8, steps=40, warmup=4, lr=3e-3),
    "default": dict(n_layer=2, d_model=64, n_head=2, block=64, batch=16, steps=300, warmup=30, lr=3e-3),
}
DIGITS_STEPS = {"quick": 60, "default": 300}
PLAIN_LR = 3e-3


def tolerance(config_name: str):
    """(tolerance, baseline) of a configuration, or (None, baseline) for the baselines and informative rows."""
    config = CONFIGS[config_name]
    if config.name == config.baseline:
        return None, config.baseline
    if config.param_dtype == torch.bfloat16 and config.baseline != "fp32":
        return (TOLERANCE_NO_MASTER if config.bits < 32 or "SR" in config.name else None), config.baseline
    return TOLERANCE_BY_BITS.get(config.bits), config.baseline


# ---- the tasks: (seed, param dtype, size) -> TrainingRun -----------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _corpus():
    import gpt

    train, _, info = gpt.load_corpus()
    return train, info


def gpt_task(seed: int, param_dtype: torch.dtype, size: str = "default") -> TrainingRun:
    import gpt

    cfg = dict(GPT_SIZES[size])
    train, _ = _corpus()
    starts = gpt.batch_starts(len(train), cfg["block"], cfg["batch"], cfg["steps"], seed + 1)
    batches = [gpt.get_batch(train, starts[step], cfg["block"]) for step in range(cfg["steps"])]
    model = gpt.build_model(cfg["n_layer"], cfg["d_model"], cfg["n_head"], cfg["block"], True, seed).to(param_dtype)
    return TrainingRun(model, gpt.param_groups(model), batches, lambda m, batch: m(*batch),
                       functools.partial(gpt.lr_at, cfg=cfg), betas=gpt.BETAS, eps=gpt.EPS)


def digits_task(seed: int, param_dtype: torch.dtype, size: str = "default") -> TrainingRun:
    import digits

    steps = DIGITS_STEPS[size]
    x_train, _, y_train, _ = digits.load_data(seed)
    g = torch.Generator().manual_seed(seed + 1)
    index = torch.randint(0, len(x_train), (steps, digits.BATCH), generator=g)
    batches = [(x_train[i].to(param_dtype), y_train[i]) for i in index]
    torch.manual_seed(seed)
    model = digits.MLP().to(param_dtype)
    loss = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]).float(), batch[1])  # noqa: E731
    return TrainingRun(model, [dict(params=list(model.parameters()), weight_decay=1e-2)], batches, loss,
                       lambda step: digits.LR)


@functools.lru_cache(maxsize=1)
def _all_digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def digits_plain_task(seed: int, param_dtype: torch.dtype, size: str = "default") -> TrainingRun:
    x, y = _all_digits()
    generator = torch.Generator().manual_seed(1000 + seed)
    batches = [(x[i].to(param_dtype), y[i]) for i in (torch.randint(0, len(x), (64,), generator=generator)
                                                      for _ in range(DIGITS_STEPS[size]))]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 10)).to(param_dtype)
    loss = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]).float(), batch[1])  # noqa: E731
    return TrainingRun(model, [dict(params=list(model.parameters()), weight_decay=1e-2)], batches, loss,
                       lambda step: PLAIN_LR)


TASKS = {"gpt": gpt_task, "digits": digits_task, "digits-plain": digits_plain_task, "zipf": lowbit.zipf_task}


# ---- the experiment ------------------------------------------------------------------------------------------------

def run_experiment(tasks, configs, seeds, size: str, log=functools.partial(print, flush=True)) -> dict:
    """Every task x configuration x seed; returns {task: {config: {"runs": {seed: result}} or {"skipped": why}}}."""
    results: dict = {}
    for task in tasks:
        results[task] = {}
        for name in configs:
            config = CONFIGS[name]
            entry = results[task].setdefault(name, {"runs": {}})
            for seed in seeds:
                try:
                    run = TASKS[task](seed, config.param_dtype, size)
                    result = lowbit.train(run, config)
                except Unavailable as exc:
                    results[task][name] = {"skipped": str(exc)}
                    log(f"[{task}] {name}: skipped ({exc})")
                    break
                entry["runs"][seed] = result
                log(f"[{task}] {name} seed {seed}: mean loss {result['mean_loss']:.4f}, final "
                    f"{result['final_loss']:.4f}, {result['seconds']:.1f} s")
    return results


def summarize(results: dict) -> list[dict]:
    """One row per (task, configuration): seed-averaged losses, differences, the tolerance checks, bytes/param."""
    rows = []
    for task, by_config in results.items():
        for name, entry in by_config.items():
            row = dict(task=task, config=name)
            if "skipped" in entry:
                rows.append(dict(row, skipped=entry["skipped"]))
                continue
            runs = entry["runs"]
            means = [runs[s]["mean_loss"] for s in sorted(runs)]
            tol, baseline = tolerance(name)
            row.update(seeds=sorted(runs), mean_loss_per_seed=means, mean_loss=statistics.fmean(means),
                       final_loss=statistics.fmean(runs[s]["final_loss"] for s in runs),
                       diverged=any(r["diverged"] for r in runs.values()),
                       state_bytes_per_param=next(iter(runs.values()))["state_bytes_per_param"],
                       params_and_state_bytes_per_param=next(iter(runs.values()))["params_and_state_bytes_per_param"],
                       seconds_per_run=statistics.fmean(r["seconds"] for r in runs.values()))
            for label, ref_name in (("fp32", "fp32"), ("baseline", baseline)):
                ref = by_config.get(ref_name, {})
                if "runs" not in ref or not set(runs) <= set(ref["runs"]):
                    continue
                ref_means = [ref["runs"][s]["mean_loss"] for s in sorted(runs)]  # on this row's seeds
                ref_mean = statistics.fmean(ref_means)
                row[f"rel_diff_vs_{label}"] = row["mean_loss"] / ref_mean - 1.0
                if label == "baseline":
                    row["baseline"] = ref_name
                    row["baseline_spread"] = max(ref_means) - min(ref_means) if len(ref_means) > 1 else None
            if tol is not None and "rel_diff_vs_baseline" in row:
                row["tolerance"] = tol
                row["tolerance_faster"] = FASTER_BY_BITS.get(CONFIGS[name].bits, tol)
                row["within_tolerance"] = (-row["tolerance_faster"] <= row["rel_diff_vs_baseline"] <= tol
                                           and not row["diverged"])
                spread = row["baseline_spread"]
                base_mean = row["mean_loss"] / (1.0 + row["rel_diff_vs_baseline"])
                row["within_seed_spread"] = (abs(row["mean_loss"] - base_mean) <= spread
                                             if spread is not None else None)
            rows.append(row)
    return rows


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:+.2f}%"


def describe(command: str, meta: dict) -> str:
    return (f"Command: `{command}` (torch {meta['torch']}, {meta['threads']} thread(s), {meta['date']}, "
            f"{meta['seconds']:.0f} s; 1-minute load average {meta['load'][0]:.1f}-{meta['load'][1]:.1f} on "
            f"{os.cpu_count()} CPUs).")


def markdown(rows: list[dict], header: list[str]) -> str:
    lines = header + ["",
             "| task | configuration | mean loss per seed | mean | vs fp32 moments | vs baseline | tolerance | "
             "within tolerance | within seed spread | final loss | state B/param | params+state B/param |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['task']} | {r['config']} | not run: {r['skipped']} |" + " |" * 9)
            continue
        yes = lambda v: "" if v is None else ("yes" if v else "**no**")  # noqa: E731
        baseline = r.get("baseline")
        vs_base = f"{_pct(r.get('rel_diff_vs_baseline'))} ({baseline})" if baseline not in (None, "fp32", r["config"]) \
            else ""
        tol = "" if r.get("tolerance") is None else f"{100 * r['tolerance']:g}%"
        lines.append(
            f"| {r['task']} | {r['config']} | {', '.join(f'{m:.4f}' for m in r['mean_loss_per_seed'])} | "
            f"{r['mean_loss']:.4f} | {_pct(r.get('rel_diff_vs_fp32')) if r['config'] != 'fp32' else ''} | "
            f"{vs_base} | {tol} | {yes(r.get('within_tolerance'))}{' (diverged)' if r['diverged'] else ''} | "
            f"{yes(r.get('within_seed_spread'))} | {r['final_loss']:.4f} | {r['state_bytes_per_param']:.3f} | "
            f"{r['params_and_state_bytes_per_param']:.3f} |")
    lines += ["", "mean loss: the training loss averaged over all steps, per seed; 'vs' columns: relative difference "
              "of the seed average; baseline: fp32 moments, or for bf16 params without master weights the bf16 run "
              "with fp32 master weights; seed spread: max - min of the baseline's per-seed mean losses."]
    return "\n".join(lines) + "\n"


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict, path: Path) -> None:
    """Per task: the seed-averaged training loss of every configuration (moving average), and below it each
    configuration's difference to its baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in results if any("runs" in e and e["runs"] for e in results[t].values())]
    fig, axes = plt.subplots(2, len(tasks), figsize=(max(8.0, 5.2 * len(tasks)), 7.5), squeeze=False,
                             gridspec_kw=dict(height_ratios=(3, 2)))
    names = list(dict.fromkeys(n for t in tasks for n in results[t]))
    palette = plt.cm.tab10 if len(names) <= 10 else plt.cm.tab20
    colors = {n: palette(i % palette.N) for i, n in enumerate(names)}
    for col, task in enumerate(tasks):
        top, bottom = axes[0][col], axes[1][col]
        curves = {}
        for name, entry in results[task].items():
            runs = entry.get("runs") or {}
            if not runs or any(r["diverged"] for r in runs.values()):
                continue
            n = min(len(r["losses"]) for r in runs.values())
            curves[name] = [statistics.fmean(r["losses"][i] for r in runs.values()) for i in range(n)]
        window = max(1, len(next(iter(curves.values()), [])) // 15)
        for name, curve in curves.items():
            style = "-" if CONFIGS[name].library == "ort_optim" else ":"
            top.plot(_smooth(curve, window), style, color=colors[name], lw=1, label=name)
            _, baseline = tolerance(name)
            if name != baseline and baseline in curves:
                diff = [a - b for a, b in zip(curve, curves[baseline])]
                bottom.plot(_smooth(diff, window), style, color=colors[name], lw=1, label=f"{name} - {baseline}")
        top.set_title(f"{task} (mean of {len(next(iter(results[task].values())).get('runs', {}) or [0])} seed(s), "
                      f"moving average of {window})", fontsize=9)
        top.set_ylabel("training loss")
        top.grid(alpha=0.3)
        bottom.axhline(0, color="black", lw=0.5)
        bottom.set_ylabel("loss - baseline's")
        bottom.set_xlabel("step")
        bottom.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4 if len(tasks) == 1 else 6, len(labels)), fontsize=7)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _saved(results: dict) -> dict:
    """results as written to the JSON: seeds as strings, per-step losses to 5 significant digits (the curves; the
    mean and final losses keep every digit)."""
    def run(r):
        return dict(r, losses=[float(f"{x:.5g}") for x in r["losses"]])

    return {t: {c: ({"skipped": e["skipped"]} if "skipped" in e else
                    {"runs": {str(s): run(r) for s, r in e["runs"].items()}}) for c, e in by.items()}
            for t, by in results.items()}


def write(out: Path, results: dict, rows: list[dict], header: list[str], **about) -> None:
    """lowbit_quality.{md,json,png} in out: the table, everything (about: what produced it; compact JSON), the plot."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, header)
    (out / "lowbit_quality.md").write_text(text)
    (out / "lowbit_quality.json").write_text(json.dumps(dict(about, tolerance_by_bits=TOLERANCE_BY_BITS,
                                                             faster_by_bits=FASTER_BY_BITS,
                                                             tolerance_no_master=TOLERANCE_NO_MASTER, summary=rows,
                                                             results=_saved(results)), separators=(",", ":")))
    plot(results, out / "lowbit_quality.png")
    print()
    print(text)
    print(f"wrote {out / 'lowbit_quality.json'}, {out / 'lowbit_quality.md'}, {out / 'lowbit_quality.png'}")


def report_from_json(paths: list[Path], out: Path) -> int:
    """The table and the plot of earlier runs' JSON files, merged (later files win per task and configuration; same
    columns as a run's own). A merged file (this function's own JSON) counts as the runs it lists."""
    results: dict = {}
    header, sources = [], []
    for path in paths:
        saved = json.loads(path.read_text())
        for source in saved.get("sources") or [dict(command=saved["command"], meta=saved["meta"])]:
            header.append(describe(source["command"], source["meta"]))
            sources.append(source)
        for task, by_config in saved["results"].items():
            for name, entry in by_config.items():
                results.setdefault(task, {})[name] = entry if "skipped" in entry else \
                    {"runs": {int(seed): r for seed, r in entry["runs"].items()}}
    write(out, results, summarize(results), header, sources=sources)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, seed 0 only (seconds)")
    ap.add_argument("--tasks", default=",".join(TASK_NAMES), help=f"comma-separated among {', '.join(TASK_NAMES)}")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma-separated configurations among: " + ", ".join(CONFIGS))
    ap.add_argument("--seeds", help="comma-separated seeds (default 0,1,2; --quick: 0)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (default 1: on a shared machine a second thread that waits for a "
                         "busy core makes these small models many times slower)")
    ap.add_argument("--out", default="results", help="folder for lowbit_quality.{json,md,png} (default results/)")
    ap.add_argument("--check", action="store_true",
                    help="exit with status 1 if a configuration that ran is outside its tolerance")
    ap.add_argument("--from-json", help="comma-separated lowbit_quality.json files of earlier runs: merge them "
                                        "(later files win per task and configuration) and write the table and plot, "
                                        "without training")
    args = ap.parse_args(argv)
    if args.from_json:
        return report_from_json([Path(p) for p in args.from_json.split(",")], Path(args.out))
    tasks = [t for t in args.tasks.split(",") if t]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for t in tasks:
        if t not in TASKS:
            ap.error(f"unknown task {t!r}; choose among {', '.join(TASK_NAMES)}")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r}; choose among {', '.join(CONFIGS)}")
    # baselines first: the comparisons need them
    needed = list(dict.fromkeys(tolerance(c)[1] for c in configs))
    configs = list(dict.fromkeys(needed + configs))
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0] if args.quick else [0, 1, 2])
    size = "quick" if args.quick else "default"
    torch.set_num_threads(args.threads)

    start, load_start = time.perf_counter(), os.getloadavg()[0]
    results = run_experiment(tasks, configs, seeds, size)
    rows = summarize(results)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d %H:%M"),
                seconds=time.perf_counter() - start, load=(load_start, os.getloadavg()[0]))
    command = shlex.join(["python", "guides/examples/lowbit_quality.py", *(sys.argv[1:] if argv is None else argv)])
    write(Path(args.out), results, rows, [describe(command, meta)], command=command, size=size, seeds=seeds, meta=meta)
    failed = [f"{r['task']}/{r['config']}" for r in rows if r.get("within_tolerance") is False]
    if failed:
        print("outside tolerance: " + ", ".join(failed))
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
