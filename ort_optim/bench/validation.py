"""What validation costs a FusedAdam step: the share of the step that re-validates its plan (ort_optim/_plan.py,
``Plan.read_grads_if_valid``: the rule above the tensors, then every tensor and gradient through the native
watches, or through Python fingerprints where the native library is not loaded).

Rows:

* ``native CPU``: 2000 x 1K fp32 params on the native CPU backend, on one intra-op thread and on torch's default
  count (``threads``: the step's kernel splits its work over them; the check runs on the calling thread, so its
  share grows with the threads). Each call runs right after a cold
  ``x.mul_(c)`` probe that evicts the caches (common.time_after_probe), as an optimizer step runs in training, calls
  interleaved: ``FusedAdam.step()`` as a whole, and ``Plan.read_grads_if_valid()`` alone (what each step re-validates).
  ``share`` = validation / step; the target is at most 10%. ``floor_ms``: the validation floor probe
  (probes.ValidationFloor), timed in the same loop after the same eviction: one load of each cache line of tensor
  metadata the check must read for these params (the lines the check itself prefetches), ideally prefetched, no
  logic; ``check_per_floor`` = validation / floor, and ``floor_share`` = floor / step, the share no check of these
  tensors' metadata can go below on this machine. ``between_steps``: what happens to the params and
  gradients before each call (untimed, BETWEEN_STEPS): nothing; gradients written in place
  (``zero_grad(set_to_none=False)`` then backward); new gradient tensors (``zero_grad()`` then backward); or params
  and gradients both written in place, as another optimizer stepping the same params does (bench fp32's
  candidates). Each of these bumps autograd's version counters or gives new tensors, which a sound check must see
  and a fast one must not re-plan for: a row whose step or share stands out from the first shows a check that does
  (``plans_built`` counts the timed steps' new plans: 0 unless the check failed). ``cpu_share``: the same from a
  second pass timed by this thread's CPU time (``time.thread_time``), which a loaded machine's scheduler does not
  inflate (on a shared machine, a wall-clock millisecond call is often several times its CPU time); one-thread rows
  only (None on the others: a thread's CPU time is not the time of a call split over several).
* ``triton host``: the host side of a step on the Triton backend (``ORT_OPTIM_BACKEND=triton``), on CPU tensors with
  the Triton launch replaced by a no-op, so that only the host's work is timed: ``Plan.read_grads_if_valid()``
  through the native watch against the Python fingerprints (the fallback where the native library is not loaded),
  and the whole ``FusedAdam.step()`` with each; 2000 x 1K and GPT-2 small's 148 tensors (first dims / 8:
  validation reads no data), interleaved, warm caches (the host's metadata is what a GPU step's host reads), one
  thread; ``cpu_*``: the same timed by this thread's CPU time.

    python -m ort_optim.bench --sections validation      # or alone:
    python -m ort_optim.bench.validation [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager

import torch

from .. import _plan, backends
from . import probes
from ..backends import triton as triton_backend
from ..fused_adam import AdamWMode, FusedAdam
from .common import WORKLOADS, gc_paused, intra_op_threads, make_params, time_after_probe, time_interleaved_one_thread


@contextmanager
def _environment(name: str, value: str):
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def _validation(opt: FusedAdam):
    return lambda: opt._plan.read_grads_if_valid(opt.param_groups, opt.state, opt._layout)


# What happens to the params and gradients between two steps of the native CPU rows (untimed, before the probe):
# nothing; what training does to them (autograd's version counters bump, gradient tensors come and go); or both
# written by another optimizer's in-place step over the same params, as bench fp32's candidates do to each other.
BETWEEN_STEPS = ("nothing", "grads written in place", "new grad tensors", "params and grads written in place")


def _between_steps(kind: str, params: list, grads: list):
    if kind == "nothing":
        return None
    if kind == "grads written in place":  # zero_grad(set_to_none=False), then backward accumulating into p.grad
        return lambda: torch._foreach_copy_([p.grad for p in params], grads)
    if kind == "new grad tensors":  # zero_grad() (set_to_none=True), then backward: new tensors every step

        def new_grads():
            for p, g in zip(params, grads):
                p.grad = g.clone()

        return new_grads

    def write_both():
        torch._foreach_add_(params, grads, alpha=-1e-3)
        torch._foreach_copy_([p.grad for p in params], grads)

    return write_both


def run_native_cpu(quick: bool) -> list[dict]:
    rows = []
    for threads in sorted({1, torch.get_num_threads()}):
        for between in BETWEEN_STEPS:
            rows.append(_native_cpu_row(quick, threads, between))
    return rows


def _native_cpu_row(quick: bool, threads: int, between: str) -> dict:
    params = make_params(WORKLOADS["2000x1K"](quick))
    grads = [p.grad.clone() for p in params]
    opt = FusedAdam(params, lr=1e-3, eps=1e-8, weight_decay=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH)
    between_steps = _between_steps(between, params, grads)
    with intra_op_threads(threads):
        opt.step()  # (plans)
        plans = [opt._plan]  # (each plan the timed calls step with: more than one means they planned again)

        def step():
            opt.step()
            plans.append(opt._plan)

        calls = {"FusedAdam.step()": step, "validation (Plan.read_grads_if_valid)": _validation(opt)}
        try:
            floor = probes.ValidationFloor([bucket for _, _, bucket in opt._plan.buckets()])
            calls["validation floor (probe)"] = floor
        except probes.ProbeUnavailable:
            floor = None

        def prepare():
            if between_steps is not None:
                between_steps()
            if floor is not None:
                floor.list_lines()  # (the gradients' lines may be new ones)

        numel = sum(p.numel() for p in params)
        # (this thread's CPU time says nothing of a step split over several threads: wall clock alone there)
        clocks = {"wall": time.perf_counter, "cpu": time.thread_time} if threads == 1 else {"wall": time.perf_counter}
        timed = {}
        for kind, clock in clocks.items():
            timed[kind], _, probe_gbps = time_after_probe(calls, dict.fromkeys(calls, 28.0 * numel), quick, warmup=2,
                                                          reps=5 if quick else 15, prepare=prepare, clock=clock)
    step, check = (timed["wall"][name] for name in list(calls)[:2])
    floor_time = timed["wall"].get("validation floor (probe)")
    cpu_step, cpu_check = (timed["cpu"][name] for name in list(calls)[:2]) if "cpu" in timed else (None, None)
    return {"section": "validation", "path": "native CPU", "workload": "2000x1K", "caches": "evicted",
            "threads": threads, "between_steps": between, "check": "native watch", "step_ms": step * 1e3,
            "validation_ms": check * 1e3, "share": check / step,
            "floor_ms": None if floor_time is None else floor_time * 1e3,
            "check_per_floor": None if floor_time is None else check / floor_time,
            "floor_share": None if floor_time is None else floor_time / step,
            "floor_lines": None if floor is None else floor.line_count,
            "cpu_step_ms": None if cpu_step is None else cpu_step * 1e3,
            "cpu_validation_ms": None if cpu_check is None else cpu_check * 1e3,
            "cpu_share": None if cpu_check is None else cpu_check / cpu_step, "target_share": 0.10,
            "plans_built": len({id(plan) for plan in plans}) - 1, "probe_GBps": probe_gbps,
            "native": backends.native_available()}


def _python_fallback(opt: FusedAdam) -> None:
    """The plan's buckets checked as where the native library is not loaded: Python fingerprints, no native watch."""
    for planned in opt._plan.groups:
        for bucket in planned.buckets:
            bucket.watch = None
            bucket.fingerprints = _plan.fingerprints(bucket.tensors())


