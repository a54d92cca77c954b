"""FusedAdam's step cache: which params a step updates, in buckets with their state tensors, and the one rule that says
whether it still holds.

A step walks ``FusedAdam.step -> Plan (still valid, or rebuilt by build() after full validation) -> backend op``.

:func:`build` validates everything a step needs (gradients, states, storages, params or states that share memory)
before it writes anything, then creates missing state, adopts state tensors assigned by the user, and groups the
params of each param group into buckets (device, dtype, state dtypes, master): one op call per bucket. On the native CPU
backend each bucket also gets a native ``AdamPlan`` (ops/README.md) that holds its tensors and reads the gradients
itself.

:meth:`Plan.read_grads_if_valid` applies the single validity rule at every step (and reads the step's gradients):

* ``optimizer.state`` is an :class:`OptimizerState`: each mutation of it or of a param's state dict gives it a new
  version (:func:`new_version`), and a plan is valid only for that very container (one put in its place is
  told by identity) at the version it was built at (O(1));
* each param group must still be the dict the plan was built from (a dict put in its place, ``{**group, 'lr': x}``
  say, is told by identity: the step reads the hyperparameters from the group the plan holds), and each
  ``param_groups[i]['params']`` is a :class:`ParamList` that marks its mutations the same way: the group must still
  hold that very list (a list put in its place is told by identity), at that version; the group's ``amsgrad`` (it
  adds a state list), the optimizer's state layout options and the backend (native plans exist only while the native
  CPU op runs) must be unchanged (O(groups));
* per tensor (params, grads, states, masters, scales, steps): the same storage, data pointer (a native plan
  re-resolves a storage re-allocated in place; the buckets of other backends plan again, as their launch plans keep
  addresses), storage size, dtype, device, shape, strides and TensorImpl (``torch.utils.swap_tensors``
  gives a param another), and which params have gradients: in C++ by native watches (``backends.TensorWatch``, which
  compare metadata only, so they serve every device: the native plans of CPU buckets, a watch of their own for the
  buckets of other backends), or, where the native library is not loaded, in Python by :func:`fingerprints`.

When the rule fails, the step builds a new plan, which raises (naming ``param_groups[i]['params'][j]``) for anything
that cannot be honoured, before any write.

DTensor params (FSDP2, tensor parallel) are planned and stepped through their local tensors
(``integrations/dtensor.py``): the buckets hold the local pieces and their gradients' local pieces, validated like
plain tensors; a gradient laid out unlike its param is brought to the param's layout once per step after the rule
held (:meth:`Plan.resolve_grads`: a local slice, or DTensor's redistribution). Their buckets take the Python check (a native plan
reads ``.grad`` from the tensors it holds, and a local piece has none: its DTensor holds it), whose fingerprints
follow storages that an engine frees and re-allocates, and which reads the local pieces afresh at every step.
"""

from __future__ import annotations

import collections
import itertools
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import _checkpoint, _spec, backends, formats
from ._checkpoint import MOMENT_KEYS
from ._group_options import checked_entries, same_checked_entries, show
from ._layout import StateLayout, compact_flat_buffers
from ._versions import tracks_versions
from ._spec import FP8_FORMATS, LOW_BIT_FORMATS, SUPPORTED_PARAM_DTYPES, num_blocks
from .integrations import dtensor

CPU = torch.device("cpu")
# Eager steps in a row through a plan made for compiled steps before the eager steps plan natively again.
EAGER_STEPS_ON_A_TRACED_PLAN = 4
# Element-wise overlap checks (exotic strides only) look at no more elements than this per param.
MAX_ELEMENTWISE_OVERLAP_CHECK = 1 << 24


def describe(group_index: int, index: int, param: torch.Tensor) -> str:
    # (a lazy module's UninitializedParameter has no shape until its first forward materialises it)
    shape = "uninitialized" if torch.nn.parameter.is_lazy(param) else f"shape {tuple(param.shape)}"
    return f"param_groups[{group_index}]['params'][{index}] ({shape}, {param.dtype})"


class GradientError(ValueError, RuntimeError):
    """A gradient the step cannot use: sparse, of another shape or device than its param, float64 on a param of another
    dtype or the other way round, without its memory, overlapping itself or sharing memory with its param where the
    step unscales it in place, or placed otherwise than its DTensor param.

    A ValueError, as every input FusedAdam refuses, and a RuntimeError, as torch.optim's AdamW and apex's and ONNX
    Runtime's FusedAdam raise for a sparse gradient, so that code written against either catches it."""


# ---- containers that mark their mutations ---------------------------------------------------------------------------


_VERSIONS = itertools.count()


def new_version() -> str:
    """A container's version after a mutation: a string that no other version in the process equals (so a new
    container's never equals an old one's). A string because torch.compile guards it by its value and never makes it a
    symbol: an int that changed between two compilations it makes a symbol (automatic dynamic), and an analysis
    restarted with the symbol in place of the constant takes another path through the plan's check than the first one
    took (TorchDynamo's SpeculationLogDivergence); an identity test of two plain objects it folds while tracing,
    guarding neither (a state assigned between compiled steps then went unnoticed)."""
    return f"v{next(_VERSIONS)}"


_ABSENT = object()


def _held(key, value):
    """What a state dict holds for this entry: a step count given as a number becomes the float64 tensor torch's
    optimizers keep (TorchDynamo reads every state's step as a tensor before a compiled step runs); the step checks
    its value, as any step's (an int beyond 2**53 stays the int, which the step refuses naming the param: as a
    float64 tensor it could be another number, or none)."""
    if key == "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, int) and abs(value) > _spec.MAX_STEP:
            return value
        return torch.tensor(float(value), dtype=torch.float64)
    return value


class ParamState(dict):
    """One param's state dict inside an :class:`OptimizerState`: every mutation bumps the owner's version."""

    __slots__ = ("_owner",)

    def __init__(self, owner: "OptimizerState", items=()):
        super().__init__({key: _held(key, value) for key, value in dict(items).items()})
        self._owner = weakref.ref(owner)

    def _bump(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner.changed()

    def __setitem__(self, key, value) -> None:
        value = _held(key, value)
        unchanged = dict.get(self, key, _ABSENT) is value
        super().__setitem__(key, value)
        if not unchanged:  # (the same object put back is no change: TorchDynamo puts every state's step back at
            self._bump()   # each trace, which would otherwise plan again and fail the earlier graphs' guards)

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._bump()

    def pop(self, *args):
        self._bump()
        return super().pop(*args)

    def popitem(self):
        self._bump()
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self._bump()

    def update(self, *args, **kwargs) -> None:
        super().update({key: _held(key, value) for key, value in dict(*args, **kwargs).items()})
        self._bump()

    def setdefault(self, key, default=None):
        self._bump()
        return super().setdefault(key, _held(key, default))

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):  # copies and pickles are plain dicts (the optimizer wraps them again)
        return dict, (dict(self),)


