#!/usr/bin/env python
"""The one-shot device check of the Triton path: correctness on the GPU, then benchmarks, in about 5 minutes.

    python tools/gpu_check.py --out DIR            # on a machine with a CUDA GPU, torch and triton
    python tools/gpu_check.py --out DIR --dry-run  # anywhere: the same code paths on CPU tensors, tiny shapes,
                                                   # Triton's interpreter (no numbers worth reading)
    python tools/gpu_check.py --out DIR --bench-only --quick  # about a minute: the eager step against torch's
                                                   # fused AdamW on 1x4096^2, GPT-2 small and 2000 x 1K, GPU and host
                                                   # time per step

Needs only the repository plus torch, triton and numpy (no project venv; pytest is used when installed).

1. Correctness, compiled kernels on CUDA tensors: every storage combination x mode x amsgrad against the exact numpy
   model of ops/README.md (bit for bit; 8-bit and 4-bit states included), stochastic rounding of bf16 params,
   found_inf skips, grad_stats, the kernels on a non-default stream,
   FusedAdam(capturable=True).step() captured in a CUDA graph and replayed (== eager, bit for bit; clipped and
   scaled, and bf16 params rounded stochastically), one FusedAdam over CPU and CUDA params with a grad_scale,
   found_inf and clipping (== all on the CPU), and a plain
   step's last_grad_norm (summed by the Adam kernels) against the float64 total norm, eagerly and from graph replays. Then
   tests/triton_backend/test_triton.py under pytest, if pytest is installed.
2. Benchmarks against torch.optim.AdamW (fused=True, foreach=True, foreach=False): 1x1024^2, 32x512^2, 1x4096^2
   (fp32 params; ours with fp16 moments, as the reference numbers in the performance notes, and with fp32 moments),
   the GPT-2-small parameter shapes and 2000 x 1K (fp32), plus a graph-captured FusedAdam step; ours with 8-bit and
   4-bit moments (torch.uint8 / torch.uint4) on 1x4096^2 and GPT-2 small. Times are medians of
   CUDA-event timings of single steps after warm-up, interleaved; a device-to-device copy measured in the same run
   gives the bandwidth that the "% of copy bandwidth" column refers to (bytes each step must move at least / time).
   Then the plain step with and without last_grad_norm (its cost in the Adam kernel), fp32, 8-bit and 4-bit moments,
   on 1x4096^2 and GPT-2 small. A small sweep of the launch parameters (warps, blocks per program) on 1x4096^2 comes
   last.

Writes DIR/gpu_check.json (everything), DIR/gpu_check.md (the tables) and DIR/pytest.log, and prints the tables.
Exit status 0 when every correctness check passed (benchmarks never fail the run), 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

BUDGET_S = 290.0  # the whole run, correctness included
T0 = time.time()


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---- correctness ----------------------------------------------------------------------------------------------------

def correctness(device, dry_run: bool, results: dict) -> bool:
    import torch
    import triton_cases as tc
    from ort_optim.backends import triton as triton_backend

    checks = results.setdefault("checks", [])
    ok = True

    def record(name, fn):
        nonlocal ok
        t = time.time()
        try:
            fn()
            checks.append({"check": name, "ok": True, "seconds": round(time.time() - t, 2)})
        except Exception as exc:  # keep going: report every failure
            ok = False
            checks.append({"check": name, "ok": False, "seconds": round(time.time() - t, 2),
                           "error": f"{type(exc).__name__}: {exc}"[-3000:], "traceback": traceback.format_exc()[-6000:]})
            log(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:300]}")

    shapes = [(1000,), ()] if dry_run else tc.SHAPES + [(1 << 16,)]

    def combo_check(combo, mode, amsgrad, tensors):
        def run():
            base = tc.make_case(combo, amsgrad, seed=7 * mode + amsgrad, shapes=shapes)
            tri, ref = tc.clone_case(base, device), tc.clone_case(base)
            # lr, the unscale factor and found_inf as device tensors in half of the checks (one kernel variant each)
            hp = tc.hyper(mode, lr_tensor=torch.tensor([2e-3]) if tensors else None,
                          inv_grad_scale=torch.tensor([0.5]) if tensors else None,
                          found_inf=torch.zeros(1) if tensors else None)
            for step in range(2):
                tc.run_triton(tri, hp, device)
                tc.reference_step(ref, hp)
                tc.assert_bitwise(tri, ref, f"{combo} mode {mode} amsgrad {amsgrad} step {step}")
        return run

    # Every combination x mode x amsgrad when pytest is missing; otherwise (tests/triton_backend/test_triton.py runs them all next)
    # two per combination, to leave the time budget to the benchmarks (each variant is a compilation).
    try:
        import pytest  # noqa: F401
        full = False
    except ImportError:
        full = True
    combos = ["fp32", "fp32-fp16states", "bf16-master-fp16m-bf16v", "bf16-master-q8m-q4v"] if dry_run \
        else list(tc.COMBOS)
    for c, combo in enumerate(combos):
        for mode in (0, 1, 2):
            for amsgrad in (False, True):
                if (dry_run or not full) and (mode, amsgrad) not in (((c % 2), False), (2 - (c % 2), True)):
                    continue
                record(f"bitwise {combo} mode {mode}{' amsgrad' if amsgrad else ''}",
                       combo_check(combo, mode, amsgrad, tensors=(c + mode + amsgrad) % 2 == 0))
        log(f"checked {combo}")

    def found_inf_skip():
        base = tc.make_case("fp16-master-fp16states", True, seed=3, shapes=shapes)
        tri = tc.clone_case(base, device)
        tc.run_triton(tri, tc.hyper(2, found_inf=torch.ones(1)), device)
        tc.assert_bitwise(tri, base, "skipped step")
    record("found_inf skips everything (steps too)", found_inf_skip)

    def stochastic_rounding():
        from ort_optim._spec import rounding_key

        base = tc.make_case("bf16-q4", False, seed=17, shapes=shapes)
        keys = torch.tensor([rounding_key(7, i) for i in range(len(shapes))], dtype=torch.int64)
        tri, ref = tc.clone_case(base, device), tc.clone_case(base)
        hp = tc.hyper(2, lr=1e-3, rounding_keys=keys)
        for step in range(2):
            tc.run_triton(tri, hp, device)
            tc.reference_step(ref, hp)
            tc.assert_bitwise(tri, ref, f"stochastic rounding step {step}")
    record("bitwise stochastic rounding of bf16 params (rounding_keys)", stochastic_rounding)

    def grad_stats():
        gen = torch.Generator().manual_seed(2)
        ts = [torch.randn(3000, generator=gen), torch.randn(7, 5, generator=gen).half(),
              torch.randn(2100, generator=gen).bfloat16(), torch.randn(9, generator=gen, dtype=torch.float64)]
        out = triton_backend.grad_stats([t.to(device) for t in ts]).cpu()
        expected = sum(float((t.double() ** 2).sum()) for t in ts)
        assert abs(float(out[0]) - expected) <= 1e-6 * expected and float(out[1]) == 0.0, (out, expected)
        ts[2][5] = float("nan")
        assert float(triton_backend.grad_stats([t.to(device) for t in ts])[1]) == 1.0
    record("grad_stats", grad_stats)

    # FusedAdam's plain step: last_grad_norm summed by the Adam kernels themselves == the float64 total norm,
    # eagerly and (CUDA) from a captured graph's replays
    record("plain-step last_grad_norm == the float64 total norm (eager" + (", CUDA graph)" if device.type == "cuda" else ")"),
           lambda: tc.check_plain_step_norm(device, shapes=[(1000,), (), (40, 30)] if dry_run
                                            else [(1000, 1030), (4096,), (), (33, 17)]))

    record("FP16_Optimizer(FusedAdam) over fp16 params with an overflow == the CPU's bit for bit"
           + (", no host sync in step()" if device.type == "cuda" else ""), lambda: tc.check_fp16_optimizer(device))

    if device.type == "cuda":
        record("kernels run on the current (non-default) stream", lambda: tc.check_same_stream(device))
        record("CUDA graph capture/replay of FusedAdam(capturable=True)", lambda: tc.check_graph_capture(device))
        record("CUDA graph capture/replay with max_grad_norm and a grad_scale tensor",
               lambda: tc.check_graph_capture(device, clip=True))
        record("CUDA graph capture/replay of bf16 params rounded stochastically",
               lambda: tc.check_graph_capture(device, stochastic=True))
        record("one FusedAdam over CPU and CUDA params, grad_scale, found_inf and max_grad_norm == all on the CPU",
               lambda: tc.check_mixed_devices(device))
    else:
        checks.append({"check": "streams and CUDA graphs", "ok": None, "skipped": "needs CUDA"})
    return ok


def run_pytest(out: Path, dry_run: bool, results: dict) -> bool:
    try:
        import pytest  # noqa: F401
    except ImportError:
        results["pytest"] = {"skipped": "pytest is not installed; the built-in checks above ran instead"}
        return True
    timeout = max(30.0, min(150.0, left() - 120.0))
    env = dict(os.environ, PYTHONPATH=str(ROOT), ORT_OPTIM_NO_NATIVE=os.environ.get("ORT_OPTIM_NO_NATIVE", "1"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(ROOT / "tests" / "triton_backend" / "test_triton.py")]
    if not dry_run and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "8"]  # the kernels' compilations are CPU work
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
        cmd += ["-k", "canary or block_sizes or found_inf or grad_stats_empty or grad_norm_of"]
    log(f"pytest tests/triton_backend/test_triton.py (timeout {timeout:.0f}s)")
    t = time.time()
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text += f"\n[gpu_check] pytest timed out after {timeout:.0f}s"
        rc = -1
    (out / "pytest.log").write_text(text)
    summary = [line for line in text.strip().splitlines() if line.strip()][-1:] or [""]
    results["pytest"] = {"returncode": rc, "seconds": round(time.time() - t, 1), "summary": summary[0]}
    log(f"pytest: rc {rc}, {summary[0]}")
    return rc == 0


# ---- benchmarks -----------------------------------------------------------------------------------------------------

GPT2_SMALL = (
    [(50257, 768), (1024, 768)]
    + 12 * [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,),
            (3072, 768), (768,)]
    + [(768,), (768,)]
)


def workloads(dry_run: bool) -> list:
    if dry_run:
        return [("1x4096", [(4096,)], True), ("3x1500", [(1500,)] * 3, True), ("20x1K", [(1024,)] * 20, False)]
    return [
        ("1x1024^2", [(1024, 1024)], True),
        ("32x512^2", [(512, 512)] * 32, True),
        ("1x4096^2", [(4096, 4096)], True),
        ("GPT-2 small", GPT2_SMALL, False),
        ("2000x1K", [(1024,)] * 2000, False),
    ]


class Timer:
    """Per-step times: CUDA events on the current stream (GPU) or perf_counter (dry run)."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"

    def time(self, fn, iters: int, warmup: int) -> list:
        torch = self.torch
        for _ in range(warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize()
            pairs = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                pairs.append((a, b))
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in pairs]
        else:
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return times


