"""Floor probes: the least work a step of one kind can do over the same tensors (``ops/bench_probes.cpp``).

They answer, in the same run as the step they bound, whether a speed target is out of the machine's reach or only
out of our kernel's. Built on first use with torch.utils.cpp_extension into its own folder of the cache (about a
minute), with the native library's compiler flags; never part of the optimizer.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io

import torch

from ..backends import native


class ProbeUnavailable(RuntimeError):
    """The probe library could not be built here (no compiler, no sources in this install): the reason."""


@functools.lru_cache(maxsize=None)
def library():
    """The probe module (``lowbit_floor_step``, ``mixed_floor_step``, ``validation_floor_lines``, ``touch_lines``);
    raises ProbeUnavailable with the reason."""
    source = native.OPS_DIR / "bench_probes.cpp"
    if not source.exists():
        raise ProbeUnavailable(f"{source} is not in this install")
    # (the validation floor's lines: the plan's check's own list; the threads' split: the kernel's own)
    headers = [native.OPS_DIR / name for name in ("metadata_lines.h", "parallel_items.h")]
    digest = hashlib.sha256(source.read_bytes() + b"".join(h.read_bytes() for h in headers)
                            + " ".join(native.CFLAGS).encode()).hexdigest()[:16]
    folder = native.cache_root() / "bench-probes" / f"torch-{torch.__version__}-{digest}"
    try:  # (a cache that cannot be written, as a compiler error: a reason to skip the probe rows)
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.redirect_stderr(io.StringIO()):  # cpp_extension's "No CUDA runtime" line, as in native.build
            from torch.utils.cpp_extension import load

            with native.build_lock(folder):
                return load(name="ort_optim_bench_probes", sources=[str(source)], extra_cflags=native.CFLAGS,
                            extra_ldflags=["-fopenmp"], extra_include_paths=[str(native.OPS_DIR)],
                            build_directory=str(folder))
    except Exception as error:  # a compiler error is a reason to skip the probe rows, not to stop the benchmark
        lines = native.compiler_lines(str(error))  # (cpp_extension's message holds the whole ninja transcript)
        reason = lines[-1] if lines and not isinstance(error, OSError) else f"{type(error).__name__}: {error}"
        raise ProbeUnavailable(f"building {source.name} in {folder} failed: {reason}") from error


class LowBitFloorStep:
    """A step callable of :func:`library`'s ``lowbit_floor_step`` over fp32 params with linear ``bits``-bit codes:
    the cheapest block-quantised Adam step (decode, update, block maximum, encode; no tables, no stochastic
    rounding). A lower bound on the compute of any such format, not a usable format (see bench_probes.cpp)."""

    def __init__(self, params: list[torch.Tensor], bits: int):
        self.lib, self.bits, self.steps = library(), bits, 0
        block = 256 if bits == 8 else 128
        self.params = params
        self.grads = [p.grad for p in params]
        code_bytes = [p.numel() if bits == 8 else (p.numel() + 1) // 2 for p in params]
        self.codes_m = [torch.full((n,), 0 if bits == 8 else 8, dtype=torch.uint8) for n in code_bytes]
        self.codes_u = [torch.zeros(n, dtype=torch.uint8) for n in code_bytes]
        self.scales_m = [torch.zeros((p.numel() + block - 1) // block) for p in params]
        self.scales_u = [torch.zeros((p.numel() + block - 1) // block) for p in params]

    def __call__(self) -> None:
        self.steps += 1
        self.lib.lowbit_floor_step(self.params, self.grads, self.codes_m, self.codes_u, self.scales_m, self.scales_u,
                                   self.bits, 1e-3, 0.9, 0.999, 1e-8, 1e-2, self.steps)


class MixedFloorStep:
    """A step callable of ``mixed_floor_step`` over fp16 params and gradients with fp32 masters and moments: the
    mixed step's bytes (``BYTES_PER_ELEMENT``: gradient read once, param written, master and both moments read and
    written) with one multiply-add per array, in one parallel region over (tensor, chunk) work items like ours."""

    BYTES_PER_ELEMENT = 28

    def __init__(self, params: list[torch.Tensor], prefetch_ahead: int = 0):
        self.lib, self.prefetch_ahead = library(), prefetch_ahead
        self.params, self.grads = params, [p.grad for p in params]
        self.masters = [p.float() for p in params]
        self.exp_avgs = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sqs = [torch.zeros_like(m) for m in self.masters]

    def __call__(self) -> None:
        self.lib.mixed_floor_step(self.params, self.grads, self.masters, self.exp_avgs, self.exp_avg_sqs, 0.5,
                                  self.prefetch_ahead)


class ValidationFloor:
    """A callable of ``touch_lines`` over the cache lines of tensor metadata that a plan's check reads for its
    buckets (``validation_floor_lines``, per bucket: each param's TensorImpl, storage and AutogradMeta, its states'
    and step tensor's TensorImpls and storages, its gradient's TensorImpl and storage, then the steps'; each line
    once): one load per line, ``ahead`` lines prefetched before it, nothing else. The floor of a check
    (TensorWatch::check) of these tensors. buckets: the plan's (ort_optim._plan.Bucket: params, state_lists(),
    step_tensors, steps). :meth:`list_lines` lists the lines again (untimed) after the gradients change."""

    MAX_LINES_PER_PARAM = 64  # (about 20 in practice: see metadata_lines.h)

    def __init__(self, buckets: list, ahead: int = 32):
        self.lib, self.ahead, self.buckets = library(), ahead, list(buckets)
        # (one buffer per bucket, allocated once: listing again allocates nothing the step's tensors would notice)
        self.lines = [torch.empty(self.MAX_LINES_PER_PARAM * (len(b.params) + 1), dtype=torch.int64)
                      for b in self.buckets]
        self.counts = [0] * len(self.buckets)
        self.list_lines()

    def list_lines(self) -> None:
        for j, b in enumerate(self.buckets):
            self.counts[j] = self.lib.validation_floor_lines(b.params, [s for s in b.state_lists() if s],
                                                             b.step_tensors, b.steps, self.lines[j])
        self.line_count = sum(self.counts)

    def listed(self, j: int = 0) -> list[int]:
        """Bucket j's lines, as addresses."""
        return self.lines[j][: self.counts[j]].tolist()

    def __call__(self) -> None:
        for lines, count in zip(self.lines, self.counts):
            self.lib.touch_lines(lines, count, self.ahead)
