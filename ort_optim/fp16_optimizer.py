"""FP16_Optimizer: dynamic loss scaling and fp32 master weights around any optimizer, ONNX Runtime's entry point.

``from ort_optim.fp16_optimizer import FP16_Optimizer`` mirrors ``onnxruntime.training.optim.fp16_optimizer``:
``FP16_Optimizer(optimizer, **kwargs)`` accepts

* any ``torch.optim.Optimizer`` (ours, torch's, DeepSpeed's plain ones such as ``DeepSpeedCPUAdam``): the result is
  an :class:`FP16_Optimizer` wrapper (a torch optimizer to hooks, schedulers and checkpoints) that scales the
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

import inspect
import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from . import backends
from .fused_adam import FusedAdam
from .integrations import dtensor

LOW_PRECISION = (torch.float16, torch.bfloat16)
MIN_SCALE_ACTIONS = ("raise", "clamp")
MIGRATION_GUIDE = ("guides/fp16-optimizer.md, section 'Migrating from Apex amp O2', and the diff in guides/migration.md, "
                   "section '4. Apex amp O2 -> FP16_Optimizer'")
STATE_FORMAT = "ort_optim.FP16_Optimizer/1"
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# Every loss scale (init_scale, min_scale, max_scale and all scales in between) lies in [2**-126, 2**126]: there both
# the scale and 1/scale are normal float32 numbers, so scaling and unscaling lose nothing to subnormals or overflow.
SCALE_RANGE = (2.0**-126, 2.0**126)
INT32_MAX = 2**31 - 1  # the growth tracker and the hysteresis counter are int32 tensors
NO_GRADIENTS = (
    "FP16_Optimizer.step(): no parameter has a gradient, so there is nothing to unscale, check or update (as "
    "torch.amp.GradScaler, which raises 'No inf checks were recorded for this optimizer'). Call "
    "backward(loss) before step(); nothing was changed"
)


class LossScaleUnderflowError(FloatingPointError):
    """An overflow happened while the loss scale was already at ``min_scale`` (``min_scale_action='raise'``)."""


# ---- option checks (each error names the option) ------------------------------------------------------------------


def _float32(value: float) -> float:
    """value rounded to float32 (inf beyond float32's range, 0 below its smallest subnormal)."""
    return float(torch.tensor(value, dtype=torch.float32))


def _float32_toward(value: float, toward: float) -> float:
    """The float32 number nearest to value on the side of toward (value itself when it is a float32 number)."""
    x = _float32(value)
    if x != value and (x > value) == (toward < value):
        x = float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(toward, dtype=torch.float32)))
    return x


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float), got {type(value).__name__} {value!r:.60}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.60}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.60} (a string such as "
                        "'False' would read as true)")
    return value


def _scale_option(name: str, value: Any) -> float:
    value = _real(name, value)
    if not SCALE_RANGE[0] <= value <= SCALE_RANGE[1]:
        raise ValueError(
            f"{name} must lie in [2**-126, 2**126] (so that the scale and 1/scale are both normal float32 numbers), "
            f"got {value!r}"
        )
    return value


def check_max_grad_norm(value: Any) -> Optional[float]:
    """None, or a finite float > 0 that stays > 0 and finite in float32 (the clip coefficient is float32)."""
    if value is None:
        return None
    value = _real("max_grad_norm", value)
    if not (value > 0 and 0 < _float32(value) <= FLOAT32_MAX):
        raise ValueError(f"max_grad_norm must be None or a float > 0 within float32's range, got {value!r}")
    return value


# ---- the loss scaler -------------------------------------------------------------------------------------------

_SCALER_STATE = {  # entry -> (kind, low, high) of the one value each holds
    "scale": ("float", None, None),  # [min_scale, max_scale], checked against this scaler's policy
    "growth_tracker": ("int", 0, INT32_MAX),
    "hysteresis_left": ("int", 1, INT32_MAX),
    "skipped_steps": ("int", 0, 2**63 - 1),
    "found_inf": ("float", 0.0, 1.0),  # 0 or 1: the last step's decision
}


