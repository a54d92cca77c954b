"""The native backend: builds and loads the C++ CPU library compiled from ``ops/`` (schemas in ``ops/schema.cpp``,
called through ``torch.ops.ort_optim``), and wraps its ``AdamPlan`` helper class.

The library is built by the project's setup (``python -m ort_optim.build``) into a cache folder keyed by the torch
version, C++ ABI and location, the sources and the CPU's instruction-set flags (not the Python ABI: the library uses no
Python C API, only torch's C++ API and torch.library registration), from a copy of the
sources in that folder, and loaded on first use, never at import time. Dispatch between backends is :mod:`ort_optim.backends`' job, not this module's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import logging
import os
import platform
import re
import struct
import subprocess
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import _spec

# The checkout's ops/, or the copy a wheel carries (setup.py puts it in ort_optim/_ops).
_PACKAGE = Path(__file__).resolve().parent.parent
OPS_DIR = next((d for d in (_PACKAGE.parent / "ops", _PACKAGE / "_ops") if (d / "schema.cpp").exists()),
               _PACKAGE.parent / "ops")
# The files the library is built from (ops/README.md, "Files"): its translation units (.cpp, compiled) and the headers
# they share (.h); all of them go into the cache key and into a wheel. ops/bench_probes.cpp is not one of them.
SOURCES = ("schema.cpp", "registration.cpp", "step.cpp", "adam_kernel.cpp", "adam_kernel.h", "validation.cpp",
           "validation.h", "grad_stats.cpp", "grad_stats.h", "adam_plan.cpp", "adam_plan.h", "low_bit.cpp",
           "low_bit.h", "fp8.cpp", "fp8.h", "conversions.h", "rounding.h", "step.h", "metadata_lines.h",
           "parallel_items.h")
# -fno-math-errno lets sqrt vectorise; -march=native is safe because the build folder is keyed by the CPU flags;
# -ffp-contract=off keeps every multiply and add separately rounded, as ops/README.md specifies, so the CPU kernel
# and the Triton kernels agree bit for bit (the update is memory-bound: FMA would buy nothing). The pure-PyTorch
# path matches the moments bit for bit but can differ from them in the last bit of a few parameter elements.
# -fno-semantic-interposition: a shared library's own functions may be called directly and inlined, not through
# the PLT (nothing interposes them): the per-tensor helpers of the plan's check() cost no call.
# No -std: torch.utils.cpp_extension passes the C++ standard its own headers need (C++17 for torch 2.4, C++20 from
# torch 2.13 on; torch 2.14's headers do not compile as C++17), and a later -std of ours would override it.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
          "-ffp-contract=off", "-fopenmp", "-fno-semantic-interposition"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def spec_header() -> str:
    """ort_optim_spec.h, generated into the build folder from ort_optim/_spec.py: the low-bit formats' block sizes
    and code levels (exact float32 values as hex literals), so the C++ kernels read the one definition."""

    def array(name: str, values) -> str:
        return f"constexpr float {name}[] = {{{', '.join(float(v).hex() + 'f' for v in values)}}};"

    lines = ["// Generated from ort_optim/_spec.py by ort_optim/backends/native.py (spec_header); do not edit.",
             "#pragma once", "namespace ort_optim {", "namespace spec {"]
    for tag, fmt in (("Q8", _spec.Q8), ("Q4", _spec.Q4)):
        lines += [
            f"constexpr int k{tag}Bits = {fmt.bits};",
            f"constexpr int k{tag}Block = {fmt.block};",
            f"constexpr bool k{tag}Bf16Scales = {'true' if fmt.scale_dtype == torch.bfloat16 else 'false'};",
            f"constexpr bool k{tag}ExpAvgRelative = {'true' if fmt.exp_avg_relative else 'false'};",
            array(f"k{tag}ExpAvgLevels", fmt.exp_avg_levels),
            array(f"k{tag}ExpAvgSqLevels", fmt.exp_avg_sq_levels),
            array(f"k{tag}ExpAvgThresholds", fmt.sr_thresholds(False)),
            array(f"k{tag}ExpAvgSqThresholds", fmt.sq_thresholds()),
            f"constexpr bool k{tag}ExpAvgSqStochastic = {'true' if fmt.exp_avg_sq_stochastic else 'false'};",
            array(f"k{tag}ExpAvgSqSrThresholds", fmt.sr_thresholds(True)),
            array(f"k{tag}ExpAvgSqSquares", _spec.square_tables(fmt.exp_avg_sq_levels)[0]),
            array(f"k{tag}ExpAvgSqSquareGaps", _spec.square_tables(fmt.exp_avg_sq_levels)[1]),
            f"constexpr float k{tag}MinSqScale = {fmt.min_sq_scale.hex()}f;",
        ]
    max_root_bits = struct.unpack("<I", struct.pack("<f", _spec.FP8_MAX_ROOT))[0]  # (exact: a float32 value)
    lines += [f"constexpr float kExpAvgSnap = {_spec.EXP_AVG_SNAP.hex()}f;",
              f"constexpr uint32_t kExpAvgSrUlps = {_spec.EXP_AVG_SR_ULPS};",
              f"constexpr uint32_t kCanonicalNan = {_spec.CANONICAL_NAN:#x}u;",
              f"constexpr bool kFp16SqrtSecondMoment = {'true' if _spec.FP16_SQRT_SECOND_MOMENT else 'false'};",
              f"constexpr int kFp8Block = {_spec.FP8_E4M3.block};",
              f"constexpr int kFp8MinExponent = {_spec.FP8_E4M3.min_exponent};",
              f"constexpr uint32_t kFp8MaxMantissa = {_spec.FP8_E4M3.max_mantissa:#x}u;",
              f"constexpr uint32_t kFp8MaxRootBits = {max_root_bits:#x}u;",
              f"constexpr double kMaxStep = {_spec.MAX_STEP.hex()};",
              f"constexpr int kFp8E4M3MinSqExponent = {_spec.FP8_E4M3.min_sq_exponent};",
              f"constexpr int kFp8E5M2MinSqExponent = {_spec.FP8_E5M2.min_sq_exponent};",
              "}  // namespace spec", "}  // namespace ort_optim", ""]
    return "\n".join(lines)


def _abi() -> str:
    """What the library is compiled against besides torch's version: torch's C++ ABI (a source build or conda torch
    may differ from the PyPI wheel of the same version). Not the Python ABI: the library includes no Python header
    and links no Python library (``--as-needed`` drops the libtorch_python that torch's build adds), so environments
    of different Pythons with the same torch build share it."""
    return f"cxx11abi={int(torch.compiled_with_cxx11_abi())}"


def _source_files() -> list[Path]:
    """The library's sources and the headers they include."""
    return [OPS_DIR / name for name in SOURCES]


def build_dir() -> Path:
    """Folder of the native library for this torch (version, C++ ABI and location), these sources,
    the generated spec header and this CPU: environments that share the cache never load each other's library, and
    clones, worktrees and installed wheels with the same sources share one build. torch's build records the paths of
    the sources and of torch's headers in the folder's build.ninja, and recompiles when they change: so the sources
    are compiled from a copy inside the folder (build()), never from where they were found, and torch's location is
    part of the key."""
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(spec_header().encode())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(_cpu_flags().encode())
    digest.update(_abi().encode())
    digest.update(str(Path(torch.__file__).resolve().parent).encode())
    return cache_root() / "ops" / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


def cache_root() -> Path:
    """The cache folder: $ORT_OPTIM_CACHE, or ~/.cache/ort-optim where it is unset or empty (as tools/make_env.sh
    reads it: an empty value would otherwise build into the current directory)."""
    return Path(os.environ.get("ORT_OPTIM_CACHE") or Path.home() / ".cache" / "ort-optim")


def _baton_lock() -> bool:
    """Whether torch.utils.cpp_extension locks a build folder with a FileBaton (torch < 2.14): a ``lock`` file whose
    existence is the lock. torch >= 2.14 takes a filelock.FileLock instead, an flock on that file, which stays on disk
    after every build and blocks nothing once its holder is gone."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


@contextlib.contextmanager
def build_lock(folder: Path, stale_lock_blocks: Optional[bool] = None):
    """Serialises the builds into ``folder`` (a torch.utils.cpp_extension build directory) across processes, and
    clears what a killed build left behind.

    cpp_extension's own lock before torch 2.14 is a file, ``folder/lock``, created at the start of a build and removed
    at its end: a build killed in between (Ctrl-C at the wrong moment, a CI timeout) leaves it, and every later build
    then waits for it forever, printing nothing. This lock is an ``fcntl.flock`` on ``folder/build.flock``, which the
    kernel releases when its holder dies. Every build of ours takes it first, so while it is held no other build of
    ours is running, and a ``lock`` file found then was left by a dead one: it is removed (with a warning naming it).
    stale_lock_blocks: whether such a file blocks builds (default: whether this torch's cpp_extension locks with a
    FileBaton, :func:`_baton_lock`); from torch 2.14 on, its lock is an flock too, whose file is left alone."""
    if stale_lock_blocks is None:
        stale_lock_blocks = _baton_lock()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale_lock_blocks and stale.exists():
                warnings.warn(f"ort_optim: removed {stale}, left by a build that was killed (no build of ours "
                              "holds the folder now)", RuntimeWarning, stacklevel=3)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


LIBRARY = "ort_optim_ops.so"
# What a successful build produced (size and sha256 of the library), written beside it: a library whose stamp is
# missing or differs (truncated by a full disk, a killed copy, an edit) is rebuilt, never loaded; loading a truncated
# shared object kills the process with SIGBUS, beyond any except clause.
STAMP = "ort_optim_ops.stamp"
# errno of a cache folder this process cannot write (a read-only mount, another user's folder)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class BuildError(RuntimeError):
    """The native library could not be built or loaded here; the message says what failed in one line.
    details: the compiler's last meaningful lines (empty when there are none); compiled: whether a build ran (and has
    a log worth reading with ``--verbose``), not a refusal before it."""

    def __init__(self, message: str, details: Sequence[str] = (), compiled: bool = True) -> None:
        super().__init__(message)
        self.details = list(details)
        self.compiled = compiled


def _fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return f"size={path.stat().st_size} sha256={digest.hexdigest()}\n"


def verified(path: Path) -> bool:
    """Whether the library at path is the one its build recorded in the stamp beside it (same size and sha256)."""
    try:
        return (path.parent / STAMP).read_text() == _fingerprint(path)
    except OSError:
        return False


def _record(path: Path) -> None:
    """Writes the stamp of a library just built and loaded (replaced atomically: a reader sees the old or the new)."""
    stamp, text = path.parent / STAMP, _fingerprint(path)
    if not stamp.exists() or stamp.read_text() != text:
        partial = stamp.with_name(f"{STAMP}.{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, stamp)


def _discard_unverified(path: Path) -> None:
    """Removes a library (and its stamp) that its stamp does not vouch for, so that the build relinks it: ninja alone
    would find a truncated library newer than its objects and keep it."""
    if path.exists() and not verified(path):
        path.unlink()
        (path.parent / STAMP).unlink(missing_ok=True)


def compiler_lines(text: str, limit: int = 5) -> list[str]:
    """The last meaningful lines of a build transcript: its errors, or else its last lines."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    wanted = re.compile(r"error|fatal|not found|No such file|undefined reference|cannot", re.IGNORECASE)
    picked = [line for line in lines if wanted.search(line) and not line.startswith("[")] or lines[-3:]
    picked = list(dict.fromkeys(line[:300] for line in picked))
    return picked[-limit:]


