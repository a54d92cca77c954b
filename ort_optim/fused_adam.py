"""FusedAdam: a multi-tensor Adam/AdamW on ort_optim's own op, a drop-in for ORT's and for torch.optim.AdamW."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch

from . import _checkpoint, _spec, backends
from ._checkpoint import MOMENT_KEYS
from ._spec import LOW_PRECISION, STATE_DTYPES, SUPPORTED_PARAM_DTYPES, AdamWMode
from .integrations import dtensor

# State views in one flat buffer start a multiple of this many elements apart (256 bytes for float32).
_STATE_ALIGN = 64


@dataclass
class _Bucket:
    """Parameters of one param group that share (device, dtype, state dtypes, master): one op call per step."""

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
    whole_group: bool = False  # holds every param of its group, in order (the grads list can be passed as is)
    native: Optional[backends.AdamPlan] = None  # over the lists above, when its group steps through plans


@dataclass
class _GroupPlan:
    """A param group's buckets, valid while key (_plan_key) holds. native: every bucket has a native AdamPlan, and
    together they check that key still holds (the first also watches the params without a gradient), so a step can go
    through them without reading any grad in Python."""

    key: tuple
    buckets: list[_Bucket]
    native: bool


@dataclass
class _Launch:
    """One op call of a step: grads is None when the bucket's native plan reads the gradients itself."""

    group_index: int
    group: dict
    bucket: _Bucket
    grads: Optional[list[torch.Tensor]]


def _describe(group_index: int, index: int, param: torch.Tensor) -> str:
    return f"param_groups[{group_index}]['params'][{index}] (shape {tuple(param.shape)}, {param.dtype})"


def _check_hyperparameters(group: dict, where: str) -> None:
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: lr must be a float or a one-element tensor, got shape {tuple(lr.shape)}")
        if lr.device.type == "cpu" and not float(lr) >= 0.0:
            raise ValueError(f"{where}: lr must be >= 0, got {float(lr)}")
    elif not (isinstance(lr, (int, float)) and lr >= 0.0):
        raise ValueError(f"{where}: lr must be a float >= 0, got {lr!r}")
    if not (isinstance(group["eps"], (int, float)) and group["eps"] >= 0.0):
        raise ValueError(f"{where}: eps must be a float >= 0, got {group['eps']!r}")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        if not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
            raise ValueError(f"{where}: {name} must be in [0, 1), got {beta!r}")
    if not (isinstance(group["weight_decay"], (int, float)) and group["weight_decay"] >= 0.0):
        raise ValueError(f"{where}: weight_decay must be a float >= 0, got {group['weight_decay']!r}")
    if group["adam_w_mode"] not in tuple(AdamWMode):
        raise ValueError(f"{where}: adam_w_mode must be an AdamWMode (0, 1 or 2), got {group['adam_w_mode']!r}")


def _check_dtype_option(name: str, dtype: Optional[torch.dtype]) -> None:
    if dtype is not None and dtype not in STATE_DTYPES:
        raise ValueError(f"{name} must be None, torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")


def _may_overlap_itself(p: torch.Tensor) -> bool:
    """False when the strides prove that no two elements of p share memory (dims sorted by stride, each stride
    exceeds the extent of the smaller ones); True when they may (an expand()ed tensor, exotic strides)."""
    dims = sorted((st, sz) for st, sz in zip(p.stride(), p.shape) if sz > 1)
    extent = 0
    for stride, size in dims:
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False


def _element_offsets(p: torch.Tensor, base: int) -> torch.Tensor:
    """Storage offsets (in elements, minus base) of every element of p."""
    last = p.storage_offset() + sum(st * (sz - 1) for st, sz in zip(p.stride(), p.shape))
    index = torch.arange(last + 1 - base, dtype=torch.int64)
    return index.as_strided(p.shape, p.stride(), p.storage_offset() - base).reshape(-1)


def _find_overlap(entries: list[tuple[int, int, torch.Tensor]]) -> Optional[tuple[tuple, Optional[tuple]]]:
    """The first parameter that overlaps itself, (entry, None), or the first pair of overlapping parameters,
    (entry, entry), among (group_index, index, param) entries; None when all of them own their memory."""
    by_storage: dict[tuple, list[tuple[int, int, torch.Tensor]]] = {}
    for entry in entries:
        p = entry[2]
        if p.numel() == 0:
            continue
        if p.dim() > 0 and not p.is_contiguous() and _may_overlap_itself(p):
            offsets = _element_offsets(p, p.storage_offset())
            if offsets.unique().numel() < offsets.numel():
                return entry, None
        by_storage.setdefault((p.device, p.untyped_storage().data_ptr()), []).append(entry)
    for shared in by_storage.values():
        if len(shared) < 2:
            continue
        # byte ranges first: views that split one flat buffer into disjoint pieces need nothing more
        spans = []
        for entry in shared:
            p = entry[2]
            size = p.element_size()
            start = p.storage_offset() * size
            end = start + size * (1 + sum(st * (sz - 1) for st, sz in zip(p.stride(), p.shape)))
            spans.append((start, end, entry))
        spans.sort(key=lambda s: s[0])
        for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
            if s1 >= e0:
                continue
            pa, pb = a[2], b[2]
            if pa.element_size() != pb.element_size() or pa.is_contiguous() and pb.is_contiguous():
                return a, b  # contiguous ranges that intersect, or views of one buffer with different dtypes
            base = min(pa.storage_offset(), pb.storage_offset())  # interleaved views: compare element by element
            if torch.isin(_element_offsets(pa, base), _element_offsets(pb, base)).any():
                return a, b
        # (a range can also reach past its successor: check every pair whose ranges intersect)
        for i, (s0, e0, a) in enumerate(spans):
            for s1, e1, b in spans[i + 2:]:
                if s1 >= e0:
                    break
                pa, pb = a[2], b[2]
                base = min(pa.storage_offset(), pb.storage_offset())
                if pa.element_size() != pb.element_size() or torch.isin(
                        _element_offsets(pa, base), _element_offsets(pb, base)).any():
                    return a, b
    return None