class DynamicLossScaler:
    """Dynamic loss-scale policy whose state lives in 0-dim tensors on one device (no host sync to update it).

    Per step, given ``found_inf`` (non-zero when any gradient of any rank was inf/NaN):

    * good step: the growth tracker counts it; when it reaches ``growth_interval`` (consecutive good steps since the
      last overflow), the scale becomes ``min(scale * growth_factor, max_scale)``, the tracker restarts at 0 and the
      hysteresis refills. With ``consecutive_hysteresis=True`` every good step refills the hysteresis.
    * overflow: the step is skipped and the tracker restarts at 0. If ``hysteresis_left > 1`` it is decremented and
      the scale kept; otherwise the scale becomes ``max(scale * backoff_factor, min_scale)`` (the hysteresis stays
      exhausted until it refills). An overflow that would back off while the scale already equals ``min_scale``
      raises :class:`LossScaleUnderflowError` (``min_scale_action='raise'``) or keeps the scale (``'clamp'``).

    ``hysteresis=1`` (the default) is torch.amp.GradScaler's rule; ``hysteresis=2`` and the refill rules are
    DeepSpeed's (``hysteresis``/``consecutive_hysteresis`` in its fp16 config). With ``dynamic=False`` the scale
    stays at ``init_scale`` (overflowing steps are still skipped and counted).

    Every option is checked at construction against the float32/int32 tensors that hold the state (errors name the
    option): ``init_scale``, ``min_scale`` and ``max_scale`` lie in [2**-126, 2**126] (the scale and 1/scale are then
    normal float32 numbers; the scale never becomes inf or 0), ``min_scale <= init_scale <= max_scale``, and they are
    kept as float32 numbers like the scale (``min_scale`` rounded up, ``max_scale`` down, ``init_scale`` to the
    nearest between them),
    ``growth_factor > 1`` and ``0 < backoff_factor < 1`` also after rounding to float32, ``growth_interval`` and
    ``hysteresis`` ints in [1, 2**31 - 1], ``consecutive_hysteresis`` and ``dynamic`` bools.
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
        init_scale = _scale_option("init_scale", init_scale)
        min_scale = _scale_option("min_scale", min_scale)
        max_scale = _scale_option("max_scale", max_scale)
        if min_scale > max_scale:
            raise ValueError(f"min_scale={min_scale!r} must be <= max_scale={max_scale!r}")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(f"init_scale={init_scale!r} must lie in [min_scale, max_scale] = [{min_scale!r}, "
                             f"{max_scale!r}]")
        # The scale is a float32 tensor, so its bounds are float32 numbers too: min_scale rounds up and max_scale
        # down (the scale never leaves the range given), init_scale to the nearest float32 between them. Without
        # this, init_scale = max_scale = 1.00001 started at 1.0000100136 > max_scale.
        min32, max32 = _float32_toward(min_scale, math.inf), _float32_toward(max_scale, -math.inf)
        if min32 > max32:
            raise ValueError(f"min_scale={min_scale!r} and max_scale={max_scale!r} hold no float32 number between "
                             "them (the scale is a float32 tensor); widen the range")
        min_scale, max_scale = min32, max32
        init_scale = min(max(_float32(init_scale), min_scale), max_scale)
        growth_factor = _real("growth_factor", growth_factor)
        if not 1.0 < _float32(growth_factor) <= FLOAT32_MAX:
            raise ValueError(f"growth_factor must be > 1 in float32 (and finite), got {growth_factor!r}")
        backoff_factor = _real("backoff_factor", backoff_factor)
        if not 0.0 < _float32(backoff_factor) < 1.0:
            raise ValueError(f"backoff_factor must lie in (0, 1) in float32, got {backoff_factor!r}")
        if not isinstance(min_scale_action, str) or min_scale_action not in MIN_SCALE_ACTIONS:
            raise ValueError(f"min_scale_action must be one of {MIN_SCALE_ACTIONS}, got {min_scale_action!r:.60}")
        self.init_scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = _integer("growth_interval", growth_interval, 1, INT32_MAX)
        self.hysteresis = _integer("hysteresis", hysteresis, 1, INT32_MAX)
        self.consecutive_hysteresis = _flag("consecutive_hysteresis", consecutive_hysteresis)
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.min_scale_action = min_scale_action
        self.dynamic = _flag("dynamic", dynamic)
        self._device = torch.device("cpu") if device is None else torch.device(device)
        self._reset_state()
        self._pending: Optional[tuple[torch.Tensor, Any]] = None  # (pinned host flag, CUDA event), CUDA only

    _STATE_NAMES = ("scale", "growth_tracker", "hysteresis_left", "skipped_steps", "found_inf", "underflow")

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
        for name in self._STATE_NAMES:
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
        self._commit(self._next_state(found_inf))

    @torch.no_grad()
    def _next_state(self, found_inf: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state after one step's outcome, as new tensors (nothing changes until _commit): a caller whose step
        can still fail after deciding keeps the scaler as it was."""
        bad = found_inf.to(self._device, torch.float32).reshape(()) != 0
        good = ~bad
        new = {"found_inf": bad.float(), "skipped_steps": self.skipped_steps + bad.to(torch.int64)}
        if not self.dynamic:
            return new
        tracker = torch.where(good, self.growth_tracker + 1, torch.zeros_like(self.growth_tracker))
        grow = good & (tracker >= self.growth_interval)
        back = bad & (self.hysteresis_left <= 1)
        at_floor = back & (self.scale <= self.min_scale)

        grown = torch.clamp(self.scale * self.growth_factor, max=self.max_scale)
        backed = torch.clamp(self.scale * self.backoff_factor, min=self.min_scale)
        new["scale"] = torch.where(grow, grown, torch.where(back, backed, self.scale))

        refill = good if self.consecutive_hysteresis else grow
        hyst = torch.where(bad & (self.hysteresis_left > 1), self.hysteresis_left - 1, self.hysteresis_left)
        new["hysteresis_left"] = torch.where(refill, torch.full_like(hyst, self.hysteresis), hyst)
        new["growth_tracker"] = torch.where(grow, torch.zeros_like(tracker), tracker)
        if self.min_scale_action == "raise":
            new["underflow"] = self.underflow | at_floor
        return new

    def _commit(self, new: dict[str, torch.Tensor]) -> None:
        for name, value in new.items():
            getattr(self, name).copy_(value)

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

    def validate_state_dict(self, sd: Any, where: str = "state_dict") -> dict[str, Any]:
        """The saved state's values as Python numbers, once every entry is checked; raises TypeError/ValueError
        naming the entry (``where[key]``) otherwise. Each entry is a 0-dim tensor (as state_dict() writes them):
        ``scale`` a finite float in [min_scale, max_scale] of this scaler, ``growth_tracker`` an int in
        [0, 2**31), ``hysteresis_left`` an int in [1, 2**31), ``skipped_steps`` an int >= 0, ``found_inf`` 0 or 1;
        ``policy`` (optional, for information) a dict; no other keys."""
        if not isinstance(sd, dict):
            raise TypeError(f"{where} must be a dict (DynamicLossScaler.state_dict()), got {type(sd).__name__}")
        missing = [k for k in _SCALER_STATE if k not in sd]
        extra = [k for k in sd if k not in _SCALER_STATE and k != "policy"]
        if missing or extra:
            raise ValueError(f"{where} must hold exactly {sorted(_SCALER_STATE)} (and optionally 'policy'); "
                             f"missing {missing}, unexpected {extra}")
        if "policy" in sd and not isinstance(sd["policy"], dict):
            raise TypeError(f"{where}['policy'] must be a dict, got {type(sd['policy']).__name__}")
        values: dict[str, Any] = {}
        for key, (kind, low, high) in _SCALER_STATE.items():
            entry, value = f"{where}[{key!r}]", sd[key]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{entry} must be a 0-dim tensor, got {type(value).__name__} {value!r:.60}")
            if value.dim() != 0:
                raise ValueError(f"{entry} must be a 0-dim tensor (one value), got shape {tuple(value.shape)}")
            if kind == "float" and not value.is_floating_point():
                raise TypeError(f"{entry} must be a floating-point tensor, got {value.dtype}")
            if kind == "int" and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
                raise TypeError(f"{entry} must be an integer tensor, got {value.dtype}")
            number = value.item()
            if key == "scale":
                low, high = self.min_scale, self.max_scale
            if not (math.isfinite(number) and low <= number <= high):
                raise ValueError(
                    f"{entry} must be finite and lie in [{low!r}, {high!r}], got {number!r}"
                    + (" (this scaler's min_scale/max_scale; construct it with bounds that include the saved scale)"
                       if key == "scale" else "")
                )
            values[key] = number
        if values["found_inf"] not in (0.0, 1.0):
            raise ValueError(f"{where}['found_inf'] must be 0 or 1, got {values['found_inf']!r}")
        return values

    def load_state_dict(self, sd: dict, where: str = "state_dict") -> None:
        """Restores the state (validated first: nothing changes on an error, which names the entry)."""
        self._load_values(self.validate_state_dict(sd, where))

    def _load_values(self, values: dict[str, Any]) -> None:
        for key, number in values.items():
            getattr(self, key).fill_(number)
        self.underflow.fill_(False)
        self._pending = None