def _build_error(folder: Path, error: Exception) -> BuildError:
    """A BuildError for an exception of torch.utils.cpp_extension.load: whose message holds the whole ninja
    transcript (compiler command lines of several KB) in place of the few lines that say what went wrong."""
    if isinstance(error, subprocess.CalledProcessError) and list(error.cmd)[:1] == ["which"]:  # (torch < 2.5)
        return BuildError(f"building the native library in {folder} failed: {error.cmd[-1]}: not found (no C++ "
                          "compiler on PATH)", [])
    text = str(error)
    cause = error.__cause__
    if isinstance(cause, subprocess.CalledProcessError) and not text.partition(":")[2].strip():
        text = str(cause)
    details = compiler_lines(text.partition(":")[2] if text.startswith("Error building extension") else text)
    reason = details[-1][:200] if details else f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"
    return BuildError(f"building the native library in {folder} failed: {reason}", details)


def _cpp_extension():
    """torch.utils.cpp_extension, imported without its output: on a CUDA build of torch without a GPU it prints "No
    CUDA runtime is found, using CUDA_HOME=...", noise for a CPU-only library (and the one line beside `make setup`'s
    own)."""
    with contextlib.redirect_stderr(io.StringIO()):
        from torch.utils import cpp_extension
    return cpp_extension


