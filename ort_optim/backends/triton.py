"""Triton implementation of the ort_optim ops (``adam_step_``, ``grad_stats``) for CUDA tensors.

Same semantics as the native CPU kernel (ops/README.md gives the math): every mode, amsgrad, maximize, per-parameter
steps (read on the device; bias corrections computed in the kernel), master weights, bf16, block-scaled fp16 states
(sqrt(v) for second moments) and 8-bit / 4-bit block-quantised states (uint8 codes whose scales' dtype names the
format: float32 for ``_spec.Q8``, bfloat16 for ``_spec.Q4``; the reference's codes and scales bit for bit),
in-kernel unscaling, found_inf (read on the device: a skipped step writes nothing, step counts included), lr from
``lr_tensor``, beta1 and beta2 from ``betas_tensor`` (read in the kernel, bias corrections included) and stochastic
rounding of bfloat16 params (``rounding_keys``; the same random bits as the CPU kernel).
Like the CPU kernel, a call marks what it wrote as modified in place for autograd (ort_optim/_versions.py).

How a call runs:

* The tensors of a call are grouped by their dtypes (FusedAdam already passes one group per call); each group is ONE
  launch of ``adam_kernel``: a device table holds every tensor's addresses (params, moments, masters, scales) and a
  work list holds one (tensor, offset) item per program, so the launch covers all tensors of the group. One more tiny
  launch (``step_finish_kernel``) advances the step counts afterwards (unless found_inf says skip) and adds up the
  norm's partial sums when asked for: two launches per call.
* The tables are built once and kept, for a direct call in a cache keyed by every tensor's data_ptr, dtype, shape
  and strides (all a table holds; rebuilt, after validation, only when one of those changes), for FusedAdam in the
  ``launch_cache`` dict of its bucket (see adam_step_: its plan checks the same at every step, so the tensors are not
  read again here). Gradients get their own small address table, since they change whenever they are set to None:
  one H2D copy of ``[g.data_ptr() ...]``, non-blocking from pinned memory.
* With ORT_OPTIM_TRITON_FAST_LAUNCH=1, compiled kernels (triton 3.6) are launched through a kept launcher
  (_Launcher), without JITFunction.run's per-call binding and specialisation of every argument.
* Nothing synchronises with the host inside a call, and every kernel runs on ``torch.cuda.current_stream()``, so a
  step can be captured in a CUDA graph (with lr and the loss scale as device tensors if they change between replays).
* ``triton`` is imported on first use only; ``import ort_optim`` never imports it.

CPU tensors are accepted under ``TRITON_INTERPRET=1`` (Triton's interpreter), which is how the tests exercise these
kernels without a GPU: ``ORT_OPTIM_BACKEND=triton TRITON_INTERPRET=1 pytest ...``.
"""

from __future__ import annotations

import operator
import os
import struct
import sys
import warnings
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from .._fork import renewed_lock
from .._spec import (CANONICAL_NAN, EXP_AVG_SNAP, EXP_AVG_SR_ULPS, FP8_E4M3, FP8_E5M2, FP8_MAX_ROOT,
                     GRAD_IN_PARAM, GRAD_OVERLAPS_ITSELF, MIN_SCALE, QUANT_BLOCK, Q4, Q8, LowBitFormat,
                     check_hyperparameters, grad_in_param_memory, square_tables)
from .._versions import mark_modified, step_taken
from ._validation import check_grads, check_lists, check_options, check_rounding_keys, check_tensors, fail

# Elements per block: the fp16 quantisation block and the unit of every program's work (must equal QUANT_BLOCK).
BLOCK = 1024
assert BLOCK == QUANT_BLOCK
NUM_WARPS = int(os.environ.get("ORT_OPTIM_TRITON_WARPS", "8"))  # 8: half the registers per thread of 4
# ptxas's register cap per thread for the Adam kernel; unset, ptxas chooses (128 registers and a few spilled bytes
# for the quantised-moment variants on sm_80, for 2 CTAs per SM: tools/aot_compile.py, spill_limit).
MAXNREG = int(os.environ["ORT_OPTIM_TRITON_MAXNREG"]) if os.environ.get("ORT_OPTIM_TRITON_MAXNREG") else None
# Blocks per program: 0 picks it from the total size (see _blocks_per_program); tests set small values.
BLOCKS_PER_PROGRAM = int(os.environ.get("ORT_OPTIM_TRITON_BLOCKS", "0"))
CACHE_SIZE = 64

_DT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
# Low-bit states are uint8 code tensors; their scales' dtype tells the format (float32: 8-bit, bfloat16: 4-bit).
_LOW_BIT = {Q8.scale_dtype: (4, Q8), Q4.scale_dtype: (5, Q4)}
if not Q4.exp_avg_relative or Q8.exp_avg_relative:  # what the kernels implement (_spec.EXP_AVG_RELATIVE)
    raise RuntimeError("ort_optim: the Triton kernels code a 4-bit exp_avg relative to its exp_avg_sq and an 8-bit one "
                       "as m itself; ort_optim._spec's formats say otherwise")
