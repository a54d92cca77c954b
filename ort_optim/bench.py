"""Benchmarks FusedAdam against the alternatives in one process: ``python -m ort_optim.bench [--quick]``.

Every workload runs all its implementations interleaved (round robin, after warm-up) and reports medians, the
ratio against each alternative, the bytes each step must move, and the fraction of the memory bandwidth measured in
the same run. It prints tables, writes JSON (``--out``, default results/bench.json) and a PNG chart of the ratios.
Absolute times move between runs on shared machines; the ratios are what we quote.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from . import _native
from .fused_adam import AdamWMode, FusedAdam

MB = 1e6


def gpt2_small_shapes(layers: int = 12, dim: int = 768, vocab: int = 50257, context: int = 1024
                      ) -> list[tuple[int, ...]]:
    """GPT-2's parameter shapes (tied embeddings): 148 tensors, 124,439,808 parameters at the defaults."""
    shapes: list[tuple[int, ...]] = [(vocab, dim), (context, dim)]
    for _ in range(layers):
        shapes += [(dim,), (dim,), (dim, 3 * dim), (3 * dim,), (dim, dim), (dim,), (dim,), (dim,),
                   (dim, 4 * dim), (4 * dim,), (4 * dim, dim), (dim,)]
    return shapes + [(dim,), (dim,)]


WORKLOADS: dict[str, Callable[[bool], list[tuple[int, ...]]]] = {
    "gpt2-small": lambda quick: gpt2_small_shapes() if not quick else [(s[0] // 8,) + s[1:] for s in
                                                                     gpt2_small_shapes()],
    "2000x1K": lambda quick: [(1024,)] * 2000,
    "1x1024^2": lambda quick: [(1024, 1024)],
    "32x512^2": lambda quick: [(512, 512)] * 32,
    "1x4096^2": lambda quick: [(4096, 4096)] if not quick else [(2048, 2048)],
}


def measure_bandwidth(quick: bool) -> dict:
    """Memory bandwidth in GB/s over 64M floats, best of 9 (a ceiling, so the fastest repetition counts): in-place
    scale (read + write), copy (read + write), triad (two reads + one write) and a read-only sum. ``peak_GBps`` is
    the largest. Single torch ops keep fewer memory streams in flight than a fused optimizer step (4 reads and 3
    writes at once), so on some machines the step itself moves more bytes per second than any of these probes."""
    n = (16 if quick else 64) * 1024 * 1024
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    kernels = {
        "inplace": (lambda: a.mul_(1.0000001), 2),
        "copy": (lambda: c.copy_(a), 2),
        "triad": (lambda: torch.add(a, b, alpha=0.5, out=c), 3),
        "read": (lambda: a.sum(), 1),
    }
    result = {}
    for name, (kernel, arrays) in kernels.items():
        times = []
        for _ in range(9):
            start = time.perf_counter()
            kernel()
            times.append(time.perf_counter() - start)
        result[f"{name}_GBps"] = arrays * 4 * n / min(times) / 1e9
    result["peak_GBps"] = max(result.values())
    return result


def time_interleaved(candidates: dict[str, Callable[[], None]], warmup: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each candidate, run round robin so that machine noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for rep in range(warmup + reps):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _params(shapes, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.randn(shape, generator=generator).to(dtype)
        p.grad = (torch.randn(shape, generator=generator) * 1e-2).to(dtype)
        params.append(p)
    return params


def _deepspeed_cpu_adam(params) -> Optional[torch.optim.Optimizer]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its JIT build failed
        return None
    try:
        return DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=1e-2, adamw_mode=True)
    except Exception:
        return None


def bench_fp32(names: list[str], quick: bool, reps: int, with_deepspeed: bool) -> list[dict]:
    """fp32 params, grads and moments: 28 bytes per element (read p, g, m, v; write p, m, v)."""
    rows = []
    for name in names:
        params = _params(WORKLOADS[name](quick))
        numel = sum(p.numel() for p in params)
        optimizers: dict[str, torch.optim.Optimizer] = {
            "ort_optim.FusedAdam": FusedAdam(params, lr=1e-3, eps=1e-8, weight_decay=1e-2,
                                             adam_w_mode=AdamWMode.ADAMW_TORCH),
            "torch AdamW for-loop": torch.optim.AdamW(params, lr=1e-3, foreach=False),
            "torch AdamW foreach": torch.optim.AdamW(params, lr=1e-3, foreach=True),
            "torch AdamW fused": torch.optim.AdamW(params, lr=1e-3, fused=True),
        }
        if with_deepspeed:
            ds = _deepspeed_cpu_adam(params)
            if ds is not None:
                optimizers["DeepSpeed CPUAdam"] = ds
        medians = time_interleaved({k: o.step for k, o in optimizers.items()}, warmup=2, reps=reps)
        rows += _rows("fp32 AdamW", name, len(params), numel, medians, bytes_per_element=28,
                      state_bytes={k: 8 for k in medians})
    return rows


def bench_mixed(names: list[str], quick: bool, reps: int) -> list[dict]:
    """fp16/bf16 params and grads, fp32 masters and moments, loss-scale unscale + inf check + clip + update.

    Ours: FusedAdam(master_weights=True, max_grad_norm=1.0).step(grad_scale=S), two passes over the gradients.
    Composite (the usual way with torch ops): copy grads into fp32 master grads, unscale and check with
    torch._amp_foreach_non_finite_check_and_unscale_, clip_grad_norm_(foreach=True), fused AdamW on the masters,
    copy the masters back into the low-precision params.
    """
    rows = []
    scale = 1024.0
    for dtype in (torch.float16, torch.bfloat16):
        for name in names:
            params = _params(WORKLOADS[name](quick), dtype)
            for p in params:
                p.grad.mul_(scale)
            numel = sum(p.numel() for p in params)
            ours = FusedAdam(params, lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH,
                             master_weights=True, max_grad_norm=1.0)
            masters = [p.detach().float() for p in params]
            for m in masters:
                m.grad = torch.zeros_like(m)
            torch_opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)
            found_inf = torch.zeros(1)
            inv_scale = torch.full((1,), 1.0 / scale)

            def composite():
                torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
                found_inf.zero_()
                torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in masters], found_inf, inv_scale)
                if not found_inf.item():
                    torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)
                    torch_opt.step()
                    torch._foreach_copy_(params, masters)

            medians = time_interleaved(
                {"ort_optim.FusedAdam": lambda: ours.step(grad_scale=scale), "torch composite": composite},
                warmup=2, reps=reps)
            # Fused: read g twice (norm, update) + p16 write + master, m, v read+write = 2*2 + 2 + 24 = 30 B/elem.
            # Composite: grad copy 2+4, unscale 4+4, clip norm 4 + scale 4+4, AdamW 16+12, copy back 4+2 = 60.
            rows += _rows(f"mixed {str(dtype).replace('torch.', '')} params", name, len(params), numel, medians,
                          bytes_per_element={"ort_optim.FusedAdam": 30, "torch composite": 60},
                          state_bytes={"ort_optim.FusedAdam": 12, "torch composite": 16})
    return rows