class FusedAdam(torch.optim.Optimizer):
    r"""Multi-tensor Adam/AdamW whose update is one call of ort_optim's fused op per (device, dtype) bucket.

    A drop-in for ``onnxruntime.training.optim.FusedAdam`` (same positional signature, defaults and
    :class:`AdamWMode`) and, with ``adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2``, for
    ``torch.optim.AdamW``. For parameter :math:`p` with gradient :math:`g` at its own step :math:`t`:

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2

    * ``ADAMW_TORCH``: :math:`p \leftarrow p(1-\eta\lambda) - \frac{\eta}{1-\beta_1^t}
      \frac{m_t}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}`
    * ``ADAMW_TRANSFORMERS`` (default): :math:`p \leftarrow p - \eta\frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}
      \frac{m_t}{\sqrt{v_t} + \epsilon}`, then :math:`p \leftarrow p - \eta\lambda p`
    * ``ADAM_L2_REGULARIZATION``: :math:`g_t \leftarrow g_t + \lambda p` first, then the ``ADAMW_TRANSFORMERS``
      update without the decay term.

    Args:
        params: parameters or param groups (dicts), as for any torch optimizer.
        lr: learning rate :math:`\eta` (default 1e-3); a float or a one-element tensor.
        bias_correction: divide by :math:`1-\beta^t` (default True).
        betas: :math:`(\beta_1, \beta_2)` (default (0.9, 0.999)).
        eps: :math:`\epsilon` (default 1e-6, ORT's real default; torch's AdamW uses 1e-8).
        adam_w_mode: the weight-decay variant (default ``ADAMW_TRANSFORMERS``, as ORT).
        weight_decay: :math:`\lambda` (default 0.0, as ORT; torch's AdamW uses 1e-2).
        set_grad_none: ``zero_grad()`` sets gradients to None (default True).
        amsgrad: use :math:`\max_{s\le t} v_s` in the denominator (default False).
        maximize: ascend instead of descend (default False).
        master_weights: keep an fp32 master copy (``state['master_param']``) of fp16/bf16 params; the update is done
            on the master and the param receives it rounded to nearest even (default False).
        exp_avg_dtype, exp_avg_sq_dtype: storage dtype of the moments: torch.float32, torch.bfloat16 or
            torch.float16 (default None: float32 for fp16/bf16 params with master weights, else the param's dtype;
            float64 params always keep float64 states). fp16 moments are stored with one power-of-two scale per
            1024 elements, so they neither overflow nor flush to zero.
        max_grad_norm: when set, clip the gradients by their global L2 norm over all params (default None), inside
            the fused step, after unscaling.
        capturable: promise that step() will be captured in a CUDA graph (default False). Steps and bias
            corrections already live on the device and step() never synchronises; this additionally refuses what a
            graph cannot replay: an lr tensor on another device, a float grad_scale. A float lr is baked into the
            graph at capture: to change it between replays, make it a device tensor and update it in place.
        process_group: a torch.distributed group over which plain (non-DTensor) params are replicas, as under DDP:
            the clipping norm (counting each replica once) and the inf/NaN skip become one decision for the group, in
            one all-reduce of two floats per step (default None: each process decides alone, as torch's optimizers;
            DTensor params are reduced over their meshes' ranks without it). See guides/distributed.md.

    On the CPU, each bucket keeps a native plan (ops/README.md, "AdamPlan") that validated its params and states
    once; from the second step on, steps go through it and read the gradients in C++, so a step over thousands of
    small tensors costs their bytes, not their metadata. It is a cache: same checks, same bits as the op, rebuilt
    whenever the set of params with gradients changes (params that never get one, frozen ones, are fine) or states
    are replaced.

    Each parameter has its own step count (as torch), so a parameter that first gets a gradient late gets a correct
    first update; parameters without a gradient are skipped entirely. Parameters must not share memory: overlapping
    views of one storage (or an ``expand()``-ed param) are refused at the first step, as they would be updated twice;
    disjoint views of one buffer are fine. A step that raises (bad gradient, bad hyperparameter) changes nothing.

    Distributed training (guides/distributed.md): DTensor params (FSDP2 ``fully_shard``, tensor parallel, 2D meshes)
    are stepped through their local pieces, and the states are local tensors shaped like them; ``state_dict()`` hands
    them back as DTensors laid out like their params, so ``torch.distributed.checkpoint`` saves and reshards them.
    The clipping norm and the inf/NaN skip are global: one all-reduce of [sum of squares, inf flag] per step (two
    floats, no host sync) over the ranks of the params' meshes, each piece counted once however often it is
    replicated. Plain params replicated by DDP (or any data-parallel scheme) get the same with ``process_group=``.

    ``step(closure=None, *, grad_scale=None, found_inf=None)``: ``grad_scale`` (float or one-element tensor)
    divides every gradient inside the kernel; ``found_inf`` (one-element tensor) turns the step into a no-op when
    non-zero. When ``grad_scale`` or ``max_grad_norm`` is given, the optimizer also checks the gradients for inf/NaN
    itself and skips the step if it finds any, or if unscaling (dividing by a ``grad_scale`` below 1) would overflow
    (the check is on the global norm of the unscaled gradients, which must stay below float32's range, about 1.8e19);
    :attr:`last_step_skipped` tells. A skipped step changes nothing: no
    parameter, master, moment or step count. ``torch.amp.GradScaler`` is honoured through its protocol for fused
    optimizers (``_step_supports_amp_scaling``).
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable,
        lr: Union[float, torch.Tensor] = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        adam_w_mode: AdamWMode = AdamWMode.ADAMW_TRANSFORMERS,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        master_weights: bool = False,
        exp_avg_dtype: Optional[torch.dtype] = None,
        exp_avg_sq_dtype: Optional[torch.dtype] = None,
        max_grad_norm: Optional[float] = None,
        capturable: bool = False,
        process_group: Any = None,
    ):
        _check_dtype_option("exp_avg_dtype", exp_avg_dtype)
        _check_dtype_option("exp_avg_sq_dtype", exp_avg_sq_dtype)
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be None or a float > 0, got {max_grad_norm!r}")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, adam_w_mode=adam_w_mode,
            weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
        )
        _check_hyperparameters(defaults, "FusedAdam")
        self.set_grad_none = set_grad_none
        self.master_weights = master_weights
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.max_grad_norm = max_grad_norm
        self.capturable = capturable
        self.process_group = process_group
        self._has_dtensors = False  # any DTensor param: steps go through local pieces and the global reduction
        self._plans: dict[int, _GroupPlan] = {}
        self._last_found_inf: Optional[torch.Tensor] = None
        super().__init__(params, defaults)

    # Constructor options that torch.optim.Optimizer's pickling (copy.deepcopy, torch.save of the optimizer) would
    # otherwise drop: it keeps only defaults, state and param_groups.
    # (process_group is not among them: a process group belongs to its process; a copy decides alone until given one)
    _OPTIONS = ("set_grad_none", "master_weights", "exp_avg_dtype", "exp_avg_sq_dtype", "max_grad_norm", "capturable",
                "_has_dtensors")

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._OPTIONS})
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._plans = {}  # caches (native plans cannot be copied): rebuilt at the next step
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("_has_dtensors", False)
        self._last_found_inf = None

    # ---- configuration ------------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        group = self.param_groups[group_index]
        where = f"param_groups[{group_index}]"
        try:
            _check_hyperparameters(group, where)
            group["adam_w_mode"] = int(group["adam_w_mode"])  # a plain int, so checkpoints load with weights_only
            for index, p in enumerate(group["params"]):
                if p.dtype not in SUPPORTED_PARAM_DTYPES:
                    raise ValueError(
                        f"{_describe(group_index, index, p)}: FusedAdam supports float32, float64, float16 and "
                        f"bfloat16 params; complex or integer params are not supported (use torch.view_as_real for "
                        f"complex ones)"
                    )
                dtensor.check_placements(p, _describe(group_index, index, p))
        except ValueError:
            self.param_groups.pop()
            raise
        self._has_dtensors = self._has_dtensors or any(dtensor.is_dtensor(p) for p in group["params"])
        self._plans.clear()

    def _state_layout(self, p: torch.Tensor) -> tuple[torch.dtype, torch.dtype, bool]:
        """(exp_avg dtype, exp_avg_sq dtype, has master) for a parameter."""
        if p.dtype == torch.float64:
            return torch.float64, torch.float64, False
        has_master = self.master_weights and p.dtype in LOW_PRECISION
        default = torch.float32 if has_master else p.dtype
        return self.exp_avg_dtype or default, self.exp_avg_sq_dtype or default, has_master

    def _steps_device(self, p: torch.Tensor) -> torch.device:
        # The CPU kernel reads steps on the host; GPU kernels read them on the device (no host sync per step).
        return p.device

    def _init_state(self, p: torch.Tensor, amsgrad: bool) -> dict:
        return self._init_states([p], amsgrad)[0]

    def _init_states(self, params: list[torch.Tensor], amsgrad: bool) -> list[dict]:
        """Fresh states for params. Each kind of state tensor of params sharing (device, dtype) is a view of one
        flat buffer: the kernel then streams through contiguous memory instead of thousands of small allocations,
        whose cold starts cost more than their bytes. Views start 256 bytes apart (times n) from the buffer's start,
        which torch's allocator aligns to 64 bytes, so vector loads stay aligned. DTensor params get states shaped
        like their local pieces."""
        params = [dtensor.local(p) for p in params]
        states: list[dict[str, Any]] = []
        requests: dict[tuple[str, torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            m_dtype, v_dtype, has_master = self._state_layout(p)
            kinds = {"exp_avg": m_dtype, "exp_avg_sq": v_dtype}
            if amsgrad:
                kinds["max_exp_avg_sq"] = v_dtype
            if has_master:
                kinds["master_param"] = torch.float32
            state: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float64, device=self._steps_device(p))}
            for key, dtype in kinds.items():
                requests.setdefault((key, p.device, dtype), []).append(i)
                if dtype == torch.float16:
                    state[key + "_scale"] = torch.ones(_spec.num_blocks(p.numel()), device=p.device)
            states.append(state)
        for (key, device, dtype), indices in requests.items():
            offsets, total = [], 0
            for i in indices:
                offsets.append(total)
                total += -(-params[i].numel() // _STATE_ALIGN) * _STATE_ALIGN
            flat = torch.zeros(total, dtype=dtype, device=device)
            for i, offset in zip(indices, offsets):
                view = flat[offset:offset + params[i].numel()].view(params[i].shape)
                if key == "master_param":
                    view.copy_(params[i].detach())
                states[i][key] = view
        return states

    # ---- the step -----------------------------------------------------------------------------------------------

    def _cached_plan(self, group_index: int, grads: list[Optional[torch.Tensor]]) -> Optional[list[_Bucket]]:
        cached = self._plans.get(group_index)
        if cached is not None and cached.key == self._plan_key(group_index, grads):
            return cached.buckets
        return None

    def _plan_key(self, group_index: int, grads: list[Optional[torch.Tensor]]) -> tuple:
        """What a group's buckets depend on: which params have gradients, and amsgrad (which adds a state list); with
        DTensor params also which local tensors they hold (an engine may give a DTensor a new local tensor, as FSDP2
        does at its lazy init; the buckets hold them, so their ids stay unique while compared)."""
        group = self.param_groups[group_index]
        key = bool(group["amsgrad"]), tuple(g is not None for g in grads)
        if self._has_dtensors:
            key += (tuple(id(dtensor.local(p)) for p in group["params"]),)
        return key

    def _plan(self, group_index: int, grads: list[Optional[torch.Tensor]]) -> list[_Bucket]:
        """Builds and caches this group's buckets (step() reuses them, via _cached_plan, until the set of params
        with gradients changes). Runs only after _validate_step, so it creates state but checks nothing."""
        group = self.param_groups[group_index]
        fresh = [p for p, g in zip(group["params"], grads) if g is not None and not self.state[p]]
        for p, state in zip(fresh, self._init_states(fresh, group["amsgrad"])):
            self.state[p].update(state)
        by_key: dict[tuple, _Bucket] = {}
        for index, p in enumerate(group["params"]):
            if grads[index] is None:
                continue
            state = self.state[p]
            key = (p.device, p.dtype, state["exp_avg"].dtype, state["exp_avg_sq"].dtype, "master_param" in state)
            bucket = by_key.setdefault(key, _Bucket(indices=[], params=[]))
            bucket.indices.append(index)
            bucket.params.append(dtensor.local(p))
        for bucket in by_key.values():
            states = [self.state[group["params"][i]] for i in bucket.indices]
            for key in MOMENT_KEYS + ("master_param",):
                if key == "max_exp_avg_sq" and not group["amsgrad"]:
                    continue
                if key in states[0]:
                    getattr(bucket, key + "s").extend(s[key] for s in states)
                if key + "_scale" in states[0]:
                    getattr(bucket, key + "_scales").extend(s[key + "_scale"] for s in states)
            bucket.steps = torch.stack([s["step"] for s in states]).to(torch.float64)
            for j, s in enumerate(states):
                s["step"] = bucket.steps[j]
        buckets = list(by_key.values())
        for bucket in buckets:
            bucket.whole_group = len(bucket.indices) == len(group["params"])
        # The first bucket's plan also watches the params without a gradient (frozen ones, say): if one gets a
        # gradient, the plans refuse to step and the group is planned again. A group without any gradient has no plan.
        idle = [p for p, g in zip(group["params"], grads) if g is None]
        for bucket in buckets:
            # (a native plan reads each param's .grad itself: a DTensor's local piece has none, its wrapper holds it)
            native = backends.runs_natively(bucket.params[0].device) and not self._has_dtensors
            bucket.native = None if not native else backends.AdamPlan.create(
                bucket.params, bucket.exp_avgs, bucket.exp_avg_sqs, bucket.max_exp_avg_sqs, bucket.master_params,
                bucket.exp_avg_scales, bucket.exp_avg_sq_scales, bucket.max_exp_avg_sq_scales, bucket.steps,
                idle if bucket is buckets[0] else (),
            )
        native = bool(buckets) and all(bucket.native is not None for bucket in buckets) or not group["params"]
        self._plans[group_index] = _GroupPlan(self._plan_key(group_index, grads), buckets, native)
        return buckets

    @staticmethod
    def _check_grad(group_index: int, index: int, p: torch.Tensor, g: torch.Tensor) -> None:
        where = _describe(group_index, index, p)
        if g.layout != torch.strided:
            raise ValueError(f"{where}: its gradient is sparse ({g.layout}); FusedAdam needs dense gradients")
        if g.shape != p.shape:
            raise ValueError(f"{where}: its gradient has shape {tuple(g.shape)}, not the parameter's")
        if g.device != p.device:
            raise ValueError(f"{where}: its gradient is on {g.device}, the parameter on {p.device}")
        if (p.dtype == torch.float64) != (g.dtype == torch.float64) or g.dtype not in SUPPORTED_PARAM_DTYPES:
            raise ValueError(f"{where}: its gradient has dtype {g.dtype}, which cannot update a {p.dtype} param")
        if dtensor.is_dtensor(p) or dtensor.is_dtensor(g):
            dtensor.check_placements(g, f"{where}: its gradient")
            if not (dtensor.is_dtensor(p) and dtensor.is_dtensor(g) and g.device_mesh == p.device_mesh
                    and tuple(g.placements) == tuple(p.placements)):
                raise ValueError(f"{where}: the parameter is {dtensor.describe_layout(p)} but its gradient is "
                                 f"{dtensor.describe_layout(g)}; they must be laid out alike")

    def _validate_step(self, all_grads: list[list[Optional[torch.Tensor]]], check_overlap: bool) -> None:
        """Everything that can make a step fail, checked before the step changes anything (state creation
        included): gradients, amsgrad state, and (when the plans change) parameters that share memory."""
        entries = []
        for group_index, (group, grads) in enumerate(zip(self.param_groups, all_grads)):
            for index, (p, g) in enumerate(zip(group["params"], grads)):
                if g is None:
                    continue
                self._check_grad(group_index, index, p, g)
                state = self.state.get(p)
                p = dtensor.local(p)
                if state and state["exp_avg"].shape != p.shape:
                    raise ValueError(
                        f"{_describe(group_index, index, p)}: its optimizer state was made for shape "
                        f"{tuple(state['exp_avg'].shape)}; a parameter cannot change shape under its optimizer"
                    )
                if state and (state["exp_avg"].dtype == torch.float64) != (p.dtype == torch.float64):
                    raise ValueError(
                        f"{_describe(group_index, index, p)}: its optimizer state is {state['exp_avg'].dtype}; a "
                        "parameter cannot switch to or from float64 under its optimizer (float64 params keep "
                        "float64 states)"
                    )
                if group["amsgrad"] and state and "max_exp_avg_sq" not in state:
                    raise ValueError(
                        f"{_describe(group_index, index, p)}: amsgrad is on but this parameter's state has no "
                        f"max_exp_avg_sq (it was created with amsgrad=False); load a checkpoint made with amsgrad=True"
                    )
                entries.append((group_index, index, p))
        if check_overlap:
            overlap = _find_overlap(entries)
            if overlap is not None:
                a, b = overlap
                if b is None:
                    raise ValueError(
                        f"{_describe(*a)}: its elements overlap in memory (an expand()ed or otherwise self-overlapping "
                        "view); FusedAdam would update the shared elements several times. Give it its own memory, "
                        "e.g. torch.nn.Parameter(t.clone())"
                    )
                raise ValueError(
                    f"{_describe(*a)} and {_describe(*b)} share memory (overlapping views of one storage); FusedAdam "
                    "would update the shared elements twice. Give each parameter its own memory, e.g. "
                    "torch.nn.Parameter(t.clone()); disjoint views of one buffer are fine"
                )

    @property
    def last_found_inf(self) -> Optional[torch.Tensor]:
        """The last step()'s skip flag as a one-element float32 tensor on the params' device (non-zero: skipped),
        or None when no loss scaling or clipping was involved. Reading it never synchronises."""
        return self._last_found_inf

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step() was skipped because of inf/NaN gradients or a non-zero found_inf.

        On CUDA reading this synchronises with the device; step() itself never does.
        """
        return self._last_found_inf is not None and bool(self._last_found_inf.item() != 0)

    @torch.no_grad()
    def step(
        self,
        closure: Optional[Callable[[], Any]] = None,
        *,
        grad_scale: Optional[Union[float, torch.Tensor]] = None,
        found_inf: Optional[torch.Tensor] = None,
    ):
        """Performs one optimization step; see the class docstring for grad_scale and found_inf."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler hands these over as attributes to optimizers with _step_supports_amp_scaling.
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        for group_index, group in enumerate(self.param_groups):
            _check_hyperparameters(group, f"param_groups[{group_index}]")
        if self.capturable:  # checked before anything changes (state creation included), like everything else
            if grad_scale is not None and not isinstance(grad_scale, torch.Tensor):
                raise ValueError("capturable=True: pass grad_scale as a tensor on the params' device (a float is "
                                 "copied to the device at every step, which a CUDA graph cannot capture)")
            for group_index, group in enumerate(self.param_groups):
                lr = group["lr"]
                if isinstance(lr, torch.Tensor):
                    for p in group["params"]:
                        if p.grad is not None and p.device != lr.device:
                            raise ValueError(f"param_groups[{group_index}]: capturable=True needs lr on the params' "
                                             f"device ({p.device}), got a tensor on {lr.device}")

        launches = self._planned_launches()
        if launches is None or not self._launch(launches, grad_scale, found_inf):
            self._launch(self._launches_from_grads(), grad_scale, found_inf)
        return loss

    def _planned_launches(self) -> Optional[list[_Launch]]:
        """The step's launches through native plans, when every group has them; None when the step must read the
        gradients in Python (first step, a group without plans, or a param whose gradient appeared or went away)."""
        # Plans exist only for the native CPU op; the backend can change between steps (ORT_OPTIM_BACKEND).
        if not backends.runs_natively(torch.device("cpu")):
            return None
        launches = []
        for group_index, group in enumerate(self.param_groups):
            cached = self._plans.get(group_index)
            if cached is None or not cached.native:
                return None
            amsgrad, has_grad = cached.key[:2]
            if amsgrad != bool(group["amsgrad"]) or len(has_grad) != len(group["params"]):  # (params appended directly)
                return None
            launches.extend(_Launch(group_index, group, bucket, None) for bucket in cached.buckets)
        # A lone launch checks its gradients itself before writing (in grad_stats when scaled, else in its step);
        # several are all checked first, so that no launch writes before a later one finds a missing or bad gradient.
        if len(launches) > 1:
            try:
                if not all(launch.bucket.native.ready() for launch in launches):
                    return None
            except RuntimeError:
                self._name_offending_param()
                raise
        return launches

    def _launches_from_grads(self) -> list[_Launch]:
        """The step's launches with the gradients read in Python; validates everything and (re)plans as needed."""
        all_grads = [[p.grad for p in group["params"]] for group in self.param_groups]
        cached = [self._cached_plan(group_index, grads) for group_index, grads in enumerate(all_grads)]
        # A failed step must change nothing, so everything is validated before the first write (or state creation).
        # The native CPU op validates its own inputs before writing; when the plans are cached and the step is a single
        # op call, that is enough (its errors are re-raised with the parameter's name). With several calls, a bad
        # input in a later call would surface after earlier calls had written, so Python checks all first.
        stale = any(plan is None for plan in cached)
        calls = [bucket for plan in cached if plan is not None for bucket in plan]
        if stale or len(calls) != 1 or not backends.runs_natively(calls[0].params[0].device):
            self._validate_step(all_grads, check_overlap=stale)
        launches = []
        for group_index, (group, grads) in enumerate(zip(self.param_groups, all_grads)):
            for bucket in cached[group_index] or self._plan(group_index, grads):
                bucket_grads = grads if bucket.whole_group else [grads[i] for i in bucket.indices]
                if self._has_dtensors:
                    bucket_grads = [dtensor.local(g) for g in bucket_grads]
                launches.append(_Launch(group_index, group, bucket, bucket_grads))
        return launches

    def _name_offending_param(self) -> None:
        """Raises the Python-side ValueError that names the parameter behind a native error, if it can find one
        (the op's own messages only know list indices); the caller re-raises the native error otherwise."""
        self._validate_step([[p.grad for p in group["params"]] for group in self.param_groups], check_overlap=False)

    def _launch(self, launches: list[_Launch], grad_scale, found_inf) -> bool:
        """Runs the launches; False (with nothing written) only when a lone plan launch found that the set of params
        with gradients changed, which _planned_launches leaves to it."""
        if not launches:
            self._last_found_inf = None
            reduction = self._reduction()
            if reduction is not None and (grad_scale is not None or self.max_grad_norm is not None):
                # no gradient here, but the other ranks wait for this rank's share, and their skip decision is ours
                device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
                stats = dtensor.all_reduce_stats(torch.zeros(2, device=device), reduction)
                self._last_found_inf = ((stats[1] > 0) | ~torch.isfinite(stats[0])).float().reshape(1)
            return True
        try:
            scaling = self._scaling(launches, grad_scale, found_inf)
        except RuntimeError:
            self._name_offending_param()
            raise
        if scaling is None:
            return False
        inv_grad_scale, found_inf = scaling
        self._last_found_inf = found_inf
        for launch in launches:
            group, bucket = launch.group, launch.bucket
            device = bucket.params[0].device
            lr = group["lr"]
            lr_tensor = lr if isinstance(lr, torch.Tensor) else None
            hyper = dict(
                lr=0.0 if lr_tensor is not None else float(lr), beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                adam_w_mode=int(group["adam_w_mode"]), bias_correction=bool(group["bias_correction"]),
                maximize=bool(group["maximize"]), lr_tensor=lr_tensor,
                inv_grad_scale=None if inv_grad_scale is None else inv_grad_scale[device],
                found_inf=None if found_inf is None else found_inf.to(device, non_blocking=True),
            )
            try:
                if launch.grads is None:
                    if not bucket.native.step(**hyper):
                        return False
                else:
                    backends.adam_step_(
                        bucket.params, launch.grads, bucket.exp_avgs, bucket.exp_avg_sqs, bucket.max_exp_avg_sqs,
                        bucket.master_params, bucket.exp_avg_scales, bucket.exp_avg_sq_scales,
                        bucket.max_exp_avg_sq_scales, bucket.steps, **hyper,
                    )
            except RuntimeError:
                self._name_offending_param()
                raise
        return True

    def _scaling(self, launches: list[_Launch], grad_scale, found_inf):
        """Per-device inverse gradient multiplier (unscale and clip) and the combined skip flag, without host syncs;
        None when a plan launch found that the set of params with gradients changed.

        One grad_stats pass per launch gives the global sum of squares and the inf/NaN check; the Adam pass then
        multiplies each gradient by clip_coef / grad_scale. Two passes over the gradients in all. The per-launch
        sums are added in launch order whether a plan or Python read the gradients, so both give the same bits.
        """
        if grad_scale is None and self.max_grad_norm is None:
            return None, found_inf
        devices = list(dict.fromkeys(launch.bucket.params[0].device for launch in launches))
        main = devices[0]
        reduction = self._reduction()
        per_launch = [self._launch_stats(launch, reduction) for launch in launches]
        if any(stats is None for stats in per_launch):
            return None
        stats = sum(s.to(main, non_blocking=True) for s in per_launch)
        stats = dtensor.all_reduce_stats(stats, reduction)  # the step's one collective, when distributed
        inv = torch.ones((), dtype=torch.float32, device=main)
        if grad_scale is not None:
            scale = grad_scale.to(main, torch.float32) if isinstance(grad_scale, torch.Tensor) else \
                torch.tensor(float(grad_scale), dtype=torch.float32, device=main)
            inv = inv / scale.reshape(())
        # The norm of the unscaled gradients. Unscaling multiplies by 1/grad_scale, which overflows when grad_scale < 1
        # and a gradient is large: every |g| / grad_scale <= norm, so a finite norm proves that unscaling stays finite,
        # and a non-finite one skips the step like an inf gradient (traps.md #14: check after unscaling).
        norm = stats[0].sqrt() * inv
        if self.max_grad_norm is not None:
            clip = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            inv = inv * clip
        skip = ((stats[1] > 0) | ~torch.isfinite(norm)).float()
        if found_inf is not None:
            skip = torch.maximum(skip, (found_inf.to(main).reshape(()) != 0).float())
        per_device = {device: inv.to(device, non_blocking=True).reshape(1) for device in devices}
        return per_device, skip.reshape(1)

    def _reduction(self) -> Optional[dtensor.Reduction]:
        """Where the global norm and skip decision are all-reduced (None: this process decides alone)."""
        if self.process_group is None and not self._has_dtensors:
            return None
        return dtensor.reduction_for((p for group in self.param_groups for p in group["params"]), self.process_group)

    @staticmethod
    def _launch_stats(launch: _Launch, reduction: Optional[dtensor.Reduction]) -> Optional[torch.Tensor]:
        """grad_stats of a launch's gradients, each weighted by 1 / (ranks of the reduction holding it)."""
        if launch.grads is None:  # a native plan: plain params only, all weighted alike
            stats = launch.bucket.native.grad_stats()
            if stats is None or reduction is None:
                return stats
            return stats * dtensor.weight(launch.bucket.params[0], reduction)
        if reduction is None:
            return backends.grad_stats(launch.grads)
        by_weight: dict[float, list[torch.Tensor]] = {}
        for i, g in zip(launch.bucket.indices, launch.grads):
            by_weight.setdefault(dtensor.weight(launch.group["params"][i], reduction), []).append(g)
        return sum(backends.grad_stats(grads) * w for w, grads in by_weight.items())

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clears the gradients; set_to_none defaults to the constructor's set_grad_none (True, as ORT)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    # ---- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch.optim.AdamW's layout in canonical form: fresh tensors, moments and masters unscaled float32
        (float64 for float64 params), a float64 per-parameter ``step``. It loads into FusedAdam with any state
        dtypes, into torch.optim.AdamW, and with ``torch.load(weights_only=True)``. The per-element states of
        DTensor params are DTensors laid out like their params (``step`` stays a plain tensor), which is what
        ``torch.distributed.checkpoint`` saves and reshards."""
        sd = _checkpoint.canonical(super().state_dict())
        if self._has_dtensors:
            params = [p for group in self.param_groups for p in group["params"]]  # torch's ids are these positions
            for index, state in sd["state"].items():
                for key in MOMENT_KEYS + ("master_param",):
                    if key in state:
                        state[key] = dtensor.wrap_like(params[index], state[key])
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a FusedAdam, torch.optim.Adam/AdamW or ORT FusedAdam checkpoint, all or nothing.

        Every entry is checked before anything changes, strictly: group options must have their types (``maximize``,
        ``amsgrad`` and ``bias_correction`` real bools: a ``"False"`` from a JSON/YAML export is refused, not read as
        True; ``adam_w_mode`` an AdamWMode or the int 0/1/2), numbers finite and in range; every parameter id listed
        once; each state a dict of exactly the Adam keys, its ``step`` a whole number in [0, 2**53] (a number or a
        one-element tensor), its moments finite floating-point tensors of the parameter's shape (second moments
        non-negative). A bad entry raises ValueError (bad value) or TypeError (wrong type) naming it, for example
        ``state_dict['state'][3]['step']``, and leaves the optimizer as it was. Then new state tensors are built as
        copies in this optimizer's storage dtypes: the given dict and its tensors are never written to, so loading the
        same dict twice equals loading it once. Missing ``master_param`` entries are taken from the current params.

        Group options missing from the checkpoint keep this optimizer's values (ORT's FusedAdam saves no
        ``adam_w_mode``, ``amsgrad`` or ``maximize``; torch's no ``adam_w_mode``), and ORT's per-group ``step``
        becomes every listed parameter's step. torch's implementation switches (``foreach``, ``fused``, ...) are
        dropped. Other keys (a scheduler's ``initial_lr``, your own tags) are kept, as torch keeps them.

        torch.optim.Adam with ``weight_decay > 0`` is L2 decay with torch's eps placement, which no FusedAdam mode
        reproduces: its checkpoints are refused where that can be told, that is when the group says
        ``decoupled_weight_decay=False`` (torch >= 2.5 saves it). Checkpoints of torch 2.4 and earlier cannot be told
        apart from torch.optim.AdamW's (same keys, same state): they load as decoupled decay with this optimizer's
        ``adam_w_mode``, so know where yours came from. To load such moments deliberately, put ``adam_w_mode`` in the
        checkpoint's groups.
        """
        if self._has_dtensors:
            prepared = self._prepare_local_load(state_dict)
        else:
            prepared = _checkpoint.prepare_load(self.param_groups, state_dict, self._init_state)
        for group, new_group in zip(self.param_groups, prepared.groups):
            params = group["params"]
            group.clear()
            group.update(new_group, params=params)
        self.state.clear()
        self.state.update(prepared.state)
        self._plans.clear()

    def _prepare_local_load(self, state_dict: Any) -> _checkpoint.PreparedLoad:
        """prepare_load for DTensor params: each per-element state (a DTensor in any layout of its param's mesh, or a
        full plain tensor) becomes this rank's piece first, then everything is checked against the local pieces."""
        try:  # only well-formed parts are converted; prepare_load reports whatever is malformed, by entry
            pairs = [(saved_id, p) for saved, group in zip(state_dict["param_groups"], self.param_groups)
                     for saved_id, p in zip(saved["params"], group["params"])]
            local_state = dict(state_dict["state"])
            for saved_id, p in pairs:
                saved = local_state.get(saved_id)
                if not (dtensor.is_dtensor(p) and isinstance(saved, dict)):
                    continue
                saved = dict(saved)
                for key in MOMENT_KEYS + ("master_param",):
                    if isinstance(saved.get(key), torch.Tensor):
                        where = _checkpoint.entry("state", saved_id, key)
                        saved[key] = dtensor.local_like(p, saved[key], where)
                local_state[saved_id] = saved
            state_dict = {**state_dict, "state": local_state}
        except (KeyError, TypeError, AttributeError):
            pass
        locals_ = [{**group, "params": [dtensor.local(p) for p in group["params"]]} for group in self.param_groups]
        prepared = _checkpoint.prepare_load(locals_, state_dict, self._init_state)
        param_of = {id(dtensor.local(p)): p for group in self.param_groups for p in group["params"]}
        prepared.state = {param_of[id(local)]: state for local, state in prepared.state.items()}
        return prepared

    # ---- conversion ---------------------------------------------------------------------------------------------

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **kwargs) -> "FusedAdam":
        """An equivalent FusedAdam (param groups, hyperparameters and state) for a torch.optim.Adam or AdamW.

        Both map to ``AdamWMode.ADAMW_TORCH`` (torch's eps placement), so the result continues exactly as torch
        would. torch.optim.Adam with weight_decay > 0 (L2 decay with torch's eps placement) has no FusedAdam mode
        and is refused rather than converted approximately. Extra keyword arguments (master_weights, ...) are
        passed to the constructor.
        """
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(
                f"FusedAdam.from_optimizer converts torch.optim.Adam and torch.optim.AdamW, got "
                f"{type(optimizer).__name__}"
            )
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        groups = []
        for index, group in enumerate(optimizer.param_groups):
            if group.get("differentiable"):
                raise ValueError(f"param_groups[{index}]: differentiable=True is not supported by FusedAdam")
            if not decoupled and group["weight_decay"] != 0 and not group.get("decoupled_weight_decay", False):
                raise ValueError(
                    f"param_groups[{index}]: torch.optim.Adam with weight_decay={group['weight_decay']} is L2 decay "
                    "with torch's eps placement, which no FusedAdam mode reproduces exactly. Use "
                    "torch.optim.AdamW semantics (AdamWMode.ADAMW_TORCH) or ORT's L2 mode "
                    "(AdamWMode.ADAM_L2_REGULARIZATION, eps outside the bias correction) explicitly."
                )
            groups.append({
                "params": group["params"], "lr": group["lr"], "betas": tuple(group["betas"]), "eps": group["eps"],
                "weight_decay": group["weight_decay"], "amsgrad": group["amsgrad"], "maximize": group["maximize"],
            })
        fused = cls(groups, adam_w_mode=AdamWMode.ADAMW_TORCH, **kwargs)
        torch_state = optimizer.state_dict()
        for group in torch_state["param_groups"]:
            group["adam_w_mode"] = int(AdamWMode.ADAMW_TORCH)
        fused.load_state_dict(torch_state)
        return fused
