"""Benchmarks FusedAdam against the alternatives in one process: ``python -m ort_optim.bench [--quick] [--sections ...]``.

Every workload runs all its implementations interleaved (round robin, after warm-up) and reports medians, the
ratio against each alternative, the bytes each step must move, and the fraction of the memory bandwidth measured in
the same run. It prints tables, writes JSON (``--out``, default results/bench.json, or results/bench-quick.json with
``--quick``), the tables in markdown and a PNG chart of the ratios (where matplotlib is installed).
Absolute times move between runs on shared machines; the ratios are what we quote.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from .. import backends
from .adam import bench_fp32, bench_low_precision_states, bench_mixed, bench_op_overhead
from .common import measure_bandwidth

# Sections with their own row format: name -> "module:function" in this package, called as function(quick) and
# returning a list of flat dicts; printed as a table of their keys, saved under "sections" in the JSON and the
# markdown. Add a section by adding a module and one line here.
EXTRA_SECTIONS: dict[str, str] = {"step_in_backward": "backward:run", "distributed": "distributed:bench_distributed"}
EXTRA_SECTIONS.update(lowbit="lowbit:run", lowbit_memory="lowbit:run_memory",  # low-bit states
                      lowbit_limit="lowbit:run_limit")
EXTRA_SECTIONS.update(mixed_limit="adam:run_mixed_limit")  # how far the mixed step is from its targets
EXTRA_SECTIONS.update(compiled="compiled:run")  # a torch.compile'd train step, FusedAdam against torch's AdamW
EXTRA_SECTIONS.update(validation="validation:run")  # the share of a step that re-validates its plan


def run_extra_section(name: str, quick: bool) -> list[dict]:
    import importlib

    module, function = EXTRA_SECTIONS[name].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)(quick)


def generic_table(rows: list[dict]) -> list[str]:
    """A markdown table of flat dicts, one column per key (in first-seen order)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    show = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + [
        "| " + " | ".join(show(row.get(k, "")) for k in keys) + " |" for row in rows]

