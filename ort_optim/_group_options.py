"""The one validation of FusedAdam's options: a param group's hyperparameters and flags, the optimizer-wide state
options, and step()'s loss-scaling arguments.

The constructor, ``add_param_group``, ``load_state_dict`` (through ort_optim/_checkpoint.py) and every ``step()``
(and every update made in backward) call :func:`check_group`, so a value is accepted or refused the same way
wherever it comes in (steps and updates through :class:`CheckedGroups`, which validates a group again whenever one
of its options differs, in value or type, from what was last accepted, and at every step while one is a tensor).
Each fault has one exception type and one message, which starts with the entry it is about:

* a value of the wrong type (a string, a bool where a number belongs, a betas element that is a list): TypeError;
* a value of the right type out of range (negative, NaN or inf, a beta outside [0, 1), betas that are not a pair,
  a tensor with more than one element): ValueError.

Numbers are Python's, numpy's or any other ``numbers.Real`` except bool (a ``True`` there is a mistake). As in
torch.optim, ``lr``, each element of ``betas``, ``eps`` and ``weight_decay`` may also be one-element floating-point
tensors: ``lr`` on any device (the kernels read it where it lives), the others on the CPU (the op takes them as host
numbers, read at every step; a tensor on an accelerator would cost a device synchronisation per step and is refused,
saying so). The values of CPU tensors are checked like numbers; an accelerator's lr is not read (no sync).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from ._layout import StateLayout
from ._spec import STATE_DTYPES, AdamWMode, to_float32

# Options of the whole optimizer (the state layout of every param, and the one norm that clips all gradients): a
# param group may repeat the optimizer's own value (torch's ZeroRedundancyOptimizer stores its keyword arguments in
# every group it hands to the optimizer it wraps), and another value there is refused rather than silently ignored.
OPTIMIZER_WIDE_KEYS = ("master_weights", "exp_avg_dtype", "exp_avg_sq_dtype", "max_grad_norm")
DTYPE_OPTIONS = ("exp_avg_dtype", "exp_avg_sq_dtype")
# The optimizer's torch.distributed groups: never in a param group, which is saved with the state_dict (a process
# group cannot be pickled).
PROCESS_GROUP_KEYS = ("process_group", "pipeline_group")
# Group keys of torch.optim.Adam/AdamW that a group may carry (copied in by a wrapper that loads a torch checkpoint
# into the groups directly, as ZeroRedundancyOptimizer does): foreach, fused and capturable choose how torch runs the
# same update and change nothing here; differentiable=True is refused (the step is not differentiable) and
# decoupled_weight_decay must agree with adam_w_mode (it says which decay the moments were trained with).
TORCH_GROUP_KEYS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
BOOL_OPTIONS = ("bias_correction", "amsgrad", "maximize", "stochastic_rounding")
# What every group holds (the constructor's defaults fill them in; stochastic_rounding and its seed default to off).
REQUIRED_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad", "maximize")

Where = Callable[[str], str]


class UnsupportedDtypeError(ValueError, RuntimeError):
    """A dtype FusedAdam does not support: a param's, or a state option's (``master_weight_dtype``,
    ``exp_avg_dtype``, ``exp_avg_sq_dtype``). A ValueError, as every input FusedAdam refuses, and a RuntimeError, as
    TransformerEngine's FusedAdam raises for a master or moment dtype it does not support and apex's, DeepSpeed's and
    ONNX Runtime's FusedAdam for a param dtype they do not support, so that code written against either catches it."""


class WideOptions(NamedTuple):
    """The optimizer's own values of :data:`OPTIMIZER_WIDE_KEYS`, which a param group may only repeat."""

    master_weights: bool
    exp_avg_dtype: Optional[torch.dtype]
    exp_avg_sq_dtype: Optional[torch.dtype]
    max_grad_norm: Optional[float]

    @property
    def layout(self) -> StateLayout:
        """How these options store state: the first three, which decide every param's state layout."""
        return StateLayout(self.master_weights, self.exp_avg_dtype, self.exp_avg_sq_dtype)


