"""What every benchmark section shares: workloads, the bandwidth probe, interleaved timing and result rows."""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch

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


@contextmanager
def gc_paused():
    """Python's cyclic collector off inside the block (after one collection), as timeit does while it times: a
    collection is triggered by the count of objects allocated since the last, so one that a candidate which allocates
    many (torch's for-loop optimizers, DeepSpeed's Python loops, the Python fingerprints) triggers would be charged to
    whichever call happens to run next."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def interleaved_samples(candidates: dict[str, Callable[[], None]], warmup: int, reps: int,
                        clock: Callable[[], float] = time.perf_counter,
                        prepare: Optional[dict[str, Callable[[], None]]] = None) -> dict[str, list[float]]:
    """Seconds of every call of each candidate, run round robin so that machine noise hits all alike: sample i of
    every candidate comes from the same round (pair them for per-round ratios), with the cyclic collector paused
    (gc_paused). ``clock``: see time_after_probe. ``prepare``: per candidate, a call run untimed right before each
    of its calls (to give every call the same inputs, e.g. gradients that a step writes back)."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    prepare = prepare or {}
    with gc_paused():
        for rep in range(warmup + reps):
            for name, fn in candidates.items():
                if name in prepare:
                    prepare[name]()
                start = clock()
                fn()
                if rep >= warmup:
                    times[name].append(clock() - start)
    return times


def time_interleaved(candidates: dict[str, Callable[[], None]], warmup: int, reps: int,
                     clock: Callable[[], float] = time.perf_counter,
                     prepare: Optional[dict[str, Callable[[], None]]] = None) -> dict[str, float]:
    """Median seconds per call of each candidate, run round robin (interleaved_samples, ``prepare`` included)."""
    return {name: statistics.median(values)
            for name, values in interleaved_samples(candidates, warmup, reps, clock, prepare).items()}


def time_interleaved_one_thread(candidates: dict[str, Callable[[], None]], warmup: int, reps: int,
                                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """time_interleaved on one intra-op thread (the thread count is restored after): for hot, cache-resident steps
    whose compute is divided by the thread count afterwards. A short parallel region on a shared 2-core machine
    waits for whichever of its threads the scheduler took away (measured: a 250 us step took 8-16 ms under load)."""
    with intra_op_threads(1):
        return time_interleaved(candidates, warmup, reps, clock)


@contextmanager
def intra_op_threads(threads: int):
    """torch on this many intra-op threads inside the block; the thread count is restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def time_after_probe(candidates: dict[str, Callable[[], None]], moved_bytes: dict[str, float], quick: bool,
                     warmup: int, reps: int, prepare: Optional[Callable[[], None]] = None,
                     clock: Callable[[], float] = time.perf_counter
                     ) -> tuple[dict[str, float], dict[str, float], float]:
    """Times each candidate right after an in-place ``x.mul_(c)`` over 512 MB (256 MB with quick), in one loop:
    probe, first candidate, probe, second candidate, and so on. The probe evicts the caches, so every candidate runs
    cold, as an optimizer step does in training (forward and backward evict the last-level cache in between), and
    it measures the memory bandwidth (8 bytes per element: read and write) at that moment, under the same load.
    ``prepare``, if given, runs untimed before each probe (to give every call the same inputs). ``clock`` times the
    candidates (``time.thread_time``: the CPU time of this thread, which a loaded machine's scheduler does not
    inflate); the probe is timed by the wall clock.

    Returns (median seconds per candidate; each candidate's bandwidth as a fraction of the probe's, from its
    ``moved_bytes`` per call: the median over repetitions of the ratio to the probe run just before it; the
    probe's median GB/s)."""
    x = torch.rand((64 if quick else 128) * 1024 * 1024)
    probe_bytes = 8 * x.numel()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    fractions: dict[str, list[float]] = {name: [] for name in candidates}
    probes: list[float] = []
    for rep in range(warmup + reps):
        for name, fn in candidates.items():
            if prepare is not None:
                prepare()
            start = time.perf_counter()
            x.mul_(1.0000001)
            middle = time.perf_counter()
            begin = clock()
            fn()
            took = clock() - begin
            if rep >= warmup:
                times[name].append(took)
                fractions[name].append((moved_bytes[name] / took) / (probe_bytes / (middle - start)))
                probes.append(middle - start)
    return ({name: statistics.median(v) for name, v in times.items()},
            {name: statistics.median(v) for name, v in fractions.items()},
            probe_bytes / statistics.median(probes) / 1e9)


def make_params(shapes, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.randn(shape, generator=generator).to(dtype)
        p.grad = (torch.randn(shape, generator=generator) * 1e-2).to(dtype)
        params.append(p)
    return params


def rows(section, workload, tensors, numel, medians, bytes_per_element, state_bytes) -> list[dict]:
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
