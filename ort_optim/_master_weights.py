"""FP16_Optimizer's two ways of keeping fp32 master weights, one chosen per wrapper at construction.

* :class:`InnerMasters`: the wrapped optimizer keeps them itself. :class:`~ort_optim.FusedAdam` with
  ``master_weights=True`` holds an fp32 copy of each fp16/bf16 param in its state and takes the loss scale and the
  overflow flag into its fused step (it unscales, checks, clips and skips in the kernel's pass); DeepSpeed's ZeRO
  optimizers do the same in their flat fp32 partitions (FP16_Optimizer hands those to the DeepSpeed integration).
* :class:`WrapperMasters`: any other torch optimizer. The wrapper swaps fp32 copies of the fp16/bf16 params into its
  param_groups; at each step it copies the model's gradients into fp32 buffers, unscales and checks them (and the
  fp32 params' gradients, in place) in one multi-tensor pass, clips, runs the optimizer on the masters and copies them
  back into the model.

Both answer the same calls from :class:`~ort_optim.fp16_optimizer.FP16_Optimizer` (the ``owner`` argument: its
``scaler`` and the ranks that decide together); neither imports it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import backends
from ._group_options import WideOptions, check_wide_keys
from .formats import sqrt_f32
from .fused_adam import FusedAdam
from .integrations import dtensor

LOW_PRECISION = (torch.float16, torch.bfloat16)
NO_GRADIENTS = (
    "FP16_Optimizer.step(): no parameter has a gradient, so there is nothing to unscale, check or update (as "
    "torch.amp.GradScaler, which raises 'No inf checks were recorded for this optimizer'). Call "
    "backward(loss) before step(); nothing was changed"
)


class NotFloatingPointError(ValueError, TypeError):
    """A param FP16_Optimizer cannot train: not floating point. A ValueError, as the wrapper's other refusals of a
    param, and a TypeError, as apex's FP16_Optimizer raises for a param that is neither float nor half, so that code
    written against either catches it."""


def _where(group_index: int, index: int) -> str:
    return f"param_groups[{group_index}]['params'][{index}]"


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The local pieces of DTensors (FSDP2, tensor parallel), plain tensors as they are. DTensor has no sharding rule
    for ``_foreach_copy_`` (nor, in torch 2.4, for the unscale-and-check op); between tensors laid out alike (a param
    and its master, a gradient and its buffer) a copy is a copy of the local pieces."""
    return [dtensor.local(t) for t in tensors]