def _load_or_build(verbose: bool, build_anyway: bool) -> Path:
    """Loads this torch's library from the cache, building it first when it is not there or not verified; with
    build_anyway, runs the build (a no-op when up to date) even over a verified library. Holds the folder's build
    lock throughout, so no process loads a library another is linking; where the lock cannot be taken because the
    cache cannot be written, loads a verified library without it (nothing can be building it there)."""
    folder = build_dir()
    path = folder / LIBRARY
    if not build_anyway and _load_if_verified(folder, path):
        return path
    _cpp_extension()  # (quietly, before build_lock imports it)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(build_lock(folder))
        except OSError as error:
            if error.errno not in _READ_ONLY:
                raise
            if not verified(path):
                raise BuildError(f"the cache folder {folder} cannot be written ({error.strerror}) and holds no "
                                 "verified native library: set ORT_OPTIM_CACHE to a writable folder",
                                 compiled=False) from None
            torch.ops.load_library(str(path))
            return path
        if verified(path) and not build_anyway:
            torch.ops.load_library(str(path))
            return path
        _discard_unverified(path)
        _compile(folder, verbose)  # (loads the library into this process)
        _record(path)
    return path


def _load_if_verified(folder: Path, path: Path) -> bool:
    """The common case of a load, cheaply: loads the library if its stamp vouches for it, holding the folder's build
    lock shared (a build holds it exclusively, so no library is being linked meanwhile), without importing
    torch.utils.cpp_extension; where the lock file cannot be opened because the cache cannot be written, without the
    lock. False, with nothing loaded, where the caller must build (or report why it cannot)."""
    try:
        handle = open(folder / "build.flock", "a")
    except OSError as error:
        if error.errno in _READ_ONLY and verified(path):
            torch.ops.load_library(str(path))
            return True
        return False
    with handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        try:
            if not verified(path):
                return False
            torch.ops.load_library(str(path))
            return True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(verbose: bool = False) -> Path:
    """Compiles ops/ with torch.utils.cpp_extension (idempotent), loads the library and returns its path. Builds
    into one folder never run at once, a build killed midway does not block the next one (:func:`build_lock`), and a
    library whose stamp does not match it is rebuilt (:data:`STAMP`). On a cache that cannot be written, a verified
    library is loaded as it is. Raises :class:`BuildError` with a short reason."""
    return _load_or_build(verbose, build_anyway=True)