class OptimizerState(collections.defaultdict):
    """``optimizer.state``: a ``defaultdict(dict)`` of :class:`ParamState` that marks its mutations (``version``, a new
    one at each: :func:`new_version`) and tells them to the caches built on it (:meth:`add_listener`).

    Assigning a dict to ``state[p]`` stores a :class:`ParamState` copy of it (a ParamState of this container is stored
    as is), so later changes must go through ``optimizer.state[p]``, not through the dict that was assigned.
    """

    def __init__(self, items=()):
        super().__init__(None)
        self.version = new_version()
        self._listeners: list = []
        for key, value in dict(items).items():
            self[key] = value

    def add_listener(self, listener: weakref.WeakMethod) -> None:
        """Calls ``listener()()`` at each mutation while the listener's object lives. A step plan holds the state
        tensors it was built for, which a mutation may have dropped or replaced (``del state[p]``, a moment assigned,
        a checkpoint loaded): its owner releases it then, so that they are freed at once, as torch.optim's states
        are, instead of at the next step, which plans again anyway. A listener added again (the container assigned
        to its optimizer once more) is kept once, and those of objects gone are dropped."""
        self.remove_listener(listener)
        self._listeners.append(listener)

    def remove_listener(self, listener: weakref.WeakMethod) -> None:
        """Stops calling the listener (its object no longer uses this container), and drops those of objects gone."""
        self._listeners = [known for known in self._listeners if known() is not None and known != listener]

    def changed(self) -> None:
        """A mutation: a new version, and the listeners told."""
        self.version = new_version()
        for listener in self._listeners:
            release = listener()
            if release is not None:
                release()

    def __missing__(self, key) -> ParamState:
        # an empty state changes no plan: no version bump for reading optimizer.state[p]
        value = ParamState(self)
        super().__setitem__(key, value)
        return value

    def _wrap(self, value) -> ParamState:
        if isinstance(value, ParamState) and value._owner() is self:
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"optimizer.state[p] must be a dict of state entries, got {type(value).__name__}")
        return ParamState(self, value)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, self._wrap(value))
        self.changed()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self.changed()

    def pop(self, *args):
        self.changed()
        return super().pop(*args)

    def popitem(self):
        self.changed()
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self.changed()

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = {} if default is None else default
        return self[key]

    def __ior__(self, other):
        self.update(other)
        return self

    def copy(self):
        return collections.defaultdict(dict, self)

    __copy__ = copy

    def __reduce__(self):  # copies and pickles are a plain defaultdict(dict) (the optimizer wraps it again)
        return collections.defaultdict, (dict,), None, None, iter([(k, dict(v)) for k, v in self.items()])


class ParamList(list):
    """A param group's ``params`` list that marks its mutations (``version``, a new one at each: :func:`new_version`)."""

    def __init__(self, items=()):
        super().__init__(items)
        self.version = new_version()

    def __reduce__(self):  # copies and pickles are plain lists
        return list, (list(self),)


def _counting(method):
    def mutate(self, *args, **kwargs):
        self.version = new_version()
        return method(self, *args, **kwargs)

    mutate.__name__ = method.__name__
    return mutate


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove",
              "clear", "sort", "reverse"):
    setattr(ParamList, _name, _counting(getattr(list, _name)))
del _name


# ---- the plan -------------------------------------------------------------------------------------------------------


@dataclass
class Bucket:
    """Params of one param group that share (device, dtype, state dtypes, master): one op call per step."""

    indices: list[int]  # positions in group["params"]
    params: list[torch.Tensor]  # the tensors the op updates: the params, or their local pieces for DTensor params
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    max_exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    master_params: list[torch.Tensor] = field(default_factory=list)
    exp_avg_scales: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sq_scales: list[torch.Tensor] = field(default_factory=list)
    max_exp_avg_sq_scales: list[torch.Tensor] = field(default_factory=list)
    steps: Optional[torch.Tensor] = None  # float64 [n]; state[p]["step"] are 0-dim views of it
    step_tensors: list[torch.Tensor] = field(default_factory=list)  # those views (`.data = t` replaces their storage)
    rounding_keys: Optional[torch.Tensor] = None  # int64 [n]: stochastic rounding of bfloat16 params, else None
    native: Optional[backends.AdamPlan] = None  # on the native CPU backend
    watch: Optional[backends.TensorWatch] = None  # other backends' buckets, while the native library is loaded
    fingerprints: list = field(default_factory=list)  # of every tensor above, for the Python check (neither of those)
    grads: list = field(default_factory=list)  # this step's gradients (other backends; a native plan reads its own)
    pending: list = field(default_factory=list)  # (slot, DTensor gradient) to redistribute into grads this step
    holds_dtensor_pieces: bool = False  # params holds DTensors' local pieces
    launch_cache: dict = field(default_factory=dict)  # the Triton backend's launch plan for these tensors

    def state_lists(self) -> list[list[torch.Tensor]]:
        return [self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs, self.master_params, self.exp_avg_scales,
                self.exp_avg_sq_scales, self.max_exp_avg_sq_scales]

    def tensors(self) -> list[torch.Tensor]:
        return [t for lst in [self.params] + self.state_lists() + [self.step_tensors] for t in lst] + [self.steps]

    def op_lists(self) -> list:
        return [self.params, self.grads] + self.state_lists() + [self.steps]

    @property
    def runner(self) -> backends.Runner:
        """Its check, statistics and step (ort_optim.backends): through its native plan, else through the op of its
        device's backend. (Made when asked: a runner kept here would hold the bucket in a reference cycle.)"""
        if self.native is not None:
            return backends.PlanRunner(self.native, self.rounding_keys)
        return backends.OpRunner(self.op_lists, self.unchanged, self.params[0].device, self.rounding_keys,
                                 self.step_tensors, self.launch_cache)

    def unchanged(self) -> bool:
        """The check of a bucket without a native plan: its TensorWatch where the op library is loaded, else in
        Python: every tensor has the fingerprint it had when planned, and every gradient read (GroupPlan.read_grads)
        is usable."""
        if self.watch is not None:
            return self.watch.check() < 0
        return fingerprints(self.tensors()) == self.fingerprints and all(
            g is None or _usable_grad(g, p) for g, p in zip(self.grads, self.params))


@dataclass
class GroupPlan:
    group: dict
    params: ParamList  # the group's list when planned, and its version then
    params_version: str
    amsgrad: bool
    rounding: tuple  # the group's (stochastic_rounding, stochastic_rounding_seed): they decide the rounding keys
    checked: tuple  # the group's entries that only validation reads (_group_options.checked_entries), as planned
    has_grad: list[bool]  # which params had a gradient
    buckets: list[Bucket]
    native: bool  # every bucket has a native plan: they watch the gradients (watchers), Python reads none
    watchers: list = field(default_factory=list)  # native plans to check(): the buckets', or one over idle params
    has_dtensors: bool = False  # the group has DTensor params
    in_order: bool = field(init=False)  # one bucket holds every param, in order: it takes the gradients as read

    def __post_init__(self) -> None:
        self.in_order = len(self.buckets) == 1 and self.buckets[0].indices == list(range(len(self.params)))

    def read_grads_if_current(self) -> bool:
        """The per-tensor part of the rule (see the module docstring), after reading this step's gradients into the
        buckets (read_grads); a False leaves them half read, for a new plan to replace."""
        if self.native:
            for watcher in self.watchers:
                if watcher.check() >= 0:
                    return False
            return True
        if not self.read_grads():
            return False
        return all(bucket.runner.check() for bucket in self.buckets)

    def read_grads(self) -> bool:
        """Puts this step's gradients into the buckets; False when the params that have
        one are not those planned, or a DTensor's gradient or local piece is not what was planned. The part of
        :meth:`read_grads_if_current` that torch.compile can trace: it reads no data pointers (there, TorchDynamo's guards on the
        tensors it reads stand in for the fingerprints)."""
        grads = [p.grad for p in self.params]
        if [g is not None for g in grads] != self.has_grad:
            return False
        pending = {}  # position: gradient to redistribute (Plan.resolve_grads, once the plan holds)
        if self.has_dtensors:
            if any(g is not None and dtensor.gradient_problem(p, g) for p, g in zip(self.params, grads)):
                return False
            pending = {i: g for i, (p, g) in enumerate(zip(self.params, grads))
                       if g is not None and dtensor.needs_redistribution(p, g)}
            grads = [None if i in pending else dtensor.local(g) for i, g in enumerate(grads)]
        for bucket in self.buckets:
            bucket.grads = grads if self.in_order else [grads[i] for i in bucket.indices]
            bucket.pending = ([(slot, pending[i]) for slot, i in enumerate(bucket.indices) if i in pending]
                              if pending else [])
            if bucket.holds_dtensor_pieces and not all(dtensor.local(self.params[i]) is q
                                           for i, q in zip(bucket.indices, bucket.params)):
                return False  # (a DTensor given another local tensor: what it holds now is what must be stepped)
        return True