def _clone_tensors(obj: Any) -> Any:
    """A copy of a nested dict/list structure with every tensor cloned (so loading never aliases the caller's)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _clone_tensors(v)) for k, v in obj.items()) if not isinstance(obj, OrderedDict) \
            else OrderedDict((k, _clone_tensors(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tensors(v) for v in obj)
    return obj


def step_in_backward_refused(what: str) -> ValueError:
    return ValueError(
        f"FP16_Optimizer: {what} has step_in_backward=True, which updates each param during backward, before loss "
        "scaling can unscale and check the gradients (and, inside DeepSpeed, before DeepSpeed reduces them); construct "
        "it with step_in_backward=False (or train in bf16, which needs no loss scaling)")


class _Versions:
    """Gradients as a step() left them: per param (by id), a weak reference to its gradient tensor and that tensor's
    autograd version then. ``holds(p, g)``: g is still that tensor, unwritten since (a new backward gives a new tensor
    or, accumulating, a new version). Weak: a gradient the user drops is freed."""

    def __init__(self) -> None:
        self._grads: dict[int, tuple[weakref.ref, int]] = {}

    def add(self, p: torch.Tensor, g: torch.Tensor) -> None:
        self._grads[id(p)] = (weakref.ref(g), g._version)

    def holds(self, p: torch.Tensor, g: Optional[torch.Tensor]) -> bool:
        entry = self._grads.get(id(p))
        return g is not None and entry is not None and entry[0]() is g and entry[1] == g._version

    def __len__(self) -> int:
        return len(self._grads)


# ---- the wrapped optimizer keeps the masters -----------------------------------------------------------------------


def _params_in_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's params in param_groups order: the order of a checkpoint's ``master_params``."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _saved_states(inner_state_dict: Any) -> list:
    """The states a torch.optim-style state_dict holds for its params, in param_groups order (None for a param it
    holds none for; an empty list where its groups are malformed: the optimizer's own load names that)."""
    try:
        state = inner_state_dict["state"]
        return [state.get(pid) for group in inner_state_dict["param_groups"] for pid in group["params"]]
    except (KeyError, TypeError, AttributeError):
        return []


class InnerMasters:
    """FusedAdam keeps the fp32 masters (``state['master_param']``) and does the unscale, check, clip and skip in its
    own step: the wrapper hands it the loss scale as ``grad_scale`` (and, in a distributed run that FusedAdam does not
    reduce itself, the overflow flag of all ranks as ``found_inf``).

    FusedAdam writes each gradient back unscaled in its update pass (as torch's fused AdamW does), bumping its
    version. Every step() records which gradients are unscaled after it (those written, by their versions): the next
    step() hands FusedAdam no grad_scale when every gradient is one of those, unwritten since (a retry after a step
    post hook raised, a second step() on the same gradients), and the loss scale when none is; a mix (an update that
    raised half way, a backward without zero_grad that reached only some params) is refused, changing nothing. After
    a skipped step every gradient is still scaled (on a device, whose kernels decide the skip where the host does not
    read it, their versions move all the same: the flag is read then, at a second step() over them only). A
    step() that raises before the update (a pre hook) leaves the gradients scaled and recorded as such. A step that
    torch.compile traces keeps no record and counts every gradient as scaled (see step)."""

    def __init__(self, optimizer: FusedAdam, max_grad_norm: Optional[float]) -> None:
        """Checks that the FusedAdam can take fp32 masters and the clipping, writing nothing (see apply())."""
        if optimizer.step_in_backward:  # (backward(loss) would update every param with the scaled gradients)
            raise step_in_backward_refused("this FusedAdam")
        for gi, group in enumerate(optimizer.param_groups):
            if group.get("stochastic_rounding", False):
                raise ValueError(
                    f"FP16_Optimizer: param_groups[{gi}] of this FusedAdam has stochastic_rounding=True, which rounds "
                    "the update into bf16 params that have no fp32 master; FP16_Optimizer gives FusedAdam fp32 master "
                    "weights (master_weights=True), which keep the update exactly, and FusedAdam refuses the two "
                    "together. Either build the FusedAdam with stochastic_rounding=False (the masters then do what "
                    "the rounding did), or train the bf16 params with FusedAdam(stochastic_rounding=True) alone: bf16 "
                    "has float32's exponent range and needs no loss scaling. The FusedAdam was not changed")
        if not optimizer.master_weights:
            for gi, group in enumerate(optimizer.param_groups):
                for j, p in enumerate(group["params"]):
                    if p.dtype in LOW_PRECISION and optimizer.state.get(p):
                        raise ValueError(
                            f"FP16_Optimizer: this FusedAdam already holds state for the fp16/bf16 param {_where(gi, j)} "
                            "without fp32 master weights; construct it with master_weights=True before the first step"
                        )
        if max_grad_norm is not None and optimizer.max_grad_norm is not None \
                and optimizer.max_grad_norm != max_grad_norm:
            raise ValueError(
                f"FP16_Optimizer(max_grad_norm={max_grad_norm}) disagrees with the wrapped FusedAdam's "
                f"max_grad_norm={optimizer.max_grad_norm}; give it in one place"
            )
        # (apply() sets master_weights and max_grad_norm: a group repeating another value of either, as torch's
        # ZeroRedundancyOptimizer's groups or a loaded checkpoint's do, would have every step refused after it)
        after = WideOptions(True, optimizer.exp_avg_dtype, optimizer.exp_avg_sq_dtype,
                            optimizer.max_grad_norm if max_grad_norm is None else max_grad_norm)
        for gi, group in enumerate(optimizer.param_groups):
            check_wide_keys(group, lambda key, gi=gi: f"FP16_Optimizer: param_groups[{gi}] of this FusedAdam: {key}",
                            after)
        self.optimizer = optimizer
        self._max_grad_norm = max_grad_norm
        self._unscaled = _Versions()  # the gradients the last step() left unscaled
        self._skipped: Optional[torch.Tensor] = None  # the last step()'s skip flag (None: it raised, or none yet)

    def apply(self) -> None:
        """Switches the FusedAdam's masters on (and hands it max_grad_norm). Also with no fp16/bf16 param yet: groups
        added later then get masters too. FusedAdam creates state lazily, at a param's first step, so masters start
        there (no fp16/bf16 param has state: checked at construction)."""
        self.optimizer.master_weights = True
        if self._max_grad_norm is not None:
            self.optimizer.max_grad_norm = self._max_grad_norm

    def sync(self) -> None:
        """(FusedAdam gives the params of groups added later masters itself.)"""

    @property
    def max_grad_norm(self) -> Optional[float]:
        return self.optimizer.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Optional[float]) -> None:
        self.optimizer.max_grad_norm = value

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        return self.optimizer.last_grad_norm

    @property
    def master_params(self) -> list[torch.Tensor]:
        opt = self.optimizer
        return [dtensor.wrap_like(p, opt.state[p]["master_param"]) for g in opt.param_groups for p in g["params"]
                if "master_param" in opt.state.get(p, {})]

    def zero_grad(self, set_to_none: bool) -> None:
        self._unscaled = _Versions()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, owner: Any) -> bool:
        opt = self.optimizer
        scale = owner.scaler.scale
        given = None
        distributed = owner._distributed()
        grads = [(gi, j, p, p.grad) for gi, g in enumerate(opt.param_groups) for j, p in enumerate(g["params"])
                 if p.grad is not None]
        if not distributed and not grads:
            raise RuntimeError(NO_GRADIENTS)
        # Inside a traced step the gradients' versions are not read (each read is a data-dependent value that splits
        # the graph, and the weak references guard on each gradient's identity, a recompile per new gradient): the
        # gradients count as scaled, as a backward leaves them.
        traced = torch.compiler.is_compiling()
        unscaled = [False if traced else self._unscaled.holds(p, g) for _, _, p, g in grads]
        if any(unscaled) and self._skipped is not None and bool(self._skipped != 0):
            # The last step() was skipped, so it wrote back no gradient: they are all still scaled. (Their versions
            # moved all the same where the kernels decide the skip on the device, which the host does not read:
            # ort_optim/_versions.py. Read here, on a second step() over the same gradients only.)
            unscaled = [False] * len(unscaled)
        if any(unscaled):
            if not all(unscaled):
                gi, j = next((gi, j) for (gi, j, _, _), done in zip(grads, unscaled) if not done)
                raise RuntimeError(
                    f"FP16_Optimizer.step(): some gradients are those the last step() left unscaled (FusedAdam writes "
                    f"them back unscaled), others are scaled (that of {_where(gi, j)}: written since, or not reached "
                    "by an update that raised), and one step cannot unscale only some. Call zero_grad() before "
                    "backward(loss); nothing was changed")
            scale = None  # (every gradient holds its unscaled value already)
        reduction = opt._reduction() if distributed else None
        # (the wrapper's process_group left None is the group of the FusedAdam's own decision where it has one)
        explicit = [g for g in owner._overflow_groups() if g is not None]
        if distributed and (reduction is None or not reduction.spans(explicit)):
            # Our own flag, reduced over the wrapper's groups, goes in as found_inf (FusedAdam ORs it with its own
            # check, which also covers a gradient that overflows when unscaled by a scale below 1). A FusedAdam over
            # DTensor params or with a process_group decides globally itself, in the all-reduce that also carries its
            # norm: enough where that reduction spans the wrapper's groups too (a model-parallel group it does not
            # reduce over would otherwise let the stages decide apart).
            grads_by_device: dict[torch.device, list[torch.Tensor]] = {}
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:  # (a DTensor's local piece: each rank checks its own)
                        grads_by_device.setdefault(p.grad.device, []).append(dtensor.local(p.grad))
            given = torch.zeros((), dtype=torch.float32, device=owner._main_device)
            for on_device in grads_by_device.values():
                given = torch.maximum(given, backends.grad_stats(on_device)[1].to(owner._main_device))
            # (beside a FusedAdam's own reduction, over the wrapper's explicit groups only: it covers the rest)
            given = owner._reduce_found_inf(given.reshape(1), None if reduction is None else explicit).reshape(())
        self._unscaled = _Versions()  # (filled again below, after the step, where it is kept)
        self._skipped = None  # (this step's skip flag, once it has one)
        if traced:  # (nothing to record; and no try block, which TorchDynamo cannot resume in after a graph break)
            opt.step(grad_scale=scale, found_inf=given)
        else:
            versions = [g._version for _, _, _, g in grads]
            try:
                opt.step(grad_scale=scale, found_inf=given)
            finally:
                for (_, _, p, g), version, done in zip(grads, versions, unscaled):
                    if done or g._version != version:  # (FusedAdam wrote it back unscaled)
                        self._unscaled.add(p, g)
        found = opt.last_found_inf
        if found is None:  # no parameter had a gradient on this rank: nothing was (or could be) updated here
            found = torch.zeros((), dtype=torch.float32, device=owner._main_device) if given is None else given
        self._skipped = found.reshape(())
        owner.scaler.update(found.reshape(()))
        return False

    def _with_masters(self):
        """(param, its master) for each param of the FusedAdam that has a master."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                if st and "master_param" in st:
                    yield p, st["master_param"]

    @torch.no_grad()
    def refresh(self) -> None:
        for p, master in self._with_masters():  # (a DTensor param's master is its local piece, as FusedAdam keeps it)
            master.copy_(dtensor.local(p.detach()))

    def saved_masters(self) -> list[Optional[dict]]:
        """FusedAdam's masters are in its own state_dict. An fp16/bf16 param that has none yet (FusedAdam creates
        state at a param's first step: one without a gradient so far has none) is saved here, so that loading
        restores it as it restores the others: ``{'param': its value in fp32}`` for each such param and None for the
        others, in param_groups order; an empty list when there is none (the usual case)."""
        state = self.optimizer.state
        flat = _params_in_order(self.optimizer)
        unstepped = [p.dtype in LOW_PRECISION and "master_param" not in state.get(p, {}) for p in flat]
        if not any(unstepped):
            return []
        # (a DTensor param's value is a DTensor laid out like it, as FusedAdam saves its masters)
        return [{"param": p.detach().float().clone()} if u else None for p, u in zip(flat, unstepped)]

    def validate_masters(self, saved: list, where: str, inner_state_dict: Any) -> None:
        """An empty list, or one entry per param: None, or ``{'param': fp32 tensor}`` for an fp16/bf16 param (the
        value of a param that had no FusedAdam state when it was saved, so none whose state in ``inner_state_dict``
        holds a ``master_param``: the two would disagree about the param)."""
        if not saved:
            return
        if any(isinstance(entry, torch.Tensor) for entry in saved):
            raise ValueError(f"{where} must hold no fp32 masters with FusedAdam inside (its masters are in its own "
                             f"state as 'master_param'); this checkpoint holds {len(saved)} entries, saved by an "
                             "FP16_Optimizer around another optimizer")
        flat = _params_in_order(self.optimizer)
        if len(saved) != len(flat):
            raise ValueError(f"{where} must list {len(flat)} entries (one per parameter) or none, got {len(saved)}")
        saved_states = _saved_states(inner_state_dict)
        for index, (p, entry) in enumerate(zip(flat, saved)):
            if entry is None:
                continue
            name, shape = f"{where}[{index}]", tuple(p.shape)
            if p.dtype not in LOW_PRECISION:
                raise ValueError(f"{name} must be None (a {p.dtype} parameter), got {type(entry).__name__}")
            value = entry.get("param") if isinstance(entry, dict) and set(entry) == {"param"} else None
            if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 \
                    or value.layout != torch.strided or tuple(value.shape) != shape:
                raise ValueError(f"{name} must be None or {{'param': a dense float32 tensor of shape {shape}}} (the "
                                 f"value of an fp16/bf16 parameter FusedAdam held no state for), got {entry!r:.80}")
            dtensor.local_like(p, value, f"{name}['param']")  # (a DTensor on another mesh: refused, naming it)
            saved_state = saved_states[index] if index < len(saved_states) else None
            if isinstance(saved_state, dict) and "master_param" in saved_state:
                raise ValueError(f"{name} holds the value of a param that had no FusedAdam state, but the checkpoint's "
                                 f"FusedAdam state of that param holds a master_param: the two disagree about it. "
                                 f"Nothing was changed")

    @torch.no_grad()
    def _restore_unstepped(self, masters: list) -> None:
        """Writes each saved value of a param that had no FusedAdam state (validate_masters() ran before) into the
        model's param, and into its master where the FusedAdam holds one now (a load that kept the current state)."""
        for index, (p, entry) in enumerate(zip(_params_in_order(self.optimizer), masters)):
            if entry is not None:
                value = dtensor.local_like(p, entry["param"], f"state_dict['master_params'][{index}]['param']")
                dtensor.local(p).copy_(value)
                st = self.optimizer.state.get(p)
                if st and "master_param" in st:
                    st["master_param"].copy_(value)

    @torch.no_grad()
    def load(self, inner_state_dict: dict, masters: list) -> None:
        """Loads the FusedAdam's checkpoint (it validates before changing anything, and copies what it keeps), then
        writes its masters (rounded) into the model's params."""
        self.optimizer.load_state_dict(inner_state_dict)
        self.refresh_model()
        self._restore_unstepped(masters)
        self._unscaled = _Versions()

    @torch.no_grad()
    def load_masters(self, inner_state_dict: Any, masters: list, where: str) -> None:
        """Loads only the masters of a FusedAdam checkpoint (``load_state_dict(..., load_optimizer_states=False)``):
        each fp16/bf16 param's ``master_param`` replaces the FusedAdam's, whose moments, steps and group options stay
        as they are; a param with no state yet gets a fresh one (step 0, zero moments: what its first step would
        create) holding the saved master; a param with state but no saved master takes it from the model's param, as
        a full load does. Then the masters are written (rounded) into the model's params, and so are the saved values
        of params that had no FusedAdam state then (into their masters too where they have one now). Everything is
        checked before anything changes (the FusedAdam checks its own checkpoint, made of its current state and these
        masters); errors name the entry of ``where``."""
        opt = self.optimizer
        if not isinstance(inner_state_dict.get("param_groups"), (list, tuple)) or \
                not isinstance(inner_state_dict.get("state"), dict):
            raise TypeError(f"{where} must hold 'param_groups' (a list) and 'state' (a dict), as a FusedAdam "
                            "state_dict does")
        saved_groups, saved_state = inner_state_dict["param_groups"], inner_state_dict["state"]
        if len(saved_groups) != len(opt.param_groups):
            raise ValueError(f"{where}['param_groups'] has {len(saved_groups)} groups but this FusedAdam has "
                             f"{len(opt.param_groups)}")
        saved_masters: dict[int, torch.Tensor] = {}  # position in param_groups order -> saved master
        position = 0
        for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
            ids = saved.get("params") if isinstance(saved, dict) else None
            if not isinstance(ids, (list, tuple)) or len(ids) != len(group["params"]):
                raise ValueError(f"{where}['param_groups'][{gi}]['params'] must list the {len(group['params'])} "
                                 f"params of this FusedAdam's param_groups[{gi}]")
            for j, (saved_id, p) in enumerate(zip(ids, group["params"])):
                entry = saved_state.get(saved_id)
                if isinstance(entry, dict) and "master_param" in entry:
                    master = entry["master_param"]
                    name = f"{where}['state'][{saved_id!r}]['master_param']"
                    if not isinstance(master, torch.Tensor) or not master.is_floating_point() \
                            or tuple(master.shape) != tuple(p.shape):
                        raise ValueError(f"{name} must be a floating-point tensor of shape {tuple(p.shape)} (the "
                                         f"master of {_where(gi, j)}), got {type(master).__name__} "
                                         f"{getattr(master, 'dtype', '')} {tuple(getattr(master, 'shape', ()))}")
                    saved_masters[position + j] = master
            position += len(group["params"])
        current = opt.state_dict()  # (canonical: fresh tensors, ids are positions in param_groups order)
        state = dict(current["state"])
        for index, (group, p) in enumerate((g, p) for g in opt.param_groups for p in g["params"]):
            saved = saved_masters.get(index)
            if index in state:
                entry = dict(state[index])
                entry.pop("master_param", None)  # (taken from the model's param where none is saved)
            elif saved is not None and p.dtype in LOW_PRECISION:
                zeros = torch.zeros(p.shape, dtype=torch.float32, device=dtensor.local(p).device)
                entry = {"step": torch.zeros((), dtype=torch.float64, device=zeros.device), "exp_avg": zeros,
                         "exp_avg_sq": zeros.clone()}
                if group.get("amsgrad", False):
                    entry["max_exp_avg_sq"] = zeros.clone()
            else:
                continue
            if saved is not None and p.dtype in LOW_PRECISION:
                entry["master_param"] = saved
            state[index] = entry
        opt.load_state_dict({**current, "state": state})  # validates everything before changing anything
        self.refresh_model()
        self._restore_unstepped(masters)
        self._unscaled = _Versions()

    @torch.no_grad()
    def refresh_model(self) -> None:
        for p, master in self._with_masters():
            dtensor.local(p).copy_(master)