def is_number(value: Any) -> bool:
    """A real number, as torch.optim takes them: Python's, numpy's (an LR scheduler's lambda may return
    numpy.float32) or any other numbers.Real; but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def real_number(value: Any, name: str) -> float:
    """The float value of a real number (is_number), as options and checkpoint entries take them: a TypeError naming
    it for another value; an int beyond float64's range reads as inf (with its sign), which float() cannot give."""
    if not is_number(value):
        raise TypeError(f"{name} must be a real number, got {show(value)}")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def finite_number(value: Any, name: str) -> float:
    """A real number's float value (:func:`real_number`), refused with a ValueError naming it where not finite."""
    number = real_number(value, name)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number!r}")
    return number


def show(value: Any) -> str:
    """A short description of a value for an error message."""
    if isinstance(value, torch.Tensor):
        kind = type(value)
        subclass = ("" if kind in (torch.Tensor, torch.nn.Parameter)
                    else f" (a {kind.__module__}.{kind.__qualname__}, a tensor subclass)")
        if value.is_nested:  # (whose shape cannot be read)
            return f"a nested {value.dtype} tensor on {value.device}"
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}{subclass}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def group_where(group_index: int) -> Where:
    """Names a live group's entries: ``param_groups[1]: betas``."""
    return lambda key: f"param_groups[{group_index}]: {key}"


def constructor_where(key: str) -> str:
    return f"FusedAdam: {key}"


def _value(value: Any, name: str, any_device: bool = False) -> Optional[float]:
    """The float value of a hyperparameter (a number or a one-element floating-point tensor); None for a tensor whose
    value is not read here (an accelerator's lr: reading it would synchronise)."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_nested or not value.is_floating_point():
            raise TypeError(f"{name} must be a number or a one-element floating-point tensor, got {show(value)}")
        if value.numel() != 1:
            raise ValueError(f"{name} must hold exactly one number, got {show(value)}")
        if value.device.type != "cpu":
            if any_device:
                if value.is_meta:  # (a checkpoint loaded with map_location="meta": no step can read it)
                    raise ValueError(f"{name} is a tensor on the meta device, which holds no value; pass a float or "
                                     "a tensor with data")
                return None
            raise ValueError(f"{name}: a tensor on {value.device} is not supported (the op reads this value on the "
                             "host at every step, which would synchronise with the device); pass a float or a "
                             "CPU tensor")
        return float(value.detach().reshape(()))
    return real_number(value, name)


def _non_negative(value: Any, name: str, any_device: bool = False) -> None:
    number = _value(value, name, any_device)
    if number is None:
        return
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number!r}")
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number!r}")


def _flag(group: dict, key: str, where: Where) -> None:
    if not isinstance(group[key], bool):  # ("False" from a config file would read as True)
        raise TypeError(f"{where(key)} must be True or False (a bool), got {show(group[key])}; a string such as "
                        "'False' from a JSON/YAML export would read as True")


def wide_option_value(key: str, value: Any) -> Any:
    """An optimizer-wide option's value as a group holds it: a state dtype saved by name (``'torch.uint4'``: a
    checkpoint saves dtypes as their names, which ``torch.load(weights_only=True)`` reads in every torch; torch 2.4
    refuses torch.uint4 itself there) read back as the dtype; every other value as it is."""
    if key in DTYPE_OPTIONS and isinstance(value, str) and value.startswith("torch."):
        dtype = getattr(torch, value[len("torch."):], None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return value


def _is_process_group(value: Any) -> bool:
    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def _check_distributed_keys(group: dict, where: Where) -> None:
    """No torch.distributed group in a param group (see :data:`PROCESS_GROUP_KEYS`)."""
    for key, value in group.items():
        if key == "params" or not ((key in PROCESS_GROUP_KEYS and value is not None) or _is_process_group(value)):
            continue
        option = key if key in PROCESS_GROUP_KEYS else "pipeline_group"
        raise ValueError(
            f"{where(key)} is {show(value)} in a param group, but a process group is an option of the whole "
            "optimizer, and a param group is saved with its state_dict, where a process group cannot be pickled "
            "(ZeroRedundancyOptimizer.consolidate_state_dict would fail on it while the receiving rank waits until "
            f"its timeout). Pass it to the optimizer, FusedAdam(..., {option}=...), and remove it from the group; "
            "under torch's ZeroRedundancyOptimizer, whose ranks step different params of one model, pass "
            "optimizer_class=functools.partial(FusedAdam, pipeline_group=...) instead of a keyword argument of "
            "ZeroRedundancyOptimizer (which it stores in every param group)")


def check_wide_keys(group: dict, where: Where, own: WideOptions) -> None:
    """An optimizer-wide option in a param group: accepted where it is the optimizer's own value."""
    for key in OPTIMIZER_WIDE_KEYS:
        if key not in group:
            continue
        value, mine = wide_option_value(key, group[key]), getattr(own, key)
        if value is mine:  # (bools, None and dtypes are singletons: 1 is not True)
            continue
        if key == "max_grad_norm" and mine is not None and is_number(value) and value == mine:
            continue
        theirs = f"this optimizer's own value ({mine!r}), not {show(group[key])}"
        what = ("it clips the norm of all gradients together" if key == "max_grad_norm"
                else "it decides the state layout of every param")
        raise ValueError(
            f"{where(key)} is set in a param group, but FusedAdam takes it for the whole optimizer ({what}), so a "
            f"param group may only repeat {theirs}: pass {key}= to "
            f"FusedAdam(...) (under torch's ZeroRedundancyOptimizer, as its keyword argument or "
            f"optimizer_class=functools.partial(FusedAdam, {key}=...)) and remove it from the "
            "group (torch's ZeroRedundancyOptimizer copies its own param_groups into FusedAdam's at every step, a "
            f"loaded checkpoint's values among them: set {key} in each of its param_groups too, or build it with the "
            "checkpoint's value); for parameters with other options, use a second FusedAdam")