@dataclass
class Plan:
    groups: list[GroupPlan]
    state: OptimizerState  # the optimizer's state container it was built for
    state_version: str
    layout: StateLayout  # the optimizer's state layout
    native: bool  # whether CPU buckets run on the native op (have native plans)
    traced: bool = False  # made for a step that torch.compile traces (no native plans; eager steps take it as it is)
    eager_run: int = 0  # eager steps through this traced plan in a row, with no compiled step between
    eager_version: int = -1  # the steps buffer's autograd version after the last of them
    has_dtensors: bool = field(init=False)  # whether any group has DTensor params

    def __post_init__(self) -> None:
        self.has_dtensors = any(planned.has_dtensors for planned in self.groups)

    def read_grads_if_valid(self, groups: list[dict], state: OptimizerState, layout: StateLayout) -> bool:
        """Whether this plan still describes the optimizer's param groups, state and layout (the rule in the module
        docstring); when it does, the buckets are ready to step (native plans checked, other buckets' gradients
        read into bucket.grads)."""
        # (a plan made for a compiled step serves eager steps too: one made again, with native plans, would fail the
        # compiled graphs' guards, and the next compiled step would trace again)
        if not self.describes(groups, state, layout, backends.runs_natively(CPU) and not self.traced):
            return False
        for planned in self.groups:
            if not planned.read_grads_if_current():
                self.forget()  # (the groups checked before it hold their params and gradients for a step)
                return False
        return True

    def describes(self, groups: list[dict], state: OptimizerState, layout: StateLayout, native: bool) -> bool:
        """The part of the rule above the tensors: the same state container at the same version, the same layout and
        backend choice, the same group dicts with the same params lists at the same versions, the same amsgrad
        and rounding options and the same entries that only validation reads (O(groups), and traceable by
        torch.compile, which guards on what it reads: a step traced again validates them)."""
        if (state is not self.state or self.state_version != state.version or self.layout != layout
                or self.native != native or len(groups) != len(self.groups)):
            return False
        for group, planned in zip(groups, self.groups):
            params = group["params"]
            if (group is not planned.group or params is not planned.params
                    or params.version != planned.params_version or bool(group["amsgrad"]) != planned.amsgrad
                    or _rounding(group) != planned.rounding
                    or not same_checked_entries(checked_entries(group), planned.checked)):
                return False
        return True

    def resolve_grads(self, writes_grads: bool) -> None:
        """Brings the gradients laid out unlike their DTensor params to the params' layout (dtensor.local_grad), once
        per step, after read_grads_if_valid(): every rank runs the same collectives in the same order, whether or not its plan was
        rebuilt. writes_grads: the step writes the gradients back unscaled; a piece that is a view of the gradient
        is then copied, so p.grad stays as it was, as torch's fused AdamW leaves it for a redistributed gradient
        (a replicated gradient unscaled in one rank's slice only would no longer be replicated). Raises ValueError
        naming the param if a piece cannot update it (nothing has been written)."""
        for group_index, planned in enumerate(self.groups):
            for bucket in planned.buckets:
                for slot, g in bucket.pending:
                    p = planned.params[bucket.indices[slot]]
                    piece = dtensor.local_grad(p, g)
                    if writes_grads and piece.untyped_storage().data_ptr() == dtensor.local(g).untyped_storage(
                            ).data_ptr():
                        piece = piece.clone()
                    problem = _grad_problem(piece, bucket.params[slot])
                    if problem is not None:
                        raise GradientError(f"{describe(group_index, bucket.indices[slot], p)}: {problem} (once "
                                         f"redistributed from {dtensor.describe_layout(g)})")
                    bucket.grads[slot] = piece

    def serves_eager_steps(self) -> bool:
        """For an eager step: whether to step through this plan. A plan made for compiled steps (traced) serves the
        eager steps between them, so that their graphs stay valid (a new plan fails their guards); after
        EAGER_STEPS_ON_A_TRACED_PLAN eager steps in a row, the eager steps plan natively again (native plans read the
        gradients in C++ and report a plain step's norm). A compiled step writes the steps buffer through the op,
        which moves its autograd version: that tells the eager steps apart that had a compiled one between them."""
        if not self.traced:
            return True
        version = self._steps_version()
        self.eager_run = self.eager_run + 1 if version >= 0 and version == self.eager_version else 1
        return self.eager_run < EAGER_STEPS_ON_A_TRACED_PLAN

    def stepped_eagerly(self) -> None:
        """Records the steps buffer's version after an eager step through this plan (serves_eager_steps)."""
        self.eager_version = self._steps_version()

    def _steps_version(self) -> int:
        """The autograd version of the first bucket's steps buffer (-1: no bucket has one)."""
        steps = next((bucket.steps for _, _, bucket in self.buckets() if bucket.steps is not None), None)
        return -1 if steps is None else steps._version

    def buckets(self):
        """(group index, group, bucket) of every op call of a step, in order."""
        for group_index, planned in enumerate(self.groups):
            for bucket in planned.buckets:
                yield group_index, planned.group, bucket

    def forget(self) -> None:
        """Gives back what the buckets hold for a step, once it is done or will not come: the gradients read for it
        (other backends) and what a native plan's check holds (a step gives that back itself)."""
        for _, _, bucket in self.buckets():
            if bucket.native is not None:
                bucket.native.forget()
            bucket.grads, bucket.pending = [], []


def fingerprints(tensors: list[torch.Tensor]) -> Optional[list]:
    """What the native watches compare, in Python, where the native library is not loaded: per tensor its Python
    object (its TensorImpl: ``torch.utils.swap_tensors`` gives it another), data pointer, dtype, shape and strides
    (contiguity, which implies them, where it holds), in one flat list made in one pass. The data pointer stands for the storage and offset: a tensor given other memory
    (``.data =``, ``set_``, a storage re-allocated or freed in place) points elsewhere, and the bucket's ops read the
    tensors afresh at each step. None when a tensor's storage is freed (its data pointer cannot be read): never
    equal to a plan's, so the step plans again and refuses it by name."""
    try:
        # (a contiguous tensor's strides follow from its shape; Tensor.stride() costs more than the rest together)
        return [x for t in tensors
                for x in (t._cdata, t.data_ptr(), t.dtype, t.shape, t.is_contiguous() or t.stride())]
    except RuntimeError:  # ("The tensor has a non-zero number of elements, but its data is not allocated yet")
        return None