def _compile(folder: Path, verbose: bool) -> None:
    """The build itself, under the folder's build lock."""
    load = _cpp_extension().load
    sources = folder / "src"  # (compiler messages name these copies: the same files as ops/, by the folder's key)
    sources.mkdir(parents=True, exist_ok=True)
    for path in _source_files():
        copy = sources / path.name
        if not copy.exists() or copy.read_bytes() != path.read_bytes():  # (a rewrite would make ninja recompile)
            copy.write_bytes(path.read_bytes())
    header, text = folder / "ort_optim_spec.h", spec_header()
    if not header.exists() or header.read_text() != text:  # (a rewrite makes ninja recompile the kernels: 25-50 s)
        header.write_text(text)
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    if not verbose:  # (its warnings, such as "Your compiler (c++) is not compatible", restate a failure or are noise)
        quiet.setLevel(logging.ERROR)
    try:
        load(
            name="ort_optim_ops",
            sources=[str(sources / name) for name in SOURCES if name.endswith(".cpp")],
            extra_cflags=CFLAGS,
            # (--as-needed: torch's build adds -ltorch_python, which the library does not use)
            extra_ldflags=["-fopenmp", "-Wl,--as-needed"],
            extra_include_paths=[str(folder)],
            build_directory=str(folder),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as error:
        raise _build_error(folder, error) from None
    finally:
        quiet.setLevel(level)


def _register_fakes() -> None:
    """Fake (meta) kernels, so torch.compile and opcheck can trace the ops without running them."""

    @torch.library.register_fake("ort_optim::adam_step_")
    def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
          exp_avg_sq_scales, max_exp_avg_sq_scales, steps, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode,
          bias_correction, maximize, lr_tensor=None, inv_grad_scale=None, found_inf=None, grad_scale=None,
          rounding_keys=None, betas_tensor=None, group_hyperparameters=None):
        return None

    @torch.library.register_fake("ort_optim::grad_stats")
    def _(tensors):
        device = tensors[0].device if len(tensors) else torch.device("cpu")
        return torch.empty(2, dtype=torch.float32, device=device)


