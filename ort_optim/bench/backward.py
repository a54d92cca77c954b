"""FusedAdam(step_in_backward=True) against step() after backward: peak memory and time per training iteration.

Model: a stack of Linear(d, d) + tanh layers with a small batch, so that parameters, gradients and optimizer states
dominate the memory (activations are small). Each configuration runs in a process of its own (the peak resident set
size, VmHWM, is per process), with the C library's allocator at its defaults, as users run it (step_in_backward gives
the freed gradients' heap pages back itself: ort_optim/_heap.py); the two configurations alternate, twice each. ``saved / grad bytes`` is the drop in peak RSS as a
fraction of the gradients' bytes (what step_in_backward can save at most). Time per iteration is measured with both
configurations interleaved in one process. An iteration's time swings by more than the difference between the two
on a shared machine (measured on 2 cores: a quarter of the rounds differ by over 15% either way), so the ratio is
taken per round (step_in_backward's iteration over step()'s in the same round) and reported as the median with its
quartiles: "no worse" means a median at or below 1.

    python -m ort_optim.bench --sections step_in_backward      # or alone:
    python -m ort_optim.bench.backward [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

MODES = ("step() after backward", "step_in_backward=True")


def _model(layers: int, width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


def _iteration(model, optimizer, x) -> None:
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _peak_rss(layers: int, width: int, batch: int, steps: int, step_in_backward: bool) -> dict:
    """In a process of its own: a few iterations, then the process's peak RSS."""
    import torch

    from ort_optim import FusedAdam

    model = _model(layers, width)
    optimizer = FusedAdam(model.parameters(), lr=1e-4, step_in_backward=step_in_backward)
    x = torch.randn(batch, width)
    for _ in range(steps):
        _iteration(model, optimizer, x)
    return {"peak_rss_MB": _peak_rss_bytes() / 1e6}


def _peak_rss_bytes() -> int:
    """This address space's peak RSS: VmHWM, which starts afresh at exec. (ru_maxrss does not: Linux keeps it across
    execve, so a child started from a large benchmark process would report its parent's peak.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(quick: bool) -> list[dict]:
    """Rows for ``python -m ort_optim.bench``: one per configuration. Peak RSS: the median of two processes each
    (alternating); time per iteration (forward, backward, step, zero_grad): both configurations interleaved in this
    process, medians."""
    import torch

    from ort_optim import FusedAdam

    from .common import interleaved_samples

    layers, width, batch, steps = (8, 512, 8, 4) if quick else (24, 1024, 8, 4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's defaults
    peaks: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(2):
        for mode in MODES:
            out = subprocess.run([sys.executable, "-m", "ort_optim.bench.backward", "--child", str(layers), str(width),
                                  str(batch), str(steps), str(int(mode == MODES[1]))],
                                 env=env, check=True, capture_output=True, text=True)
            peaks[mode].append(json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_MB"])
    x = torch.randn(batch, width)
    runs = {}
    for mode in MODES:
        model = _model(layers, width)
        runs[mode] = (model, FusedAdam(model.parameters(), lr=1e-4, step_in_backward=mode == MODES[1]))
    samples = interleaved_samples({mode: lambda m=m, o=o: _iteration(m, o, x) for mode, (m, o) in runs.items()},
                                  warmup=2, reps=4 if quick else 40)
    medians = {mode: statistics.median(times) for mode, times in samples.items()}
    ratios = [ours / base for base, ours in zip(samples[MODES[0]], samples[MODES[1]])]
    params = sum(p.numel() for p in runs[MODES[0]][0].parameters())
    rows = [{"section": "step in backward", "model": f"{layers} x Linear({width}, {width}), batch {batch}",
             "mode": mode, "params": params, "grad_MB": 4 * params / 1e6,
             "peak_rss_MB": statistics.median(peaks[mode]), "iteration_ms": medians[mode] * 1e3} for mode in MODES]
    base, ours = rows
    ours["saved / grad bytes"] = (base["peak_rss_MB"] - ours["peak_rss_MB"]) / base["grad_MB"]
    quartiles = statistics.quantiles(ratios, n=4)
    ours["time / step()'s"] = quartiles[1]  # the median of the per-round ratios
    ours["ratio quartiles"] = f"{quartiles[0]:.2f}-{quartiles[2]:.2f}"
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=5, type=int, help=argparse.SUPPRESS)  # layers width batch steps in_backward
    args = parser.parse_args(argv)
    if args.child:
        layers, width, batch, steps, in_backward = args.child
        print(json.dumps(_peak_rss(layers, width, batch, steps, bool(in_backward))))
        return 0
    for row in run(args.quick):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