def _bytes_needed(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (t.storage_offset() + sum(st * (sz - 1) for st, sz in zip(t.stride(), t.shape)) + 1) * t.element_size()


def wrapper_problem(t: torch.Tensor) -> Optional[str]:
    """Why t has no memory of its own for the op to update: a tensor subclass whose values live in the tensors it
    wraps (a ``__torch_dispatch__`` wrapper such as torchao's quantized tensors), or a sparse or mkldnn tensor (not
    one strided block); None for a tensor with a storage
    (plain tensors, nn.Parameter, ``__torch_function__`` subclasses, a DTensor's local piece) and for a lazy
    module's UninitializedParameter, which gets its memory at the first forward."""
    if torch.nn.parameter.is_lazy(t):
        return None
    if t.layout != torch.strided:
        return f"is a {t.layout} tensor, whose values are not one strided block of memory for the fused op to update"
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:  # ("Attempted to access the data pointer on an invalid python storage")
        return (f"is a {type(t).__name__}, a tensor subclass whose values live in the tensors it wraps, with no memory "
                "of its own for FusedAdam's fused op to update")
    return None


def param_memory_problem(p: torch.Tensor) -> Optional[str]:
    """wrapper_problem(p) for a param, with what to do."""
    problem = wrapper_problem(p)
    if problem is None:
        return None
    if p.layout != torch.strided:
        return f"{problem}; give it a dense tensor (t.to_dense())"
    return f"{problem}: step it with torch.optim.AdamW, or train a plain tensor"


def _storage_problem(t: torch.Tensor) -> Optional[str]:
    nbytes = t.untyped_storage().nbytes()
    needed = _bytes_needed(t)
    if nbytes < needed:
        return (f"has a storage of {nbytes} bytes but needs {needed} (its storage was freed or shrunk in place, "
                "e.g. by untyped_storage().resize_(0)); give it its memory back before the step")
    return None


def _usable_grad(g: torch.Tensor, p: torch.Tensor) -> bool:
    """_grad_problem(g, p) is None, with a fast path for the usual gradient (a plain tensor: dense, contiguous, the
    param's shape, device and dtype), whose storage check needs no loop over its dims."""
    if (type(g) is torch.Tensor and g.layout == torch.strided and g.dtype is p.dtype and g.shape == p.shape
            and g.device == p.device and g.is_contiguous()):
        return g.untyped_storage().nbytes() >= _span_end(g)
    return _grad_problem(g, p) is None


def _grad_problem(g: torch.Tensor, p: torch.Tensor, same_shape: bool = True) -> Optional[str]:
    """Why g cannot update p; same_shape=False: g is the local piece of a gradient still to be redistributed
    (Plan.resolve_grads), whose shape becomes p's."""
    if g.layout != torch.strided:
        return f"its gradient is sparse ({g.layout}); FusedAdam needs dense gradients"
    if same_shape and g.shape != p.shape:
        return f"its gradient has shape {tuple(g.shape)}, not the parameter's"
    if g.device != p.device:
        return f"its gradient is on {g.device}, the parameter on {p.device}"
    if (p.dtype == torch.float64) != (g.dtype == torch.float64) or g.dtype not in SUPPORTED_PARAM_DTYPES:
        return f"its gradient has dtype {g.dtype}, which cannot update a {p.dtype} param"
    problem = wrapper_problem(g)
    if problem is not None:
        return f"its gradient {problem}; give it a plain tensor gradient"
    problem = _storage_problem(g)
    return None if problem is None else "its gradient " + problem


# ---- building a plan ------------------------------------------------------------------------------------------------


@dataclass
class _Adoption:
    """A state entry to replace once everything is validated: state[key] = value (None: delete the key)."""

    state: ParamState
    key: str
    value: Any


def build(groups: list[dict], optimizer_state: OptimizerState, layout: StateLayout,
          native: Optional[bool] = None, traced: bool = False, unscales: bool = False) -> Plan:
    """Validates everything a step needs, then creates and adopts state (in optimizer_state, laid out by layout) and
    buckets the params of groups (the optimizer's param_groups). Raises ValueError or TypeError naming
    ``param_groups[i]['params'][j]`` (and the state key) before any write. native: whether CPU buckets get native
    plans (default: when the native CPU op runs now); traced: for a step that torch.compile traces (no native plans,
    fresh states in storages of their own); unscales: the step that plans writes the unscaled gradients back (a
    grad_scale), so a gradient that cannot hold them is refused here too (check_grads_writable)."""
    _mark_param_lists(groups)
    all_grads = [[p.grad for p in group["params"]] for group in groups]

    # 1. validate (nothing is written)
    entries, adoptions, stateful = [], [], []
    for group_index, (group, grads) in enumerate(zip(groups, all_grads)):
        for index, (p, g) in enumerate(zip(group["params"], grads)):
            if g is None:
                continue
            where = describe(group_index, index, p)
            if p.dtype not in SUPPORTED_PARAM_DTYPES:
                raise ValueError(f"{where}: FusedAdam supports float32, float64, float16 and bfloat16 params")
            misplaced = dtensor.gradient_problem(p, g)
            if misplaced is not None:
                raise GradientError(f"{where}: {misplaced}")
            state = optimizer_state.get(p)
            same_layout = not dtensor.needs_redistribution(p, g)  # (else brought to p's at each step: resolve_grads)
            p, g = dtensor.local(p), dtensor.local(g)  # (from here on, what this rank stores and updates)
            problem = param_memory_problem(p)
            if problem is not None:
                raise ValueError(f"{where} {problem}")
            problem = _storage_problem(p)
            if problem is not None:
                raise ValueError(f"{where}: it {problem}")
            problem = _grad_problem(g, p, same_shape=same_layout)
            if problem is not None:
                raise GradientError(f"{where}: {problem}")
            if unscales and same_layout and not grad_writable(g):
                raise GradientError(unwritable_grad_message(where))
            if unscales and same_layout and _spec.grad_in_param_memory(g, p):
                raise GradientError(grad_in_param_message(where))
            if state:
                adoptions += check_state(layout, p, state, bool(group["amsgrad"]), where)
                stateful.append((group_index, index, p, state))
            entries.append((group_index, index, p))
    _check_overlap(entries)
    _check_shared_states(entries, stateful, adoptions)

    # 2. write: adopt assigned state tensors, create missing state, bucket
    for adoption in adoptions:
        if adoption.value is None:
            del adoption.state[adoption.key]
        else:
            adoption.state[adoption.key] = adoption.value
    compact_flat_buffers(optimizer_state.values())  # (views left in a flat buffer that is mostly dead: re-homed)
    steps = set()
    for *_, state in stateful:  # a step tensor assigned to two params' states: each gets its own (a plan re-points it)
        if id(state["step"]) in steps:
            state["step"] = state["step"].clone()
        steps.add(id(state["step"]))
    if traced:
        _own_storages(stateful)
    native = False if traced else backends.runs_natively(CPU) if native is None else native
    # (a traced step's states get storages of their own: see StateLayout.init_states)
    planned = [_plan_group(groups, optimizer_state, layout, group_index, grads, native, one_buffer=not traced)
               for group_index, grads in enumerate(all_grads)]
    return Plan(planned, optimizer_state, optimizer_state.version, layout, native, traced)


def _mark_param_lists(groups: list[dict]) -> None:
    """Makes each group's ``params`` a ParamList (the same params), whose mutations change its version."""
    for group in groups:
        if not isinstance(group["params"], ParamList):
            group["params"] = ParamList(group["params"])


def check_across_params(groups: list[dict], optimizer_state: OptimizerState, layout: StateLayout) -> None:
    """The checks across params that build() makes, for updates that go one param at a time (step_in_backward, whose
    hooks check each param alone): every param that requires a gradient (any of them may get one in a backward) is
    listed once and shares no memory with another, each has a state dict of its own, and no state tensor kept as it
    is shares memory with another or with a param. Raises as build() does, naming the params; writes nothing (but
    makes each group's ``params`` a ParamList, as build() does, so that its changes are seen). A state that its own
    checks refuse (check_state) is left out here: its param's hook refuses it when that param is updated, and a param
    that gets no gradient is not concerned (as step() does not check the state of a param without one)."""
    _mark_param_lists(groups)
    entries, adoptions, stateful = [], [], []
    for group_index, group in enumerate(groups):
        for index, p in enumerate(group["params"]):
            if not (isinstance(p, torch.Tensor) and p.requires_grad):
                continue
            local = dtensor.local(p)
            state = optimizer_state.get(p)
            if state:
                try:
                    adoptions += check_state(layout, local, state, bool(group["amsgrad"]),
                                             describe(group_index, index, p))
                except (ValueError, TypeError):
                    state = None
            if state:
                stateful.append((group_index, index, local, state))
            entries.append((group_index, index, local))
    _check_overlap(entries)
    _check_shared_states(entries, stateful, adoptions)


def _own_storages(stateful: list) -> None:
    """For a step that torch.compile traces: every state tensor that is a view into a larger storage (the flat
    buffers an eager step lays states out in, StateLayout.init_states) is replaced by a copy in a storage of its own.
    The traced op mutates its list arguments through functionalization, and mutated graph inputs that share a storage
    are merged into one synthetic base that inductor copies around the op at every step (measured: 8 x Linear(256,
    256) after one eager step, 82 ms per compiled step instead of 1), where inputs of their own are written in place.
    The step counts are not concerned: the op receives their base (Bucket.steps), not the views."""
    for *_, state in stateful:
        for key, value in list(state.items()):
            if (key != "step" and isinstance(value, torch.Tensor)
                    and value.untyped_storage().nbytes() != value.numel() * value.element_size()):
                state[key] = value.clone(memory_format=torch.contiguous_format)


def _rounding(group: dict) -> tuple:
    return bool(group.get("stochastic_rounding", False)), group.get("stochastic_rounding_seed", 0)


def rounding_keys(groups: list[dict], group_index: int, indices: list[int], p: torch.Tensor,
                  has_master: bool) -> Optional[torch.Tensor]:
    """The op's rounding_keys (int64, one per index) for params of param group group_index at these positions, all
    of p's dtype: None unless the group asks for stochastic rounding and they are bfloat16 params without masters.
    A param's key comes from the group's seed and its position over all param groups (its id in state_dict()), so
    it is the same after a resume."""
    group = groups[group_index]
    stochastic, seed = _rounding(group)
    if not stochastic or p.dtype != torch.bfloat16 or has_master:
        return None
    first = sum(len(g["params"]) for g in groups[:group_index])
    # (on the params' device, copied there once per plan: the kernels read them at every step, and a CUDA graph
    # cannot capture a copy from pageable host memory)
    return torch.tensor([_spec.rounding_key(int(seed), first + i) for i in indices], dtype=torch.int64,
                        device=p.device)


def _storage_kind(state: dict, key: str) -> tuple:
    """What a bucket's states of this key share: dtype, and the scales' dtype (uint8 codes are 8-bit or 4-bit)."""
    scale = state.get(key + "_scale")
    return state[key].dtype, None if scale is None else scale.dtype


def _plan_group(groups: list[dict], optimizer_state: OptimizerState, layout: StateLayout, group_index: int,
                grads: list, native: bool, one_buffer: bool = True) -> GroupPlan:
    group = groups[group_index]
    params = group["params"]
    fresh = [p for p, g in zip(params, grads) if g is not None and not optimizer_state.get(p)]
    for p, state in zip(fresh, layout.init_states([dtensor.local(p) for p in fresh], group["amsgrad"],
                                                       one_buffer)):
        optimizer_state[p] = state
    by_key: dict[tuple, Bucket] = {}
    for index, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        state = optimizer_state[p]
        key = (p.device, p.dtype, _storage_kind(state, "exp_avg"), _storage_kind(state, "exp_avg_sq"),
               "master_param" in state, dtensor.is_dtensor(p))
        bucket = by_key.setdefault(key, Bucket(indices=[], params=[], holds_dtensor_pieces=dtensor.is_dtensor(p)))
        bucket.indices.append(index)
        bucket.params.append(dtensor.local(p))
    buckets = list(by_key.values())
    for bucket in buckets:
        states = [optimizer_state[params[i]] for i in bucket.indices]
        for key in MOMENT_KEYS + ("master_param",):
            if key == "max_exp_avg_sq" and not group["amsgrad"]:
                continue
            if key in states[0]:
                getattr(bucket, key + "s").extend(s[key] for s in states)
            if key + "_scale" in states[0]:
                getattr(bucket, key + "_scales").extend(s[key + "_scale"] for s in states)
        bucket.steps = torch.stack([s["step"] for s in states])
        for j, s in enumerate(states):
            # the same tensor, now a view of steps: torch's state['step'] is one tensor for a whole run, so code that
            # holds it keeps reading (and writing) the param's step after the optimizer plans again
            s["step"].data = bucket.steps[j]
        bucket.step_tensors = [s["step"] for s in states]
        bucket.rounding_keys = rounding_keys(groups, group_index, bucket.indices, bucket.params[0],
                                             bool(bucket.master_params))
    idle = [p for p, g in zip(params, grads) if g is None]
    dtensors = any(dtensor.is_dtensor(p) for p in params)
    # (a native plan reads .grad from the tensors it holds: a DTensor's local piece has none, the DTensor holds it; a
    # lazy module's param, which the first forward materialises, no tensor to hold yet: its group's gradients are
    # read in Python, which sees it get one)
    all_native = (native and not dtensors and all(b.params[0].device.type == "cpu" for b in buckets)
                  and not any(torch.nn.parameter.is_lazy(p) for p in idle))
    for bucket in buckets:
        if native and bucket.params[0].device.type == "cpu" and not bucket.holds_dtensor_pieces:
            # in a group that steps through native plans alone, the first plan also watches the params without a
            # gradient (frozen ones, say): when one gets a gradient, the group is planned again
            watch_idle = idle if all_native and bucket is buckets[0] else ()
            bucket.native = backends.AdamPlan.create(
                bucket.params, bucket.exp_avgs, bucket.exp_avg_sqs, bucket.max_exp_avg_sqs, bucket.master_params,
                bucket.exp_avg_scales, bucket.exp_avg_sq_scales, bucket.max_exp_avg_sq_scales, bucket.steps,
                watch_idle, step_tensors=bucket.step_tensors)
        elif not bucket.holds_dtensor_pieces and backends.native_available():
            # (a native watch compares metadata only, whatever the device: the gradients are read in Python for the
            # launch, and checked by the watch; a storage re-allocated in place fails its check, as the launch plan
            # keeps the tensors' addresses)
            bucket.watch = backends.TensorWatch.create(bucket.params, bucket.state_lists(), bucket.steps,
                                                       bucket.step_tensors)
        else:
            bucket.fingerprints = fingerprints(bucket.tensors())
    watchers = [b.native for b in buckets]
    if all_native and not buckets and params:  # a group without gradients: a plan that only watches
        watchers = [backends.AdamPlan.create([], [], [], [], [], [], [], [],
                                             torch.zeros(0, dtype=torch.float64, device="cpu"), idle, step_tensors=[])]
    return GroupPlan(group, params, params.version, bool(group["amsgrad"]), _rounding(group), checked_entries(group),
                     [g is not None for g in grads], buckets, all_native, watchers, dtensors)


# ---- states: what is used as is, adopted or refused -----------------------------------------------------------------


def check_state(layout: StateLayout, p: torch.Tensor, state: ParamState, amsgrad: bool, where: str
                ) -> list[_Adoption]:
    """Validates a param's existing state; returns the entries to adopt into the layout (see FusedAdam's docstring,
    "optimizer.state")."""
    m_dtype, v_dtype, has_master = layout.dtypes(p)
    adoptions = []
    required = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    for key in required:
        if key not in state:
            hint = (" (it was created with amsgrad=False: load a checkpoint made with amsgrad=True)"
                    if key == "max_exp_avg_sq" else "; delete optimizer.state[p] to start the param afresh")
            if key == "max_exp_avg_sq":
                raise ValueError(f"{where}: amsgrad is on but this parameter's state has no max_exp_avg_sq{hint}")
            raise ValueError(f"{where}: its optimizer state has no '{key}'{hint}")
    adoptions += _check_step(p, state, where, layout.steps_device(p))
    # exp_avg last: a 4-bit one is coded relative to exp_avg_sq (_spec.EXP_AVG_RELATIVE), checked before it, and read
    # as it will be once its adoptions are made (values assigned in place of 4-bit codes become codes and scales)
    for key, dtype in (("exp_avg_sq", v_dtype), ("max_exp_avg_sq", v_dtype), ("exp_avg", m_dtype)):
        if key in state and (amsgrad or key != "max_exp_avg_sq"):
            adoptions += _check_moment(layout, p, state, key, dtype, where, _after(state, adoptions))
    if "master_param" in state:
        if not has_master:
            raise ValueError(
                f"{where}: its optimizer state has a 'master_param' but this optimizer keeps none for a {p.dtype} "
                "param (master weights are for float16/bfloat16 params with master_weights=True). If the param "
                "became float32 after its master was made (model.float()), continue from the master: "
                "p.data.copy_(state['master_param']), then del state['master_param'] (state = optimizer.state[p])")
        adoptions += _check_tensor_entry(p, state, "master_param", torch.float32, where)
    elif has_master:  # (a param that became float16/bfloat16 under its optimizer): its master starts from it
        adoptions.append(_Adoption(state, "master_param", p.detach().to(torch.float32, copy=True).contiguous()))
    # A tensor made under inference_mode and given other data with `.data =` since has no version counter, yet is not
    # an inference tensor: nothing can view it, not even inside inference_mode. Kept as is, the native kernel would
    # write it through pointers but the other backends' views of it fail; adopted as a copy, every backend steps it.
    adopted = {a.key for a in adoptions}
    for key, value in state.items():
        if (key not in adopted and isinstance(value, torch.Tensor) and not value.is_inference()
                and not tracks_versions(value)):
            adoptions.append(_Adoption(state, key, value.clone()))
    return adoptions


def _after(state: ParamState, adoptions: list[_Adoption]) -> dict:
    """What state holds once these adoptions are made (a new dict; state itself is not written)."""
    view = dict(state)
    for adoption in adoptions:
        if adoption.value is None:
            view.pop(adoption.key, None)
        else:
            view[adoption.key] = adoption.value
    return view


def _state_tensor(p: torch.Tensor, state: ParamState, key: str, where: str) -> torch.Tensor:
    value = state[key]
    what = f"{where}: optimizer.state[p][{key!r}]"
    if (not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.layout != torch.strided
            or value.is_nested):
        raise TypeError(f"{what} must be a dense floating-point tensor, got {show(value)}")
    # (the state was assigned, or the param changed under its state: the message says both ways out)
    if value.shape != p.shape:
        raise ValueError(f"{what} has shape {tuple(value.shape)} but the parameter has shape {tuple(p.shape)}: a "
                         "state holds one value per element of its parameter. Assign a tensor of the parameter's "
                         "shape, or delete optimizer.state[p] to start the param afresh (a parameter cannot change "
                         "shape under its optimizer)")
    if value.device != p.device:
        raise ValueError(f"{what} is on {value.device}, the parameter on {p.device}")
    if (value.dtype == torch.float64) != (p.dtype == torch.float64):
        raise ValueError(f"{what} is {value.dtype} but the parameter is {p.dtype}: a float64 state goes with a "
                         "float64 parameter only, and a float64 parameter keeps float64 states. Assign it as "
                         f".to({p.dtype if p.dtype == torch.float64 else torch.float32}), "
                         "or delete optimizer.state[p] to start the param afresh (a parameter cannot switch to or "
                         "from float64 under its optimizer)")
    problem = _storage_problem(value)
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    return value


def _check_tensor_entry(p, state, key, dtype, where) -> list[_Adoption]:
    value = _state_tensor(p, state, key, where)
    if value.dtype == dtype and value.is_contiguous():
        return []
    return [_Adoption(state, key, value.detach().to(dtype, memory_format=torch.contiguous_format, copy=True))]


def _check_moment(layout: StateLayout, p, state, key, dtype, where, reads: dict) -> list[_Adoption]:
    """A moment in the layout this optimizer would create for p now is used as is (float16 ones with valid block
    scales in state[key + '_scale'], uint8 codes with valid 8-bit or 4-bit block scales there); any other floating
    tensor of p's shape, or low-bit codes of the other low-bit format, is taken as values and converted into that
    layout, through the checkpoints' conversions (_checkpoint.to_canonical and from_canonical)."""
    dtype = torch.float64 if p.dtype == torch.float64 else dtype
    scale = state.get(key + "_scale")
    if isinstance(state[key], torch.Tensor) and state[key].dtype == torch.uint8:
        value, fmt = _low_bit_state(p, state, key, where)
        if key == "exp_avg" and fmt.exp_avg_relative:
            pair = state.get("exp_avg_sq")
            if not (isinstance(pair, torch.Tensor) and pair.dtype == torch.uint8
                    and formats.is_relative(pair, state.get("exp_avg_sq_scale"))):
                raise ValueError(f"{where}: optimizer.state[p]['exp_avg'] holds {fmt.name} codes, which are coded "
                                 f"relative to a {fmt.name} exp_avg_sq, but optimizer.state[p]['exp_avg_sq'] is not "
                                 f"{fmt.name} codes (the codes exp_avg was made with are gone, and with them its "
                                 "values): assign exp_avg's values too, or delete optimizer.state[p] to start the "
                                 "param afresh")
        if LOW_BIT_FORMATS.get(dtype) is fmt and value.is_contiguous():
            return []
        scaled = True
    elif isinstance(state[key], torch.Tensor) and state[key].dtype in FP8_FORMATS:
        # (fp8 codes without their scales are refused, as low-bit codes are: no moment is kept as plain float8
        # values, so codes whose scales were dropped cannot be told from values)
        value = _fp8_state(p, state, key, where)
        if value.dtype == dtype and value.is_contiguous():
            return []
        scaled = True
    else:
        value = _state_tensor(p, state, key, where)
        scaled = value.dtype == torch.float16 and _valid_scale(scale, value)
        if value.dtype == dtype and value.is_contiguous() and (dtype not in (torch.float16, *FP8_FORMATS) or scaled):
            return [] if dtype == torch.float16 or scale is None else [_Adoption(state, key + "_scale", None)]
        if scale is not None and value.dtype == torch.float16 and not scaled:
            raise ValueError(f"{where}: optimizer.state[p][{key + '_scale'!r}] must be a contiguous float32 tensor of "
                             f"{num_blocks(value.numel())} positive block scales on {value.device}")
    source = {key: value, key + "_scale": scale} if scaled else {key: value}
    pair = ("exp_avg_sq", "exp_avg_sq_scale")
    if key == "exp_avg" and value.dtype == torch.uint8:
        # (4-bit exp_avg codes decode relative to the exp_avg_sq codes they were made with: the pair as it is now;
        # _spec.EXP_AVG_RELATIVE)
        source.update({k: state[k] for k in pair if k in state})
    values = _checkpoint.to_canonical(source, key, p.shape)
    fresh = layout.init_state(p, amsgrad=key == "max_exp_avg_sq")  # (a state in the layout, to fill)
    if key == "exp_avg" and formats.is_relative(fresh["exp_avg"], fresh.get("exp_avg_scale")):
        # (and encode relative to exp_avg_sq as the state will hold it, once its own adoption is made)
        stored = {k: reads[k] for k in pair if k in reads}
        _checkpoint.from_canonical(fresh, "exp_avg_sq", _checkpoint.to_canonical(stored, "exp_avg_sq", p.shape))
    _checkpoint.from_canonical(fresh, key, values)
    companion = key + "_scale"
    return [_Adoption(state, key, fresh[key])] + (
        [_Adoption(state, companion, fresh.get(companion))] if companion in fresh or companion in state else [])


def _valid_scale(scale, value: torch.Tensor) -> bool:
    return (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.is_contiguous()
            and scale.dim() == 1 and scale.numel() == num_blocks(value.numel()) and scale.device == value.device
            and _storage_problem(scale) is None and (scale.is_meta or bool((scale > 0).all())))  # (meta: no values)


def _low_bit_state(p: torch.Tensor, state: ParamState, key: str, where: str) -> tuple[torch.Tensor,
                                                                                        _spec.LowBitFormat]:
    """Validates uint8 codes in state[key] and their block scales in state[key + '_scale'] (ops/README.md, "low-bit
    states"; the scales' dtype tells the format: float32 8-bit, bfloat16 4-bit); returns (codes, format)."""
    value, scale = state[key], state.get(key + "_scale")
    what, scale_what = f"{where}: optimizer.state[p][{key!r}]", f"{where}: optimizer.state[p][{key + '_scale'!r}]"
    if p.dtype == torch.float64:
        raise ValueError(f"{what} holds uint8 (low-bit) codes but the parameter is float64: float64 params keep "
                         "float64 states")
    if value.layout != torch.strided or value.device != p.device:
        raise ValueError(f"{what} must be a dense uint8 tensor on {p.device}, got one on {value.device}")
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{scale_what} must hold the block scales of the uint8 (low-bit) codes in {key!r}: float32 "
                         f"(8-bit) or bfloat16 (4-bit), got {type(scale).__name__}"
                         + (f" {scale.dtype}" if isinstance(scale, torch.Tensor) else ""))
    fmt = _spec.low_bit_format(scale.dtype)
    shape = fmt.storage_shape(p.shape)
    if tuple(value.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(value.shape)} but {fmt.name} codes of a parameter of shape "
                         f"{tuple(p.shape)} have shape {shape}; a parameter cannot change shape under its optimizer")
    blocks = fmt.num_scales(p.numel())
    if not (scale.layout == torch.strided and scale.dim() == 1 and scale.numel() == blocks and scale.is_contiguous()
            and scale.device == p.device):
        raise ValueError(f"{scale_what} must be a contiguous 1-d {scale.dtype} tensor of {blocks} block scales on "
                         f"{p.device} ({fmt.name} codes), got shape {tuple(scale.shape)} on {scale.device}")
    for name, tensor in ((what, value), (scale_what, scale)):
        problem = _storage_problem(tensor)
        if problem is not None:
            raise ValueError(f"{name} {problem}")
    # (NaN scales are legal: a block that held inf/NaN; so are a second moment's negative ones: the sign bit marks a
    # block whose overflowed v reads back as inf, ops/README.md)
    if key == "exp_avg" and not scale.is_meta and bool((scale < 0).any()):  # (meta: no values to check)
        raise ValueError(f"{scale_what} holds negative block scales; exp_avg's scales are block maxima (>= 0)")
    return value, fmt


