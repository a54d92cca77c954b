"""FP16_Optimizer: dynamic loss scaling and fp32 master weights around any optimizer, ONNX Runtime's entry point.

``from ort_optim.fp16_optimizer import FP16_Optimizer`` mirrors ``onnxruntime.training.optim.fp16_optimizer``:
``FP16_Optimizer(optimizer, **kwargs)`` accepts

* any ``torch.optim.Optimizer`` (ours or torch's): the result is an :class:`FP16_Optimizer` wrapper that scales the
  loss, keeps fp32 master weights for fp16/bf16 parameters, unscales and checks the gradients with multi-tensor ops,
  clips, and updates or skips (guides/fp16-optimizer.md);
* a DeepSpeed ZeRO stage 1/2 optimizer (what ``deepspeed.initialize`` returns): its overflow check and gradient-norm
  loops are replaced in place by ort_optim's fused ``grad_stats`` op and the same object is returned, as ORT does
  (see :mod:`ort_optim._deepspeed`);
* an Apex amp optimizer (``_amp_stash``): refused with a pointer to the migration guide (Apex amp was removed
  upstream).

The loss-scale state (scale, growth tracker, hysteresis, overflow flag, skipped-step count) lives in tensors on the
parameters' device, as in ``torch.amp.GradScaler``, so ``step()`` needs no host synchronisation on CUDA when the
inner optimizer can skip on a device flag (FusedAdam, or torch's ``fused=True`` optimizers).
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from . import backends
from .fused_adam import FusedAdam

LOW_PRECISION = (torch.float16, torch.bfloat16)
MIN_SCALE_ACTIONS = ("raise", "clamp")
MIGRATION_GUIDE = ("guides/fp16-optimizer.md, section 'Migrating from Apex amp O2', and the diff in guides/migration.md, "
                   "section '4. Apex amp O2 -> FP16_Optimizer'")
STATE_FORMAT = "ort_optim.FP16_Optimizer/1"
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class LossScaleUnderflowError(FloatingPointError):
    """An overflow happened while the loss scale was already at ``min_scale`` (``min_scale_action='raise'``)."""


# ---- the loss scaler -------------------------------------------------------------------------------------------


class DynamicLossScaler:
    """Dynamic loss-scale policy whose state lives in 0-dim tensors on one device (no host sync to update it).

    Per step, given ``found_inf`` (non-zero when any gradient of any rank was inf/NaN):

    * good step: the growth tracker counts it; when it reaches ``growth_interval`` (consecutive good steps since the
      last overflow), the scale becomes ``min(scale * growth_factor, max_scale)`` (never inf: a growth whose result
      is not finite leaves the scale unchanged), the tracker restarts at 0 and the hysteresis refills. With
      ``consecutive_hysteresis=True`` every good step refills the hysteresis.
    * overflow: the step is skipped and the tracker restarts at 0. If ``hysteresis_left > 1`` it is decremented and
      the scale kept; otherwise the scale becomes ``max(scale * backoff_factor, min_scale)`` (the hysteresis stays
      exhausted until it refills). An overflow that would back off while the scale already equals ``min_scale``
      raises :class:`LossScaleUnderflowError` (``min_scale_action='raise'``) or keeps the scale (``'clamp'``).

    ``hysteresis=1`` (the default) is torch.amp.GradScaler's rule; ``hysteresis=2`` and the refill rules are
    DeepSpeed's (``hysteresis``/``consecutive_hysteresis`` in its fp16 config). With ``dynamic=False`` the scale
    stays at ``init_scale`` (overflowing steps are still skipped and counted).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        min_scale_action: str = "raise",
        dynamic: bool = True,
        device: Optional[torch.device] = None,
    ):
        checks = [
            (init_scale > 0 and math.isfinite(init_scale), "init_scale must be a finite float > 0"),
            (growth_factor > 1.0 and math.isfinite(growth_factor), "growth_factor must be a finite float > 1"),
            (0.0 < backoff_factor < 1.0, "backoff_factor must be in (0, 1)"),
            (isinstance(growth_interval, int) and growth_interval >= 1, "growth_interval must be an int >= 1"),
            (isinstance(hysteresis, int) and hysteresis >= 1, "hysteresis must be an int >= 1"),
            (0.0 < min_scale <= max_scale, "min_scale must be > 0 and <= max_scale"),
            (min_scale <= init_scale <= max_scale, "init_scale must lie in [min_scale, max_scale]"),
            (min_scale_action in MIN_SCALE_ACTIONS, f"min_scale_action must be one of {MIN_SCALE_ACTIONS}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(
                    f"{message} (got init_scale={init_scale!r}, growth_factor={growth_factor!r}, "
                    f"backoff_factor={backoff_factor!r}, growth_interval={growth_interval!r}, "
                    f"hysteresis={hysteresis!r}, min_scale={min_scale!r}, max_scale={max_scale!r}, "
                    f"min_scale_action={min_scale_action!r})"
                )
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = min(float(max_scale), FLOAT32_MAX)
        self.min_scale_action = min_scale_action
        self.dynamic = bool(dynamic)
        self._device = torch.device("cpu") if device is None else torch.device(device)
        self._reset_state()
        self._pending: Optional[tuple[torch.Tensor, Any]] = None  # (pinned host flag, CUDA event), CUDA only

    def _reset_state(self) -> None:
        d = self._device
        self.scale = torch.full((), self.init_scale, dtype=torch.float32, device=d)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=d)
        self.hysteresis_left = torch.full((), self.hysteresis, dtype=torch.int32, device=d)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=d)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=d)  # the last step's decision
        self.underflow = torch.zeros((), dtype=torch.bool, device=d)  # min-scale reached with action 'raise'

    def to(self, device: torch.device) -> "DynamicLossScaler":
        device = torch.device(device)
        for name in ("scale", "growth_tracker", "hysteresis_left", "skipped_steps", "found_inf", "underflow"):
            setattr(self, name, getattr(self, name).to(device))
        self._device = device
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def inv_scale(self) -> torch.Tensor:
        """1/scale as a 0-dim float32 tensor, formed in float64 as torch.amp.GradScaler does."""
        return self.scale.double().reciprocal().float()

    @torch.no_grad()
    def update(self, found_inf: torch.Tensor) -> None:
        """Applies one step's outcome (a 0-dim/1-element tensor, non-zero = overflow) with device-side ops only."""
        bad = found_inf.to(self._device, torch.float32).reshape(()) != 0
        good = ~bad
        self.found_inf.copy_(bad)
        self.skipped_steps.add_(bad.to(torch.int64))
        if not self.dynamic:
            return
        tracker = torch.where(good, self.growth_tracker + 1, torch.zeros_like(self.growth_tracker))
        grow = good & (tracker >= self.growth_interval)
        back = bad & (self.hysteresis_left <= 1)
        at_floor = back & (self.scale <= self.min_scale)

        grown = torch.clamp(self.scale * self.growth_factor, max=self.max_scale)
        grown = torch.where(torch.isfinite(grown) & (grown >= self.scale), grown, self.scale)
        backed = torch.clamp(self.scale * self.backoff_factor, min=self.min_scale)
        new_scale = torch.where(grow, grown, torch.where(back, backed, self.scale))

        refill = good if self.consecutive_hysteresis else grow
        hyst = torch.where(bad & (self.hysteresis_left > 1), self.hysteresis_left - 1, self.hysteresis_left)
        hyst = torch.where(refill, torch.full_like(hyst, self.hysteresis), hyst)

        self.scale.copy_(new_scale)
        self.growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))
        self.hysteresis_left.copy_(hyst)
        if self.min_scale_action == "raise":
            self.underflow.logical_or_(at_floor)

    def check(self, blocking: bool) -> None:
        """Raises LossScaleUnderflowError if an update hit the floor with action 'raise'.

        ``blocking=True`` reads the flag (CPU: a plain memory read). ``blocking=False`` (CUDA) copies it to pinned
        host memory without waiting and reads an earlier copy whose CUDA event has completed: no host sync, and the
        error surfaces at most a step or two after the overflow that caused it.
        """
        if self.min_scale_action != "raise":
            return
        if blocking or self._device.type != "cuda":
            if bool(self.underflow.item()):
                self._raise()
            return
        if self._pending is not None:
            host, event = self._pending
            if event.query():
                self._pending = None
                if bool(host.item()):
                    self._raise()
        if self._pending is None:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(self.underflow, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event)

    def _raise(self) -> None:
        self.underflow.fill_(False)  # raised once per floor hit: a caller who catches it may go on
        self._pending = None  # an in-flight copy may still show the flag just cleared
        raise LossScaleUnderflowError(
            f"gradients overflowed while the loss scale was already at min_scale={self.min_scale:g}: the model "
            "produces inf/NaN gradients at any scale (diverged, or a bug such as log(0)). Lower min_scale, or pass "
            "min_scale_action='clamp' to keep skipping steps at the floor instead of raising."
        )

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain tensors and numbers (loads with torch.load(weights_only=True)). The policy is saved for
        information only: load_state_dict restores the state and keeps the policy this scaler was built with."""
        return {
            "scale": self.scale.detach().to("cpu", copy=True),
            "growth_tracker": self.growth_tracker.detach().to("cpu", copy=True),
            "hysteresis_left": self.hysteresis_left.detach().to("cpu", copy=True),
            "skipped_steps": self.skipped_steps.detach().to("cpu", copy=True),
            "found_inf": self.found_inf.detach().to("cpu", copy=True),
            "policy": {
                "init_scale": self.init_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "hysteresis": self.hysteresis, "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_scale": self.min_scale, "max_scale": self.max_scale, "min_scale_action": self.min_scale_action,
                "dynamic": self.dynamic,
            },
        }

    def validate_state_dict(self, sd: Any) -> None:
        if not isinstance(sd, dict):
            raise ValueError(f"loss_scaler state must be a dict, got {type(sd).__name__}")
        for key in ("scale", "growth_tracker", "hysteresis_left", "skipped_steps"):
            value = sd.get(key)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError(f"loss_scaler state: '{key}' must be a one-element tensor, got {value!r:.80}")
        scale = float(sd["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss_scaler state: 'scale' must be finite and > 0, got {scale}")

    def load_state_dict(self, sd: dict) -> None:
        self.validate_state_dict(sd)
        self.scale.fill_(float(sd["scale"]))
        self.growth_tracker.fill_(int(sd["growth_tracker"]))
        self.hysteresis_left.fill_(int(sd["hysteresis_left"]))
        self.skipped_steps.fill_(int(sd["skipped_steps"]))
        self.found_inf.fill_(float(sd["found_inf"]) if isinstance(sd.get("found_inf"), torch.Tensor) else 0.0)
        self.underflow.fill_(False)
        self._pending = None


# ---- the optimizer wrapper -------------------------------------------------------------------------------------


def _is_deepspeed_object(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "deepspeed"


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


class FP16_Optimizer(torch.optim.Optimizer):  # noqa: N801 (ONNX Runtime's name)
    r"""Mixed-precision optimizer wrapper: dynamic loss scaling and fp32 master weights for fp16/bf16 parameters.

    ``FP16_Optimizer(optimizer, **kwargs)`` (ONNX Runtime's entry point) dispatches on ``optimizer``:

    * a ``torch.optim.Optimizer``: returns an ``FP16_Optimizer`` wrapping it (below);
    * a DeepSpeed ZeRO stage 1/2 optimizer, a DeepSpeed engine, or accelerate's wrapper of one: patches the ZeRO
      optimizer's overflow check and gradient norm with ort_optim's fused op and returns **the object passed in**
      (as ORT does; no kwargs are accepted there). Other DeepSpeed optimizers get one warning and come back
      unchanged;
    * an Apex amp optimizer: ``TypeError`` pointing to the migration guide.

    The wrapper, usage::

        opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-3), max_grad_norm=1.0)
        for x, y in data:
            opt.zero_grad()
            opt.backward(loss_fn(model(x), y))   # (loss * scale).backward()
            opt.step()                           # unscale, check inf/NaN, clip, update or skip, adjust the scale

    Master weights: with :class:`~ort_optim.FusedAdam` inside, its own fp32 masters and fused unscale/skip/clip
    path are used (``master_weights`` is switched on if the optimizer has no state yet, and ``max_grad_norm`` is
    handed to it). Any other optimizer gets fp32 master copies of the fp16/bf16 params swapped into its
    ``param_groups``; ``step()`` copies the model's gradients into fp32 buffers and unscales and checks them in one
    multi-tensor pass (``torch._amp_foreach_non_finite_check_and_unscale_``), runs the optimizer on the masters and
    copies them back (rounded to nearest even). fp32 params are updated in place as usual.

    Args:
        optimizer: the optimizer to wrap (built on the model's parameters).
        init_scale: initial loss scale (default 2**16).
        growth_factor: factor applied after ``growth_interval`` good steps (default 2.0).
        backoff_factor: factor applied on an overflow once the hysteresis is exhausted (default 0.5).
        growth_interval: consecutive good steps, counted from the last overflow, before growing (default 2000).
        hysteresis: overflows tolerated before backing off, each still skipping its step (default 1: back off at
            every overflow, as torch.amp.GradScaler). It refills when the scale grows, or at every good step with
            ``consecutive_hysteresis=True`` (DeepSpeed's rules).
        consecutive_hysteresis: refill the hysteresis at every good step (default False).
        min_scale: the scale never backs off below this (default 1.0, DeepSpeed's default).
        max_scale: the scale never grows above this (default 2**24; growth never produces inf in any case).
        min_scale_action: ``'raise'`` (default, as DeepSpeed): an overflow at ``min_scale`` raises
            :class:`LossScaleUnderflowError`; ``'clamp'``: keep skipping at ``min_scale``.
        dynamic: False keeps the scale at ``init_scale`` (static loss scaling; overflowing steps are still skipped).
        max_grad_norm: clip the unscaled gradients to this global L2 norm (default None: no clipping).
        process_group: data-parallel group over which the overflow flag is all-reduced with MAX before deciding
            (default: the default group when torch.distributed is initialised, else none).
        model_parallel_groups: further groups (tensor/pipeline parallel) over which the flag is MAX-reduced.

    Attributes: ``loss_scale`` (float), ``overflow``/``skipped`` (whether the last step was skipped),
    ``skipped_steps`` (count), ``scaler`` (the :class:`DynamicLossScaler`, device tensors), ``optimizer`` (the
    wrapped one). ``param_groups`` and ``state`` are the wrapped optimizer's, so LR schedulers work on the wrapper.
    Reading ``loss_scale``/``overflow``/``skipped_steps`` synchronises with the device; ``step()`` does not (CUDA,
    with FusedAdam or a torch ``fused=True`` optimizer; other optimizers need one host read of the overflow flag to
    decide whether to call their ``step``, as with torch.amp.GradScaler).
    """

    def __new__(cls, optimizer: Any = None, *args: Any, **kwargs: Any):
        if optimizer is not None and cls is FP16_Optimizer:
            if hasattr(optimizer, "_amp_stash"):
                raise TypeError(
                    "FP16_Optimizer: this optimizer was prepared by Apex amp (it has `_amp_stash`). Apex amp and "
                    "apex.fp16_utils were removed from Apex upstream and are not supported by ort_optim; wrap the "
                    "plain torch optimizer instead (no amp.initialize): FP16_Optimizer(optimizer, ...). See "
                    f"{MIGRATION_GUIDE}."
                )
            from . import _deepspeed

            target = _deepspeed.find_zero_optimizer(optimizer)
            inner = getattr(optimizer, "optimizer", None)
            if target is None and _is_deepspeed_object(inner):
                target = inner  # an engine's or accelerate's wrapper's DeepSpeed optimizer (patched, or a warning)
            if target is not None or _is_deepspeed_object(optimizer):
                if args or kwargs:
                    raise TypeError(
                        "FP16_Optimizer(deepspeed_optimizer) takes no options: DeepSpeed's own loss scaler and "
                        "clipping stay in charge (configure them in the DeepSpeed config); got "
                        f"{sorted(kwargs) or len(args)}"
                    )
                _deepspeed.patch_zero_optimizer(target if target is not None else optimizer)
                return optimizer
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        min_scale_action: str = "raise",
        dynamic: bool = True,
        max_grad_norm: Optional[float] = None,
        process_group: Any = None,
        model_parallel_groups: Sequence[Any] = (),
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"FP16_Optimizer wraps a torch.optim.Optimizer or a DeepSpeed ZeRO stage 1/2 optimizer, got "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
            )
        if isinstance(optimizer, FP16_Optimizer):
            raise TypeError("FP16_Optimizer: this optimizer is already wrapped")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be None or a float > 0, got {max_grad_norm!r}")
        # Not torch.optim.Optimizer.__init__: param_groups and state are the wrapped optimizer's own objects.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self.process_group = process_group
        self.model_parallel_groups = tuple(model_parallel_groups)

        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("FP16_Optimizer: the optimizer has no parameters")
        devices = {p.device for p in params}
        self._main_device = params[0].device
        self.scaler = DynamicLossScaler(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale, max_scale=max_scale, min_scale_action=min_scale_action, dynamic=dynamic,
            device=self._main_device,
        )
        self._fused = isinstance(optimizer, FusedAdam)
        if self._fused:
            self._setup_fused_adam(optimizer, max_grad_norm)
            self.max_grad_norm = optimizer.max_grad_norm
        else:
            self.max_grad_norm = max_grad_norm
            self._setup_masters(optimizer)
        self._devices = sorted(devices, key=str)

    # ---- setup -------------------------------------------------------------------------------------------------

    @staticmethod
    def _setup_fused_adam(optimizer: FusedAdam, max_grad_norm: Optional[float]) -> None:
        low = [p for g in optimizer.param_groups for p in g["params"] if p.dtype in LOW_PRECISION]
        if low and not optimizer.master_weights:
            if any(optimizer.state.get(p) for p in low):
                raise ValueError(
                    "FP16_Optimizer: this FusedAdam already holds state for fp16/bf16 params without fp32 master "
                    "weights; construct it with master_weights=True before the first step"
                )
            optimizer.master_weights = True  # state is created lazily, so the masters start with the first step
        if max_grad_norm is not None:
            if optimizer.max_grad_norm is not None and optimizer.max_grad_norm != max_grad_norm:
                raise ValueError(
                    f"FP16_Optimizer(max_grad_norm={max_grad_norm}) disagrees with the wrapped FusedAdam's "
                    f"max_grad_norm={optimizer.max_grad_norm}; give it in one place"
                )
            optimizer.max_grad_norm = float(max_grad_norm)

    @torch.no_grad()
    def _setup_masters(self, optimizer: torch.optim.Optimizer) -> None:
        """Swaps fp32 master copies of the fp16/bf16 params into the optimizer's param_groups (state moves along)."""
        self._model_params: list[torch.Tensor] = []  # fp16/bf16 model params with a master, in group order
        self._masters: list[torch.Tensor] = []
        self._fp32_params: list[torch.Tensor] = []  # params the optimizer updates directly
        self._grad_buffers: list[Optional[torch.Tensor]] = []
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for index, p in enumerate(group["params"]):
                if id(p) in seen:
                    raise ValueError("FP16_Optimizer: a parameter appears twice in the optimizer's param_groups")
                seen.add(id(p))
                if p.dtype not in LOW_PRECISION:
                    if not p.is_floating_point():
                        raise ValueError(f"FP16_Optimizer: parameter of dtype {p.dtype} is not floating point")
                    self._fp32_params.append(p)
                    continue
                master = p.detach().clone(memory_format=torch.contiguous_format).float()
                group["params"][index] = master
                if p in optimizer.state:  # existing state moves to the master, floating tensors cast to fp32
                    old = optimizer.state.pop(p)
                    optimizer.state[master] = {
                        k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape
                        else v for k, v in old.items()
                    }
                self._model_params.append(p)
                self._masters.append(master)
                self._grad_buffers.append(None)

    # ---- torch.optim.Optimizer surface ------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "FP16_Optimizer.add_param_group is not supported: add the group to the inner optimizer before wrapping"
        )

    def __repr__(self) -> str:
        return f"FP16_Optimizer(scaler={self.scaler.init_scale:g}..., optimizer={self.optimizer!r})"

    def __getstate__(self):
        raise TypeError("FP16_Optimizer is not picklable; save state_dict() instead")

    # ---- public state --------------------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current loss scale (reads a device tensor: synchronises on CUDA)."""
        return float(self.scaler.scale.item())

    @property
    def overflow(self) -> bool:
        """Whether the last step() found inf/NaN gradients and was skipped (synchronises on CUDA)."""
        return bool(self.scaler.found_inf.item() != 0)

    skipped = overflow

    @property
    def skipped_steps(self) -> int:
        """How many step() calls were skipped so far (synchronises on CUDA)."""
        return int(self.scaler.skipped_steps.item())

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters of the fp16/bf16 params (FusedAdam: those created so far), in param_groups order."""
        if self._fused:
            return [self.optimizer.state[p]["master_param"] for g in self.param_groups for p in g["params"]
                    if "master_param" in self.optimizer.state.get(p, {})]
        return list(self._masters)

    # ---- the training step -------------------------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in float32, for callers that run backward themselves."""
        return loss.float() * self.scaler.scale.to(loss.device, non_blocking=True)

    def backward(self, loss: torch.Tensor, retain_graph: Optional[bool] = None, **kwargs: Any) -> None:
        """Backpropagates ``loss * scale`` (gradients accumulate, scaled, until step())."""
        self.scale_loss(loss).backward(retain_graph=retain_graph, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the model's gradients (and the masters', which exist only inside step())."""
        if self._fused:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        for p in self._model_params + self._fp32_params:
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

    def _reduce_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        """MAX over the data-parallel group and the model-parallel groups (all ranks then decide alike)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return found_inf
        groups = [self.process_group] + list(self.model_parallel_groups)
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf

    def _distributed(self) -> bool:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False
        return any(dist.get_world_size(g) > 1 for g in [self.process_group] + list(self.model_parallel_groups))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Unscales, checks inf/NaN (all ranks), clips, and updates or skips; then adjusts the loss scale.

        A closure, if given, is called (with grad enabled) first; it should call ``backward`` itself.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        blocking = self._main_device.type != "cuda"
        if not blocking:
            self.scaler.check(blocking=False)  # a floor hit reported by an earlier step (no host sync)
        checked = self._step_fused() if self._fused else self._step_masters()
        if blocking and not checked:
            self.scaler.check(blocking=True)
        return loss

    # Both update the scaler and return whether they already read its min-scale flag on the host (and raised if set).

    def _step_fused(self) -> bool:
        opt = self.optimizer
        scale = self.scaler.scale
        given = None
        if self._distributed():
            # Our own flag, reduced over the ranks, goes in as found_inf (FusedAdam ORs it with its own check, which
            # also covers a gradient that overflows when unscaled by a scale below 1).
            grads_by_device: dict[torch.device, list[torch.Tensor]] = {}
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        grads_by_device.setdefault(p.grad.device, []).append(p.grad)
            given = torch.zeros((), dtype=torch.float32, device=self._main_device)
            for grads in grads_by_device.values():
                given = torch.maximum(given, backends.grad_stats(grads)[1].to(self._main_device))
            given = self._reduce_found_inf(given.reshape(1)).reshape(())
        opt.step(grad_scale=scale, found_inf=given)
        found = opt.last_found_inf
        if found is None:  # no parameter had a gradient: nothing was (or could be) updated
            found = torch.zeros((), dtype=torch.float32, device=self._main_device) if given is None else given
        self.scaler.update(found.reshape(()))
        return False

    def _step_masters(self) -> bool:
        inv_scale = self.scaler.inv_scale()
        found_inf = torch.zeros((), dtype=torch.float32, device=self._main_device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        copy_src: dict[torch.device, list[torch.Tensor]] = {}
        copy_dst: dict[torch.device, list[torch.Tensor]] = {}
        stepped: list[int] = []
        for i, (p, master) in enumerate(zip(self._model_params, self._masters)):
            g = p.grad
            if g is None:
                master.grad = None
                continue
            if g.is_sparse:
                raise ValueError(f"FP16_Optimizer: sparse gradients are not supported (param of shape {tuple(p.shape)})")
            buf = self._grad_buffers[i]
            if buf is None:
                buf = self._grad_buffers[i] = torch.empty_like(master)
            copy_src.setdefault(g.device, []).append(g)
            copy_dst.setdefault(g.device, []).append(buf)
            by_device.setdefault(g.device, []).append(buf)
            master.grad = buf
            stepped.append(i)
        for p in self._fp32_params:
            if p.grad is not None:
                by_device.setdefault(p.grad.device, []).append(p.grad)
        for device, grads in by_device.items():
            if device in copy_src:
                torch._foreach_copy_(copy_dst[device], copy_src[device])
            dev_found = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, dev_found, inv_scale.to(device))
            if self.scaler.min_scale < 1.0:
                # torch's op checks before multiplying; with 1/scale > 1 the product itself can overflow: check
                # the unscaled values once more (an inv_scale of 1 makes the op check only).
                torch._amp_foreach_non_finite_check_and_unscale_(grads, dev_found, torch.ones((), device=device))
            found_inf = torch.maximum(found_inf, dev_found.to(self._main_device))
        found_inf = self._reduce_found_inf(found_inf.reshape(1)).reshape(())

        if self.max_grad_norm is not None and by_device:
            self._clip(by_device)

        self.scaler.update(found_inf)  # the scale is not needed any more this step
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
            found, underflow = torch.stack([found_inf != 0, self.scaler.underflow.to(found_inf.device)]).tolist()
            checked = True
            raise_now = bool(underflow)
            do_copy = not found
            if do_copy:
                opt.step()
        if do_copy and stepped:
            by_dev_params: dict[torch.device, tuple[list, list]] = {}
            for i in stepped:
                dst, src = by_dev_params.setdefault(self._model_params[i].device, ([], []))
                dst.append(self._model_params[i])
                src.append(self._masters[i])
            for dst, src in by_dev_params.values():
                torch._foreach_copy_(dst, src)
        for master in self._masters:
            master.grad = None
        if raise_now:
            self.scaler.check(blocking=True)  # raises LossScaleUnderflowError (and clears the flag)
        return checked

    def _clip(self, by_device: dict[torch.device, list[torch.Tensor]]) -> None:
        """Scales the (unscaled, fp32) gradients so that their global L2 norm is at most max_grad_norm."""
        total = torch.zeros((), dtype=torch.float32, device=self._main_device)
        for grads in by_device.values():
            norms = torch._foreach_norm(grads, 2.0)
            total = total + torch.stack(norms).float().square().sum().to(self._main_device)
        coef = torch.clamp(self.max_grad_norm / (total.sqrt() + 1e-6), max=1.0)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device))

    # ---- masters -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def refresh_master_params(self) -> None:
        """Copies the model's fp16/bf16 params into their fp32 masters: call it after writing the model's params
        directly (e.g. ``model.load_state_dict`` without the optimizer's checkpoint); otherwise the next step
        would overwrite them with the masters."""
        if self._fused:
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.optimizer.state.get(p)
                    if st and "master_param" in st:
                        st["master_param"].copy_(p.detach())
            return
        for p, master in zip(self._model_params, self._masters):
            master.copy_(p.detach())

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{'format', 'optimizer', 'loss_scaler', 'master_params'}``: the wrapped optimizer's state_dict (whose
        params are the masters; FusedAdam keeps its masters in its own state as ``master_param``), the scaler's
        state and, for other optimizers, one fp32 master per parameter in param_groups order (None for fp32
        params). Tensors and plain values only: loads with ``torch.load(weights_only=True)``."""
        masters: list[Optional[torch.Tensor]] = []
        if not self._fused:
            lookup = {id(m): m for m in self._masters}
            for group in self.param_groups:
                for p in group["params"]:
                    masters.append(lookup[id(p)].detach().clone() if id(p) in lookup else None)
        return {
            "format": STATE_FORMAT,
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.scaler.state_dict(),
            "master_params": masters,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the wrapped optimizer, the scaler and the masters, then writes the masters (rounded) into the
        model's fp16/bf16 params, so resuming equals never stopping. Everything is validated before anything
        changes; the given dict is never modified nor aliased."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not an FP16_Optimizer state_dict (expected 'format': {STATE_FORMAT!r}); to load only the inner "
                "optimizer's checkpoint use fp16_optimizer.optimizer.load_state_dict(...)"
            )
        self.scaler.validate_state_dict(state_dict.get("loss_scaler"))
        masters = state_dict.get("master_params")
        if not self._fused:
            flat = [p for g in self.param_groups for p in g["params"]]
            if not isinstance(masters, list) or len(masters) != len(flat):
                raise ValueError(
                    f"state_dict['master_params'] must list {len(flat)} entries (one per parameter), got "
                    f"{len(masters) if isinstance(masters, list) else type(masters).__name__}"
                )
            lookup = {id(m) for m in self._masters}
            for index, (p, saved) in enumerate(zip(flat, masters)):
                if (id(p) in lookup) != (saved is not None):
                    raise ValueError(
                        f"state_dict['master_params'][{index}]: expected "
                        f"{'an fp32 tensor' if id(p) in lookup else 'None (an fp32 parameter)'}, got {saved!r:.60}"
                    )
                if saved is not None and (not isinstance(saved, torch.Tensor) or saved.shape != p.shape
                                          or not saved.is_floating_point()):
                    raise ValueError(
                        f"state_dict['master_params'][{index}]: expected a floating tensor of shape "
                        f"{tuple(p.shape)}, got {saved!r:.80}"
                    )
        inner = state_dict["optimizer"] if self._fused else _clone_tensors(state_dict["optimizer"])
        self.optimizer.load_state_dict(inner)  # validates before changing anything
        if not self._fused:
            for p, saved in zip([p for g in self.param_groups for p in g["params"]], masters):
                if saved is not None:
                    p.copy_(saved)
            for p, master in zip(self._model_params, self._masters):
                p.copy_(master)
        else:
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.optimizer.state.get(p)
                    if st and "master_param" in st:
                        p.copy_(st["master_param"])
        self.scaler.load_state_dict(state_dict["loss_scaler"])