if not Q4.exp_avg_sq_stochastic or Q8.exp_avg_sq_stochastic:  # (_spec.EXP_AVG_SQ_STOCHASTIC)
    raise RuntimeError("ort_optim: the Triton kernels round a 4-bit sqrt(v) stochastically in a step and an 8-bit one "
                       "to nearest; ort_optim._spec's formats say otherwise")
# fp8 states hold their codes in the float8 dtypes themselves, with float32 power-of-two scales (_spec.Fp8Format).
_FP8 = {torch.float8_e4m3fn: 6, torch.float8_e5m2: 7}

# Where the launch tables are made before they go to the tensors' device: torch's default device (`with
# torch.device(...)`) is not the tensors'.
_HOST = torch.device("cpu")
_lock = renewed_lock(sys.modules[__name__], "_lock")
_cache: "OrderedDict[tuple, _Plan]" = OrderedDict()
_stats_cache: "OrderedDict[tuple, tuple]" = OrderedDict()
# Device tables (and pinned host buffers) used by kernels captured in a CUDA graph: a graph replays the launches with
# the addresses it saw, so what they point to must outlive any cache eviction or table rebuild. One entry per capture.
_graph_owned: list = []
_generation = 0  # bumped by clear_caches(): plans kept in callers' launch_cache dicts before it are not used


# ---- triton, lazily -------------------------------------------------------------------------------------------

def broken_interpreter_reason() -> Optional[str]:
    """Why Triton's interpreter cannot be trusted in this environment, or None.

    Measured on this project's machines: triton 3.0/3.1 under numpy 2 silently return wrong values from interpreted
    kernels (no error). The project pins numpy<2 next to torch 2.4.1 / triton 3.0.
    """
    import numpy
    import triton

    tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
    nv = int(numpy.__version__.split(".")[0])
    if tv < (3, 2) and nv >= 2:
        return (f"triton {triton.__version__} with numpy {numpy.__version__}: the interpreter of triton < 3.2 returns "
                f"garbage under numpy 2; install numpy<2 (or triton >= 3.2)")
    return None