def bench_low_precision_states(names: list[str], quick: bool, reps: int) -> list[dict]:
    """fp32 params with fp16 moments (ours, 1024-element block scales) against torch fused AdamW (fp32 moments)."""
    rows = []
    for name in names:
        params = _params(WORKLOADS[name](quick))
        numel = sum(p.numel() for p in params)
        medians = time_interleaved({
            "ort_optim.FusedAdam fp16 moments": FusedAdam(
                params, lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH,
                exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16).step,
            "torch AdamW fused": torch.optim.AdamW(params, lr=1e-3, fused=True).step,
        }, warmup=2, reps=reps)
        # fp16 moments: p, g, m, v read (4+4+2+2) and p, m, v written (4+2+2) = 20; torch's fp32 moments: 28.
        rows += _rows("fp32 params, fp16 moments", name, len(params), numel, medians,
                      bytes_per_element={"ort_optim.FusedAdam fp16 moments": 20, "torch AdamW fused": 28},
                      state_bytes={"ort_optim.FusedAdam fp16 moments": 4 + 8 / 1024, "torch AdamW fused": 8})
    return rows


def bench_op_overhead(reps: int) -> list[dict]:
    """Where many-tensor steps lose time: 2000 one-element tensors (metadata only), 2000 x 1K and one 2M-element
    tensor, with warm caches and after a 256 MB pass has evicted them (as other work does in training). Three ways in:
    the op with its four tensor lists, the native plan FusedAdam steps through (reads each param's .grad itself), and
    FusedAdam.step() as a whole (the plan plus Python)."""
    evictor = torch.empty(64 * 1024 * 1024)
    rows = []
    for workload, shapes in {"2000x1": [(1,)] * 2000, "2000x1K": [(1024,)] * 2000, "1x2M": [(2048 * 1024,)]}.items():
        params = _params(shapes)
        optimizer = FusedAdam(params)
        optimizer.step()  # creates the state and the plan
        (bucket,) = optimizer._plans[0].buckets
        grads = [p.grad for p in params]
        hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=1,
                     bias_correction=True, maximize=False)
        calls = {
            "op, 4 tensor lists": lambda: _native.adam_step_(
                bucket.params, grads, bucket.exp_avgs, bucket.exp_avg_sqs, [], [], [], [], [], bucket.steps, **hyper),
            "plan": lambda: bucket.native.step(**hyper),
            "FusedAdam.step()": optimizer.step,
        }
        if bucket.native is None:  # no native library here: there is no plan to time
            del calls["plan"]
        for call, run in calls.items():
            for caches in ("warm", "evicted"):
                times = []
                for _ in range(3 + 4 * reps):
                    if caches == "evicted":
                        evictor.add_(1.0)
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                rows.append({"section": "op overhead", "workload": workload, "call": call, "caches": caches,
                             "tensors": len(shapes), "median_ms": statistics.median(times[3:]) * 1e3})
    return rows