def differentiable_refused(name: str) -> ValueError:
    """The refusal of differentiable=True wherever it is given (name: the constructor's keyword, a group's entry, the
    group of an optimizer FusedAdam.from_optimizer converts)."""
    return ValueError(f"{name}=True is not supported: the step updates the params in place through its own op, which "
                      "autograd does not differentiate. Set it to False, or use torch.optim.AdamW(differentiable=True) "
                      "to differentiate through optimizer steps")


def torch_adam_l2_refused(name: str, weight_decay: Any, remedy: str) -> ValueError:
    """The refusal of torch.optim.Adam's L2 weight decay wherever it comes in (name: the group's
    decoupled_weight_decay entry, False with weight_decay > 0, in a param group, a checkpoint or an optimizer
    FusedAdam.from_optimizer converts); remedy: what to do there."""
    return ValueError(f"{name}=False with weight_decay={weight_decay!r} is torch.optim.Adam's L2 decay with torch's eps "
                      "placement, which no FusedAdam mode reproduces, so its moments would continue under different "
                      f"math. Train on with torch.optim.Adam, or choose the mode knowingly: {remedy}")


def _check_torch_keys(group: dict, where: Where) -> None:
    """torch.optim.Adam/AdamW's group keys (:data:`TORCH_GROUP_KEYS`), once adam_w_mode and weight_decay passed."""
    if "differentiable" in group:
        _flag(group, "differentiable", where)
        if group["differentiable"]:
            raise differentiable_refused(where("differentiable"))
    if "decoupled_weight_decay" not in group:
        return
    _flag(group, "decoupled_weight_decay", where)
    decoupled = group["decoupled_weight_decay"]
    mode = AdamWMode(int(group["adam_w_mode"]))
    weight_decay = _value(group["weight_decay"], where("weight_decay"))
    if decoupled == (mode != AdamWMode.ADAM_L2_REGULARIZATION) or weight_decay == 0:
        return  # (without weight decay the two decays are the same update)
    if not decoupled:
        raise torch_adam_l2_refused(
            where("decoupled_weight_decay"), weight_decay,
            f"set the group's adam_w_mode (now {mode.name}, which decays decoupled; AdamWMode.ADAMW_TORCH for "
            "decoupled decay, AdamWMode.ADAM_L2_REGULARIZATION for ORT's L2) and its decoupled_weight_decay to match "
            "(True for the decoupled modes, False for ADAM_L2_REGULARIZATION)")
    raise ValueError(
        f"{where('decoupled_weight_decay')} is True with weight_decay={weight_decay!r} (decoupled decay, "
        "torch.optim.AdamW's), while adam_w_mode=ADAM_L2_REGULARIZATION adds the decay to the gradient, so the "
        "moments would continue under different math. Choose the mode knowingly: set the group's adam_w_mode "
        "(AdamWMode.ADAMW_TORCH for torch's decoupled decay) and its decoupled_weight_decay to match (True for the "
        "decoupled modes, False for ADAM_L2_REGULARIZATION)")