def available() -> bool:
    """Whether triton can be imported here (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


_warned = False


def warn_unavailable() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("ort_optim: triton is not installed, so CUDA tensors are updated by the pure-PyTorch "
                      "implementation (same results, several kernels per parameter); pip install triton for the "
                      "fused multi-tensor kernels", RuntimeWarning, stacklevel=4)


_kernels_module = None


def _check_spec(module) -> None:
    if (module.EXP_AVG_SNAP.value, module.MIN_SCALE.value, module.EXP_AVG_SR_ULPS.value, module.FP8_MIN_EXPONENT.value,
            module.FP8_MAX_MANTISSA.value, module.CANONICAL_NAN.value, module.Q8_MIN_SQ_SCALE.value,
            module.Q4_MIN_SQ_SCALE.value, module.FP8_E4M3_MIN_SQ_EXPONENT.value, module.FP8_E5M2_MIN_SQ_EXPONENT.value,
            module.FP8_MAX_ROOT.value) != (
            EXP_AVG_SNAP, MIN_SCALE, EXP_AVG_SR_ULPS, FP8_E4M3.min_exponent, FP8_E4M3.max_mantissa, CANONICAL_NAN,
            Q8.min_sq_scale, Q4.min_sq_scale, FP8_E4M3.min_sq_exponent, FP8_E5M2.min_sq_exponent, FP8_MAX_ROOT):
        raise RuntimeError("ort_optim: triton_kernels' low-bit constants differ from ort_optim._spec's")


def kernels():
    """The module with the @triton.jit kernels (imports triton on first call)."""
    global _kernels_module
    if _kernels_module is None:
        try:
            from . import triton_kernels
        except ImportError as exc:  # no triton in this environment
            raise RuntimeError(
                "ort_optim: the Triton backend needs the `triton` package (pip install triton), which could not be "
                f"imported ({exc})"
            ) from exc
        if triton_kernels.INTERPRET:
            reason = broken_interpreter_reason()
            if reason is not None:
                raise RuntimeError(f"ort_optim: refusing to run Triton's interpreter: {reason}")
        _check_spec(triton_kernels)
        _kernels_module = triton_kernels
    return _kernels_module


def _check_device(device: torch.device, op: str) -> None:
    interpreted = kernels().INTERPRET
    if interpreted and device.type != "cpu":
        raise RuntimeError(f"ort_optim::{op}: TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors only, got "
                           f"tensors on {device}")
    if not interpreted and device.type != "cuda":
        raise RuntimeError(f"ort_optim::{op}: the Triton backend needs CUDA tensors (got {device}); for CPU tensors "
                           "set TRITON_INTERPRET=1 to run its kernels in Triton's interpreter, or use the native or "
                           "torch backend")


def _blocks_per_program(total_blocks: int) -> int:
    if BLOCKS_PER_PROGRAM > 0:
        return BLOCKS_PER_PROGRAM
    if kernels().INTERPRET:
        return 64  # the interpreter pays ~5 ms per program and ~2 ms per block: few, long programs
    # Keep at least ~16 programs per SM of an H100/H200 class GPU (132 SMs) before making programs longer.
    bpp = 1
    while bpp < 8 and total_blocks // (bpp * 2) >= 132 * 16:
        bpp *= 2
    return bpp


def _bits(x: float) -> int:
    """The IEEE float64 bit pattern of x as a signed int64 (how the kernels receive fp64 scalars)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _upload(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor on `device`; from pinned memory, without blocking the host, for CUDA."""
    if device.type == "cuda":
        host = torch.tensor(values, dtype=torch.int64, device=_HOST, pin_memory=True)
        if torch.cuda.is_current_stream_capturing():
            _graph_owned.append(host)  # a captured copy reads this buffer again at every replay
        return host.to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _work_list(numels: Sequence[int], bpp: int) -> list:
    chunk = BLOCK * bpp
    work = []
    for t, numel in enumerate(numels):
        for start in range(0, numel, chunk):
            work.append(t)
            work.append(start)
    return work


# ---- launching compiled kernels -------------------------------------------------------------------------------

def _fast_launch_supported() -> bool:
    """Whether launches may skip JITFunction.run (see _Launcher): compiled kernels (not the interpreter), a triton
    whose launchers take the arguments _Launcher passes (3.6: checked against JITFunction.run with a recording driver,
    tests/triton_backend/test_launcher.py), and ORT_OPTIM_TRITON_FAST_LAUNCH=1: opt-in until the direct path has run
    on a GPU (the recording driver checks the arguments, not a launch)."""
    import triton

    return (not kernels().INTERPRET and triton.__version__.startswith("3.6.")
            and os.environ.get("ORT_OPTIM_TRITON_FAST_LAUNCH", "0") == "1")


class _Launcher:
    """Launches of one @triton.jit kernel without JITFunction.run's per-call work (binding and specialising every
    argument, formatting its options into the cache key, building the launch metadata: ~50 us per launch of
    adam_kernel on this project's CPU, against ~5 us here): the compiled kernel of each specialisation is kept and its
    launcher called directly, as torch inductor's launchers do. What decides the specialisation JITFunction.run
    picks makes the key: each tensor argument's dtype and 16-byte alignment, each integer's width (and, unless
    do_not_specialize, whether it is 1 or a multiple of 16), the constexprs, the options and the device. A new key
    launches through JITFunction.run, which compiles, and its compiled kernel is kept."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}
        params = fn.params
        self.constexprs = [p.name for p in params if p.is_constexpr]
        runtime = [p for p in params if not p.is_constexpr]
        if [p.name for p in params[len(runtime):]] != self.constexprs:
            raise RuntimeError(f"ort_optim: {fn.__name__}'s constexpr arguments must follow the others")
        self.specialized = tuple(not p.do_not_specialize for p in runtime)

    def __call__(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        from triton.runtime.driver import driver

        spec = []
        for a, specialized in zip(args, self.specialized):
            if isinstance(a, torch.Tensor):
                spec.append((a.dtype, a.data_ptr() % 16 == 0))
            elif specialized:
                spec.append((-2**31 <= a < 2**31, a == 1, a % 16 == 0))
            else:
                spec.append(-2**31 <= a < 2**31)
        device = driver.active.get_current_device()
        key = (device, tuple(spec), tuple(kwargs), tuple(kwargs.values()))
        binary = self.compiled.get(key)
        if binary is None:
            self.compiled[key] = self.fn[grid](*args, **kwargs)
            return
        stream = driver.active.get_current_stream(device)
        constexprs = [kwargs[name] for name in self.constexprs]
        from triton import knobs

        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if enter.calls or leave.calls:  # (a profiler's hooks: they get what JITFunction.run gives them)
            metadata = binary.launch_metadata(grid, stream, *args, *constexprs)
        else:
            metadata = enter = leave = None
        binary.run(grid[0], 1, 1, stream, binary.function, binary.packed_metadata, metadata, enter, leave, *args,
                   *constexprs)


_launchers: dict = {}
_fast_launch: Optional[bool] = None


def _launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """kernel[grid](*args, **kwargs), through a _Launcher where this triton allows it."""
    global _fast_launch
    if _fast_launch is None:
        _fast_launch = _fast_launch_supported()
    if not _fast_launch:
        kernel[grid](*args, **kwargs)
        return
    launcher = _launchers.get(kernel)
    if launcher is None:
        launcher = _launchers.setdefault(kernel, _Launcher(kernel))
    launcher(grid, args, kwargs)


def _launch_context(device: torch.device):
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    if device.type == "cpu":
        return _quiet_interpreter()
    return _nullcontext


class _quiet_interpreter(warnings.catch_warnings):
    """Triton's interpreter warns where the GPU does not: numpy overflow in casts (inf is the IEEE result, as on the
    device) and a numpy deprecation inside the interpreter itself, thousands of times per test run."""

    def __enter__(self):
        result = super().__enter__()
        warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message="(overflow|invalid value) encountered", category=RuntimeWarning)
        return result


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_nullcontext = _NullContext()


def _remember(cache: OrderedDict, key, value) -> None:
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)


