"""Interleaved A/B of FusedAdam's many-small-tensor steps across checkouts (the 2000 x 1K rows of guides/benchmarks.md).

    python tools/ab_small_tensors.py CHECKOUT [CHECKOUT ...] [--rounds 4] [--reps 25] [--what fp32,check,fp16,bf16]

Each CHECKOUT is a source tree (e.g. ``git worktree add /tmp/ab-old <commit>``; its op is built into its own
cache folder on first use, or beforehand with ``cd /tmp/ab-old && PYTHONPATH=. python -m ort_optim.build``). One
process per checkout in turn (A B A B ...), ``--rounds`` times; inside a process the candidates run round robin on
2000 x 1K, each warm (right after its own previous call) and cold (right after a 512 MB ``x.mul_`` probe), timed with
``time.perf_counter`` and ``time.thread_time``. Prints per checkout the median over rounds of each process's medians,
and ours / torch's fused AdamW in the same process (an anchor that no checkout changes). THREADS (default 1) sets
torch's thread count: with one thread the thread time is the whole step's CPU time, blind to other processes' time
slices on a shared machine.

Candidates (``--what``): fp32 (FusedAdam in AdamW mode, and torch's fused AdamW), check (the fp32 plan's re-validation
alone), fp16 / bf16 (master weights, grad_scale 1024, max_grad_norm 1.0, the gradients restored before every call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

N, K, SCALE = 2000, 1024, 1024.0


def child(what: list[str], reps: int) -> dict:
    import torch

    from ort_optim import AdamWMode, FusedAdam

    torch.set_num_threads(int(os.environ.get("THREADS", "1")))

    def make(dtype):
        g = torch.Generator().manual_seed(0)
        params = []
        for _ in range(N):
            p = torch.randn(K, generator=g).to(dtype)
            p.grad = (torch.randn(K, generator=g) * 1e-2).to(dtype)
            params.append(p)
        return params

    candidates = {}  # name -> (call, restore or None)
    if "fp32" in what or "check" in what:
        ours = FusedAdam(make(torch.float32), lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH)
        ours.step()
        if "fp32" in what:
            candidates["fp32 ours"] = (ours.step, None)
            theirs = torch.optim.AdamW(make(torch.float32), lr=1e-3, fused=True)
            candidates["fp32 torch fused"] = (theirs.step, None)
        if "check" in what:
            candidates["check"] = (ours._plan.groups[0].buckets[0].native.check, None)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        if name in what:
            params = make(dtype)
            grads = [p.grad.mul_(SCALE) for p in params]
            saved = [g.clone() for g in grads]
            opt = FusedAdam(params, lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH,
                            master_weights=True, max_grad_norm=1.0)
            candidates[f"{name} mixed ours"] = ((lambda opt=opt: opt.step(grad_scale=SCALE)),
                                                (lambda grads=grads, saved=saved: torch._foreach_copy_(grads, saved)))
    x = torch.rand(128 * 1024 * 1024)
    times = {(name, mode): ([], []) for name in candidates for mode in ("warm", "cold")}
    for rep in range(3 + reps):
        for name, (call, restore) in candidates.items():
            for mode in ("warm", "cold"):
                if restore is not None:
                    restore()
                if mode == "warm":
                    call()
                    if restore is not None:
                        restore()
                else:
                    x.mul_(1.0000001)
                start, cpu = time.perf_counter(), time.thread_time()
                call()
                wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
                if rep >= 3:
                    times[(name, mode)][0].append(wall)
                    times[(name, mode)][1].append(cpu)
    out = {}
    for (name, mode), (wall, cpu) in times.items():
        out[f"{name} {mode} ms"] = statistics.median(wall) * 1e3
        out[f"{name} {mode} thread ms"] = statistics.median(cpu) * 1e3
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="*")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--what", default="fp32,check,fp16,bf16")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    what = args.what.split(",")
    if args.child:
        print(json.dumps(child(what, args.reps)))
        return 0
    results: dict[str, list[dict]] = {c: [] for c in args.checkouts}
    for round_index in range(args.rounds):
        for checkout in args.checkouts:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--reps", str(args.reps),
                                   "--what", args.what], env=env, cwd=os.path.abspath(checkout), capture_output=True,
                                  text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            results[checkout].append(json.loads(lines[-1]))
            print(f"round {round_index} {checkout}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in results[checkout][-1].items() if "thread" in k), flush=True)
    names = list(results[args.checkouts[0]][0])
    print("\nmedian over rounds".ljust(36) + "".join(os.path.basename(c.rstrip("/"))[:20].rjust(21)
                                                       for c in args.checkouts))
    for name in names:
        print(name.ljust(36) + "".join(f"{statistics.median(r[name] for r in results[c]):21.3f}"
                                       for c in args.checkouts))
    if "fp32" in what:
        for checkout in args.checkouts:
            ratios = {mode: statistics.median(r[f"fp32 ours {mode} thread ms"] / r[f"fp32 torch fused {mode} thread ms"]
                                              for r in results[checkout]) for mode in ("warm", "cold")}
            print(f"{checkout}: ours / torch fused AdamW (thread time): warm {ratios['warm']:.3f}, "
                  f"cold {ratios['cold']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