# Why the library is not loaded (None: loaded, or not tried yet), for an error that asks for it (ORT_OPTIM_BACKEND).
_unavailable_reason: Optional[str] = None


def unavailable_reason() -> Optional[str]:
    """Why the native library could not be loaded (after :func:`available` said False), in a few words."""
    return _unavailable_reason


@functools.lru_cache(maxsize=None)
def _load_native() -> bool:
    global _unavailable_reason
    if os.environ.get("ORT_OPTIM_NO_NATIVE") == "1":
        _unavailable_reason = "ORT_OPTIM_NO_NATIVE=1 is set"
        return False
    try:
        # first use on a machine the setup did not prepare: builds now (about a minute)
        _load_or_build(verbose=False, build_anyway=False)
        _register_fakes()
        return True
    except Exception as exc:  # any build or load failure degrades to the pure-PyTorch path
        reason = str(exc) if isinstance(exc, BuildError) else f"{type(exc).__name__}: {exc}"
        _unavailable_reason = reason.splitlines()[0][:400] if reason.strip() else type(exc).__name__
        warnings.warn(
            f"ort_optim: the native CPU kernels could not be built or loaded ({_unavailable_reason}); "
            "falling back to the pure-PyTorch implementation (same results, slower). "
            "Run `python -m ort_optim.build --verbose` to see why.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False


def available() -> bool:
    """True when the compiled CPU op library is loaded (building it first if needed)."""
    return _load_native()


class TensorWatch:
    """A native watch over one bucket's tensors (ops/README.md, "TensorWatch"), of any device: it compares metadata
    only (storage, data pointer, offset, dtype, device, sizes, strides) and never touches data.

    :meth:`check` compares every tensor with what it was at creation and checks every param's gradient (dense, on
    the param's device, a dtype it can take, its shape, a storage that holds it). It holds the states and step tensors
    but not the params (``torch.utils.swap_tensors`` refuses a tensor referenced elsewhere, even weakly): this wrapper
    keeps them and passes them to each check, whose TensorImpls the native watch compares with the planned ones
    before reading a param through them. Its methods hold no Python object and run without the GIL.
    """

    def __init__(self, native, params: list, idle_params: list) -> None:
        self._native = native
        self._watched = params + idle_params  # (their TensorImpls now are what check() compares with the planned)

    @classmethod
    def create(cls, params, state_lists, steps, step_tensors, idle_params=()) -> "TensorWatch":
        """A watch over params, their non-empty state lists (n tensors each), step tensors and steps. idle_params:
        params without a gradient now, which the watch requires to stay so."""
        params, idle_params = list(params), list(idle_params)
        return cls(torch.classes.ort_optim.TensorWatch(params, [list(s) for s in state_lists if len(s)],
                                                       list(step_tensors), steps, idle_params), params, idle_params)

    def check(self) -> int:
        """-1 when the bucket can step now: every tensor is as it was (a storage re-allocated in place is not: its
        caller keeps addresses; an AdamPlan follows it),
        every param is the TensorImpl it was (not swapped) and has a usable gradient, and no idle param has one.
        Otherwise the position of the first param that cannot (``len(params) + j`` for ``idle_params[j]``); nothing
        is written either way."""
        return self._native.check(self._watched)


class AdamPlan(TensorWatch):
    """A native handle to one CPU bucket's params and states (the lists of :func:`adam_step_`), kept across steps
    (ops/README.md, "AdamPlan"): a :class:`TensorWatch` that also steps.

    It validates them once and keeps the states' data pointers, so a step converts and checks no tensor lists: it
    reads each param and its ``.grad`` directly, which with thousands of small tensors is most of the op's cost.
    Validation and math are the op's own. Before every step, :meth:`check` compares every tensor it holds (the step
    tensors too) with what it was at creation and re-resolves the data pointers of storages re-allocated in place;
    :meth:`step` and :meth:`grad_stats` need a successful check.
    """

    @classmethod
    def create(cls, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
               exp_avg_sq_scales, max_exp_avg_sq_scales, steps, idle_params=(), *, step_tensors) -> "AdamPlan":
        """A plan over these lists (the caller checks that their steps run natively: backends.runs_natively).
        step_tensors: per param, the one-element view of ``steps[i]`` that ``optimizer.state[p]['step']`` holds; the
        plan watches it like the states (``step.data = t`` gives it another storage, which the next step must use).
        idle_params: params (of any device) that have no gradient now; the plan can step only while that stays so."""
        params, idle_params = list(params), list(idle_params)
        native = torch.classes.ort_optim.AdamPlan(
            params, list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs), list(master_params),
            list(exp_avg_scales), list(exp_avg_sq_scales), list(max_exp_avg_sq_scales), steps, list(step_tensors),
            idle_params)
        return cls(native, params, idle_params)

    def step(self, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adam_w_mode: int,
             bias_correction: bool, maximize: bool, lr_tensor: Optional[torch.Tensor] = None,
             inv_grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None,
             grad_scale: Optional[torch.Tensor] = None, rounding_keys: Optional[torch.Tensor] = None,
             grad_norm: bool = False) -> Optional[torch.Tensor]:
        """:func:`adam_step_` with the params' current gradients (written back unscaled when grad_scale is given),
        after a successful :meth:`check`. grad_norm: also return :func:`grad_stats` of the gradients as loaded
        (float32 ``[sum of squares, 1.0 if not finite]``), summed by the update pass itself (NaN when the step was
        skipped by found_inf); else None."""
        out = self._native.step(lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, maximize, lr_tensor,
                              inv_grad_scale, found_inf, grad_scale, rounding_keys, grad_norm)
        return out if grad_norm else None

    def grad_stats(self) -> torch.Tensor:
        """:func:`grad_stats` of the params' current gradients, after a successful :meth:`check`."""
        return self._native.grad_stats()

    def unscalable_grad(self) -> int:
        """After a successful :meth:`check`: the position of the first param whose gradient cannot take the unscaled
        gradient a step with grad_scale writes back (it overlaps itself, or shares memory with its param: the op's
        own tests), else -1."""
        return self._native.unscalable_grad()

    def forget(self) -> None:
        """Gives back the params and gradients that a successful :meth:`check` holds until the step (which gives them
        back itself), for a caller that does not step after all."""
        self._native.forget()