def _lookup(cache: OrderedDict, key):
    with _lock:
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
        return value


def clear_caches() -> None:
    """Forgets every cached address table (they are rebuilt on the next call), the plans kept in callers'
    ``launch_cache`` dicts included."""
    global _generation
    with _lock:
        _cache.clear()
        _stats_cache.clear()
        _generation += 1


# ---- adam_step_ -----------------------------------------------------------------------------------------------

class _Group:
    """Tensors of one call that share dtypes: one launch."""

    __slots__ = ("indices", "meta", "work", "programs", "constexprs", "grads_key", "grads_table", "bpp", "aligned",
                 "grads_aligned", "luts")

    def __init__(self, indices, meta, work, programs, constexprs, bpp, aligned, luts=(None, None)):
        self.indices = indices
        self.meta = meta
        self.work = work
        self.programs = programs
        self.constexprs = constexprs
        self.bpp = bpp
        self.aligned = aligned  # every param/state/master address is a multiple of 16 bytes
        self.grads_key = None
        self.grads_table = None
        self.grads_aligned = False
        self.luts = luts  # lookup tables of the low-bit exp_avg / exp_avg_sq formats (None for other states)


class _Plan:
    """The launch plan of one call signature: its groups, plus what identifies the tensors it was built for."""

    __slots__ = ("groups", "shapes", "devices", "device", "grad_dtypes", "programs", "stochastic_ok", "generation")

    def __init__(self, groups, shapes, devices, device, grad_dtypes, stochastic_ok):
        self.groups = groups
        self.shapes = shapes  # the params' shapes, as tuples (comparing lists of torch.Size is ~20x slower)
        self.devices = devices  # get_device() of every param
        self.device = device
        self.grad_dtypes = grad_dtypes  # the gradients' dtypes (they choose the groups)
        self.programs = sum(group.programs for group in groups)
        self.stochastic_ok = stochastic_ok  # every param bfloat16 and no masters: rounding_keys may be given
        self.generation = _generation


def _state_code(states, scales, i: int) -> int:
    """The kernel's dtype code of state i of a list: its float dtype's, or Q8 / Q4 for uint8 codes."""
    t = states[i]
    if t.dtype == torch.uint8:
        return _LOW_BIT[scales[i].dtype][0]
    if t.dtype in _FP8:
        return _FP8[t.dtype]
    return _DT_CODES[t.dtype]


_luts: dict = {}


def _lut(fmt: LowBitFormat, device: torch.device) -> torch.Tensor:
    """The float32 lookup table of a low-bit format on a device (layout: triton_kernels, "8-bit and 4-bit
    states"), built once from _spec's levels and kept (captured CUDA graphs read it at every replay)."""
    key = (fmt.name, device)
    table = _luts.get(key)
    if table is None:
        bits, m_levels, v_levels = fmt.bits, list(fmt.exp_avg_levels), list(fmt.exp_avg_sq_levels)
        if len(m_levels) != 1 << (bits - 1) or len(v_levels) != 1 << bits:
            raise RuntimeError(f"ort_optim: the Triton kernels need 2**(bits-1) exp_avg and 2**bits exp_avg_sq levels "
                               f"in the {fmt.name} format, got {len(m_levels)} and {len(v_levels)}")
        inf = float("inf")  # padding of the midpoint lists to 2**k entries: never probed
        squares, square_gaps = square_tables(tuple(v_levels))
        values = (m_levels + [-x for x in m_levels] + v_levels + list(fmt.sr_thresholds(False)) + [inf]
                  + list(fmt.sq_thresholds()) + [inf] + list(fmt.sr_thresholds(True))
                  + [inf] + list(squares) + list(square_gaps))
        host = torch.tensor(values, dtype=torch.float32, device=_HOST, pin_memory=device.type == "cuda")
        table = host.to(device, non_blocking=True) if device.type == "cuda" else host
        if _capturing(device):
            _graph_owned.append(host)
        with _lock:
            table = _luts.setdefault(key, table)
    return table


