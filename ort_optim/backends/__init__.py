"""The one boundary between ort_optim's Python code and its kernels.

Everything above this package calls :func:`adam_step_`, :func:`grad_stats` and :class:`AdamPlan` from here; this
module decides who runs them. A step reaches them through one interface, a runner per bucket (:class:`PlanRunner` on
the native CPU library, :class:`OpRunner` on every other backend): ``check()``, ``stats()``, ``step(hyper,
scaling)``. The unscaling, clipping and skip decision of a step are one function, :func:`scaling`, whose result every
runner applies the same way: its multiplier and skip flag are the ops' ``inv_grad_scale`` and ``found_inf``. The backends are modules of this package that implement the same math
(ops/README.md) from the shared constants of :mod:`ort_optim._spec`, and never import one another (the two Python
backends make the native op's argument checks through :mod:`._validation`):

* :mod:`.native`: the C++ CPU library built from ``ops/`` (``torch.ops.ort_optim``), and its ``AdamPlan`` class;
* :mod:`.triton`: Triton kernels for CUDA tensors (and, with ``ORT_OPTIM_BACKEND=triton`` and ``TRITON_INTERPRET=1``,
  for CPU tensors, so the GPU code path can be tested anywhere);
* :mod:`.reference`: pure PyTorch, when the native library cannot be built or loaded (one warning, same results
  within the tolerances the tests state), or with ``ORT_OPTIM_BACKEND=torch``.

``ORT_OPTIM_BACKEND=auto|native|torch|triton`` is read at every call, so it can change between steps (inside a step
that torch.compile traced, the choice made when it was traced holds).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Optional, Sequence, Union

import torch

from .. import _versions
from .._fork import renewed_lock
from ..formats import sqrt_f32
from . import native, reference
from . import triton as triton_backend  # imports no triton until its first kernel call

BACKENDS = ("auto", "native", "torch", "triton")
AdamPlan = native.AdamPlan
TensorWatch = native.TensorWatch


# The value of ORT_OPTIM_BACKEND last read (None: unset) and the backend it selects: read again only when it changed.
_selected: tuple[Optional[str], str] = (None, "auto")


def backend() -> str:
    """The backend selected by ORT_OPTIM_BACKEND now: auto (default, also when set but empty), native, torch or
    triton. native raises RuntimeError where the native library is unavailable (and says why)."""
    global _selected
    value = os.environ.get("ORT_OPTIM_BACKEND")
    if value == _selected[0]:
        return _selected[1]
    name = value.strip().lower() if value and value.strip() else "auto"  # (set but empty: as if unset)
    if name not in BACKENDS:
        raise ValueError(f"ORT_OPTIM_BACKEND={name!r} is not one of {', '.join(BACKENDS)}")
    if name == "native" and not native_available():  # (asked for by name: no silent fallback to the reference)
        raise RuntimeError("ORT_OPTIM_BACKEND=native, but the native CPU library is unavailable "
                           f"({native.unavailable_reason() or 'it could not be built or loaded'}): unset "
                           "ORT_OPTIM_BACKEND (or set it to torch) to run the pure-PyTorch backend, or run "
                           "`python -m ort_optim.build --verbose` to see why")
    _selected = (value, name)
    return name


_native_loaded: Optional[bool] = None  # (None: not tried yet)
# First steps in several threads at once load (and register) the library once.
_native_loading = renewed_lock(sys.modules[__name__], "_native_loading")


def native_available() -> bool:
    """True when the compiled CPU op library is loaded (building it first if needed). Loading it also registers the
    CUDA kernels of its ops (Triton, or the reference where triton is not installed). Once tried, a read of a module
    flag, which torch.compile traces as a constant. The first try holds a lock: a second registration of the ops'
    fake or CUDA kernels would raise, and the library would count as unavailable for the rest of the process."""
    global _native_loaded
    if _native_loaded is None:
        with _native_loading:
            if _native_loaded is None:
                loaded = native.available()
                if loaded:
                    _register_cuda_kernels()
                _native_loaded = loaded
    return _native_loaded


def _cuda_adam_step(*args, **kwargs) -> None:
    _cuda_implementation().adam_step_(*args, **kwargs)


def _cuda_grad_stats(tensors):
    return _cuda_implementation().grad_stats(tensors)


def _cuda_implementation():
    if triton_backend.available():
        return triton_backend
    triton_backend.warn_unavailable()  # once; CUDA tensors then take the pure-PyTorch path
    return reference


_cuda_library = None


def _register_cuda_kernels() -> None:
    """The CUDA kernels of the ort_optim ops, so torch.ops.ort_optim dispatches CUDA tensors too (needs the schemas,
    i.e. the native library, loaded). Does not import triton: that happens on the first CUDA call."""
    global _cuda_library
    if _cuda_library is None:
        library = torch.library.Library("ort_optim", "IMPL")
        library.impl("adam_step_", _cuda_adam_step, "CUDA")
        library.impl("grad_stats", _cuda_grad_stats, "CUDA")
        _cuda_library = library


def implementation(device: torch.device):
    """The backend whose adam_step_/grad_stats serve tensors on this device now."""
    choice = backend()
    if device.type == "cuda" and choice in ("auto", "triton") and torch.compiler.is_compiling() and native_available():
        return torch.ops.ort_optim  # (one node in the traced graph; its CUDA kernel is the Triton one, registered)
    if choice == "triton" or (device.type == "cuda" and choice == "auto"):
        return triton_backend if choice == "triton" else _cuda_implementation()
    if choice == "torch" or not native_available():
        return reference
    return torch.ops.ort_optim


def runs_natively(device: torch.device) -> bool:
    """Whether the ops for tensors on this device run the native CPU library now: the backend selected at this moment,
    and not while torch.compile traces (native plans exist only then)."""
    return device.type == "cpu" and not torch.compiler.is_compiling() and implementation(device) is torch.ops.ort_optim


def update_reports_grad_norm(device: torch.device) -> bool:
    """Whether :func:`adam_step_` for tensors on this device takes ``grad_norm=True`` and returns the gradients'
    [sum of squares, non-finite] from the update's own pass: the Triton kernels (outside torch.compile's tracing).
    The native CPU op does the same through ``AdamPlan.step(grad_norm=True)``; the reference backend cannot."""
    return not torch.compiler.is_compiling() and implementation(device) is triton_backend


def adam_step_(params: Sequence[torch.Tensor], *lists_and_steps, **options) -> Optional[torch.Tensor]:
    """One multi-tensor Adam step through the implementation for the params' device: ``ort_optim::adam_step_``'s
    arguments in the order and with the names of its schema, declared once in ops/schema.cpp (ops/README.md gives
    the math and every argument; backends/reference.py spells them out in Python). Mutates params, states, masters,
    scales, steps, and the grads when grad_scale is given (written back unscaled), and marks what it wrote as
    modified in place for autograd, on every backend (ort_optim/_versions.py). ``grad_norm=True``, only where
    :func:`update_reports_grad_norm` says so (not part of the op's schema), returns the float32 [sum of squares,
    non-finite] of the gradients as loaded; otherwise returns None. ``launch_cache`` (a dict, not part of the schema
    either) is used by the Triton backend only (see its adam_step_) and ignored by the others."""
    if options.get("rounding_keys", False) is None:  # (passed only when given, as before the argument existed)
        del options["rounding_keys"]
    impl = implementation(params[0].device if len(params) else torch.device("cpu"))
    if impl is not triton_backend:
        options.pop("launch_cache", None)  # (the Triton backend's alone: a dict it keeps its launch plan in)
    return impl.adam_step_(params, *lists_and_steps, **options)


def grad_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [2] on the tensors' device: [sum of squares of all elements, 1.0 if any is inf/NaN else 0.0]."""
    if not len(tensors):
        return torch.zeros(2, dtype=torch.float32, device=_CPU)
    return implementation(tensors[0].device).grad_stats(tensors)