def copy_bandwidth(device, dry_run: bool) -> float:
    """GB/s of a large device-to-device copy (bytes read + written), median of several."""
    import torch

    n = (1 << 20) if dry_run else (1 << 28)  # 1 GiB of fp32 on the GPU
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = Timer(device).time(lambda: dst.copy_(src), iters=5 if dry_run else 30, warmup=2)
    return 2 * n * 4 / (statistics.median(times) * 1e-3) / 1e9


MOMENT_BYTES = {"fp32": 4, "fp16": 2 + 4 / 1024, "uint8": 1 + 4 / 256, "uint4": 0.5 + 2 / 128,
                "fp8": 1 + 4 / 256}  # codes + scales


def min_bytes(numel: int, moments: str) -> int:
    """Bytes one step must move at least: read grad (fp32), read+write param (fp32), read+write both moments."""
    return int(numel * (4 + 8 + 2 * 2 * MOMENT_BYTES[moments]))


def params_maker(device):
    """make_params(shapes): fp32 Parameters of these shapes on the device with random gradients (seeded once)."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def make_params(shapes):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        return params
    return make_params


def benchmarks(device, dry_run: bool, results: dict) -> None:
    import torch

    from ort_optim import FusedAdam
    from ort_optim.backends import triton as triton_backend
    from ort_optim.fused_adam import _leaving_out

    def without_norm(step):
        def step_without_norm():
            with _leaving_out(plain_norm=True):
                step()
        return step_without_norm

    timer = Timer(device)
    iters, warmup = (3, 1) if dry_run else (30, 5)
    bw = copy_bandwidth(device, dry_run)
    results["copy_bandwidth_GBps"] = round(bw, 1)
    log(f"device-to-device copy: {bw:.0f} GB/s")
    rows = results.setdefault("benchmarks", [])
    make_params = params_maker(device)

    for name, shapes, fp16_too in workloads(dry_run):
        if left() < 40:
            rows.append({"workload": name, "skipped": "out of time"})
            continue
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        variants = []
        for label, kwargs in (("torch AdamW fused", dict(fused=True)), ("torch AdamW foreach", dict(foreach=True)),
                              ("torch AdamW for-loop", dict(foreach=False))):
            if label.endswith("for-loop") and len(shapes) > 200 and left() < 120:
                continue
            variants.append((label, "fp32", lambda kw=kwargs: torch.optim.AdamW(make_params(shapes), lr=1e-3, **kw)))
        variants.append(("FusedAdam (Triton)", "fp32", lambda: FusedAdam(make_params(shapes), lr=1e-3,
                                                                         adam_w_mode=2, weight_decay=0.01)))
        if fp16_too:
            variants.append(("FusedAdam (Triton)", "fp16", lambda: FusedAdam(
                make_params(shapes), lr=1e-3, adam_w_mode=2, weight_decay=0.01, exp_avg_dtype=torch.float16,
                exp_avg_sq_dtype=torch.float16)))
        if name in ("1x4096^2", "GPT-2 small", "1x4096"):
            for moments, dtype in (("uint8", torch.uint8), ("uint4", torch.uint4), ("fp8", torch.float8_e4m3fn)):
                variants.append(("FusedAdam (Triton)", moments, lambda dt=dtype: FusedAdam(
                    make_params(shapes), lr=1e-3, adam_w_mode=2, weight_decay=0.01, exp_avg_dtype=dt,
                    exp_avg_sq_dtype=dt)))
        opts = []
        for label, moments, make in variants:
            try:
                opt = make()
                opt.step()  # creates the state, compiles the kernels
                opts.append((label, moments, opt))
            except Exception as exc:
                rows.append({"workload": name, "optimizer": label, "moments": moments,
                             "error": f"{type(exc).__name__}: {exc}"[-500:]})
        times = {i: [] for i in range(len(opts))}
        for _ in range(3):  # interleaved rounds
            for i, (_, _, opt) in enumerate(opts):
                times[i] += timer.time(opt.step, iters=iters // 3 or 1, warmup=warmup // 3 or 1)
        reference = None
        for i, (label, moments, opt) in enumerate(opts):
            med = statistics.median(times[i])
            if label == "torch AdamW fused":
                reference = med
            rows.append({
                "workload": name, "tensors": len(shapes), "numel": numel, "optimizer": label, "moments": moments,
                "median_ms": round(med, 4), "min_ms": round(min(times[i]), 4),
                "pct_of_copy_bw": round(100 * min_bytes(numel, moments) / (med * 1e-3) / 1e9 / bw, 1),
            })
        for row in rows:
            if row.get("workload") == name and "median_ms" in row and reference:
                row["x_vs_torch_fused"] = round(reference / row["median_ms"], 2)
        # The raw op (no FusedAdam Python around it) and a graph-captured FusedAdam step.
        try:
            opt = FusedAdam(make_params(shapes), lr=torch.tensor(1e-3, device=device), adam_w_mode=2,
                            weight_decay=0.01, capturable=True)
            opt.step()
            if device.type == "cuda" and not dry_run:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    opt.step()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    opt.step()
                t = timer.time(graph.replay, iters=iters, warmup=warmup)
                med = statistics.median(t)
                rows.append({"workload": name, "tensors": len(shapes), "numel": numel,
                             "optimizer": "FusedAdam (Triton), CUDA graph", "moments": "fp32",
                             "median_ms": round(med, 4), "min_ms": round(min(t), 4),
                             "pct_of_copy_bw": round(100 * min_bytes(numel, "fp32") / (med * 1e-3) / 1e9 / bw, 1),
                             "x_vs_torch_fused": round(reference / med, 2) if reference else None})
        except Exception as exc:
            rows.append({"workload": name, "optimizer": "FusedAdam (Triton), CUDA graph",
                         "error": f"{type(exc).__name__}: {exc}"[-500:]})
        del opts
        log(f"benchmarked {name}")

    # What the plain-step norm costs: the same plain step with and without it (ort_optim.fused_adam._leaving_out), interleaved.
    # The norm adds a multiply and an add per element and a reduction per program to the Adam kernel, plus one tiny
    # launch; ptxas gives some variants more registers (tools/aot_compile.py), fewer resident programs for a few
    # quantised-moment ones, which is what this measures.
    norm_rows = results.setdefault("plain_norm_cost", [])
    for name, shapes in ((("1x4096", [(4096,)]), ("20x1K", [(1024,)] * 20)) if dry_run else
                         (("1x4096^2", [(4096, 4096)]), ("GPT-2 small", GPT2_SMALL))):
        for moments, dtype in (("fp32", torch.float32), ("uint8", torch.uint8), ("uint4", torch.uint4),
                               ("fp8", torch.float8_e4m3fn)):
            if left() < 30:
                norm_rows.append({"workload": name, "moments": moments, "skipped": "out of time"})
                continue
            try:
                pair = []
                for with_norm in (True, False):
                    opt = FusedAdam(make_params(shapes), lr=1e-3, adam_w_mode=2, weight_decay=0.01,
                                    exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
                    pair.append(opt.step if with_norm else without_norm(opt.step))
                    pair[-1]()
                    assert (opt.last_grad_norm is not None) == with_norm
                times = ([], [])
                for _ in range(3):
                    for i, step in enumerate(pair):
                        times[i].extend(timer.time(step, iters=iters // 3 or 1, warmup=warmup // 3 or 1))
                med = [statistics.median(t) for t in times]
                norm_rows.append({"workload": name, "moments": moments, "with_norm_ms": round(med[0], 4),
                                  "without_ms": round(med[1], 4), "ratio": round(med[0] / med[1], 3)})
                del pair
            except Exception as exc:
                norm_rows.append({"workload": name, "moments": moments,
                                  "error": f"{type(exc).__name__}: {exc}"[-500:]})
    log("priced the plain-step norm")

    # Launch-parameter sweep on the largest single tensor.
    sweep = results.setdefault("sweep", [])
    shape = [(4096,)] if dry_run else [(4096, 4096)]
    saved = (triton_backend.NUM_WARPS, triton_backend.BLOCKS_PER_PROGRAM)
    try:
        for warps in (4, 8):
            for bpp in (1, 2, 4):
                if left() < 20:
                    break
                triton_backend.NUM_WARPS, triton_backend.BLOCKS_PER_PROGRAM = warps, bpp
                opt = FusedAdam(make_params(shape), lr=1e-3, adam_w_mode=2, exp_avg_dtype=torch.float16,
                                exp_avg_sq_dtype=torch.float16)
                opt.step()
                med = statistics.median(timer.time(opt.step, iters=iters, warmup=warmup))
                numel = int(torch.Size(shape[0]).numel())
                sweep.append({"num_warps": warps, "blocks_per_program": bpp, "median_ms": round(med, 4),
                              "pct_of_copy_bw": round(100 * min_bytes(numel, "fp16") / (med * 1e-3) / 1e9 / bw, 1)})
        # ptxas's own register choice for the quantised-moment kernels (128 registers, a few spilled bytes, 2 CTAs per
        # SM on sm_80) against no cap (tools/aot_compile.py, spill_limit)
        triton_backend.NUM_WARPS, triton_backend.BLOCKS_PER_PROGRAM = saved
        for maxnreg in (None, 255):
            if left() < 20:
                break
            triton_backend.MAXNREG = maxnreg
            triton_backend.clear_caches()
            opt = FusedAdam(make_params(shape), lr=1e-3, adam_w_mode=2, amsgrad=True, exp_avg_dtype=torch.uint4,
                            exp_avg_sq_dtype=torch.uint4)
            opt.step()
            med = statistics.median(timer.time(opt.step, iters=iters, warmup=warmup))
            sweep.append({"moments": "4-bit, amsgrad", "maxnreg": maxnreg, "median_ms": round(med, 4)})
    finally:
        triton_backend.NUM_WARPS, triton_backend.BLOCKS_PER_PROGRAM = saved
        triton_backend.MAXNREG = None
        triton_backend.clear_caches()


QUICK_WORKLOADS = [("1x4096^2", [(4096, 4096)]), ("GPT-2 small", GPT2_SMALL), ("2000x1K", [(1024,)] * 2000)]


def quick_bench(device, dry_run: bool, results: dict) -> None:
    """The eager step, FusedAdam (fp32 moments, AdamW mode) against torch.optim.AdamW(fused=True), interleaved: the
    median time per step on the device (CUDA events) and the host's time per step (perf_counter over 20 steps that
    are not waited for: Python and the launches, what an eager step costs the CPU)."""
    import torch

    from ort_optim import FusedAdam

    timer = Timer(device)
    rows = results.setdefault("quick", [])
    make_params = params_maker(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    workloads = [("1x4096", [(4096,)]), ("3x1K", [(1024,)] * 3)] if dry_run else QUICK_WORKLOADS
    for name, shapes in workloads:
        opts = [("torch AdamW fused", torch.optim.AdamW(make_params(shapes), lr=1e-3, weight_decay=0.01, fused=True)),
                ("FusedAdam (Triton)", FusedAdam(make_params(shapes), lr=1e-3, adam_w_mode=2, weight_decay=0.01))]
        device_ms = {label: [] for label, _ in opts}
        host_ms = {label: [] for label, _ in opts}
        for _, opt in opts:
            opt.step()  # creates the state, compiles the kernels
        for _ in range(3):  # interleaved rounds
            for label, opt in opts:
                device_ms[label] += timer.time(opt.step, iters=3 if dry_run else 10, warmup=1)
                sync()
                t = time.perf_counter()
                for _ in range(20):
                    opt.step()
                host_ms[label].append((time.perf_counter() - t) / 20 * 1e3)
                sync()
        reference = statistics.median(device_ms["torch AdamW fused"])
        for label, _ in opts:
            med = statistics.median(device_ms[label])
            rows.append({"workload": name, "tensors": len(shapes), "optimizer": label, "median_ms": round(med, 4),
                         "host_ms": round(statistics.median(host_ms[label]), 4),
                         "x_vs_torch_fused": round(reference / med, 2)})
        del opts
        log(f"quick: {name}")


# ---- report ---------------------------------------------------------------------------------------------------------

def markdown(results: dict) -> str:
    lines = [f"# gpu_check: {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}, dry run: {results['dry_run']}", ""]
    checks = results.get("checks", [])
    failed = [c for c in checks if c.get("ok") is False]
    lines.append(f"Correctness: {sum(1 for c in checks if c.get('ok'))} checks passed, {len(failed)} failed; "
                 f"pytest: {results.get('pytest', {}).get('summary') or results.get('pytest', {}).get('skipped')}")
    for c in failed:
        lines.append(f"- FAILED {c['check']}: {c['error'][:300]}")
    if results.get("benchmarks"):
        lines += ["", f"Device-to-device copy: {results.get('copy_bandwidth_GBps')} GB/s (read + write)", "",
                  "| workload | tensors | optimizer | moments | median ms | x vs torch fused | % of copy bw |",
                  "|---|---|---|---|---|---|---|"]
    for r in results.get("benchmarks", []):
        if "median_ms" in r:
            lines.append(f"| {r['workload']} | {r['tensors']} | {r['optimizer']} | {r['moments']} | {r['median_ms']} | "
                         f"{r.get('x_vs_torch_fused')} | {r['pct_of_copy_bw']} |")
        else:
            lines.append(f"| {r['workload']} | | {r.get('optimizer', '')} | | {r.get('error') or r.get('skipped')} | | |")
    if results.get("quick"):
        lines += ["", "Eager step (fp32 moments) against torch's fused AdamW, interleaved; host ms: perf_counter per "
                  "step, not waited for:", "",
                  "| workload | tensors | optimizer | median ms | x vs torch fused | host ms |", "|---|---|---|---|---|---|"]
        for r in results["quick"]:
            lines.append(f"| {r['workload']} | {r['tensors']} | {r['optimizer']} | {r['median_ms']} | "
                         f"{r['x_vs_torch_fused']} | {r['host_ms']} |")
    if results.get("plain_norm_cost"):
        lines += ["", "Plain step with last_grad_norm (summed by the Adam kernel) vs without, interleaved:", "",
                  "| workload | moments | with norm ms | without ms | ratio |", "|---|---|---|---|---|"]
        for r in results["plain_norm_cost"]:
            first = r.get("with_norm_ms", r.get("error") or r.get("skipped"))
            lines.append(f"| {r['workload']} | {r['moments']} | {first} | {r.get('without_ms', '')} | "
                         f"{r.get('ratio', '')} |")
    if results.get("sweep"):
        lines += ["", "Launch sweep, 1x4096^2 fp32 params with fp16 moments:", "",
                  "| num_warps | blocks/program | median ms | % of copy bw |", "|---|---|---|---|"]
        for r in results["sweep"]:
            if "num_warps" in r:
                lines.append(f"| {r['num_warps']} | {r['blocks_per_program']} | {r['median_ms']} | {r['pct_of_copy_bw']} |")
        lines += ["", "Register cap of the quantised-moment kernel (ORT_OPTIM_TRITON_MAXNREG), same shape:", "",
                  "| moments | maxnreg | median ms |", "|---|---|---|"]
        for r in results["sweep"]:
            if "maxnreg" in r:
                lines.append(f"| {r['moments']} | {r['maxnreg'] or 'ptxas default'} | {r['median_ms']} |")
    if results["dry_run"]:
        lines += ["", "DRY RUN: CPU tensors through Triton's interpreter; the times above measure nothing useful."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU tensors, Triton's interpreter, tiny shapes")
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--bench-only", action="store_true", help="no correctness checks, no pytest")
    parser.add_argument("--quick", action="store_true",
                        help="instead of the benchmarks: the eager step against torch's fused AdamW (about a minute)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        os.environ.setdefault("ORT_OPTIM_TRITON_BLOCKS", "1")
    import torch
    import triton

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to exercise the code paths on the CPU")
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda")
    results = {
        "device": "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "dry_run": args.dry_run, "argv": sys.argv,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        results.update(sm_count=props.multi_processor_count, memory_GiB=round(props.total_memory / 2**30, 1),
                       capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    chosen = os.environ.get("ORT_OPTIM_BACKEND", "auto")
    if not args.dry_run and chosen not in ("auto", "triton"):
        print(f"ORT_OPTIM_BACKEND={chosen} would run the checks and benchmarks of the Triton path on another backend: "
              "unset it")
        return 2
    os.environ["ORT_OPTIM_BACKEND"] = "triton" if args.dry_run else chosen
    ok = True
    try:
        if not args.bench_only:
            log(f"correctness on {results['device']}")
            ok = correctness(device, args.dry_run, results) and ok
            if not args.skip_pytest:
                ok = run_pytest(args.out, args.dry_run, results) and ok
        if args.quick:
            quick_bench(device, args.dry_run, results)
        elif not args.skip_bench:
            benchmarks(device, args.dry_run, results)
    except Exception as exc:
        ok = False
        results["fatal"] = traceback.format_exc()[-6000:]
        log(f"FATAL {type(exc).__name__}: {exc}")
    finally:
        results["seconds"] = round(time.time() - T0, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
        report = markdown(results)
        (args.out / "gpu_check.md").write_text(report)
        print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