def _build_groups(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                  exp_avg_sq_scales, max_exp_avg_sq_scales, device) -> list:
    amsgrad = len(max_exp_avg_sqs) > 0
    keyed: "OrderedDict[tuple, list]" = OrderedDict()
    for i, p in enumerate(params):
        key = (
            _DT_CODES[p.dtype], _DT_CODES.get(grads[i].dtype, -1), _state_code(exp_avgs, exp_avg_scales, i),
            _state_code(exp_avg_sqs, exp_avg_sq_scales, i),
        )
        keyed.setdefault(key, []).append(i)
    groups = []
    for (p_dt, g_dt, m_dt, v_dt), indices in keyed.items():
        rows = []
        numels = []
        for i in indices:
            numel = params[i].numel()
            numels.append(numel)
            rows += [
                params[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
                max_exp_avg_sqs[i].data_ptr() if amsgrad else 0,
                master_params[i].data_ptr() if len(master_params) else 0,
                exp_avg_scales[i].data_ptr() if len(exp_avg_scales) else 0,
                exp_avg_sq_scales[i].data_ptr() if len(exp_avg_sq_scales) else 0,
                max_exp_avg_sq_scales[i].data_ptr() if amsgrad and len(max_exp_avg_sq_scales) else 0,
                numel, i,
            ]
        total_blocks = sum((x + BLOCK - 1) // BLOCK for x in numels)
        bpp = _blocks_per_program(total_blocks)
        work = _work_list(numels, bpp)
        programs = len(work) // 2
        constexprs = dict(
            P_DT=p_dt, G_DT=g_dt, M_DT=m_dt, V_DT=v_dt, HAS_MASTER=len(master_params) > 0,
            M_SCALED=len(exp_avg_scales) > 0, V_SCALED=len(exp_avg_sq_scales) > 0, AMSGRAD=amsgrad,
        )
        aligned = all(rows[r * 10 + c] % 16 == 0 for r in range(len(indices)) for c in range(5))
        meta = _upload(rows, device)
        work_t = _upload(work if work else [0, 0], device)
        luts = tuple(_lut(_LOW_BIT[scales[indices[0]].dtype][1], device) if code in (4, 5) else None
                     for code, scales in ((m_dt, exp_avg_scales), (v_dt, exp_avg_sq_scales)))
        groups.append(_Group(indices, meta, work_t, programs, constexprs, bpp, aligned, luts))
    return groups


_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_dtype_of = operator.attrgetter("dtype")
_HYPER_BITS = struct.Struct("<6d")
_LAUNCH_CACHE_KEY = "triton"


def _on_device(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """A one-element scalar tensor on the params' device (copied there, without blocking, if given elsewhere); bool
    flags as uint8."""
    if t is None:
        return None
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.device != device:
        t = t.to(device, non_blocking=True)
    return t.reshape(1)


def _new_plan(params, work_params, work_grads, grad_dtypes, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params,
              exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales, amsgrad: bool, device) -> _Plan:
    n = len(params)
    groups = _build_groups(work_params, work_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params,
                           exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales, device)
    stochastic_ok = not len(master_params) and all(p.dtype == torch.bfloat16 for p in params)
    return _Plan(groups, [tuple(p.shape) for p in work_params], [params[0].get_device()] * n, device, grad_dtypes,
                 stochastic_ok)


def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor],
    exp_avg_sq_scales: Sequence[torch.Tensor],
    max_exp_avg_sq_scales: Sequence[torch.Tensor],
    steps: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: int,
    bias_correction: bool,
    maximize: bool,
    lr_tensor: Optional[torch.Tensor] = None,
    inv_grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    rounding_keys: Optional[torch.Tensor] = None,
    betas_tensor: Optional[torch.Tensor] = None,
    group_hyperparameters: Optional[torch.Tensor] = None,
    grad_norm: bool = False,
    launch_cache: Optional[dict] = None,
) -> Optional[torch.Tensor]:
    """ort_optim::adam_step_ (ops/README.md) on CUDA tensors (CPU tensors under TRITON_INTERPRET=1).

    The values of lr_tensor, betas_tensor and grad_scale are read by the kernels on the device and not checked (a
    check on the host would synchronise with the device at every step), nor are group_hyperparameters' (which the
    kernels do not read); their dtypes, shapes and devices are. lr, beta1 and beta2 given as floats are checked as
    the CPU kernel checks them (ValueError), before anything is written.

    grad_norm (a keyword of this backend only, not of the op's schema; FusedAdam's plain steps pass it): also return
    :func:`grad_stats`' float32 [sum of squares, 1.0 if not finite] of the gradients as the update loaded them
    (before any unscaling), summed by the update's own pass: no second read of the gradients, no host sync (as the
    native plan's ``step(grad_norm=True)``). Each program of the Adam launches writes its float64 partial sum into a
    buffer allocated here (from the graph's pool while a CUDA graph is captured, so replays rewrite it), then the
    launch that advances the step counts adds the partials in a fixed order. The squares are summed in float32
    (float64 for float64 params), so unlike grad_stats the flag is also 1 when finite gradients overflow float32 (a
    norm above about 1.8e19); the sum is NaN when found_inf skips the step. Otherwise returns None.

    launch_cache (a keyword of this backend only): a dict that the caller keeps for as long as the tensors of every
    list but ``grads`` stay the same tensors with the same data pointers, dtypes, shapes and strides, on the same
    device (FusedAdam passes one per bucket of its plan, which it re-plans when any of these changes: the plan's
    fingerprints, checked at every step). The launch plan built at the first call is kept in it, and later calls
    skip re-reading those tensors (one data pointer, dtype, shape and strides per tensor: 6000 tensors for 2000
    params, the larger part of the host time of a many-tensor step). The caller also vouches that every gradient is
    dense, of its param's shape and on its device (FusedAdam's plan checks them at every step): of the gradients,
    only the data pointers, dtypes and contiguity are read at every call."""
    n = len(params)
    # the op's structural checks (_validation), before anything is written: of the lists and the optional tensors at
    # every call, of every tensor in them when a launch plan is built (the plan is kept for the same tensors)
    check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                exp_avg_sq_scales, max_exp_avg_sq_scales, steps)
    check_options(n, steps.device, adam_w_mode, lr_tensor, inv_grad_scale, found_inf, grad_scale, rounding_keys,
                  betas_tensor, group_hyperparameters)
    amsgrad = len(max_exp_avg_sqs) > 0
    # lr, beta1 and beta2 given as floats are host values: checked by the op's rules, as the CPU kernel checks them.
    # A float that lr_tensor or betas_tensor replaces is not used (and the tensors are read on the device only).
    host_lr = lr if lr_tensor is None else 0.0
    host_betas = (beta1, beta2) if betas_tensor is None else (0.0, 0.0)
    check_hyperparameters(host_lr, *host_betas)
    if n == 0:
        return _stats_without_elements(found_inf, steps.device) if grad_norm else None
    device = params[0].device
    _check_device(device, "adam_step_")
    k = kernels()

    # Non-contiguous grads go through contiguous copies (copied back at the end when they are unscaled in place).
    work_grads = grads if all(map(_is_contiguous, grads)) else [g if g.is_contiguous() else g.contiguous()
                                                                 for g in grads]
    grad_dtypes = tuple(map(_dtype_of, work_grads))
    plan = None if launch_cache is None else launch_cache.get(_LAUNCH_CACHE_KEY)
    if plan is not None and not (plan.generation == _generation and plan.device == device
                                 and plan.grad_dtypes == grad_dtypes and len(plan.shapes) == n):
        plan = None
    vouched = plan is not None
    if plan is not None:
        # (the caller vouches for every tensor but the gradients, see launch_cache; the plan was only kept when the
        # params were contiguous, and it checked the gradients' shapes, devices and layouts itself)
        work_params, copied = params, []
    else:
        # Non-contiguous params go through contiguous copies, copied back at the end (every tensor checked first:
        # a copy reads the param's storage).
        work_params = list(params)
        copied = [i for i, p in enumerate(params) if not p.is_contiguous()]
        if copied:
            check_tensors(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                          exp_avg_sq_scales, max_exp_avg_sq_scales)
            for i in copied:
                work_params[i] = params[i].contiguous()
        statics = [work_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                   exp_avg_sq_scales, max_exp_avg_sq_scales]
        flat = [t for lst in statics for t in lst]
        # The tables hold addresses, sizes and dtypes, so the key has every tensor's address, dtype, shape and
        # strides: whatever tensor now has all four (the same object given new data, or a new tensor in freed
        # memory), the table describes it exactly. (No references to the tensors are kept: torch.utils.swap_tensors
        # refuses tensors that anything holds, even weakly.)
        key = (device, n, tuple([len(lst) for lst in statics]), tuple(map(_data_ptr, flat)),
               tuple(map(_dtype_of, flat)), tuple([(t.shape, t.stride()) for t in flat]), grad_dtypes,
               BLOCKS_PER_PROGRAM)
        plan = _lookup(_cache, key)
        if plan is None:
            if not copied:
                check_tensors(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                              exp_avg_sq_scales, max_exp_avg_sq_scales)
            check_grads(params, grads)
            plan = _new_plan(params, work_params, work_grads, grad_dtypes, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                             master_params, exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales, amsgrad, device)
            _remember(_cache, key, plan)
        elif ([tuple(g.shape) for g in work_grads] != plan.shapes or [g.get_device() for g in work_grads]
              != plan.devices or any([g.layout != torch.strided for g in work_grads])):
            check_grads(params, grads)  # raises, naming the gradient
        if launch_cache is not None and not copied:
            launch_cache[_LAUNCH_CACHE_KEY] = plan
    if rounding_keys is not None and not plan.stochastic_ok:
        check_rounding_keys(params, len(master_params) > 0)
    copied_grads = ([i for i, g in enumerate(grads) if g is not work_grads[i]]
                    if grad_scale is not None and work_grads is not grads else [])
    for i in copied_grads:  # before anything is written
        if torch._debug_has_internal_overlap(grads[i]) == 1:
            fail(f"grads[{i}] {GRAD_OVERLAPS_ITSELF}")
    if grad_scale is not None and not vouched:  # (a kept launch plan's caller checked its gradients: FusedAdam)
        for i, g in enumerate(grads):
            if grad_in_param_memory(g, params[i]):
                fail(f"grads[{i}] {GRAD_IN_PARAM}")

    # Scalars that live on the device: same device as the params (copied there if given elsewhere).
    lr_t, inv_t, found_t = _on_device(lr_tensor, device), _on_device(inv_grad_scale, device), _on_device(found_inf,
                                                                                                          device)
    scale_t = _on_device(grad_scale, device)
    betas_t = None if betas_tensor is None else (betas_tensor if betas_tensor.device == device else
                                                 betas_tensor.to(device, non_blocking=True)).contiguous()
    keys_t = None if rounding_keys is None else rounding_keys if rounding_keys.device == device else \
        rounding_keys.to(device, non_blocking=True)
    steps_dev = steps if steps.device == device else steps.to(device)
    dummy = steps_dev
    capturing = _capturing(device)
    # The partial sums of the norm, then its result: float32 [2] in the buffer's last float64 (one allocation).
    norm_partial = torch.empty(plan.programs + 1, dtype=torch.float64, device=device) \
        if grad_norm and plan.programs else None
    norm_base = 0
    lr_bits, beta1_bits, beta2_bits, eps_bits, wd_bits, sign_bits = struct.unpack(
        "<6q", _HYPER_BITS.pack(lr, beta1, beta2, eps, weight_decay, -1.0 if maximize else 1.0))
    flags = dict(MODE=int(adam_w_mode), BIAS_CORRECTION=bool(bias_correction), HAS_LR_TENSOR=lr_t is not None,
                 HAS_INV_SCALE=inv_t is not None, HAS_FOUND_INF=found_t is not None,
                 UNSCALE_GRADS=scale_t is not None, BLOCK=BLOCK, HAS_SR=keys_t is not None,
                 HAS_NORM=norm_partial is not None, HAS_BETAS_TENSOR=betas_t is not None, num_warps=NUM_WARPS,
                 enable_fp_fusion=False)
    if MAXNREG:
        flags["maxnreg"] = MAXNREG
    grad_ptrs = list(map(_data_ptr, work_grads))

    with _launch_context(device):
        for group in plan.groups:
            if group.programs == 0:
                continue
            gkey = tuple(grad_ptrs) if len(group.indices) == n else tuple([grad_ptrs[i] for i in group.indices])
            if gkey != group.grads_key:
                group.grads_table = _upload(list(gkey), device)
                group.grads_key = gkey
                group.grads_aligned = all(ptr % 16 == 0 for ptr in gkey)
            _launch(k.adam_kernel, (group.programs,), (
                group.meta, group.grads_table, group.work, steps_dev,
                lr_t if lr_t is not None else dummy,
                betas_t if betas_t is not None else dummy,
                inv_t if inv_t is not None else dummy,
                found_t if found_t is not None else dummy,
                scale_t if scale_t is not None else dummy,
                group.luts[0] if group.luts[0] is not None else dummy,
                group.luts[1] if group.luts[1] is not None else dummy,
                keys_t if keys_t is not None else dummy,
                norm_partial if norm_partial is not None else dummy, norm_base,
                lr_bits, beta1_bits, beta2_bits, eps_bits, wd_bits, sign_bits,
            ), dict(group.constexprs, BLOCKS_PER_PROGRAM=group.bpp, ALIGNED=group.aligned and group.grads_aligned,
                    **flags))
            norm_base += group.programs
        stats = None if norm_partial is None else norm_partial[-1:].view(torch.float32)
        _launch(k.step_finish_kernel, ((n + BLOCK - 1) // BLOCK,), (
            steps_dev, found_t if found_t is not None else dummy, n,
            norm_partial if norm_partial is not None else dummy, norm_base, stats if stats is not None else dummy,
        ), dict(HAS_FOUND_INF=found_t is not None, HAS_NORM=norm_partial is not None, BLOCK=BLOCK,
                num_warps=NUM_WARPS))
    if capturing:
        _graph_owned.append([(g.meta, g.work, g.grads_table) for g in plan.groups])
    if steps_dev is not steps:
        steps.copy_(steps_dev)
    for i in copied:
        params[i].copy_(work_params[i])
    for i in copied_grads:
        grads[i].copy_(work_grads[i])
    # Autograd's version counters (ort_optim/_versions.py): a step skipped by a host-side found_inf wrote nothing; one
    # on the device is not read here (no synchronisation), so those steps mark what they may have written.
    if step_taken(found_inf):
        mark_modified([*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs, *master_params, *exp_avg_scales,
                       *exp_avg_sq_scales, *max_exp_avg_sq_scales, steps, *(grads if grad_scale is not None else ())])
    if not grad_norm:
        return None
    return stats if stats is not None else _stats_without_elements(found_t, device)


