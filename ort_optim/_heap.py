"""How the optimizer's CPU memory meets the C library and the kernel: freed CPU gradients given back to the system,
so that step_in_backward's saving shows in RSS; and the flat state buffers placed on transparent huge pages.

Freed gradients:

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

Huge pages: a step streams every moment (and master) once, and with 4 KiB pages each 4 KiB of each stream costs a
TLB miss, a page walk, that the hardware prefetchers wait for. :func:`zeros` asks Linux to back a flat state buffer
with 2 MiB transparent huge pages (``madvise(MADV_HUGEPAGE)`` on the buffer's whole 2 MiB pages, before the zero
fill that faults them in), as the kernel offers them to a process that asks where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (and to every process where it is ``always``;
``never`` turns them off). Measured on GPT-2 small's shapes (AMD EPYC, 2 threads, guides/benchmarks.md): the fp32
step 5% faster with its moments on huge pages. The memory is the same (the buffer is filled anyway); a fault may
compact memory to find a 2 MiB page, once, when the state is made. Elsewhere (other systems, a refused advice) the
buffer is plain zeros.
"""

from __future__ import annotations

import ctypes
import os
import sys
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

HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14  # (linux/mman.h)


def _linux_madvise() -> Optional[Callable[[int, int, int], int]]:
    """The C library's madvise on Linux, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        advise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


_MADVISE = _linux_madvise()


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(numel, dtype=dtype, device=device)``; on the CPU under Linux, its whole 2 MiB pages advised to
    be transparent huge pages before they are first written (see the module docstring)."""
    if device.type != "cpu" or _MADVISE is None or numel * dtype.itemsize < 2 * HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype, device=device)
    buffer = torch.empty(numel, dtype=dtype, device=device)
    start = buffer.data_ptr()
    begin = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + numel * dtype.itemsize) // HUGE_PAGE * HUGE_PAGE
    _MADVISE(begin, end - begin, _MADV_HUGEPAGE)  # (a refusal, EINVAL without THP, leaves plain pages)
    return buffer.zero_()


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
