"""How FusedAdam stores a param's state: which dtypes its moments have, whether it keeps a master, where its step
lives, and how fresh states are laid out in memory. The one description of it: the optimizer, its step cache
(ort_optim/_plan.py), step_in_backward and checkpoint loading all ask a :class:`StateLayout`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from . import _heap, _spec
from ._spec import FP8_FORMATS, LOW_BIT_FORMATS, LOW_PRECISION

# State views in one flat buffer start a multiple of this many elements apart (256 bytes for float32).
STATE_ALIGN = 64


@dataclass(frozen=True)
class StateLayout:
    """The optimizer-wide options that decide how state is stored (equal layouts store states alike: a step cache is
    valid only while its layout is the optimizer's)."""

    master_weights: bool = False
    exp_avg_dtype: Optional[torch.dtype] = None
    exp_avg_sq_dtype: Optional[torch.dtype] = None

    def dtypes(self, p: torch.Tensor) -> tuple[torch.dtype, torch.dtype, bool]:
        """(exp_avg dtype, exp_avg_sq dtype, has master) for a parameter: float64 params keep float64 states and no
        master; fp16/bf16 params with master weights default to float32 moments, others to the param's dtype."""
        if p.dtype == torch.float64:
            return torch.float64, torch.float64, False
        has_master = self.master_weights and p.dtype in LOW_PRECISION
        default = torch.float32 if has_master else p.dtype
        return self.exp_avg_dtype or default, self.exp_avg_sq_dtype or default, has_master

    @staticmethod
    def steps_device(p: torch.Tensor) -> torch.device:
        """Where a param's step count lives: the CPU kernel reads it on the host, GPU kernels on the device (no host
        sync per step)."""
        return p.device

    def init_state(self, p: torch.Tensor, amsgrad: bool) -> dict:
        return self.init_states([p], amsgrad)[0]

    def init_states(self, params: list[torch.Tensor], amsgrad: bool, one_buffer: bool = True) -> list[dict]:
        """Fresh states for params (plain tensors: DTensor params pass their local pieces). Each kind of float state
        tensor of params sharing (device, dtype) is a view of one flat buffer: the kernel then streams through
        contiguous memory instead of thousands of small allocations, whose cold starts cost more than their bytes.
        Views start 256 bytes apart (times n) from the buffer's start, which torch's allocator aligns to 64 bytes, so
        vector loads stay aligned; the buffer ends with its last view. Low-bit codes (8-bit, 4-bit) get a storage per
        param instead, as their scales do, as in torchao and bitsandbytes: then the bytes of the storages in
        ``state[p]`` are that param's state exactly, however they are counted, and the low-bit step, bound by its
        arithmetic, gains nothing from the flat layout. one_buffer=False gives every state tensor a storage of its
        own, as a step that torch.compile traces needs: the op there mutates its list arguments through
        functionalization, which copies a whole buffer whose views it writes, at every step, rather than write them
        in place."""
        states: list[dict[str, Any]] = []
        requests: dict[tuple[str, torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            m_dtype, v_dtype, has_master = self.dtypes(p)
            kinds = {"exp_avg": m_dtype, "exp_avg_sq": v_dtype}
            if amsgrad:
                kinds["max_exp_avg_sq"] = v_dtype
            if has_master:
                kinds["master_param"] = torch.float32
            state: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float64, device=self.steps_device(p))}
            for key, dtype in kinds.items():
                requests.setdefault((key, p.device, dtype), []).append(i)
                if dtype == torch.float16:
                    state[key + "_scale"] = torch.ones(_spec.num_blocks(p.numel()), dtype=torch.float32,
                                                       device=p.device)
                elif dtype in LOW_BIT_FORMATS or dtype in FP8_FORMATS:  # codes; zero scales: all-zero moments
                    fmt = LOW_BIT_FORMATS.get(dtype) or FP8_FORMATS[dtype]
                    state[key + "_scale"] = torch.zeros(fmt.num_scales(p.numel()), dtype=fmt.scale_dtype,
                                                        device=p.device)
            states.append(state)
        for (key, device, dtype), indices in requests.items():
            fmt = LOW_BIT_FORMATS.get(dtype) or FP8_FORMATS.get(dtype)
            if not one_buffer and not fmt:
                for i in indices:
                    states[i][key] = (params[i].detach().to(dtype, copy=True, memory_format=torch.contiguous_format)
                                      if key == "master_param"  # (a copy keeps a strided param's strides else)
                                      else torch.zeros(params[i].shape, dtype=dtype, device=device))
                continue
            if fmt:
                for i in indices:
                    codes = torch.zeros(fmt.storage_shape(params[i].shape), dtype=torch.uint8, device=device)
                    states[i][key] = codes.view(dtype) if dtype in FP8_FORMATS else codes  # (torch 2.4 cannot fill fp8)
                continue
            shapes = [params[i].shape for i in indices]
            offsets, total = _flat_offsets([math.prod(shape) for shape in shapes])
            flat = _heap.zeros(total, dtype, device)  # (on huge pages where the system gives them)
            for i, offset, shape in zip(indices, offsets, shapes):
                view = flat[offset:offset + math.prod(shape)].view(shape)
                if key == "master_param":
                    view.copy_(params[i].detach())
                states[i][key] = view
        return states


def _flat_offsets(numels: list[int]) -> tuple[list[int], int]:
    """Where views of these sizes start in a flat buffer, and its length: each view starts aligned (STATE_ALIGN
    elements), and the buffer ends where the last view does (no padding after it)."""
    offsets, total = [], 0
    for numel in numels:
        offsets.append(-(-total // STATE_ALIGN) * STATE_ALIGN)
        total = offsets[-1] + numel
    return offsets, total


def compact_flat_buffers(states: Iterable[dict]) -> None:
    """Re-homes state tensors that are views of one storage of which they use less than 7/8 (after ``del
    optimizer.state[p]``, or a state tensor replaced, the rest of a flat buffer stays allocated as long as any view of
    it lives: up to twice the state's memory): copies them into a flat buffer of their own sizes, laid out as
    init_states lays out one, through ``.data =`` (the same tensor objects, holding the same values). Step counts
    (which every plan stacks again), inference tensors, tensor subclasses (a DTensor state: its local tensor is its
    own) and tensors that are a whole storage are left alone."""
    by_storage: dict[tuple, list[torch.Tensor]] = {}
    for state in states:
        for key, t in state.items():
            if (key != "step" and type(t) is torch.Tensor and t.numel() and t.is_contiguous()
                    and not t.is_inference() and t.layout == torch.strided):
                storage = t.untyped_storage()
                if t.numel() * t.element_size() < storage.nbytes():
                    views = by_storage.setdefault((t.device, storage.data_ptr()), [])
                    if all(v is not t for v in views):
                        views.append(t)
    for views in by_storage.values():
        dtype, nbytes = views[0].dtype, views[0].untyped_storage().nbytes()
        if any(v.dtype != dtype for v in views):
            continue
        offsets, total = _flat_offsets([v.numel() for v in views])
        if total * views[0].element_size() * 8 >= nbytes * 7:
            continue
        flat = _heap.zeros(total, dtype, views[0].device)
        for view, offset in zip(views, offsets):
            home = flat[offset:offset + view.numel()].view(view.shape)
            home.copy_(view)
            view.data = home