def check_group(group: dict, where: Where, options: WideOptions) -> None:
    """Every FusedAdam option of a param group (see the module docstring); where(key) names an entry in errors;
    options: the optimizer's own optimizer-wide options, which a group may repeat. Raises before anything changes;
    changes nothing."""
    for key in REQUIRED_KEYS:
        if key not in group:  # (as torch.optim's add_param_group: a ValueError naming the option)
            raise ValueError(
                f"{where(key)} is missing: a param group needs every option of the optimizer's defaults (a group "
                "appended to optimizer.param_groups directly gets none; add groups with optimizer.add_param_group, "
                "which fills them in)")
    master_weights = options.master_weights
    _check_distributed_keys(group, where)
    check_wide_keys(group, where, options)
    for key in BOOL_OPTIONS:
        if key in group:
            _flag(group, key, where)
    if group.get("stochastic_rounding", False) and master_weights:
        raise stochastic_rounding_refused(where("stochastic_rounding"))
    seed = group.get("stochastic_rounding_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where('stochastic_rounding_seed')} must be an int in [0, 2**64), got {show(seed)}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"{where('stochastic_rounding_seed')} must be an int in [0, 2**64), got {seed!r}")
    _non_negative(group["lr"], where("lr"), any_device=True)
    for key in ("eps", "weight_decay"):
        _non_negative(group[key], where(key))
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where('betas')} must be a pair (beta1, beta2), got {show(betas)}")
    for i, beta in enumerate(betas):
        name = f"{where('betas')}[{i}]"
        number = _value(beta, name)
        if not 0.0 <= number < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {number!r}")
    mode = group["adam_w_mode"]
    if isinstance(mode, bool):  # apex's FusedAdam takes a bool here, with other meanings
        raise ValueError(
            f"{where('adam_w_mode')} must be an AdamWMode (0, 1 or 2), got {mode!r}. apex's adam_w_mode=True "
            "(decoupled decay, eps added to sqrt(v_hat)) is AdamWMode.ADAMW_TORCH; apex's False (L2 decay with "
            "that eps placement) has no FusedAdam mode")
    if not isinstance(mode, int):
        raise TypeError(f"{where('adam_w_mode')} must be an AdamWMode or the int 0, 1 or 2, got {show(mode)}")
    if mode not in tuple(AdamWMode):
        raise ValueError(f"{where('adam_w_mode')} must be an AdamWMode (0, 1 or 2), got {mode!r}")
    _check_torch_keys(group, where)


def hyperparameters(group: dict, traced: bool = False) -> dict:
    """A validated group's hyperparameters as the op's keyword arguments (all but inv_grad_scale, found_inf,
    grad_scale): host floats (CPU tensors read), lr as ``lr_tensor`` when it is a tensor. traced=True leaves beta1,
    beta2 and an lr that is not a tensor at 0.0, for a step traced by torch.compile, which passes them as tensors
    (reading a tensor beta on the host would split its graph, and so would float() of a numpy scalar lr)."""
    lr = group["lr"]
    # (any one-element tensor, as torch.optim takes it; the op reads one of at most one dimension)
    lr_tensor = (lr if lr.dim() <= 1 else lr.reshape(())) if isinstance(lr, torch.Tensor) else None
    beta1, beta2 = (0.0, 0.0) if traced else (float(beta) for beta in group["betas"])
    return dict(
        lr=0.0 if lr_tensor is not None or traced else float(lr), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]), adam_w_mode=int(group["adam_w_mode"]),
        bias_correction=bool(group["bias_correction"]), maximize=bool(group["maximize"]), lr_tensor=lr_tensor,
    )


