"""Marking what a kernel wrote through data pointers as modified in place, for autograd.

torch's in-place ops bump the version counter of every tensor they write (``torch.optim.AdamW``'s foreach and
for-loop steps do), and autograd compares it with the version a backward saved: a backward that still needs the old
value (a second backward over a retained graph that saved a param, a ``p.detach()`` saved by a later forward) raises
"one of the variables needed for gradient computation has been modified by an inplace operation" instead of silently
computing with the new one. Kernels that write through pointers are invisible to it, so every ort_optim step marks
what it wrote, whichever backend runs it and whoever calls it (``FusedAdam.step()``, step_in_backward's hooks):

* the native CPU op and its plans, in C++ (ops/step.h, "autograd's version counters": about 4000 atomic
  increments for 2000 params, instead of a Python call per tensor);
* the Triton kernels, through :func:`mark_modified`;
* the reference backend writes with torch ops (``copy_``, ``add_``), which mark their outputs themselves;
* ``optimizer.state[p]['step']``: each is a view of its bucket's ``steps`` put in place with ``.data =`` (so that it
  stays the same tensor across re-planning), which keeps a version counter of its own; the native plans mark them
  with the rest, FusedAdam marks them after the other backends' op calls.

What a step writes: the params, their moments, masters, block scales and step counts, and the gradients when it
unscales them in place (``grad_scale``). A step skipped by ``found_inf`` writes nothing and marks nothing (on CUDA,
where the flag stays on the device, the Triton path marks them anyway rather than wait for it). Tensors made under
``torch.inference_mode()`` have no version counter and are skipped, as ``torch.autograd.graph.increment_version``
skips them (torch's foreach step refuses such params; ours updates them, see tests/fused_adam/test_state_cache.py).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def _takes_lists() -> bool:
    """Whether torch._C._increment_version takes a list of tensors (and skips inference tensors itself), as newer
    torch's does (2.13); torch 2.4's takes one tensor, and raises for an inference tensor."""
    try:
        torch._C._increment_version([])
        return True
    except (TypeError, RuntimeError):
        return False


_TAKES_LISTS = _takes_lists()


def step_taken(found_inf: Optional[torch.Tensor]) -> bool:
    """Whether a step given this found_inf wrote, or may have: a flag on the host is read, one on a device is not
    (that would wait for the device), so such a step counts as taken."""
    return found_inf is None or found_inf.device.type != "cpu" or float(found_inf) == 0.0


def tracks_versions(t: torch.Tensor) -> bool:
    """Whether t has an autograd version counter. One made under torch.inference_mode() has none, and keeps none when
    given other data with ``.data =`` (while ``is_inference()`` then says False): such a tensor can be neither viewed
    nor written in place outside inference mode. A plan adopts such a state['step'] as a new tensor (it re-points
    step tensors into its buckets' steps), and the reference backend writes such states inside inference_mode."""
    try:
        t._version
    except RuntimeError:
        return False
    return True


def mark_modified(tensors: Iterable[torch.Tensor]) -> None:
    """Bumps the autograd version counter of each tensor (a view shares its base's), as an in-place op would;
    tensors without one are skipped: inference tensors, and a tensor made under torch.inference_mode() that was given
    normal data with ``.data =`` (it keeps its missing counter, while ``is_inference()`` says False). Not while torch.compile traces: a traced step mutates functionalized
    copies, which torch writes back into the real tensors with in-place copies that mark them."""
    if torch.compiler.is_compiling():
        return
    tensors = list(tensors)
    increment = torch._C._increment_version
    if _TAKES_LISTS:
        try:
            increment(tensors)
            return
        except RuntimeError:  # (one without a counter; bumping the others twice below does no harm)
            pass
    for t in tensors:
        try:
            increment([t] if _TAKES_LISTS else t)
        except RuntimeError:  # "Inplace update to inference tensor outside InferenceMode is not allowed"
            pass