def _rows(section, workload, tensors, numel, medians, bytes_per_element, state_bytes) -> list[dict]:
    ours = next(v for k, v in medians.items() if k.startswith("ort_optim"))
    moved = bytes_per_element if isinstance(bytes_per_element, dict) else dict.fromkeys(medians, bytes_per_element)
    return [
        {
            "section": section, "workload": workload, "tensors": tensors, "params": numel, "impl": impl,
            "median_ms": seconds * 1e3, "ours_speedup": seconds / ours, "bytes_per_element": moved[impl],
            "effective_GBps": moved[impl] * numel / seconds / 1e9,
            "optimizer_state_bytes_per_param": state_bytes.get(impl),
        }
        for impl, seconds in medians.items()
    ]


def print_table(rows: list[dict], bandwidth: dict) -> None:
    header = f"{'section':<28} {'workload':<11} {'impl':<34} {'ms':>9} {'ours is':>9} {'GB/s':>7} {'of peak BW':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        fraction = row["effective_GBps"] / bandwidth["peak_GBps"]
        print(f"{row['section']:<28} {row['workload']:<11} {row['impl']:<34} {row['median_ms']:9.2f} "
              f"{row['ours_speedup']:8.2f}x {row['effective_GBps']:7.1f} {fraction:10.0%}")


def markdown(rows: list[dict], fp16_rows: list[dict], overhead_rows: list[dict], bandwidth: dict, command: str) -> str:
    """The run's tables in markdown, for guides/benchmarks.md (pasted from here, never retyped)."""
    lines = [f"Command: `{command}` (torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"{time.strftime('%Y-%m-%d')}). Measured bandwidth (best of 9): in-place {bandwidth['inplace_GBps']:.1f}, "
             f"copy {bandwidth['copy_GBps']:.1f}, triad {bandwidth['triad_GBps']:.1f}, read {bandwidth['read_GBps']:.1f} "
             f"GB/s; 'of peak BW' divides by the largest.", "",
             "| section | workload | implementation | median ms | ort_optim speed-up | GB/s | of peak BW | "
             "state bytes/param |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        state = r["optimizer_state_bytes_per_param"]
        lines.append(f"| {r['section']} | {r['workload']} | {r['impl']} | {r['median_ms']:.2f} | "
                     f"{r['ours_speedup']:.2f}x | {r['effective_GBps']:.1f} | "
                     f"{r['effective_GBps'] / bandwidth['peak_GBps']:.0%} | "
                     f"{'' if state is None else f'{state:g}'} |")
    if fp16_rows:
        lines += ["", "| workload | implementation | median ms | time / baseline's |", "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['impl']} | {r['median_ms']:.2f} | {r['ratio_vs_baseline']:.3f} |"
                  for r in fp16_rows]
    if overhead_rows:
        lines += ["", "| workload | call | caches | median ms |", "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['call']} | {r['caches']} | {r['median_ms']:.2f} |" for r in overhead_rows]
    return "\n".join(lines) + "\n"


def save_chart(rows: list[dict], path: Path) -> None:
    import matplotlib

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads, fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per implementation")
    parser.add_argument("--sections", default="fp32,mixed,states,fp16_optimizer,overhead",
                        help="comma-separated: fp32, mixed, states, fp16_optimizer, overhead")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's CPU Adam")
    parser.add_argument("--out", default="results/bench.json", help="JSON output (a PNG chart is saved beside it)")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 5)
    sections = set(args.sections.split(","))
    torch.manual_seed(0)
    if not _native.native_available():
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
        from . import bench_fp16

        fp16_rows = bench_fp16.run(args.quick)
    else:
        fp16_rows = []
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

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m ort_optim.bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    out.write_text(json.dumps({
        "command": command.strip(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "native": _native.native_available(), "bandwidth": bandwidth, "rows": rows,
        "fp16_optimizer_rows": fp16_rows, "op_overhead_rows": overhead_rows,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }, indent=2))
    out.with_suffix(".md").write_text(markdown(rows, fp16_rows, overhead_rows, bandwidth, command.strip()))
    chart = out.with_suffix(".png")
    save_chart([r for r in rows if "ours_speedup" in r], chart)
    print(f"\nwrote {out}, {out.with_suffix('.md')} and {chart}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