# The types of option values that signature() compares by value: immutable numbers, whose == with the same type tells
# whether the value changed (True == 1 == 1.0, hence the types beside the values).
_PLAIN_NUMBERS = frozenset((int, float, bool))
# The other keys check_group reads, whose values signature() compares by identity (bools, None, dtypes, a dtype's
# name, process groups: a group that gets one, or another value, is validated again), and ints and floats (a
# max_grad_norm) by value and type: an equal number written again is no change, as for lr.
_OTHER_KEYS = OPTIMIZER_WIDE_KEYS + PROCESS_GROUP_KEYS + ("differentiable", "decoupled_weight_decay")
_MISSING = object()


def checked_entries(group: dict) -> tuple:
    """The entries of a group that :func:`check_group` reads and a step does not otherwise use (the optimizer-wide
    options a group may repeat, process groups, torch's ``differentiable`` and ``decoupled_weight_decay``), as the
    objects they hold (a missing one as a marker): a plan records them, so that a step whose group changed one plans
    again, which validates it (under torch.compile, where the check runs only while tracing, reading them makes them
    part of the guards)."""
    return tuple(group.get(key, _MISSING) for key in _OTHER_KEYS)


def same_checked_entries(a: tuple, b: tuple) -> bool:
    """Two :func:`checked_entries` alike: each the same object, or the same int or float (a ``max_grad_norm``: a
    config or a ZeroRedundancyOptimizer loaded from a checkpoint writes a new float object of the same value, which
    is no change; NaN never equals itself, so it is validated again, and refused)."""
    return all(x is y or (type(x) is type(y) and type(x) in (int, float) and x == y) for x, y in zip(a, b))


def signature(group: dict) -> Optional[tuple]:
    """Everything :func:`check_group` reads from a group, as plain values with their types, to tell whether the group
    changed since it was validated; None when one is not a plain number (a tensor, whose value can change in place;
    a value of another type; a missing key): such a group is validated every time."""
    get = group.get
    betas = get("betas")
    if type(betas) not in (tuple, list) or len(betas) != 2:
        return None
    values = (get("lr"), betas[0], betas[1], get("eps"), get("weight_decay"), get("adam_w_mode"),
              get("bias_correction"), get("maximize"), get("amsgrad"), get("stochastic_rounding", False),
              get("stochastic_rounding_seed", 0))
    types = tuple(map(type, values))
    if not _PLAIN_NUMBERS.issuperset(types) and not all(isinstance(v, (int, float)) for v in values):
        return None
    return values, types, tuple(get(key, _MISSING) for key in _OTHER_KEYS)


def _same_signature(a: tuple, b: tuple) -> bool:
    """Two signatures alike: the numbers equal with their types, the other values alike (same_checked_entries)."""
    return a[:2] == b[:2] and same_checked_entries(a[2], b[2])


class CheckedGroups:
    """The param groups' options as :func:`check_group` last accepted them, and their :func:`hyperparameters`: a
    group is validated again only when its :func:`signature` (or the optimizer's options) changed since, or
    when it has none (a tensor option: validated every time). A group is told by identity (a dict put in its place
    is validated) at its position (which names it in errors)."""

    def __init__(self) -> None:
        # position in param_groups -> (the group, its signature, the optimizer's options, its hyperparameters)
        self._checked: dict[int, tuple] = {}

    def hyperparameters(self, groups: list, options: WideOptions) -> list[dict]:
        """:meth:`of` every group, in order."""
        if len(self._checked) > len(groups):
            self.forget_removed(groups)
        return [self.of(index, group, options) for index, group in enumerate(groups)]

    def forget_removed(self, groups: list) -> None:
        """Drops the entries of groups no longer at their position (removed, or another dict put there), which would
        otherwise keep the removed groups, and their params, alive."""
        self._checked = {index: entry for index, entry in self._checked.items()
                         if index < len(groups) and groups[index] is entry[0]}

    def of(self, index: int, group: dict, options: WideOptions) -> dict:
        """The hyperparameters of ``param_groups[index]`` as the op's keyword arguments (a dict shared between calls:
        not to be written into), validated as :func:`check_group` validates them (raising as it does, naming the
        group, before anything changes), or as they were validated at an earlier call while nothing changed."""
        current = signature(group)  # (check_group and hyperparameters only read the group)
        entry = self._checked.get(index)
        if (current is not None and entry is not None and entry[0] is group and entry[2] == options
                and _same_signature(current, entry[1])):
            return entry[3]
        self._checked.pop(index, None)
        check_group(group, group_where(index), options)
        hyper = hyperparameters(group)
        if current is not None:
            self._checked[index] = (group, current, options, hyper)
        return hyper