def _fp8_state(p: torch.Tensor, state: ParamState, key: str, where: str) -> torch.Tensor:
    """Validates fp8 codes in state[key] (float8_e4m3fn or float8_e5m2, the param's shape) and their block scales in
    state[key + '_scale'] (float32, one per block; powers of two, 0 or NaN, a second moment's also negated:
    ort_optim._spec.Fp8Format); returns the
    codes."""
    value, scale = state[key], state.get(key + "_scale")
    fmt = FP8_FORMATS[value.dtype]
    what, scale_what = f"{where}: optimizer.state[p][{key!r}]", f"{where}: optimizer.state[p][{key + '_scale'!r}]"
    if p.dtype == torch.float64:
        raise ValueError(f"{what} holds {value.dtype} (fp8) codes but the parameter is float64: float64 params keep "
                         "float64 states")
    if value.layout != torch.strided or value.device != p.device or value.shape != p.shape:
        raise ValueError(f"{what} must be a dense {value.dtype} tensor of the parameter's shape {tuple(p.shape)} on "
                         f"{p.device}, got shape {tuple(value.shape)} on {value.device}")
    blocks = fmt.num_scales(p.numel())
    if not (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.layout == torch.strided
            and scale.dim() == 1 and scale.numel() == blocks and scale.is_contiguous() and scale.device == p.device):
        raise ValueError(f"{scale_what} must be a contiguous 1-d float32 tensor of {blocks} block scales on "
                         f"{p.device} ({fmt.name} codes), got " + (f"a {scale.dtype} tensor of shape "
                         f"{tuple(scale.shape)} on {scale.device}" if isinstance(scale, torch.Tensor)
                                                                   else type(scale).__name__))
    for name, tensor in ((what, value), (scale_what, scale)):
        problem = _storage_problem(tensor)
        if problem is not None:
            raise ValueError(f"{name} {problem}")
    if scale.is_meta:  # (a param on the meta device: its states have no values to check)
        return value
    # (a second moment's scale may have its sign bit set: it marks a block whose overflowed v reads back as inf,
    # ops/README.md)
    magnitude = scale if key == "exp_avg" else scale.abs()
    mantissa, exponent = torch.frexp(magnitude)
    power = (mantissa == 0.5) & (exponent - 1 >= fmt.min_exponent) & (exponent - 1 <= 127 - fmt.emax)
    if not bool((power | (magnitude == 0) | torch.isnan(scale)).all()):
        raise ValueError(f"{scale_what} holds block scales that are not powers of two in [2**{fmt.min_exponent}, "
                         f"2**{127 - fmt.emax}], 0 or NaN"
                         + ("" if key == "exp_avg" else " (negated: a block holding an overflowed v)")
                         + f": they are not {fmt.name} block scales")
    return value


