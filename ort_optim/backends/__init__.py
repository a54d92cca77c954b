"""The one boundary between ort_optim's Python code and its kernels.

Everything above this package calls :func:`adam_step_`, :func:`grad_stats` and :class:`AdamPlan` from here; this
module decides who runs them. The backends are modules of this package that implement the same math
(ops/README.md) from the shared constants of :mod:`ort_optim._spec`, and never import one another:

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
from typing import Optional, Sequence

import torch

from . import native, reference
from . import triton as triton_backend  # imports no triton until its first kernel call

BACKENDS = ("auto", "native", "torch", "triton")
AdamPlan = native.AdamPlan
TensorWatch = native.TensorWatch


def backend() -> str:
    """The backend selected by ORT_OPTIM_BACKEND: auto (default), native, torch or triton."""
    name = os.environ.get("ORT_OPTIM_BACKEND", "auto").lower()
    if name not in BACKENDS:
        raise ValueError(f"ORT_OPTIM_BACKEND={name!r} is not one of {', '.join(BACKENDS)}")
    return name


_native_loaded: Optional[bool] = None  # (None: not tried yet)


def native_available() -> bool:
    """True when the compiled CPU op library is loaded (building it first if needed). Loading it also registers the
    CUDA kernels of its ops (Triton, or the reference where triton is not installed). Once tried, a read of a module
    flag, which torch.compile traces as a constant."""
    global _native_loaded
    if _native_loaded is None:
        _native_loaded = native.available()
        if _native_loaded:
            _register_cuda_kernels()
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
        return torch.zeros(2, dtype=torch.float32)
    return implementation(tensors[0].device).grad_stats(tensors)