def stochastic_rounding_refused(name: str) -> ValueError:
    """The error for stochastic_rounding=True in an optimizer with master weights, whichever way it came in."""
    return ValueError(
        f"{name}=True is for bfloat16 params without master weights (the update is rounded into the param itself); "
        "with master_weights=True the fp32 master keeps the update exactly and there is nothing to round. Set "
        "stochastic_rounding=False for this group (in a checkpoint: in its param_groups) or build the optimizer "
        "with master_weights=False")


# ---- optimizer-wide options and step() arguments --------------------------------------------------------------------


def check_dtype_option(name: str, dtype: Optional[torch.dtype]) -> None:
    if dtype is not None and dtype not in STATE_DTYPES:
        raise UnsupportedDtypeError(
            f"{name} must be None, torch.float32, torch.bfloat16, torch.float16, torch.uint8 (8-bit), torch.uint4 "
            f"(4-bit), torch.float8_e4m3fn or torch.float8_e5m2 (fp8), got {dtype!r}")


def check_optimizer_options(master_weights: Any, master_weight_dtype: Any, exp_avg_dtype: Any, exp_avg_sq_dtype: Any,
                            max_grad_norm: Any, flags: dict) -> None:
    """The constructor's optimizer-wide options (flags: name -> value of the options that must be bools)."""
    if master_weight_dtype is not torch.float32:
        raise UnsupportedDtypeError(
            f"FusedAdam: master_weight_dtype must be torch.float32 (master weights are kept in float32 only), got "
            f"{master_weight_dtype!r}. For less memory than fp32 masters, train bfloat16 params with "
            "stochastic_rounding=True and master_weights=False")
    check_dtype_option("exp_avg_dtype", exp_avg_dtype)
    check_dtype_option("exp_avg_sq_dtype", exp_avg_sq_dtype)
    check_dtype_pair(exp_avg_dtype, exp_avg_sq_dtype)
    check_max_grad_norm(max_grad_norm)
    for name, value in dict(flags, master_weights=master_weights).items():
        check_flag(name, value)


def check_torch_implementation_options(foreach: Any, fused: Any, differentiable: Any) -> None:
    """torch.optim.AdamW's choice of implementation, accepted so that code written for it constructs FusedAdam
    unchanged: ``foreach`` and ``fused`` (None or a bool) choose among torch's implementations of one update, which
    FusedAdam always runs as one multi-tensor kernel, so they change nothing; ``differentiable`` must be False (the
    step updates in place through its op, which autograd does not differentiate)."""
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"FusedAdam: {name} must be None, True or False, got {value!r}")
    check_flag("differentiable", differentiable)
    if differentiable:
        raise differentiable_refused("FusedAdam: differentiable")


def check_positional_order(bias_correction: Any) -> None:
    """The constructor's third positional argument, ``bias_correction`` in ORT's order: a pair there is the betas of
    torch.optim.AdamW's and TransformerEngine's order (params, lr, betas, eps, weight_decay, ...), refused naming the
    order, where the type check alone would speak of bools."""
    if isinstance(bias_correction, (tuple, list)):
        raise TypeError(
            f"FusedAdam: bias_correction must be True or False (a bool), got {show(bias_correction)}: FusedAdam takes "
            "ORT's positional order (params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, "
            "set_grad_none), not torch.optim.AdamW's or TransformerEngine's (params, lr, betas, eps, weight_decay, "
            "...). Pass betas, eps and weight_decay by keyword")


def check_dtype_pair(exp_avg_dtype: Optional[torch.dtype], exp_avg_sq_dtype: Optional[torch.dtype]) -> None:
    """The two moment dtypes together (each checked by check_dtype_option)."""
    if exp_avg_dtype == torch.uint4 and exp_avg_sq_dtype != torch.uint4:
        # (ort_optim._spec.EXP_AVG_RELATIVE: the 4-bit exp_avg holds m / sqrt(v), decoded through exp_avg_sq's codes)
        raise ValueError("exp_avg_dtype=torch.uint4 stores exp_avg relative to a 4-bit second moment (its codes hold "
                         f"m / sqrt(v)): set exp_avg_sq_dtype=torch.uint4 too, got {exp_avg_sq_dtype!r}")


