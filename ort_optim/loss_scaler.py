"""Dynamic loss scaling: the scale, its growth, backoff and hysteresis, kept in 0-dim tensors on the device.

:class:`DynamicLossScaler` decides, from one step's overflow flag, the loss scale of the next step; it holds no
reference to an optimizer or a model. :class:`~ort_optim.fp16_optimizer.FP16_Optimizer` owns one, as
``torch.amp.GradScaler`` owns its scale: the scaler's state lives in tensors on the parameters' device, so updating
it needs no host synchronisation on CUDA.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch

from ._group_options import finite_number
from ._spec import to_float32

MIN_SCALE_ACTIONS = ("raise", "clamp")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# Every loss scale (init_scale, min_scale, max_scale and all scales in between) lies in [2**-126, 2**126]: there both
# the scale and 1/scale are normal float32 numbers, so scaling and unscaling lose nothing to subnormals or overflow.
SCALE_RANGE = (2.0**-126, 2.0**126)
INT32_MAX = 2**31 - 1  # the growth tracker and the hysteresis counter are int32 tensors


class LossScaleUnderflowError(FloatingPointError):
    """An overflow happened while the loss scale was already at ``min_scale`` (``min_scale_action='raise'``)."""


# ---- option checks (each error names the option) ------------------------------------------------------------------


def _host_float32(value: float) -> torch.Tensor:
    """value as a float32 tensor on the CPU, whatever torch's default device (the rounding is host arithmetic: on
    the meta device it would hold no value, on an accelerator it would cost a sync)."""
    return torch.tensor(value, dtype=torch.float32, device="cpu")


def _float32_toward(value: float, toward: float) -> float:
    """The float32 number nearest to value on the side of toward (value itself when it is a float32 number)."""
    x = to_float32(value)
    if x != value and (x > value) == (toward < value):
        x = float(torch.nextafter(_host_float32(x), _host_float32(toward)))
    return x


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
    value = finite_number(value, name)
    if not SCALE_RANGE[0] <= value <= SCALE_RANGE[1]:
        raise ValueError(
            f"{name} must lie in [2**-126, 2**126] (so that the scale and 1/scale are both normal float32 numbers), "
            f"got {value!r}"
        )
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
    * both products are formed in float64 and rounded once to the float32 scale, as torch.amp.GradScaler's update
      rounds them (a factor such as 0.7 is not rounded to float32 first).

    ``hysteresis=1`` (the default) is torch.amp.GradScaler's rule; ``hysteresis=2`` and the refill rules are
    DeepSpeed's (``hysteresis``/``consecutive_hysteresis`` in its fp16 config). With ``dynamic=False`` the scale
    stays at ``init_scale`` (overflowing steps are still skipped and counted). The scale grows after
    ``growth_interval`` consecutive good steps, as in torch's GradScaler and DeepSpeed 0.16's DynamicLossScaler;
    DeepSpeed 0.19's, and DeepSpeed's own FP16_Optimizer, grow one good step later (their stable interval leaves out
    the first good step after an overflow or the start), so after an overflow (or the start) their
    ``loss_scale_window=N`` first grows after N + 1 good steps, then every N. (Around
    DeepSpeed's own ZeRO optimizers, FP16_Optimizer keeps DeepSpeed's scaler, whatever its release.)

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
            bound = "max_scale" if init_scale > max_scale else "min_scale"
            raise ValueError(f"init_scale={init_scale!r} must lie in [min_scale, max_scale] = [{min_scale!r}, "
                             f"{max_scale!r}]; to start there, pass {bound}={init_scale!r} or "
                             f"{'more' if bound == 'max_scale' else 'less'}")
        # The scale is a float32 tensor, so its bounds are float32 numbers too: min_scale rounds up and max_scale
        # down (the scale never leaves the range given), init_scale to the nearest float32 between them. Without
        # this, init_scale = max_scale = 1.00001 started at 1.0000100136 > max_scale.
        min32, max32 = _float32_toward(min_scale, math.inf), _float32_toward(max_scale, -math.inf)
        if min32 > max32:
            raise ValueError(f"min_scale={min_scale!r} and max_scale={max_scale!r} hold no float32 number between "
                             "them (the scale is a float32 tensor); widen the range")
        min_scale, max_scale = min32, max32
        init_scale = min(max(to_float32(init_scale), min_scale), max_scale)
        growth_factor = finite_number(growth_factor, "growth_factor")
        if not 1.0 < to_float32(growth_factor) <= FLOAT32_MAX:
            raise ValueError(f"growth_factor must be > 1 in float32 (and finite), got {growth_factor!r}")
        backoff_factor = finite_number(backoff_factor, "backoff_factor")
        if not 0.0 < to_float32(backoff_factor) < 1.0:
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

        # The products are formed in float64 and rounded once to float32, as torch.amp.GradScaler's update does: a
        # factor that is not a float32 number (backoff_factor=0.7, growth_factor=1.1) is not rounded to one first.
        # (min_scale and max_scale are float32 numbers, so clamping before or after the rounding is the same.)
        grown = torch.clamp(self.scale.double() * self.growth_factor, max=self.max_scale).float()
        backed = torch.clamp(self.scale.double() * self.backoff_factor, min=self.min_scale).float()
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

    @torch.no_grad()
    def set_scale(self, value: Any, name: str = "scale") -> None:
        """Sets the current loss scale to ``value`` (a real number, finite, in [min_scale, max_scale]; it is kept as
        the nearest float32 number, which stays in that range). The scale tensor is written in place (``fill_``, no
        host sync), so a compiled step that reads it sees the new value. The growth tracker, the hysteresis and the
        counters stay as they are; a dynamic scaler goes on growing and backing off from the new value. Errors
        (TypeError, ValueError) name ``name`` and change nothing."""
        number = finite_number(value, name)
        if not self.min_scale <= number <= self.max_scale:
            raise ValueError(f"{name} must lie in [min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}], "
                             f"got {number!r} (this scaler's bounds; construct FP16_Optimizer with min_scale/max_scale "
                             "that include it)")
        # (min_scale and max_scale are float32 numbers, so the nearest float32 to a value between them is too)
        self.scale.fill_(min(max(to_float32(number), self.min_scale), self.max_scale))

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
            # (host memory, whatever torch's default device)
            host = torch.empty((), dtype=torch.bool, device="cpu", pin_memory=True)
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
        """Restores the state (validated first: nothing changes on an error, which names the entry). The policy
        stays this scaler's: a saved ``hysteresis_left`` above this scaler's ``hysteresis`` (a checkpoint of a
        scaler with more hysteresis) is lowered to it, so that no more overflows are tolerated than this policy
        allows."""
        self._load_values(self.validate_state_dict(sd, where))

    def _load_values(self, values: dict[str, Any]) -> None:
        values = dict(values, hysteresis_left=min(values["hysteresis_left"], self.hysteresis))
        for key, number in values.items():
            getattr(self, key).fill_(number)
        self.underflow.fill_(False)
        self._pending = None