def _stats_without_elements(found_inf: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """adam_step_'s grad_norm result where no gradient holds an element (no kernel sums any): [0, 0], or [NaN, 1]
    where found_inf skips the step, as a skipped pass reports whatever it holds (computed on the device: no sync)."""
    if found_inf is None:
        return torch.zeros(2, dtype=torch.float32, device=device)
    skipped = found_inf.reshape(()).to(device) != 0
    return torch.stack([torch.where(skipped, float("nan"), 0.0), skipped.float()])


# ---- grad_stats -----------------------------------------------------------------------------------------------

def grad_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [2] on the tensors' device: [sum of squares, 1.0 if any element is inf/NaN else 0.0]."""
    if not len(tensors):
        return torch.zeros(2, dtype=torch.float32, device=_HOST)
    device = tensors[0].device
    _check_device(device, "grad_stats")
    k = kernels()
    dtypes = [t.dtype for t in tensors]
    index = tensors[0].get_device()
    if (any([t.layout != torch.strided for t in tensors]) or any([t.get_device() != index for t in tensors])
            or not all([d in _DT_CODES for d in dtypes])):
        for i, t in enumerate(tensors):
            if t.layout != torch.strided or t.device != device:
                raise RuntimeError(f"ort_optim::grad_stats: tensors[{i}] must be a dense tensor on {device}")
            if t.dtype not in _DT_CODES:
                raise RuntimeError(f"ort_optim::grad_stats: tensors[{i}] has dtype {t.dtype}")
    work_tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]

    # Static part (cached): grouping by dtype, the numel tables and the work lists.
    skey = (device, tuple(dtypes), tuple([t.numel() for t in work_tensors]), BLOCKS_PER_PROGRAM)
    layout = _lookup(_stats_cache, skey)
    if layout is None:
        by_dtype: "OrderedDict[torch.dtype, list]" = OrderedDict()
        for i, t in enumerate(work_tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        layout = []
        base = 0
        for dtype, indices in by_dtype.items():
            numels = [work_tensors[i].numel() for i in indices]
            bpp = _blocks_per_program(sum((x + BLOCK - 1) // BLOCK for x in numels))
            work = _work_list(numels, bpp)
            programs = len(work) // 2
            if programs:
                # the last two entries: the key and the table of the tensors' addresses, rebuilt when they change
                layout.append([indices, _DT_CODES[dtype], _upload(numels, device), _upload(work, device),
                               programs, base, bpp, None, None])
                base += programs
        layout = (layout, base)
        _remember(_stats_cache, skey, layout)
    groups, total_programs = layout
    if total_programs == 0:
        return torch.zeros(2, dtype=torch.float32, device=device)
    partial = torch.zeros(total_programs, dtype=torch.float64, device=device)
    out = torch.empty(2, dtype=torch.float32, device=device)
    with _launch_context(device):
        for group in groups:
            indices, dt, numels_t, work_t, programs, base, bpp = group[:7]
            ptrs = tuple([work_tensors[i].data_ptr() for i in indices])
            if ptrs != group[7]:
                group[7], group[8] = ptrs, _upload(list(ptrs), device)
            k.grad_stats_kernel[(programs,)](
                group[8], numels_t, work_t, partial, base, DT=dt, BLOCK=BLOCK, BLOCKS_PER_PROGRAM=bpp,
                ALIGNED=all(ptr % 16 == 0 for ptr in ptrs), num_warps=NUM_WARPS,
            )
        k.grad_stats_finish_kernel[(1,)](partial, total_programs, out, BLOCK=BLOCK, num_warps=NUM_WARPS)
    if _capturing(device):
        _graph_owned.append([(g[2], g[3], g[8]) for g in groups])
    return out