def check_flag(name: str, value: Any) -> None:
    """An optimizer-wide option that must be a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"FusedAdam: {name} must be True or False, got {value!r}")


def check_max_grad_norm(value: Any) -> Optional[float]:
    """max_grad_norm (FusedAdam's and FP16_Optimizer's): None, or a real number > 0 that stays > 0 and finite in
    float32 (the clip coefficient max_grad_norm / norm is float32); returned as a float."""
    if value is None:
        return None
    if not is_number(value):
        raise TypeError(f"max_grad_norm must be None or a real number > 0, got {show(value)}")
    number = finite_number(value, "max_grad_norm")
    if not (number > 0 and 0 < abs(to_float32(number)) < math.inf):
        raise ValueError(f"max_grad_norm must be None or a float > 0 within float32's range, got {value!r}")
    return number


def check_process_group(value: Any, name: str) -> None:
    """A torch.distributed group option: None (see the option's docstring) or a ProcessGroup, as
    ``torch.distributed.new_group`` returns it (``torch.distributed.group.WORLD`` is the default group's)."""
    if value is None or (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        return
    hint = ("; for a DeviceMesh, pass the group of one of its dims (mesh.get_group(dim))"
            if type(value).__name__ == "DeviceMesh" else "")
    raise TypeError(f"{name} must be None or a torch.distributed ProcessGroup (torch.distributed.new_group(ranks), or "
                    f"torch.distributed.group.WORLD), got {show(value)}{hint}")


def check_grad_scale_value(value: float) -> None:
    """grad_scale's value: finite and non-zero in float32 (the op unscales by it there)."""
    if not (math.isfinite(value) and 0.0 != abs(to_float32(value)) != math.inf):
        raise ValueError(f"step(): grad_scale must be finite and non-zero in float32 (the step unscales by it "
                         f"there), got {value!r}")


def check_scaling_arguments(grad_scale: Any, found_inf: Any) -> None:
    """step()'s grad_scale (a real number or a one-element floating-point tensor) and found_inf (a one-element
    tensor), checked before anything changes.
    The op unscales in float32 by a grad_scale that must be finite and non-zero there: a number is checked here, a
    tensor's value by the op on the CPU (reading it here would be a host read per step; a step that plans reads it
    first, so that a refused scale creates or converts no state), on an accelerator nowhere (that would synchronise
    with the device: a zero or non-finite scale skips the step, backends.scaling)."""
    if grad_scale is not None:
        if isinstance(grad_scale, torch.Tensor):
            got = f"got a {grad_scale.dtype} tensor of shape {tuple(grad_scale.shape)}"
            if not grad_scale.is_floating_point():  # (a TypeError, as for an lr tensor of such a dtype)
                raise TypeError(f"step(): grad_scale must be a float or a one-element floating-point tensor, {got}")
            if grad_scale.numel() != 1:
                raise ValueError(f"step(): grad_scale must be a float or a one-element floating-point tensor, {got}")
            if grad_scale.is_meta:
                raise ValueError("step(): grad_scale is a tensor on the meta device, which holds no value")
            value = None  # (read by the op: reading it here would be a host read per step)
        elif not is_number(grad_scale):
            raise TypeError(f"step(): grad_scale must be a float or a one-element tensor, got {grad_scale!r}")
        else:
            value = real_number(grad_scale, "step(): grad_scale")
        if value is not None:
            check_grad_scale_value(value)
    if found_inf is not None and not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"step(): found_inf must be a one-element tensor (non-zero: skip the step), got {found_inf!r}")
    if found_inf is not None and found_inf.numel() != 1:
        raise ValueError(f"step(): found_inf must be a one-element tensor, got shape {tuple(found_inf.shape)}")
    if found_inf is not None and found_inf.is_meta:
        raise ValueError("step(): found_inf is a tensor on the meta device, which holds no value")