def _check_step(p, state, where, device) -> list[_Adoption]:
    """The step count by load_state_dict's rule (_checkpoint.check_step: the same error for the same value, whether it
    was loaded or assigned), after its storage (a freed one cannot be read)."""
    value = state["step"]
    what = f"{where}: optimizer.state[p]['step']"
    if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested:
        problem = _storage_problem(value)
        if problem is not None:
            raise ValueError(f"{what} {problem}")
    # (a tensor's value is read on the host: a sync, only when planning; no view: _versions.tracks_versions)
    number = _checkpoint.check_step(value, what, meta_ok=device.type == "meta")
    if number is None:
        # (the step count of a param on the meta device, as its state's every other value, is no value to read:
        # kept as it is when it has the kind of tensor a step keeps, else replaced by one, as it would be)
        if value.dtype == torch.float64 and value.dim() == 0 and tracks_versions(value):
            return []
        return [_Adoption(state, "step", torch.empty((), dtype=torch.float64, device=device))]
    if (isinstance(value, torch.Tensor) and value.dtype == torch.float64 and value.dim() == 0 and value.device == device
            and tracks_versions(value)):
        return []
    return [_Adoption(state, "step", torch.tensor(number, dtype=torch.float64, device=device))]


# ---- params that share memory ---------------------------------------------------------------------------------------