def print_table(rows: list[dict], bandwidth: dict) -> None:
    header = (f"{'section':<28} {'workload':<11} {'impl':<34} {'ms':>9} {'ours is':>9} {'GB/s':>7} {'of peak BW':>10} "
              f"{'of probe':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        fraction = row["effective_GBps"] / bandwidth["peak_GBps"]
        print(f"{row['section']:<28} {row['workload']:<11} {row['impl']:<34} {row['median_ms']:9.2f} "
              f"{row['ours_speedup']:8.2f}x {row['effective_GBps']:7.1f} {fraction:10.0%} {_of_probe(row):>9}")


def _of_probe(row: dict) -> str:
    """The row's bandwidth as a fraction of the cold in-place probe run just before it (sections that measure it)."""
    return f"{row['of_probe']:.0%}" if "of_probe" in row else ""


def markdown(rows: list[dict], fp16_rows: list[dict], overhead_rows: list[dict], bandwidth: dict, command: str) -> str:
    """The run's tables in markdown, for guides/benchmarks.md (pasted from here, never retyped)."""
    lines = [f"Command: `{command}` (torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"{time.strftime('%Y-%m-%d')}). Measured bandwidth (best of 9): in-place {bandwidth['inplace_GBps']:.1f}, "
             f"copy {bandwidth['copy_GBps']:.1f}, triad {bandwidth['triad_GBps']:.1f}, read {bandwidth['read_GBps']:.1f} "
             f"GB/s; 'of peak BW' divides by the largest.", "",
             "| section | workload | implementation | median ms | ort_optim speed-up | GB/s | of peak BW | "
             "of cold probe | state bytes/param |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        state = r["optimizer_state_bytes_per_param"]
        lines.append(f"| {r['section']} | {r['workload']} | {r['impl']} | {r['median_ms']:.2f} | "
                     f"{r['ours_speedup']:.2f}x | {r['effective_GBps']:.1f} | "
                     f"{r['effective_GBps'] / bandwidth['peak_GBps']:.0%} | {_of_probe(r)} | "
                     f"{'' if state is None else f'{state:g}'} |")
    if fp16_rows:
        lines += ["", "| workload | implementation | median ms | time / baseline's |", "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['impl']} | {r['median_ms']:.2f} | {r['ratio_vs_baseline']:.3f} |"
                  for r in fp16_rows]
    if overhead_rows:
        lines += ["", "| workload | call | caches | median ms |", "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['call']} | {r['caches']} | {r['median_ms']:.2f} |" for r in overhead_rows]
    return "\n".join(lines) + "\n"


def save_chart(rows: list[dict], path: Path) -> bool:
    """The ratios as a bar chart; False (and no file) where matplotlib is not installed (an optional dependency)."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [r for r in rows if not r["impl"].startswith("ort_optim")]
    labels = [f"{r['section']}\n{r['workload']}\nvs {r['impl']}" for r in others]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(others) + 1))
    ax.barh(range(len(others)), [r["ours_speedup"] for r in others], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(others)), labels, fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("ort_optim speedup (x, log scale; > 1 means ort_optim is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads, fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per implementation")
    valid = ["fp32", "mixed", "states", "fp16_optimizer", "overhead", *EXTRA_SECTIONS]
    parser.add_argument("--sections", default=",".join(valid), help="comma-separated: " + ", ".join(valid))
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's CPU Adam")
    parser.add_argument("--out", default=None, help="JSON output, a .json file (the markdown tables and, with "
                        "matplotlib, a PNG chart are saved beside it: NAME.md, NAME.png); default results/bench.json, "
                        "results/bench-quick.json with --quick (so that a quick look does not overwrite a full run's "
                        "tables)")
    args = parser.parse_args(argv)
    # (checked before any timing: a mistake here would otherwise show only after minutes of it, or not at all)
    sections = {name.strip() for name in args.sections.split(",") if name.strip()}
    unknown = sorted(sections - set(valid))
    if unknown or not sections:
        parser.error(f"--sections: unknown section{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                     f"valid sections: {', '.join(valid)}" if unknown else
                     f"--sections names no section; valid sections: {', '.join(valid)}")
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be at least 1 (got {args.reps})")
    if args.out is not None and (args.out.endswith(("/", "\\")) or Path(args.out).is_dir()):
        parser.error(f"--out takes a file path (the JSON; the .md and .png go beside it), got the directory "
                     f"{args.out!r}: name a file, e.g. {str(Path(args.out) / 'bench.json')!r}")
    if args.out is not None and Path(args.out).suffix.lower() in (".md", ".png"):
        parser.error(f"--out names the JSON, and the tables (.md) and the chart (.png) are written beside it under "
                     f"its name: {args.out!r} would be overwritten by them; name a .json file, e.g. "
                     f"{str(Path(args.out).with_suffix('.json'))!r}")
    args.out = args.out or ("results/bench-quick.json" if args.quick else "results/bench.json")
    reps = args.reps or (3 if args.quick else 5)
    torch.manual_seed(0)
    if not backends.native_available():
        print("warning: native ops unavailable; timing the pure-PyTorch fallback")

    bandwidth = measure_bandwidth(args.quick)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print("measured bandwidth (best of 9): " + ", ".join(f"{k.replace('_GBps', '')} {v:.1f} GB/s"
                                                        for k, v in bandwidth.items()))
    rows: list[dict] = []
    if "fp32" in sections:
        rows += bench_fp32(["gpt2-small", "2000x1K"], args.quick, reps, not args.no_deepspeed)
    if "mixed" in sections:
        rows += bench_mixed(["gpt2-small", "2000x1K"], args.quick, reps)
    if "states" in sections:
        rows += bench_low_precision_states(["1x1024^2", "32x512^2", "1x4096^2"], args.quick, reps)
    overhead_rows = bench_op_overhead(reps) if "overhead" in sections else []
    if "fp16_optimizer" in sections:
        from . import fp16_optimizer

        fp16_rows = fp16_optimizer.run(args.quick)
    else:
        fp16_rows = []
    extra = {name: run_extra_section(name, args.quick) for name in EXTRA_SECTIONS if name in sections}
    print()
    print_table(rows, bandwidth)
    if overhead_rows:
        print("\nper-step overhead: the op, the native plan and FusedAdam.step(), warm caches vs after a 256 MB pass "
              "evicted them")
        for row in overhead_rows:
            print(f"{row['workload']:<10} {row['call']:<20} {row['caches']:<8} {row['median_ms']:8.2f} ms")
    if fp16_rows:
        print("\nFP16_Optimizer (ratio = median / baseline's median; < 1 means faster than the baseline)")
        for row in fp16_rows:
            print(f"{row['workload']:<62} {row['impl']:<40} {row['median_ms']:>10.2f} ms  "
                  f"x{row['ratio_vs_baseline']:.3f}")
    for name, section_rows in extra.items():
        print(f"\n{name}")
        print("\n".join(generic_table(section_rows)))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m ort_optim.bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    out.write_text(json.dumps({
        "command": command.strip(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "native": backends.native_available(), "bandwidth": bandwidth, "rows": rows,
        "fp16_optimizer_rows": fp16_rows, "op_overhead_rows": overhead_rows, "sections": extra,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }, indent=2))
    text = markdown(rows, fp16_rows, overhead_rows, bandwidth, command.strip())
    for name, section_rows in extra.items():
        text += "\n" + f"{name}:\n\n" + "\n".join(generic_table(section_rows)) + "\n"
    out.with_suffix(".md").write_text(text)
    chart = out.with_suffix(".png")
    if save_chart([r for r in rows if "ours_speedup" in r], chart):
        print(f"\nwrote {out}, {out.with_suffix('.md')} and {chart}")
    else:
        print(f"\nwrote {out} and {out.with_suffix('.md')}; no chart: matplotlib is not installed "
              f"(pip install matplotlib, or ort-optim[examples])")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