# ---- the runners: one bucket's check, statistics and step -------------------------------------------------------


def main_device(devices: Iterable[torch.device]) -> torch.device:
    """Where a step adds up results from several devices: the first accelerator among them, else the first (copies
    to it from the CPU need no wait; what comes back to the CPU comes once, by to_device)."""
    devices = list(devices)
    return next((d for d in devices if d.type != "cpu"), devices[0])


def to_device(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """t on device (and dtype) without synchronising where that is safe: a copy to an accelerator is queued on its
    stream (non-blocking); one to the CPU waits for it, since a non-blocking copy from an accelerator hands back host
    memory the copy has not filled yet, which the CPU kernels would read at once."""
    return t.to(device=device, dtype=dtype, non_blocking=torch.device(device).type != "cpu")


def clip_coefficient(norm: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """The factor that clips gradients of global L2 norm ``norm`` to ``max_grad_norm``: torch's clip_grad_norm_
    coefficient, clamped as it clamps (at most 1)."""
    return torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)


def scaling(stats: torch.Tensor, grad_scale: Optional[Union[float, torch.Tensor]], max_grad_norm: Optional[float],
            found_inf: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one definition of a step's loss-scale unscaling, global-norm clipping and skip decision, from the
    gradients' statistics ``stats`` (:func:`grad_stats` of every gradient of the step, summed over buckets and ranks):
    float32 tensors on stats' device, computed there without a host sync,

    * ``multiplier`` (0-dim) :math:`= \\frac{1}{s} \\min(1, \\frac{c}{n + 10^{-6}})`, the factor of every gradient
      (``inv_grad_scale`` of the ops), with :math:`s` = grad_scale (1 without), :math:`c` = max_grad_norm (no clipping
      without) and :math:`n` the norm below (torch's clip_grad_norm_ coefficient, clamped as it clamps);
    * ``norm`` (0-dim) :math:`n = \\sqrt{\\textrm{stats}[0]} / s`, the global L2 norm of the unscaled gradients (the
      square root correctly rounded, formats.sqrt_f32: torch's own float32 sqrt on the CPU is not, and a compiled
      step's is, so the two would clip differently);
    * ``skip`` (float32 [1], 1.0: skip the step, the ops' ``found_inf``): a gradient holds inf/NaN, the unscaled
      norm is not finite (unscaling by 1/s overflows when s < 1 and a gradient is large: every :math:`|g|/s \\le n`,
      so a finite norm proves that unscaling stays finite), s is zero or not finite (a tensor grad_scale on an
      accelerator, whose value step() does not read; on the CPU it is refused), or found_inf is non-zero."""
    main = stats.device
    inv = torch.ones((), dtype=torch.float32, device=main)
    skip = stats[1] > 0
    if grad_scale is not None:
        scale = grad_scale.to(main, torch.float32) if isinstance(grad_scale, torch.Tensor) else \
            torch.tensor(float(grad_scale), dtype=torch.float32, device=main)
        inv = inv / scale.reshape(())
        # (1/s is 0 for s = inf, inf or NaN for s = 0 or NaN: a scale that cannot unscale; tested before clipping,
        # whose coefficient may round to 0 for a tiny max_grad_norm without the scale being wrong)
        skip = skip | ~torch.isfinite(inv) | (inv == 0)
    norm = sqrt_f32(stats[0]) * inv  # (correctly rounded: the same bits eagerly, compiled and on CUDA)
    if max_grad_norm is not None:
        inv = inv * clip_coefficient(norm, max_grad_norm)
    skip = (skip | ~torch.isfinite(norm)).float()
    if found_inf is not None:
        skip = torch.maximum(skip, (found_inf.to(main).reshape(()) != 0).float())
    return inv, norm, skip.reshape(1)


class Scaling(NamedTuple):
    """What every runner of a step applies to its gradients: the ops' ``inv_grad_scale`` (the gradient multiplier of
    :func:`scaling`) and ``grad_scale`` (write ``p.grad`` back as grad / grad_scale), each a float32 [1] per device,
    and the ``found_inf`` skip flag (a tensor on any device; each runner reads its own copy). None: not applied."""

    inv_grad_scale: Optional[dict] = None
    found_inf: Optional[torch.Tensor] = None
    grad_scale: Optional[dict] = None

    def on(self, device: torch.device) -> dict:
        """The ops' keyword arguments for tensors on this device."""
        return dict(inv_grad_scale=None if self.inv_grad_scale is None else self.inv_grad_scale[device],
                    found_inf=None if self.found_inf is None else to_device(self.found_inf, device),
                    grad_scale=None if self.grad_scale is None else self.grad_scale[device])


NO_SCALING = Scaling()


class PlanRunner:
    """The runner of a bucket on the native CPU library: its :class:`AdamPlan`, which holds the bucket's tensors and
    reads their gradients itself. Its update pass also sums the squares of the gradients it loads (reports_norm)."""

    reports_norm = True

    def __init__(self, plan: AdamPlan, rounding_keys: Optional[torch.Tensor] = None) -> None:
        self.plan = plan
        self.rounding_keys = rounding_keys

    def check(self) -> bool:
        """Whether the bucket can step now (:meth:`AdamPlan.check`); needed before stats() and step()."""
        return self.plan.check() < 0

    def stats(self) -> torch.Tensor:
        """:func:`grad_stats` of the bucket's gradients."""
        return self.plan.grad_stats()

    def step(self, hyper: dict, scaling: Scaling = NO_SCALING, grad_norm: bool = False) -> Optional[torch.Tensor]:
        """One step of the bucket (it marks what it wrote for autograd itself); grad_norm: returns the float32 [sum of
        squares, non-finite] of the gradients as its update pass loaded them, else None."""
        return self.plan.step(**hyper, **scaling.on(_CPU), rounding_keys=self.rounding_keys, grad_norm=grad_norm)


@dataclass(eq=False)
class OpRunner:
    """The runner of a bucket on the op of its device's backend (:func:`adam_step_`: Triton, the reference, or the
    registered op, as while torch.compile traces). ``lists()`` gives the op's lists with this step's gradients;
    ``check()`` is the caller's check of them (the bucket's TensorWatch or fingerprints); ``step_tensors`` are the
    views of the steps that ``optimizer.state[p]['step']`` holds, marked for autograd after a step (their version
    counters are their own); ``launch_cache`` is the dict the Triton backend keeps its launch plan in (see
    :func:`adam_step_`)."""

    lists: Callable[[], list]
    check: Callable[[], bool]
    device: torch.device
    rounding_keys: Optional[torch.Tensor] = None
    step_tensors: Sequence[torch.Tensor] = ()
    launch_cache: Optional[dict] = None

    @property
    def reports_norm(self) -> bool:
        """Whether its update pass can sum the squares of the gradients it loads (:func:`update_reports_grad_norm`)."""
        return update_reports_grad_norm(self.device)

    def stats(self) -> torch.Tensor:
        return grad_stats(self.lists()[1])

    def step(self, hyper: dict, scaling: Scaling = NO_SCALING, grad_norm: bool = False) -> Optional[torch.Tensor]:
        options = dict(hyper, **scaling.on(self.device), rounding_keys=self.rounding_keys)
        out = adam_step_(*self.lists(), **options, **({"grad_norm": True} if grad_norm else {}),
                         launch_cache=self.launch_cache)
        if self.step_tensors and not torch.compiler.is_compiling() and _versions.step_taken(options["found_inf"]):
            _versions.mark_modified(self.step_tensors)
        return out


Runner = Union[PlanRunner, OpRunner]
_CPU = torch.device("cpu")