def _span_end(p: torch.Tensor) -> int:
    """Where p's elements end within its storage, in bytes (they start at its storage offset)."""
    if p.is_contiguous():  # (the usual case, without a loop over the dims)
        return (p.storage_offset() + p.numel()) * p.element_size()
    return _bytes_needed(p)


def _proves_no_self_overlap(p: torch.Tensor) -> bool:
    """True when the strides prove that no two elements of p share memory (dims sorted by stride, each stride exceeds
    the extent of the smaller ones)."""
    extent = 0
    for stride, size in sorted((st, sz) for st, sz in zip(p.stride(), p.shape) if sz > 1):
        if stride <= extent:
            return False
        extent += stride * (size - 1)
    return True


def _offsets(p: torch.Tensor) -> torch.Tensor:
    """Storage offsets (in elements) of every element of p: p.numel() of them, whatever p's span."""
    offsets = torch.tensor([p.storage_offset()], dtype=torch.int64, device="cpu")  # (not the default device)
    for size, stride in zip(p.shape, p.stride()):
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64, device="cpu") * stride).reshape(-1)
    return offsets


def _elementwise(*params: torch.Tensor) -> bool:
    """Whether the params' elements may share memory, element by element; True (refused as may-overlap) when they
    are too large to check."""
    if sum(p.numel() for p in params) > MAX_ELEMENTWISE_OVERLAP_CHECK:
        return True
    if len({p.element_size() for p in params}) > 1:
        return True
    offsets = torch.cat([_offsets(p) for p in params])
    return offsets.unique().numel() < offsets.numel()