# ---- the optimizer wrapper -------------------------------------------------------------------------------------


def _is_deepspeed_object(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "deepspeed"


def _is_deepspeed_engine_or_zero(obj: Any) -> bool:
    """A DeepSpeed object that is not a torch.optim.Optimizer: an engine, a ZeRO optimizer, DeepSpeed's own
    FP16_Optimizer/BF16_Optimizer. DeepSpeed's plain optimizers (DeepSpeedCPUAdam, deepspeed.ops.adam.FusedAdam,
    FusedLamb, ...) are torch.optim.Optimizers and are wrapped like any other."""
    return _is_deepspeed_object(obj) and not isinstance(obj, torch.optim.Optimizer)


def _fused_adam_inside(obj: Any) -> Optional[FusedAdam]:
    """The FusedAdam with step_in_backward=True that obj is or wraps through ``.optimizer`` (a DeepSpeed engine holds
    its ZeRO or fp16 optimizer there, which holds the client optimizer there; accelerate's wrapper adds a level)."""
    for _ in range(4):
        if isinstance(obj, FusedAdam):
            return obj if obj.step_in_backward else None
        obj = getattr(obj, "optimizer", None)
    return None


def _step_in_backward_refused(what: str) -> ValueError:
    return ValueError(
        f"FP16_Optimizer: {what} has step_in_backward=True, which updates each param during backward, before loss "
        "scaling can unscale and check the gradients (and, inside DeepSpeed, before DeepSpeed reduces them); construct "
        "it with step_in_backward=False (or train in bf16, which needs no loss scaling)")


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


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The local pieces of DTensors (FSDP2, tensor parallel), plain tensors as they are. DTensor has no sharding rule
    for ``_foreach_copy_`` (nor, in torch 2.4, for the unscale-and-check op); between tensors laid out alike (a param
    and its master, a gradient and its buffer) a copy is a copy of the local pieces."""
    return [dtensor.local(t) for t in tensors]


def _step_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step() requires a closure (LBFGS: it re-evaluates the loss several times)."""
    try:
        parameters = list(inspect.signature(type(optimizer).step).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return any(p.name == "closure" and p.default is inspect.Parameter.empty for p in parameters)


def _where(group_index: int, index: int) -> str:
    return f"param_groups[{group_index}]['params'][{index}]"


@dataclass
class _Layout:
    """Which params of the wrapped optimizer's param_groups get an fp32 master (non-FusedAdam optimizers)."""

    ids: list[int]  # id() of every param in param_groups, in order: what the layout was computed from
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (fp16/bf16 model param, master)
    pair_where: list[str] = field(default_factory=list)
    fp32: list[torch.Tensor] = field(default_factory=list)  # params the optimizer updates directly
    fp32_where: list[str] = field(default_factory=list)
    swaps: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # to apply: (gi, j, p, m)


class FP16_Optimizer(torch.optim.Optimizer):  # noqa: N801 (ONNX Runtime's name)
    r"""Mixed-precision optimizer wrapper: dynamic loss scaling and fp32 master weights for fp16/bf16 parameters.

    ``FP16_Optimizer(optimizer, **kwargs)`` (ONNX Runtime's entry point) dispatches on ``optimizer``:

    * a ``torch.optim.Optimizer`` (ours, torch's, or DeepSpeed's plain ones such as ``DeepSpeedCPUAdam``): returns
      an ``FP16_Optimizer`` wrapping it (below);
    * a DeepSpeed ZeRO stage 1/2 optimizer, a DeepSpeed engine, or accelerate's wrapper of one: patches the ZeRO
      optimizer's overflow check and gradient norm with ort_optim's fused op and returns **the object passed in**
      (as ORT does; no kwargs are accepted there). Other DeepSpeed objects that are not torch optimizers (ZeRO 3,
      DeepSpeed's own FP16_Optimizer, ...) get one warning and come back unchanged;
    * an Apex amp optimizer: ``TypeError`` pointing to the migration guide.

    The wrapper, usage::

        opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-3), max_grad_norm=1.0)
        for x, y in data:
            opt.zero_grad()
            opt.backward(loss_fn(model(x), y))   # (loss * scale).backward()
            opt.step()                           # unscale, check inf/NaN, clip, update or skip, adjust the scale

    Master weights: with :class:`~ort_optim.FusedAdam` inside, its own fp32 masters and fused unscale/skip/clip
    path are used (``master_weights`` is switched on, which needs that it holds no fp16/bf16 state without masters
    yet; ``max_grad_norm`` is handed to it). Any other optimizer gets fp32 master copies of the fp16/bf16 params
    swapped into its ``param_groups``; ``step()`` copies the model's gradients into fp32 buffers and unscales and
    checks them in one multi-tensor pass (``torch._amp_foreach_non_finite_check_and_unscale_``), runs the optimizer
    on the masters and copies them back (rounded to nearest even). fp32 params are updated in place as usual.

    Construction is all-or-nothing: every option and every parameter is checked before the wrapped optimizer is
    changed (a TypeError/ValueError names the option or ``param_groups[i]['params'][j]``).

    A torch optimizer, as torch's own: ``register_step_pre_hook``/``register_step_post_hook``, the global
    ``torch.optim.optimizer.register_optimizer_step_pre_hook``/``..._post_hook``, and the state_dict and
    load_state_dict pre/post hooks all fire on the wrapper, with the wrapper as the optimizer argument, at every
    ``step()``, taken or skipped (check ``opt.skipped`` inside a post hook). The wrapped optimizer's own hooks (and
    the global ones, with the wrapped optimizer as argument) fire whenever its ``step()`` runs, as under
    torch.amp.GradScaler: on taken steps, and on every step for optimizers that skip on a device flag (FusedAdam,
    torch's ``fused=True`` optimizers).

    Param groups added after wrapping (``opt.add_param_group``, or ``add_param_group`` on the wrapped optimizer:
    progressive unfreezing) are brought under loss scaling at the next ``step()``, as torch.amp.GradScaler unscales
    every group at step time: fp16/bf16 params get masters, every gradient is unscaled and checked. A param that
    cannot be (not floating point, given twice, a model param whose master is already there) raises, naming it,
    before anything is written.

    Closures: ``step(closure)`` calls the closure once (with grad enabled; it should call ``backward``) before
    unscaling, for optimizers that evaluate the loss once per step. Optimizers whose ``step`` requires a closure
    because they re-evaluate the loss several times per step (LBFGS) are refused at construction: each evaluation
    would need its own unscale and inf check (torch.amp.GradScaler refuses closures altogether).

    Sparse gradients (``nn.Embedding(sparse=True)``), with optimizers that accept them (SGD, SparseAdam, Adagrad):
    as torch.amp.GradScaler, the values are unscaled and checked; fp32 params' sparse gradients are coalesced in
    place first (so the check and the clip see each row once), fp16/bf16 params' are converted to fp32 and then
    coalesced (GradScaler coalesces them in fp16, where summing duplicate rows can overflow). FusedAdam refuses them
    with a ValueError naming the param.

    ``step()`` with no gradient at all raises RuntimeError (as GradScaler), changing nothing; in a distributed run a
    rank without gradients still takes part in the overflow all-reduce and follows the other ranks' decision.

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
        max_scale: the scale never grows above this (default 2**24). Scales lie in [2**-126, 2**126].
        min_scale_action: ``'raise'`` (default, as DeepSpeed): an overflow at ``min_scale`` raises
            :class:`LossScaleUnderflowError`; ``'clamp'``: keep skipping at ``min_scale``.
        dynamic: False keeps the scale at ``init_scale`` (static loss scaling; overflowing steps are still skipped).
        max_grad_norm: clip the unscaled gradients to this global L2 norm (default None: no clipping). It can be
            changed later (``opt.max_grad_norm = 0.5``); with FusedAdam it is FusedAdam's own ``max_grad_norm``.
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
            if target is None and _is_deepspeed_engine_or_zero(inner):
                target = inner  # an engine's or accelerate's wrapper's DeepSpeed optimizer (patched, or a warning)
            if target is not None or _is_deepspeed_engine_or_zero(optimizer):
                if args or kwargs:
                    raise TypeError(
                        "FP16_Optimizer(deepspeed_optimizer) takes no options: DeepSpeed's own loss scaler and "
                        "clipping stay in charge (configure them in the DeepSpeed config); got "
                        f"{sorted(kwargs) or len(args)}"
                    )
                if _fused_adam_inside(optimizer) is not None:
                    raise _step_in_backward_refused(f"the FusedAdam inside this DeepSpeed "
                                                    f"{type(target if target is not None else optimizer).__name__}")
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
        # Everything is checked before the wrapped optimizer is touched: a failed construction leaves it as it was.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"FP16_Optimizer wraps a torch.optim.Optimizer or a DeepSpeed ZeRO stage 1/2 optimizer, got "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
            )
        if isinstance(optimizer, FP16_Optimizer):
            raise TypeError("FP16_Optimizer: this optimizer is already wrapped")
        if _step_needs_closure(optimizer):
            raise TypeError(
                f"FP16_Optimizer: {type(optimizer).__name__}.step requires a closure that re-evaluates the loss "
                "several times per step; loss scaling would need an unscale and an inf check per evaluation, which "
                "FP16_Optimizer does not do (torch.amp.GradScaler refuses closures too). Train this model in fp32 "
                "with this optimizer, or use an optimizer that steps once per backward"
            )
        max_grad_norm = check_max_grad_norm(max_grad_norm)
        try:
            model_parallel_groups = tuple(model_parallel_groups)
        except TypeError:
            raise TypeError(f"model_parallel_groups must be a sequence of process groups, got "
                            f"{type(model_parallel_groups).__name__}") from None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("FP16_Optimizer: the optimizer has no parameters")
        main_device = params[0].device
        scaler = DynamicLossScaler(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale, max_scale=max_scale, min_scale_action=min_scale_action, dynamic=dynamic,
            device=main_device,
        )
        fused = isinstance(optimizer, FusedAdam)
        layout = None
        if fused:
            self._check_fused_adam(optimizer, max_grad_norm)
        else:
            layout = self._plan_layout(optimizer, _Layout(ids=[]))

        # Nothing below can fail: from here on the wrapper and the wrapped optimizer are changed.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # torch's own: step() runs the step pre/post hooks, per instance and global
        self.process_group = process_group
        self.model_parallel_groups = model_parallel_groups
        self._main_device = main_device
        self.scaler = scaler
        self._fused = fused
        self._layout = _Layout(ids=[])
        self._model_of: dict[int, torch.Tensor] = {}  # id(master) -> its model param
        self._grad_buffers: dict[int, torch.Tensor] = {}  # id(master) -> persistent fp32 gradient buffer
        self._max_grad_norm: Optional[float] = None
        self._last_grad_norm: Optional[torch.Tensor] = None  # (the master path's, from its clipping)
        if fused:
            # Also with no fp16/bf16 param yet: groups added later then get masters too. FusedAdam creates state
            # lazily, at a param's first step, so masters start there (no fp16/bf16 param has state: checked above).
            optimizer.master_weights = True
            if max_grad_norm is not None:
                optimizer.max_grad_norm = max_grad_norm
        else:
            self._max_grad_norm = max_grad_norm
            self._apply_layout(layout)
        self._devices = sorted({p.device for p in params}, key=str)

    # ---- setup -------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_fused_adam(optimizer: FusedAdam, max_grad_norm: Optional[float]) -> None:
        if optimizer.step_in_backward:  # (backward(loss) would update every param with the scaled gradients)
            raise _step_in_backward_refused("this FusedAdam")
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

    @staticmethod
    def _plan_layout(optimizer: torch.optim.Optimizer, known: _Layout) -> _Layout:
        """The masters for the current param_groups, reusing those of `known`; checks every param and writes
        nothing (new masters are fresh tensors, swapped in by _apply_layout)."""
        masters = {id(m): p for p, m in known.pairs}  # id(master) -> model param
        fp32 = {id(p) for p in known.fp32}
        layout = _Layout(ids=[id(p) for g in optimizer.param_groups for p in g["params"]])
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
                if id(p) in fp32:
                    layout.fp32.append(p)
                    layout.fp32_where.append(where)
                    continue
                if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                    raise ValueError(f"FP16_Optimizer: {where} has dtype {getattr(p, 'dtype', type(p).__name__)}, "
                                     "not a floating-point type; only floating-point parameters can be trained")
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
        layout.ids = [id(p) for g in self.optimizer.param_groups for p in g["params"]]
        self._layout = layout
        self._model_of = {id(m): p for p, m in layout.pairs}
        self._grad_buffers = {k: v for k, v in self._grad_buffers.items() if k in self._model_of}

    def _sync_layout(self) -> None:
        """Brings params added to (or replaced in) param_groups since the last call under loss scaling; raises,
        naming the param, before anything is written when one cannot be. Cheap when nothing changed."""
        if self._fused:
            return
        ids = [id(p) for g in self.optimizer.param_groups for p in g["params"]]
        if ids != self._layout.ids:
            self._apply_layout(self._plan_layout(self.optimizer, self._layout))

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

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The global L2 norm the unscaled gradients are clipped to (None: no clipping); settable at any time
        (checked: None or a float > 0). With FusedAdam inside it is FusedAdam's own ``max_grad_norm``."""
        return self.optimizer.max_grad_norm if self._fused else self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Optional[float]) -> None:
        value = check_max_grad_norm(value)
        if self._fused:
            self.optimizer.max_grad_norm = value
        else:
            self._max_grad_norm = value

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group to the wrapped optimizer (its own checks and defaults) and brings it under loss scaling:
        fp16/bf16 params get fp32 masters. On an error the group is not added."""
        self.optimizer.add_param_group(param_group)
        try:
            self._sync_layout()
        except Exception:
            self.optimizer.param_groups.pop()
            raise

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
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global L2 norm of the last step()'s unscaled gradients, before clipping, as a 0-dim float32 tensor on
        the main device (no host sync): FusedAdam's own :attr:`~ort_optim.FusedAdam.last_grad_norm` when it is the
        wrapped optimizer (every step: the loss scale goes in as its grad_scale); otherwise the norm the clipping
        computed, so None without max_grad_norm (no pass computes it then). inf or NaN on an overflow."""
        return self.optimizer.last_grad_norm if self._fused else self._last_grad_norm

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
        """The fp32 masters of the fp16/bf16 params created so far, in param_groups order (FusedAdam creates them at a
        param's first step; the wrapper for params of groups added after wrapping at the next step). For DTensor
        params (FSDP2, tensor parallel) each master is a DTensor laid out like its param, whichever optimizer is
        wrapped (FusedAdam keeps the local piece in its state; this is a DTensor view of it)."""
        if self._fused:
            return [dtensor.wrap_like(p, self.optimizer.state[p]["master_param"]) for g in self.param_groups
                    for p in g["params"] if "master_param" in self.optimizer.state.get(p, {})]
        return [m for _, m in self._layout.pairs]

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
        for group in self.param_groups:
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

        A closure, if given, is called once (with grad enabled) first; it should call ``backward`` itself.
        Optimizers that need several evaluations per step (LBFGS) were refused at construction. Runs the step
        pre/post hooks (torch's machinery) on taken and skipped steps alike.
        """
        self._sync_layout()  # groups added since the last step: masters, or an error before anything is written
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
        distributed = self._distributed()
        if not distributed and not any(p.grad is not None for g in opt.param_groups for p in g["params"]):
            raise RuntimeError(NO_GRADIENTS)
        if distributed and opt._reduction() is None:
            # Our own flag, reduced over the ranks, goes in as found_inf (FusedAdam ORs it with its own check, which
            # also covers a gradient that overflows when unscaled by a scale below 1). A FusedAdam over DTensor params
            # or with a process_group decides globally itself, in the all-reduce that also carries its norm.
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
        if found is None:  # no parameter had a gradient on this rank: nothing was (or could be) updated here
            found = torch.zeros((), dtype=torch.float32, device=self._main_device) if given is None else given
        self.scaler.update(found.reshape(()))
        return False

    def _step_masters(self) -> bool:
        layout = self._layout
        self._last_grad_norm = None
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
        if not low_grads and not fp32_grads and not self._distributed():
            raise RuntimeError(NO_GRADIENTS)

        inv_scale = self.scaler.inv_scale()
        found_inf = torch.zeros((), dtype=torch.float32, device=self._main_device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}  # dense tensors to unscale, check and clip in place
        copy_src: dict[torch.device, list[torch.Tensor]] = {}
        copy_dst: dict[torch.device, list[torch.Tensor]] = {}
        stepped = [i for i, _ in low_grads]
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
            if g.layout == torch.sparse_coo and not g.is_coalesced():
                p.grad = g = g.coalesce()  # as GradScaler: each row once, so the check sees what the update adds
            by_device.setdefault(g.device, []).append(g._values() if g.layout == torch.sparse_coo else g)
        try:
            for device, grads in by_device.items():
                if device in copy_src:  # (DTensors: their local pieces, laid out alike: checked above)
                    torch._foreach_copy_(_locals(copy_dst[device]), _locals(copy_src[device]))
                dev_found = torch.zeros((), dtype=torch.float32, device=device)
                # (DTensor gradients: each rank checks its pieces; the flag is all-reduced below)
                pieces = _locals(grads)
                torch._amp_foreach_non_finite_check_and_unscale_(pieces, dev_found, inv_scale.to(device))
                if self.scaler.min_scale < 1.0:
                    # torch's op checks before multiplying; with 1/scale > 1 the product itself can overflow: check
                    # the unscaled values once more (an inv_scale of 1 makes the op check only).
                    torch._amp_foreach_non_finite_check_and_unscale_(pieces, dev_found, torch.ones((), device=device))
                found_inf = torch.maximum(found_inf, dev_found.to(self._main_device))
            found_inf = self._reduce_found_inf(found_inf.reshape(1)).reshape(())

            if self.max_grad_norm is not None and by_device:
                self._clip(by_device)

            # The scaler's next state is decided now and committed once the optimizer has stepped: an optimizer
            # that raises leaves the scale, the counters and the params as they were.
            new_scaler_state = self.scaler._next_state(found_inf)
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
                underflow = new_scaler_state.get("underflow", self.scaler.underflow)
                found, underflow = torch.stack([found_inf != 0, underflow.to(found_inf.device)]).tolist()
                checked = True
                raise_now = bool(underflow)
                do_copy = not found
                if do_copy:
                    opt.step()
            self.scaler._commit(new_scaler_state)
            if do_copy and stepped:
                by_dev_params: dict[torch.device, tuple[list, list]] = {}
                for i in stepped:
                    p, master = layout.pairs[i]
                    dst, src = by_dev_params.setdefault(p.device, ([], []))
                    dst.append(p)
                    src.append(master)
                for dst, src in by_dev_params.values():
                    torch._foreach_copy_(_locals(dst), _locals(src))
        finally:
            for i in stepped:
                layout.pairs[i][1].grad = None
        if raise_now:
            self.scaler.check(blocking=True)  # raises LossScaleUnderflowError (and clears the flag)
        return checked

    def _clip(self, by_device: dict[torch.device, list[torch.Tensor]]) -> None:
        """Scales the (unscaled, fp32) gradients so that their global L2 norm is at most max_grad_norm."""
        total = torch.zeros((), dtype=torch.float32, device=self._main_device)
        for grads in by_device.values():
            norms = torch._foreach_norm(grads, 2.0)
            total = total + torch.stack(norms).float().square().sum().to(self._main_device)
        norm = total.sqrt()
        if dtensor.is_dtensor(norm):  # DTensor gradients (FSDP2, TP): their global norm, a plain tensor as elsewhere
            norm = norm.full_tensor()
        self._last_grad_norm = norm
        coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
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
        self._sync_layout()
        for p, master in self._layout.pairs:
            master.copy_(p.detach())

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{'format', 'optimizer', 'loss_scaler', 'master_params'}``: the wrapped optimizer's state_dict (whose
        params are the masters; FusedAdam keeps its masters in its own state as ``master_param``), the scaler's
        state and, for other optimizers, one fp32 master per parameter in param_groups order (None for fp32
        params). Tensors and plain values only: loads with ``torch.load(weights_only=True)``. Runs the
        state_dict pre and post hooks registered on the wrapper, as torch's optimizers do."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        masters: list[Optional[torch.Tensor]] = []
        if not self._fused:
            self._sync_layout()
            for group in self.param_groups:
                for p in group["params"]:
                    masters.append(p.detach().clone() if id(p) in self._model_of else None)
        state_dict = {
            "format": STATE_FORMAT,
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.scaler.state_dict(),
            "master_params": masters,
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _validate_masters(self, saved: Any) -> None:
        where = "state_dict['master_params']"
        if not isinstance(saved, list):
            raise TypeError(f"{where} must be a list, got {type(saved).__name__}")
        if self._fused:
            if saved:
                raise ValueError(f"{where} must be empty with FusedAdam inside (its masters are in its own state as "
                                 f"'master_param'); this checkpoint holds {len(saved)} entries, saved by an "
                                 "FP16_Optimizer around another optimizer")
            return
        flat = [p for g in self.param_groups for p in g["params"]]
        if len(saved) != len(flat):
            raise ValueError(f"{where} must list {len(flat)} entries (one per parameter), got {len(saved)}")
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
    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the wrapped optimizer, the scaler and the masters, then writes the masters (rounded) into the
        model's fp16/bf16 params, so resuming equals never stopping. Everything (format, keys, the loss_scaler's
        types, shapes, finite values and ranges, the masters' count, dtypes and shapes) is validated before
        anything changes; an error names the entry (e.g. ``state_dict['loss_scaler']['growth_tracker']``). The
        given dict is never modified nor aliased. Runs the load_state_dict pre and post hooks registered on the
        wrapper, as torch's optimizers do (a pre hook may return a replacement dict)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict (FP16_Optimizer.state_dict()), got "
                            f"{type(state_dict).__name__}")
        state_dict = state_dict.copy()  # shallow, as torch: hooks may edit the top level
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict):
            raise TypeError(f"a load_state_dict pre hook returned {type(state_dict).__name__}, not a dict")
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not an FP16_Optimizer state_dict: state_dict['format'] must be {STATE_FORMAT!r}, got "
                f"{state_dict.get('format')!r:.60}; to load only the inner optimizer's checkpoint use "
                "fp16_optimizer.optimizer.load_state_dict(...)"
            )
        keys = ("format", "optimizer", "loss_scaler", "master_params")
        missing, extra = [k for k in keys if k not in state_dict], [k for k in state_dict if k not in keys]
        if missing or extra:
            raise ValueError(f"state_dict must hold exactly {list(keys)}; missing {missing}, unexpected {extra}")
        if not isinstance(state_dict["optimizer"], dict):
            raise TypeError(f"state_dict['optimizer'] must be a dict (the wrapped optimizer's state_dict), got "
                            f"{type(state_dict['optimizer']).__name__}")
        self._sync_layout()
        scaler_values = self.scaler.validate_state_dict(state_dict["loss_scaler"], "state_dict['loss_scaler']")
        masters = state_dict["master_params"]
        self._validate_masters(masters)

        inner = state_dict["optimizer"] if self._fused else _clone_tensors(state_dict["optimizer"])
        self.optimizer.load_state_dict(inner)  # validates before changing anything
        # Nothing below can fail: every value was checked above.
        if not self._fused:
            for p, saved in zip([p for g in self.param_groups for p in g["params"]], masters):
                if saved is not None:
                    p.copy_(saved)
            for p, master in self._layout.pairs:
                p.copy_(master)
        else:
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.optimizer.state.get(p)
                    if st and "master_param" in st:
                        p.copy_(st["master_param"])
        self.scaler._load_values(scaler_values)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