# ---- the wrapper keeps the masters ----------------------------------------------------------------------------------


@dataclass
class _Layout:
    """Which params of the wrapped optimizer's param_groups get an fp32 master (non-FusedAdam optimizers)."""

    ids: list[int]  # id() of every param in param_groups, in order: what the layout was computed from
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (fp16/bf16 model param, master)
    pair_where: list[str] = field(default_factory=list)
    fp32: list[torch.Tensor] = field(default_factory=list)  # params the optimizer updates directly
    fp32_where: list[str] = field(default_factory=list)
    swaps: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # to apply: (gi, j, p, m)


@dataclass
class _LastStep:
    """What the last step() read, as torch.amp.GradScaler records per optimizer that it unscaled it: the fp32 params'
    gradients, unscaled (and clipped) in place; the fp16/bf16 params' gradients (still scaled) and their masters'
    buffers, which hold them unscaled; the overflow decision and the norm. ``found_inf`` is None when the step raised
    while unscaling (its fp32 gradients are then in an unknown state)."""

    fp32: _Versions
    low: _Versions
    buffers: _Versions
    found_inf: Optional[torch.Tensor]
    grad_norm: Optional[torch.Tensor]


class WrapperMasters:
    """fp32 masters of the fp16/bf16 params, kept by the wrapper and swapped into the wrapped optimizer's
    param_groups; fp32 params stay (their gradients are unscaled in place, as torch.amp.GradScaler does).

    A step() whose wrapped optimizer raises after the gradients were unscaled (a step pre or post hook, or its step
    itself) leaves the scaler, the masters' copies to the model and the loss scale as they were. Every step() (taken,
    skipped or raised) records the gradients it unscaled (the tensor and its version, :class:`_Versions`): the next
    step() unscales none of them again. If every gradient is still the one it read, the next step() reuses its
    overflow decision and clipping, so a retry equals a step that never failed (as under torch.amp.GradScaler, whose
    per-optimizer state stays UNSCALED after its step raised), and a second step() on the same gradients steps with
    the same unscaled values, as a torch optimizer would. A gradient written since (a new backward after zero_grad)
    is unscaled afresh; one written in place on top of an unscaled one (backward without zero_grad) cannot be told
    apart from a fresh one and is unscaled too. A step() that raised while unscaling (a failed all-reduce of the
    overflow flag) leaves the fp32 gradients in an unknown state: the next step() refuses them until they are new.
    ``zero_grad()`` and ``load_state_dict()`` clear the record."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_grad_norm: Optional[float]) -> None:
        """Plans the masters of the current param_groups, checking every param and writing nothing (see apply())."""
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Optional[torch.Tensor] = None  # the norm the clipping computed at the last step
        self._layout = _Layout(ids=[])
        self._model_of: dict[int, torch.Tensor] = {}  # id(master) -> its model param
        self._grad_buffers: dict[int, torch.Tensor] = {}  # id(master) -> persistent fp32 gradient buffer
        self._last: Optional[_LastStep] = None
        self._planned = self._plan_layout(optimizer, self._layout)

    def apply(self) -> None:
        self._apply_layout(self._planned)
        del self._planned

    @staticmethod
    def _plan_layout(optimizer: torch.optim.Optimizer, known: _Layout) -> _Layout:
        """The masters for the current param_groups, reusing those of `known`; checks every param and writes
        nothing (new masters are fresh tensors, swapped in by _apply_layout)."""
        masters = {id(m): p for p, m in known.pairs}  # id(master) -> model param
        fp32 = {id(p) for p in known.fp32}
        layout = _Layout(ids=[id(p) for p in _params_in_order(optimizer)])
        seen: dict[int, str] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                where = _where(gi, j)
                if id(p) in seen:
                    raise ValueError(f"FP16_Optimizer: {where} is the same tensor as {seen[id(p)]}; give each "
                                     "parameter once")
                seen[id(p)] = where
                if id(p) in masters:
                    layout.pairs.append((masters[id(p)], p))
                    layout.pair_where.append(where)
                    continue
                if id(p) in fp32 and p.dtype not in LOW_PRECISION:  # (cast to fp16/bf16 in place: gets a master)
                    layout.fp32.append(p)
                    layout.fp32_where.append(where)
                    continue
                if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                    raise NotFloatingPointError(
                        f"FP16_Optimizer: {where} has dtype {getattr(p, 'dtype', type(p).__name__)}, not a "
                        "floating-point type; only floating-point parameters can be trained: leave it out of the "
                        "optimizer's param groups (a buffer that is not trained belongs to the module, "
                        "module.register_buffer)")
                if p.dtype in LOW_PRECISION:
                    master = p.detach().clone(memory_format=torch.contiguous_format).float()
                    layout.swaps.append((gi, j, p, master))
                    layout.pairs.append((p, master))
                    layout.pair_where.append(where)
                else:
                    layout.fp32.append(p)
                    layout.fp32_where.append(where)
        # A model param given again (say, re-added after wrapping) while its master is still in the groups.
        model_ids = {}
        for (p, _), where in zip(layout.pairs, layout.pair_where):
            if id(p) in model_ids:
                first, second = sorted([model_ids[id(p)], where])
                raise ValueError(f"FP16_Optimizer: {second} is the model parameter whose fp32 master is {first} "
                                 "(the wrapper swapped it in); give each parameter once")
            model_ids[id(p)] = where
        return layout

    @torch.no_grad()
    def _apply_layout(self, layout: _Layout) -> None:
        state = self.optimizer.state
        for gi, j, p, master in layout.swaps:
            self.optimizer.param_groups[gi]["params"][j] = master
            if p in state:  # existing state moves to the master, the param-shaped floating tensors cast to fp32
                old = state.pop(p)
                state[master] = {
                    k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape
                    else v for k, v in old.items()
                }
        layout.swaps = []
        layout.ids = [id(p) for p in _params_in_order(self.optimizer)]
        self._layout = layout
        self._model_of = {id(m): p for p, m in layout.pairs}
        self._grad_buffers = {k: v for k, v in self._grad_buffers.items() if k in self._model_of}

    def sync(self) -> None:
        """Brings params added to (or replaced in) param_groups since the last call under loss scaling, and fp32
        params given fp16/bf16 data in place since (``model.half()`` after wrapping: the same Parameter objects),
        which get fp32 masters as new fp16/bf16 params do; raises, naming the param, before anything is written when
        one cannot be. Cheap when nothing changed."""
        ids = [id(p) for p in _params_in_order(self.optimizer)]
        if ids != self._layout.ids or any(p.dtype in LOW_PRECISION for p in self._layout.fp32):
            self._apply_layout(self._plan_layout(self.optimizer, self._layout))

    @property
    def master_params(self) -> list[torch.Tensor]:
        return [m for _, m in self._layout.pairs]

    def zero_grad(self, set_to_none: bool) -> None:
        self._last = None
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p = self._model_of.get(id(p), p)  # a master stands for its model param
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    # ---- the step ------------------------------------------------------------------------------------------------

    def step(self, owner: Any) -> bool:
        layout = self._layout
        # Read and check every gradient before anything is written (masters' grads attached, grads coalesced).
        low_grads = [(i, p.grad) for i, (p, _) in enumerate(layout.pairs) if p.grad is not None]
        fp32_grads = [(i, p.grad) for i, p in enumerate(layout.fp32) if p.grad is not None]
        for grads, where, params in ((low_grads, layout.pair_where, [p for p, _ in layout.pairs]),
                                     (fp32_grads, layout.fp32_where, layout.fp32)):
            for i, g in grads:
                if g.layout not in (torch.strided, torch.sparse_coo):
                    raise ValueError(f"FP16_Optimizer: the gradient of {where[i]} has layout {g.layout}; dense and "
                                     "sparse COO gradients are supported")
                problem = dtensor.layout_problem(params[i], g)
                if problem is not None:
                    raise ValueError(f"FP16_Optimizer: {where[i]}: {problem}")
        if not low_grads and not fp32_grads and not owner._distributed():
            raise RuntimeError(NO_GRADIENTS)

        last = self._last
        if last is not None and last.found_inf is None:
            for i, g in fp32_grads:
                if last.fp32.holds(layout.fp32[i], g):
                    raise RuntimeError(
                        f"FP16_Optimizer.step(): the gradient of {layout.fp32_where[i]} is the one an earlier step() "
                        "was unscaling in place when it raised, so whether it is scaled is not known. Call zero_grad() "
                        "and backward(loss) again; nothing was changed")
        self._last = None
        stepped = [i for i, _ in low_grads]
        found_inf = None
        try:
            if last is not None and self._unchanged(last, low_grads, fp32_grads):
                # The gradients the last step() read (a retry after it raised): unscaled, checked and clipped then.
                for i, _ in low_grads:
                    master = layout.pairs[i][1]
                    master.grad = self._grad_buffers[id(master)]
                found_inf, self.last_grad_norm = last.found_inf, last.grad_norm
            else:
                found_inf = self._unscale(owner, low_grads, fp32_grads, last)
            checked, underflow = self._decide_and_step(owner, found_inf, stepped)
        finally:
            self._last = self._record(low_grads, found_inf)
            for i in stepped:
                layout.pairs[i][1].grad = None
        if underflow:
            owner.scaler.check(blocking=True)  # raises LossScaleUnderflowError (and clears the flag)
        return checked

    def _unchanged(self, last: _LastStep, low_grads: list, fp32_grads: list) -> bool:
        """Whether the gradients are exactly those the last step() read (none added, removed or written since)."""
        layout = self._layout
        if last.found_inf is None or len(low_grads) != len(last.low) or len(fp32_grads) != len(last.fp32):
            return False
        for i, g in low_grads:
            p, master = layout.pairs[i]
            if not (last.low.holds(p, g) and last.buffers.holds(master, self._grad_buffers.get(id(master)))):
                return False
        return all(last.fp32.holds(layout.fp32[i], g) for i, g in fp32_grads)

    def _record(self, low_grads: list, found_inf: Optional[torch.Tensor]) -> _LastStep:
        layout = self._layout
        last = _LastStep(fp32=_Versions(), low=_Versions(), buffers=_Versions(), found_inf=found_inf,
                         grad_norm=self.last_grad_norm)
        for i, g in low_grads:
            p, master = layout.pairs[i]
            last.low.add(p, g)
            buffer = self._grad_buffers.get(id(master))
            if buffer is not None:
                last.buffers.add(master, buffer)
        for p in layout.fp32:
            if p.grad is not None:  # (after coalescing, a sparse gradient is a new tensor: the one recorded)
                last.fp32.add(p, p.grad)
        return last

    def _unscale(self, owner: Any, low_grads: list, fp32_grads: list, last: Optional[_LastStep]) -> torch.Tensor:
        """Copies the fp16/bf16 gradients into the masters' fp32 buffers, unscales and checks them and the fp32
        gradients (in place) in one multi-tensor pass per device, reduces the overflow flag over the ranks, clips.
        fp32 gradients that the last step() unscaled already (``last``) are only checked. Returns found_inf."""
        layout = self._layout
        self.last_grad_norm = None
        inv_scale = owner.scaler.inv_scale()
        found_inf = torch.zeros((), dtype=torch.float32, device=owner._main_device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}  # dense tensors to unscale, check and clip in place
        done: dict[torch.device, list[torch.Tensor]] = {}  # of these, those unscaled already: check only
        copy_src: dict[torch.device, list[torch.Tensor]] = {}
        copy_dst: dict[torch.device, list[torch.Tensor]] = {}
        for i, g in low_grads:
            master = layout.pairs[i][1]
            if g.layout == torch.sparse_coo:
                # Summed in fp32: coalescing the scaled fp16 values could overflow where the fp32 sum does not.
                master.grad = g.detach().float().coalesce()
                by_device.setdefault(g.device, []).append(master.grad._values())
                continue
            buf = self._grad_buffers.get(id(master))
            if buf is None:
                buf = self._grad_buffers[id(master)] = torch.empty_like(master)
            copy_src.setdefault(g.device, []).append(g)
            copy_dst.setdefault(g.device, []).append(buf)
            by_device.setdefault(g.device, []).append(buf)
            master.grad = buf
        for i, g in fp32_grads:
            p = layout.fp32[i]
            already = last is not None and last.fp32.holds(p, g)
            if g.layout == torch.sparse_coo and not g.is_coalesced():
                p.grad = g = g.coalesce()  # as GradScaler: each row once, so the check sees what the update adds
            dense = g._values() if g.layout == torch.sparse_coo else g
            (done if already else by_device).setdefault(g.device, []).append(dense)
        for device, grads in by_device.items():
            if device in copy_src:  # (DTensors: their local pieces, laid out alike: checked before)
                torch._foreach_copy_(_locals(copy_dst[device]), _locals(copy_src[device]))
            dev_found = torch.zeros((), dtype=torch.float32, device=device)
            # (DTensor gradients: each rank checks its pieces; the flag is all-reduced below)
            pieces = _locals(grads)
            torch._amp_foreach_non_finite_check_and_unscale_(pieces, dev_found, inv_scale.to(device))
            if owner.scaler.min_scale < 1.0:
                # torch's op checks before multiplying; with 1/scale > 1 the product itself can overflow: check
                # the unscaled values once more (an inv_scale of 1 makes the op check only).
                one = torch.ones((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(pieces, dev_found, one)
            found_inf = torch.maximum(found_inf, dev_found.to(owner._main_device))
        for device, grads in done.items():
            dev_found = torch.zeros((), dtype=torch.float32, device=device)
            one = torch.ones((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(_locals(grads), dev_found, one)
            found_inf = torch.maximum(found_inf, dev_found.to(owner._main_device))
            by_device.setdefault(device, []).extend(grads)
        found_inf = owner._reduce_found_inf(found_inf.reshape(1)).reshape(())
        if self.max_grad_norm is not None and by_device:
            self._clip(owner, by_device)
        return found_inf

    def _decide_and_step(self, owner: Any, found_inf: torch.Tensor, stepped: list[int]) -> tuple[bool, bool]:
        """Steps the optimizer on the masters unless found_inf, then commits the scaler's next state and copies the
        masters into the model. The scaler's next state is decided first and committed once the optimizer has
        stepped: an optimizer that raises leaves the scale, the counters and the params as they were. Returns
        (whether the scaler's min-scale flag was read on the host, whether it was set)."""
        new_scaler_state = owner.scaler._next_state(found_inf)
        opt = self.optimizer
        checked = raise_now = False
        if getattr(opt, "_step_supports_amp_scaling", False):
            # torch's fused optimizers (and ours) skip on a device flag: no host sync.
            opt.grad_scale = None
            opt.found_inf = found_inf
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
            do_copy = True
        else:
            # The one host read of this path: the overflow flag and the scaler's min-scale flag together.
            underflow = new_scaler_state.get("underflow", owner.scaler.underflow)
            found, underflow = torch.stack([found_inf != 0, underflow.to(found_inf.device)]).tolist()
            checked = True
            raise_now = bool(underflow)
            do_copy = not found
            if do_copy:
                opt.step()
        owner.scaler._commit(new_scaler_state)
        layout = self._layout
        if do_copy and stepped:
            by_dev_params: dict[torch.device, tuple[list, list]] = {}
            for i in stepped:
                p, master = layout.pairs[i]
                dst, src = by_dev_params.setdefault(p.device, ([], []))
                dst.append(p)
                src.append(master)
            for dst, src in by_dev_params.values():
                torch._foreach_copy_(_locals(dst), _locals(src))
        return checked, raise_now

    def _clip(self, owner: Any, by_device: dict[torch.device, list[torch.Tensor]]) -> None:
        """Scales the (unscaled, fp32) gradients so that their global L2 norm is at most max_grad_norm."""
        total = torch.zeros((), dtype=torch.float32, device=owner._main_device)
        for grads in by_device.values():
            norms = torch._foreach_norm(grads, 2.0)
            total = total + torch.stack(norms).float().square().sum().to(owner._main_device)
        norm = sqrt_f32(total)  # (correctly rounded: the same bits eagerly and compiled, as backends.scaling's)
        if dtensor.is_dtensor(norm):  # DTensor gradients (FSDP2, TP): their global norm, a plain tensor as elsewhere
            norm = norm.full_tensor()
        self.last_grad_norm = norm
        coef = backends.clip_coefficient(norm, self.max_grad_norm)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device))

    # ---- masters and checkpoints ---------------------------------------------------------------------------------

    @torch.no_grad()
    def refresh(self) -> None:
        self.sync()
        for p, master in self._layout.pairs:
            master.copy_(p.detach())

    def saved_masters(self) -> list[Optional[torch.Tensor]]:
        """One fp32 master per parameter in param_groups order (None for fp32 params)."""
        self.sync()
        return [p.detach().clone() if id(p) in self._model_of else None for p in _params_in_order(self.optimizer)]

    def validate_masters(self, saved: list, where: str, inner_state_dict: Any) -> None:
        flat = _params_in_order(self.optimizer)
        if len(saved) != len(flat):
            raise ValueError(f"{where} must list {len(flat)} entries (one per parameter), got {len(saved)}"
                             + (" (an FP16_Optimizer around FusedAdam saves its masters in FusedAdam's state: load "
                                "such a checkpoint into an FP16_Optimizer around FusedAdam)"
                                if any(isinstance(m, dict) for m in saved) or len(saved) == 0 else ""))
        for index, (p, master) in enumerate(zip(flat, saved)):
            entry = f"{where}[{index}]"
            if id(p) not in self._model_of:
                if master is not None:
                    raise ValueError(f"{entry} must be None (an fp32 parameter), got {type(master).__name__}")
                continue
            if not isinstance(master, torch.Tensor):
                raise TypeError(f"{entry} must be the fp32 master of an fp16/bf16 parameter, got "
                                f"{type(master).__name__} {master!r:.60}")
            if master.dtype != torch.float32 or master.shape != p.shape or master.layout != torch.strided:
                raise ValueError(f"{entry} must be a dense float32 tensor of shape {tuple(p.shape)}, got "
                                 f"{master.dtype} of shape {tuple(master.shape)} ({master.layout})")

    @torch.no_grad()
    def load(self, inner_state_dict: dict, masters: list) -> None:
        """Loads the optimizer's checkpoint (cloned: the optimizer keeps what it is given), writes the saved masters
        and then the model's params from them (rounded). validate_masters() ran before. torch.optim's
        load_state_dict replaces its state and param_groups first and then fixes up what it loaded (Adam's reads
        each state's 'step': a KeyError where one lacks it): on any error a torch optimizer gets both back, so a
        failed load leaves it as it was."""
        opt = self.optimizer
        state, param_groups = opt.state, opt.param_groups
        try:
            opt.load_state_dict(_clone_tensors(inner_state_dict))
        except Exception as error:
            if isinstance(opt, torch.optim.Optimizer):  # (DeepSpeed's ZeRO optimizers keep their own records)
                opt.state, opt.param_groups = state, param_groups
            if isinstance(error, KeyError):  # (names nothing but the key)
                raise ValueError(f"state_dict['optimizer'] cannot be loaded into {type(opt).__name__}: an entry lacks "
                                 f"the key {error}") from error
            raise
        self.load_masters(inner_state_dict, masters, "")

    @torch.no_grad()
    def load_masters(self, inner_state_dict: Any, masters: list, where: str) -> None:
        """Writes the saved masters (``load_state_dict(..., load_optimizer_states=False)``: the wrapped optimizer's
        state and options stay as they are) and then the model's params from them (rounded). validate_masters()
        ran before, so nothing here can fail."""
        for p, saved in zip(_params_in_order(self.optimizer), masters):
            if saved is not None:
                p.copy_(saved)
        for p, master in self._layout.pairs:
            p.copy_(master)
        self._last = None