def _overlapping_pairs(tensors: list[torch.Tensor]):
    """The index pairs (i, j) of tensors whose elements may share memory: views of one storage sorted by their byte
    spans, pairs compared only where spans intersect, element by element only where neither is contiguous
    (interleaved views), in memory bounded by their sizes. (Plain ints throughout: this runs over every state tensor
    when planning, and a tuple per tensor would wake the garbage collector, which costs more than the check.)"""
    by_storage: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() and t.device.type != "meta":  # (meta tensors have no memory to share)
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    for members in by_storage.values():
        if len(members) < 2:
            continue
        starts = [tensors[i].storage_offset() * tensors[i].element_size() for i in members]
        ends = [_span_end(tensors[i]) for i in members]
        order = sorted(range(len(members)), key=starts.__getitem__)
        for x, k in enumerate(order):
            a = tensors[members[k]]
            for y in range(x + 1, len(order)):
                m = order[y]
                if starts[m] >= ends[k]:
                    break
                b = tensors[members[m]]
                # a contiguous a holds every byte of its span, b's first element among them
                if a.device == b.device and (a.is_contiguous() or _elementwise(a, b)):
                    yield members[k], members[m]


def _check_overlap(entries: list[tuple[int, int, torch.Tensor]]) -> None:
    """Refuses a param whose elements overlap, or two params that share memory, among (group_index, index, param):
    views of one storage sorted by their byte spans, pairs compared only where spans intersect, element by element
    only where neither is contiguous (interleaved views), in memory bounded by their sizes."""
    for entry in entries:
        p = entry[2]
        if p.numel() == 0:
            continue
        if p.dim() > 0 and not p.is_contiguous() and not _proves_no_self_overlap(p) and (
                any(st == 0 and sz > 1 for st, sz in zip(p.stride(), p.shape)) or _elementwise(p)):
            raise ValueError(
                f"{describe(*entry)}: its elements overlap in memory (an expand()ed or otherwise self-overlapping "
                "view); FusedAdam would update the shared elements several times. Give it its own memory, e.g. "
                "torch.nn.Parameter(t.clone())")
    for i, j in _overlapping_pairs([entry[2] for entry in entries]):
        if entries[i][2] is entries[j][2]:
            raise ValueError(
                f"{describe(*entries[j])} is {describe(*entries[i])} listed again: list each parameter once "
                "(torch.optim warns about a param group with duplicate parameters and then updates such a parameter "
                "once per listing)")
        raise ValueError(
            f"{describe(*entries[i])} and {describe(*entries[j])} share memory (overlapping views of one storage); "
            "FusedAdam would update the shared elements twice. Give each parameter its own memory, e.g. "
            "torch.nn.Parameter(t.clone()); disjoint views of one buffer are fine")


# The state entries a step writes (or reads as scales) in place; `step` is not among them: every plan gives each param
# a step tensor of its own.
_STATE_TENSOR_KEYS = MOMENT_KEYS + ("master_param",) + tuple(key + "_scale" for key in MOMENT_KEYS)


def _check_shared_states(entries: list, stateful: list, adoptions: list) -> None:
    """Refuses state that a step would update more than once: one state dict for two params (``optimizer.state[q] =
    optimizer.state[p]``), or state tensors kept as they are (not adopted as copies) that share memory with each other
    or with a param. torch.optim would update such memory once per param holding it, one after the other; FusedAdam
    updates the params of a step together, so it refuses them, as it refuses params that share memory.
    stateful: (group_index, index, param, state) of the params with a gradient and a state."""
    holders: dict[int, tuple] = {}
    for group_index, index, p, state in stateful:
        first = holders.setdefault(id(state), (group_index, index, p))
        if first[:2] != (group_index, index):
            raise ValueError(
                f"{describe(*first)} and {describe(group_index, index, p)} have one optimizer state dict (as after "
                "optimizer.state[q] = optimizer.state[p]): FusedAdam would update its moments once for each. Give "
                "each param its own state, e.g. {k: v.clone() for k, v in optimizer.state[p].items()}")
    replaced = {(id(adoption.state), adoption.key) for adoption in adoptions}
    # the params, then the state tensors, with (index in stateful, key index) for each state tensor: plain ints
    tensors = [entry[2] for entry in entries]
    owners, keys = [], []
    for owner, (_, _, _, state) in enumerate(stateful):
        for k, key in enumerate(_STATE_TENSOR_KEYS):
            value = state.get(key)
            if isinstance(value, torch.Tensor) and (id(state), key) not in replaced:
                tensors.append(value)
                owners.append(owner)
                keys.append(k)

    def name(i: int) -> str:
        if i < len(entries):
            return describe(*entries[i])
        group_index, index, p, _ = stateful[owners[i - len(entries)]]
        return f"{describe(group_index, index, p)}'s optimizer.state[p][{_STATE_TENSOR_KEYS[keys[i - len(entries)]]!r}]"

    for i, j in _overlapping_pairs(tensors):
        if j < len(entries) and i < len(entries):
            continue  # (two params: _check_overlap's)
        raise ValueError(
            f"{name(min(i, j))} and {name(max(i, j))} share memory: FusedAdam would update it once for each. Give "
            "each state tensor its own memory, e.g. optimizer.state[p][key] = optimizer.state[p][key].clone()")


# ---- naming the param behind an op's error --------------------------------------------------------------------------

_LIST_ENTRY = re.compile(r"\b(params|grads|exp_avgs|exp_avg_sqs|max_exp_avg_sqs|master_params|exp_avg_scales|"
                         r"exp_avg_sq_scales|max_exp_avg_sq_scales|steps)\[(\d+)\]")


def check_grads_writable(buckets: list) -> None:
    """Before a step that writes the unscaled gradients back into ``p.grad`` (a grad_scale was given): refuses a
    gradient whose elements share memory (an ``expand()``ed tensor cannot hold one value per element), or that shares
    memory with its own param (``p.grad = p.detach()``, or a view of it: the param cannot hold both its update and the
    unscaled gradient), naming its param, before any bucket writes. A native bucket's plan makes both tests in one
    call (AdamPlan.unscalable_grad); other buckets' gradients are tested here, about half a microsecond each (their
    addresses and sizes read through Python). A lone native bucket needs no call: its op makes the tests itself
    before it writes; several buckets need them up front."""
    for group_index, _, bucket in buckets:
        if bucket.native is not None:
            k = bucket.native.unscalable_grad()
            candidates = [] if k < 0 else [(k, bucket.params[k].grad)]
        else:
            candidates = enumerate(bucket.grads)
        for k, g in candidates:
            where = describe(group_index, bucket.indices[k], bucket.params[k])
            if not grad_writable(g):
                raise GradientError(unwritable_grad_message(where))
            if _spec.grad_in_param_memory(g, bucket.params[k]):
                raise GradientError(grad_in_param_message(where))


def grad_in_param_message(where: str) -> str:
    """The refusal of a gradient that shares memory with its param, in a step with grad_scale: the ops' message, as
    name_op_error words it."""
    return f"{where}'s grad {_spec.GRAD_IN_PARAM}"


def grad_writable(g: torch.Tensor) -> bool:
    """Whether g can take the unscaled gradient, one value per element (the test the native and Triton ops make:
    1 is torch's MemOverlap::Yes, an expand()ed tensor). Only a non-contiguous gradient can overlap itself."""
    return g.is_contiguous() or torch._debug_has_internal_overlap(g) != 1


def unwritable_grad_message(where: str) -> str:
    """The refusal of a gradient that fails grad_writable: the ops' message, as name_op_error words it."""
    return f"{where}'s grad {_spec.GRAD_OVERLAPS_ITSELF}"


def name_op_error(exc: Exception, group_index: int, bucket: Bucket) -> ValueError:
    """The op's error as step() reports it: without the op's name (the caller called step()), each ``list[k]`` it
    mentions written as the param it stands for; a GradientError where it names a gradient."""

    def name(match: re.Match) -> str:
        k = int(match.group(2))
        if k >= len(bucket.indices):
            return match.group(0)
        where = describe(group_index, bucket.indices[k], bucket.params[k])
        return where if match.group(1) == "params" else f"{where}'s {match.group(1)[:-1]}"

    message = str(exc).removeprefix("ort_optim::adam_step_: ")
    about_a_grad = any(match.group(1) == "grads" for match in _LIST_ENTRY.finditer(message))
    return (GradientError if about_a_grad else ValueError)(_LIST_ENTRY.sub(name, message))
