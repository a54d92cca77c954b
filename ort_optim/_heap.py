"""Giving the memory of freed CPU gradients back to the system, so that step_in_backward's saving shows in RSS.

glibc's malloc serves a request below its mmap threshold from the heap, and it raises that threshold (up to 32 MiB)
each time a block it had mapped on its own is freed. After the first gradient step_in_backward frees, the gradients of
the following layers therefore come from the heap. There a freed gradient leaves a hole that the small allocations of
backward (activation gradients, the autograd engine's buffers) split before the next gradient of the same size asks
for it, so the next gradient extends the heap instead: the peak RSS grows by about a gradient per layer, and most of
what freeing the gradients early saved is lost (12 x Linear(2048, 2048), fp32, batch 8: 42-68% of the gradients'
bytes saved instead of about 95%, and a steady RSS above step()'s).

``malloc_trim(0)`` hands the whole free pages inside the heap back to the system (madvise), whatever blocks are still
alive around them; the addresses stay the heap's, and a later allocation there gets fresh zero pages. Calling it once
per :data:`TRIM_EVERY_BYTES` of freed gradients bounds the memory kept free but resident to about that much, at the
cost of one call (about 1 ms on a heap of a few hundred MB) and of refaulting the pages that get reused. An allocator
preloaded in glibc's place (jemalloc, tcmalloc) returns memory its own way, and glibc's malloc_trim finds none of its
blocks; on other C libraries nothing is called.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Optional

import torch

TRIM_EVERY_BYTES = 16 * 2**20


def _glibc_malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's malloc_trim, or None on any other C library (or platform)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, ValueError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _glibc_malloc_trim()


class FreedMemory:
    """Counts the bytes of CPU gradients freed since the last trim, and trims glibc's heap every TRIM_EVERY_BYTES."""

    def __init__(self, every_bytes: int = TRIM_EVERY_BYTES) -> None:
        self.every_bytes = every_bytes
        self.pending = 0

    def drop_grad(self, p: torch.Tensor) -> None:
        """Sets ``p.grad`` to None, and trims the heap once the CPU gradients dropped so far reach every_bytes. (A
        gradient that something else still holds stays alive; trimming then finds nothing more to give back.)"""
        grad = p.grad
        nbytes = grad.untyped_storage().nbytes() if grad.device.type == "cpu" and grad.layout == torch.strided else 0
        del grad
        p.grad = None
        if _MALLOC_TRIM is None:
            return
        self.pending += nbytes
        if self.pending >= self.every_bytes:
            self.pending = 0
            _MALLOC_TRIM(0)