def run_triton_host(quick: bool) -> list[dict]:
    rows = []
    launch = triton_backend.adam_step_
    triton_backend.adam_step_ = lambda *args, grad_norm=False, **kwargs: torch.zeros(2) if grad_norm else None
    try:
        with _environment("ORT_OPTIM_BACKEND", "triton"), intra_op_threads(1):
            for workload, shapes in (("2000x1K", WORKLOADS["2000x1K"](quick)),
                                     ("gpt2-small", WORKLOADS["gpt2-small"](True))):
                params = make_params(shapes)
                optimizers = {}
                for check in ("native watch", "Python fingerprints"):
                    opt = optimizers[check] = FusedAdam(params, lr=1e-3)
                    opt.step()  # (plans)
                    if check == "Python fingerprints":
                        _python_fallback(opt)
                    elif not backends.native_available():
                        del optimizers[check]  # (no native library: nothing to compare)
                calls = {}
                for check, opt in optimizers.items():
                    calls[f"validation, {check}"] = _validation(opt)
                    calls[f"step, {check}"] = opt.step
                medians, cpu = (time_interleaved_one_thread(calls, warmup=3, reps=10 if quick else 40, clock=clock)
                                for clock in (time.perf_counter, time.thread_time))
                for check in optimizers:
                    rows.append({"section": "validation", "path": "triton host (launch stubbed)",
                                 "workload": workload, "tensors": len(shapes), "caches": "warm", "check": check,
                                 "step_ms": medians[f"step, {check}"] * 1e3,
                                 "validation_ms": medians[f"validation, {check}"] * 1e3,
                                 "share": medians[f"validation, {check}"] / medians[f"step, {check}"],
                                 "cpu_step_ms": cpu[f"step, {check}"] * 1e3,
                                 "cpu_validation_ms": cpu[f"validation, {check}"] * 1e3,
                                 "target_ms": 1.0 if workload == "2000x1K" else None})
    finally:
        triton_backend.adam_step_ = launch
    return rows


def run(quick: bool) -> list[dict]:
    """The ``validation`` section's rows (module docstring)."""
    with gc_paused():  # (the Python fingerprints allocate thousands of tracked objects per check)
        return (run_native_cpu(quick) if backends.native_available() else []) + run_triton_host(quick)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="results/bench-validation.json")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    for row in rows:
        print(row)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
