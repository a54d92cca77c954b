"""FP16_Optimizer: dynamic loss scaling and fp32 master weights around any optimizer, ONNX Runtime's entry point.

``from ort_optim.fp16_optimizer import FP16_Optimizer`` mirrors ``onnxruntime.training.optim.fp16_optimizer``:
``FP16_Optimizer(optimizer, **kwargs)`` accepts

* any ``torch.optim.Optimizer`` (ours, torch's, DeepSpeed's plain ones such as ``DeepSpeedCPUAdam``): the result is
  an :class:`FP16_Optimizer` wrapper (a torch optimizer to hooks, schedulers and checkpoints) that scales the
  loss, keeps fp32 master weights for fp16/bf16 parameters, unscales and checks the gradients with multi-tensor ops,
  clips, and updates or skips (guides/fp16-optimizer.md);
* a DeepSpeed ZeRO stage 1, 2 or 3 optimizer (what ``deepspeed.initialize`` returns): its overflow check and
  gradient-norm loops are replaced in place by ort_optim's fused ``grad_stats`` op and the same object is returned, as
  ORT does for stages 1 and 2 (see :mod:`ort_optim.integrations.deepspeed`);
* an Apex amp optimizer (``_amp_stash``): refused with a pointer to the migration guide (Apex amp was removed
  upstream).

The wrapper also takes the API of DeepSpeed's and apex's FP16_Optimizer (the ones ONNX Runtime's patches), so code
written for them runs after swapping the import: their constructor arguments (``static_loss_scale``,
``dynamic_loss_scale``, ``dynamic_loss_args``, ``clip_grad``, ...) map onto ours, ``loss_scale``/``cur_scale`` are
settable, and ``get_lr()``, ``zero_grad(set_grads_to_None=...)`` and ``load_state_dict(sd,
load_optimizer_states=False)`` work; see :class:`FP16_Optimizer` for where and why we differ.

The wrapper is three parts: the loss scale (:class:`~ort_optim.loss_scaler.DynamicLossScaler`, its state in tensors
on the parameters' device, as in ``torch.amp.GradScaler``), one of two ways of keeping the fp32 masters, chosen once
at construction (:mod:`ort_optim._master_weights`: the wrapped FusedAdam keeps them, or the wrapper does for any
other optimizer), and this class, which checks the options, runs torch's step hooks and saves and loads the three.
``step()`` needs no host synchronisation on CUDA when the inner optimizer can skip on a device flag (FusedAdam, or
torch's ``fused=True`` optimizers).
"""

from __future__ import annotations

import inspect
import warnings
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import backends
from ._group_options import check_max_grad_norm, check_process_group, finite_number
from ._master_weights import InnerMasters, WrapperMasters, step_in_backward_refused
from .fused_adam import FusedAdam
from .integrations import deepspeed
from .loss_scaler import (INT32_MAX, SCALE_RANGE, DynamicLossScaler, LossScaleUnderflowError, _flag, _integer,
                          _scale_option)

# (DynamicLossScaler, LossScaleUnderflowError and SCALE_RANGE live in ort_optim.loss_scaler; importable from here too,
# ONNX Runtime's module for FP16_Optimizer)
__all__ = ["FP16_Optimizer", "DynamicLossScaler", "LossScaleUnderflowError", "SCALE_RANGE", "check_max_grad_norm"]

MIGRATION_GUIDE = ("guides/fp16-optimizer.md, section 'Migrating from Apex amp O2', and the diff in guides/migration.md, "
                   "section '4. Apex amp O2 -> FP16_Optimizer'")
STATE_FORMAT = "ort_optim.FP16_Optimizer/1"
# ONNX Runtime's FP16_Optimizer(torch optimizer) warns and returns the optimizer itself, so its users call
# loss.backward(); ours unscales the gradients by 1 / scale, which would shrink unscaled ones by it, silently.
UNSCALED_BACKWARD = (
    "FP16_Optimizer.step(): no loss was scaled through this wrapper since the last step (opt.backward(loss), or "
    "opt.scale_loss(loss).backward()); gradients from a plain loss.backward() are unscaled by 1 / loss_scale all the "
    "same, which makes the update loss_scale times too small. Call opt.backward(loss) instead of loss.backward() "
    "(ONNX Runtime's FP16_Optimizer returned a torch optimizer unwrapped, so code written for it calls "
    "loss.backward())")
# The loss scaler's options, which FP16_Optimizer takes as keywords and hands on: DynamicLossScaler's, with its
# defaults.
_SCALER_OPTIONS = {name: parameter for name, parameter in inspect.signature(DynamicLossScaler).parameters.items()
                   if name != "device"}


# ---- the constructor arguments of DeepSpeed's and apex's FP16_Optimizer ----------------------------------------------

# dynamic_loss_args keys: DeepSpeed's DynamicLossScaler's (init_scale, scale_factor, scale_window, min_scale,
# delayed_shift, consecutive_hysteresis, raise_error_at_min_scale) and apex's LossScaler's (init_scale, scale_factor,
# scale_window, min_loss_scale, max_loss_scale), with the loss scaler's option each one sets.
DYNAMIC_LOSS_ARGS = {
    "init_scale": "init_scale",
    "scale_factor": "growth_factor and backoff_factor (1 / scale_factor)",
    "scale_window": "growth_interval",
    "min_scale": "min_scale",
    "min_loss_scale": "min_scale (None: 2**-126, the smallest scale)",
    "max_loss_scale": "max_scale",
    "delayed_shift": "hysteresis",
    "consecutive_hysteresis": "consecutive_hysteresis",
    "raise_error_at_min_scale": "min_scale_action ('raise' or 'clamp')",
}
# DeepSpeed's and apex's other constructor arguments, refused with what to use instead.
OTHER_DEEPSPEED_APEX_ARGUMENTS = {
    "deepspeed": "DeepSpeed's engine builds its own FP16_Optimizer; pass the optimizer deepspeed.initialize returns "
                 "(FP16_Optimizer(optimizer) patches its ZeRO optimizer) or wrap a plain torch optimizer",
    "mpu": "pass model_parallel_groups=[mpu.get_model_parallel_group()] (the groups over which the overflow flag is "
           "reduced)",
    "timers": "FP16_Optimizer keeps no timers; leave it out",
    "fused_adam_legacy": "ort_optim's FusedAdam is recognised by its type; leave it out",
    "has_moe_layers": "expert-parallel gradient norms are not computed here; leave it out, and use DeepSpeed for MoE "
                      "models",
    "loss_scale_config": "pass the loss scaler's options (init_scale, growth_interval, ...) as keywords",
    "low_precision_dtype": "the params' dtypes decide (fp16 and bf16 both get fp32 masters); leave it out",
}


class _Given:
    """Each loss-scaler option (and max_grad_norm) with the argument that set it, so that two arguments setting the
    same option to different values are refused naming both."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[str, Any]] = {}

    def put(self, option: str, source: str, value: Any) -> None:
        if option in self.values and self.values[option][1] != value:
            other, shown = self.values[option]
            raise ValueError(
                f"FP16_Optimizer: {source} and {other} disagree (they set {option} to {value!r} and {shown!r}); "
                "give one of them, or the same value in both. Nothing was changed")
        self.values.setdefault(option, (source, value))

    def __contains__(self, option: str) -> bool:
        return option in self.values

    def get(self, option: str, default: Any = None) -> Any:
        return self.values[option][1] if option in self.values else default


def _dynamic_loss_args(args: Any, given: _Given, apply: bool) -> None:
    """Checks dynamic_loss_args (each error names the key) and, when ``apply``, puts the options it sets."""
    if args is None:
        return
    if not isinstance(args, dict):
        raise TypeError(f"dynamic_loss_args must be None or a dict, got {type(args).__name__} {args!r:.60}")
    unknown = [k for k in args if k not in DYNAMIC_LOSS_ARGS]
    if unknown:
        raise ValueError(
            f"dynamic_loss_args has unknown keys {unknown}; it takes DeepSpeed's and apex's keys "
            f"{list(DYNAMIC_LOSS_ARGS)}. The loss scaler's own options (init_scale, growth_factor, ...) are "
            "keywords of FP16_Optimizer itself")
    options: list[tuple[str, str, Any]] = []
    for key, value in args.items():
        name = f"dynamic_loss_args[{key!r}]"
        if key == "init_scale":
            options.append(("init_scale", name, _scale_option(name, value)))
        elif key == "scale_factor":
            factor = finite_number(value, name)
            if not factor > 1.0:
                raise ValueError(f"{name} must be > 1 (the scale is multiplied by it on growth and divided by it on "
                                 f"an overflow), got {value!r}")
            options += [("growth_factor", name, factor), ("backoff_factor", name, 1.0 / factor)]
        elif key == "scale_window":
            options.append(("growth_interval", name, _integer(name, value, 1, INT32_MAX)))
        elif key in ("min_scale", "min_loss_scale"):
            floor = SCALE_RANGE[0] if value is None and key == "min_loss_scale" else _scale_option(name, value)
            options.append(("min_scale", name, floor))
        elif key == "max_loss_scale":
            options.append(("max_scale", name, _scale_option(name, value)))
        elif key == "delayed_shift":
            options.append(("hysteresis", name, _integer(name, value, 1, INT32_MAX)))
        elif key == "consecutive_hysteresis":
            options.append(("consecutive_hysteresis", name, _flag(name, value)))
        else:  # raise_error_at_min_scale
            options.append(("min_scale_action", name, "raise" if _flag(name, value) else "clamp"))
    if apply:
        for option, name, value in options:
            given.put(option, name, value)


def _deepspeed_apex_options(scaler_options: dict, max_grad_norm: Any, static_loss_scale: Any,
                            dynamic_loss_scale: Any, dynamic_loss_args: Any, initial_dynamic_scale: Any,
                            clip_grad: Any, verbose: Any) -> tuple[dict, Any]:
    """The loss scaler's options and max_grad_norm, with DeepSpeed's and apex's constructor arguments (None: not
    given) mapped onto them. Everything is checked here, before anything is built; errors name the argument."""
    if all(a is None for a in (static_loss_scale, dynamic_loss_scale, dynamic_loss_args, initial_dynamic_scale,
                               clip_grad, verbose)):
        return scaler_options, max_grad_norm
    # verbose (a bool; an int is read as one) is accepted and not used: FP16_Optimizer prints and logs nothing
    if verbose is not None and not isinstance(verbose, int):
        raise TypeError(f"verbose must be True or False, got {type(verbose).__name__} {verbose!r:.60}")
    given = _Given()
    for option, value in scaler_options.items():
        given.put(option, option, value)
    if max_grad_norm is not None:
        given.put("max_grad_norm", "max_grad_norm", max_grad_norm)
    if clip_grad is not None:
        clip = finite_number(clip_grad, "clip_grad")
        if clip < 0:
            raise ValueError(f"clip_grad must be >= 0 (0: no clipping, as in DeepSpeed), got {clip_grad!r}")
        if clip > 0:
            try:
                check_max_grad_norm(clip)
            except ValueError as error:
                raise ValueError(f"clip_grad={clip_grad!r} (DeepSpeed's max_grad_norm): {error}") from None
        given.put("max_grad_norm", f"clip_grad={clip_grad!r}", clip if clip > 0 else None)

    if dynamic_loss_scale is None and (dynamic_loss_args is not None or initial_dynamic_scale is not None):
        which = "dynamic_loss_args" if dynamic_loss_args is not None else "initial_dynamic_scale"
        raise ValueError(
            f"FP16_Optimizer: {which} is given without dynamic_loss_scale; DeepSpeed and apex then ignore it and use "
            f"a static loss scale (static_loss_scale, default 1.0). Pass dynamic_loss_scale=True to use it (or drop "
            f"it). Nothing was changed")
    if dynamic_loss_scale is not None:
        dynamic = _flag("dynamic_loss_scale", dynamic_loss_scale)
        source = f"dynamic_loss_scale={dynamic}"
    elif static_loss_scale is not None:
        dynamic, source = False, f"static_loss_scale={static_loss_scale!r} (a static scale)"
    else:
        dynamic = None  # (only clip_grad/verbose: the loss scale keeps our defaults)
    if initial_dynamic_scale is not None:
        initial = _scale_option("initial_dynamic_scale", initial_dynamic_scale)
    # dynamic_loss_args is checked in either mode; with a static scale it is not used, as in DeepSpeed and apex
    _dynamic_loss_args(dynamic_loss_args, given, apply=bool(dynamic))
    if dynamic is not None:
        given.put("dynamic", source, dynamic)
    if dynamic:
        # (static_loss_scale is not used, as in DeepSpeed and apex: DeepSpeed's engine and Megatron-LM pass 0 or None
        # there)
        if initial_dynamic_scale is not None:
            given.put("init_scale", "initial_dynamic_scale", initial)
    elif dynamic is False:
        if static_loss_scale is not None:
            given.put("init_scale", "static_loss_scale", _scale_option("static_loss_scale", static_loss_scale))
        elif "init_scale" not in given:
            given.put("init_scale", "static_loss_scale (default 1.0)", 1.0)
    options = {k: v for k, (_, v) in given.values.items() if k != "max_grad_norm"}
    if dynamic is not None and "init_scale" in options:
        # DeepSpeed has no ceiling and apex's is 2**24, and neither has our default floor of 1: bounds nobody gave are
        # widened to include the scale given, which stays inside them.
        scale = options["init_scale"]
        if "max_scale" not in options and scale > _SCALER_OPTIONS["max_scale"].default:
            options["max_scale"] = scale
        if "min_scale" not in options and scale < _SCALER_OPTIONS["min_scale"].default:
            options["min_scale"] = scale
    return options, given.get("max_grad_norm")


def _fused_adam_inside(obj: Any) -> Optional[FusedAdam]:
    """The FusedAdam with step_in_backward=True that obj is or wraps through ``.optimizer`` (a DeepSpeed engine holds
    its ZeRO or fp16 optimizer there, which holds the client optimizer there; accelerate's wrapper adds a level)."""
    for _ in range(4):
        if isinstance(obj, FusedAdam):
            return obj if obj.step_in_backward else None
        obj = getattr(obj, "optimizer", None)
    return None


def _step_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step() requires a closure (LBFGS: it re-evaluates the loss several times)."""
    try:
        parameters = list(inspect.signature(type(optimizer).step).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return any(p.name == "closure" and p.default is inspect.Parameter.empty for p in parameters)


class FP16_Optimizer(torch.optim.Optimizer):  # noqa: N801 (ONNX Runtime's name)
    r"""Mixed-precision optimizer wrapper: dynamic loss scaling and fp32 master weights for fp16/bf16 parameters.

    ``FP16_Optimizer(optimizer, **kwargs)`` (ONNX Runtime's entry point) dispatches on ``optimizer``:

    * a ``torch.optim.Optimizer`` (ours, torch's, or DeepSpeed's plain ones such as ``DeepSpeedCPUAdam``): returns
      an ``FP16_Optimizer`` wrapping it (below);
    * a DeepSpeed ZeRO stage 1, 2 or 3 optimizer, a DeepSpeed engine, or accelerate's wrapper of one: patches the
      ZeRO optimizer's overflow check and gradient norm with ort_optim's fused op and returns **the object passed in**
      (as ORT does; no kwargs are accepted there). Other DeepSpeed objects that are not torch optimizers
      (DeepSpeed's own FP16_Optimizer, BF16_Optimizer, ...) get one warning and come back unchanged;
    * an Apex amp optimizer: ``TypeError`` pointing to the migration guide.

    The wrapper, usage::

        opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-3), max_grad_norm=1.0)
        for x, y in data:
            opt.zero_grad()
            opt.backward(loss_fn(model(x), y))   # (loss * scale).backward()
            opt.step()                           # unscale, check inf/NaN, clip, update or skip, adjust the scale

    Gradients must come from ``opt.backward(loss)`` (or ``opt.scale_loss(loss).backward()``): ``step()`` unscales
    whatever gradients it finds by ``1 / loss_scale``. The first ``step()`` of a wrapper that finds no loss scaled
    through it since the previous step warns (UserWarning): code written for ONNX Runtime's FP16_Optimizer, which
    returns a torch optimizer unwrapped, calls ``loss.backward()``.

    Master weights, one of two ways chosen at construction (:mod:`ort_optim._master_weights`): with
    :class:`~ort_optim.FusedAdam` inside, its own fp32 masters and fused unscale/skip/clip path are used
    (``master_weights`` is switched on, which needs that it holds no fp16/bf16 state without masters yet and no group
    with ``stochastic_rounding=True``; ``max_grad_norm`` is handed to it). Any other optimizer gets fp32 master copies
    of the fp16/bf16 params swapped into its ``param_groups``; ``step()`` copies the model's gradients into fp32
    buffers and unscales and checks them in one multi-tensor pass (``torch._amp_foreach_non_finite_check_and_unscale_``),
    runs the optimizer on the masters and copies them back (rounded to nearest even). fp32 params are updated in place
    as usual.

    A ``step()`` that raises (a step hook of the wrapped optimizer, or its step) leaves the loss scale, its counters
    and the model's params as they were, and a retry equals a step that never failed, as under torch.amp.GradScaler:
    the wrapper remembers which gradients were left unscaled (those FusedAdam wrote back unscaled; for other
    optimizers, the fp32 params' that it unscaled in place) and does not unscale them again
    (:class:`~ort_optim._master_weights.InnerMasters`, :class:`~ort_optim._master_weights.WrapperMasters`). Not inside
    a step traced by torch.compile, with FusedAdam: there every gradient counts as scaled, as a backward leaves it
    (reading the gradients' autograd versions would cut the graph, and keeping them would recompile at every new
    gradient), so a compiled step that raised is retried after a new backward.

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

    Code written for DeepSpeed's or apex's FP16_Optimizer (those ONNX Runtime's FP16_Optimizer patches) runs with
    this one: their constructor arguments are mapped onto ours (below), ``loss_scale`` and DeepSpeed's ``cur_scale``
    are settable, ``get_lr()`` is DeepSpeed's, ``zero_grad(set_grads_to_None=...)`` apex's and
    ``load_state_dict(sd, load_optimizer_states=False)`` DeepSpeed's. Where we differ, and why:

    * defaults: with none of their scaling arguments given the scale is ours, dynamic from 2**16; DeepSpeed and apex
      both default to a static scale of 1.0 (``dynamic_loss_scale=False``), which skips no underflow and is rarely
      what fp16 needs. ``dynamic_loss_scale=True`` without ``dynamic_loss_args`` takes our defaults too (apex's, except
      ``min_scale=1``); DeepSpeed's are ``initial_dynamic_scale=2**32`` and a window of 1000.
    * two arguments that set the same option (``static_loss_scale`` and ``init_scale``, ``clip_grad`` and
      ``max_grad_norm``, ``initial_dynamic_scale`` and ``dynamic_loss_args['init_scale']``, ...) must agree, or
      ValueError names both: DeepSpeed and apex let one win silently.
    * ``dynamic_loss_args`` or ``initial_dynamic_scale`` without ``dynamic_loss_scale`` is refused (DeepSpeed and
      apex use a static scale then, which is almost surely not what was meant); with ``dynamic_loss_scale=False`` they are checked
      and not used, as in DeepSpeed and apex (Megatron-LM passes them so). ``static_loss_scale`` is not used when
      ``dynamic_loss_scale=True`` (DeepSpeed's engine passes 0 there, Megatron-LM None), as in DeepSpeed and apex.
    * a scale given through their arguments outside our default bounds widens the bound nobody gave to include it
      (DeepSpeed has no ceiling; a static scale below 1 needs a lower floor).
    * ``clip_master_grads`` is refused (RuntimeError pointing to ``max_grad_norm``): apex fills fp32 master
      gradients in ``backward``; here they exist only inside ``step()``.
    * ``verbose`` is accepted and not used: FP16_Optimizer prints and logs nothing (read ``overflow``, ``loss_scale``).
    * other DeepSpeed arguments (``deepspeed``, ``mpu``, ``timers``, ...) are refused saying what to use instead
      (``mpu``: ``model_parallel_groups``).

    Args:
        optimizer: the optimizer to wrap (built on the model's parameters).
        init_scale ... dynamic: the loss scaler's options, :class:`DynamicLossScaler`'s (with its defaults):
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
            (default: the default group when torch.distributed is initialised, else none; with a FusedAdam inside
            that all-reduces its own decision, over DTensor params' meshes or its own process_group/pipeline_group,
            that decision's groups).
        model_parallel_groups: further groups (tensor/pipeline parallel) over which the flag is MAX-reduced.
        static_loss_scale: DeepSpeed's and apex's static scale: ``init_scale`` with ``dynamic=False`` (not used with
            ``dynamic_loss_scale=True``). None (the default): not given, here and in the arguments below.
        dynamic_loss_scale: DeepSpeed's and apex's switch: True is ``dynamic=True``, False a static scale
            (``static_loss_scale``, else ``init_scale``, else their default 1.0).
        dynamic_loss_args: with ``dynamic_loss_scale=True``, a dict of DeepSpeed's or apex's scaler arguments:
            ``init_scale``, ``scale_factor`` (``growth_factor``, and ``backoff_factor = 1 / scale_factor``),
            ``scale_window`` (``growth_interval``), ``min_scale`` or apex's ``min_loss_scale`` (None: 2**-126),
            apex's ``max_loss_scale`` (``max_scale``), ``delayed_shift`` (``hysteresis``),
            ``consecutive_hysteresis``, ``raise_error_at_min_scale`` (``min_scale_action`` 'raise'/'clamp').
        initial_dynamic_scale: DeepSpeed's ``init_scale`` for ``dynamic_loss_scale=True``.
        clip_grad: DeepSpeed's ``max_grad_norm`` (0: no clipping).
        verbose: accepted (a bool) and not used.

    Attributes: ``loss_scale`` (float, settable; ``cur_scale`` is DeepSpeed's name for it), ``overflow``/``skipped``
    (whether the last step was skipped), ``skipped_steps`` (count), ``scaler`` (the :class:`DynamicLossScaler`,
    device tensors), ``optimizer`` (the wrapped one). ``param_groups`` and ``state`` are the wrapped optimizer's, so
    LR schedulers work on the wrapper. Reading ``loss_scale``/``overflow``/``skipped_steps`` synchronises with the
    device; ``step()`` does not (CUDA, with FusedAdam or a torch ``fused=True`` optimizer; other optimizers need one host read of the overflow flag to
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
            target = deepspeed.loss_scaling_target(optimizer)
            if target is not None:
                if args or kwargs:
                    raise TypeError(
                        "FP16_Optimizer(deepspeed_optimizer) takes no options: DeepSpeed's own loss scaler and "
                        "clipping stay in charge (configure them in the DeepSpeed config); got "
                        f"{sorted(kwargs) or len(args)}"
                    )
                if _fused_adam_inside(optimizer) is not None:
                    raise step_in_backward_refused(f"the FusedAdam inside this DeepSpeed {type(target).__name__}")
                deepspeed.patch_zero_optimizer(target)
                return optimizer
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: Optional[float] = None,
        process_group: Any = None,
        model_parallel_groups: Sequence[Any] = (),
        static_loss_scale: Optional[float] = None,
        dynamic_loss_scale: Optional[bool] = None,
        dynamic_loss_args: Optional[dict] = None,
        initial_dynamic_scale: Optional[float] = None,
        clip_grad: Optional[float] = None,
        verbose: Optional[bool] = None,
        **scaler_options: Any,
    ):
        # (scaler_options: DynamicLossScaler's keywords, with its defaults; _constructor_signature spells them out)
        # Everything is checked before the wrapped optimizer is touched: a failed construction leaves it as it was.
        unknown = sorted(set(scaler_options) - set(_SCALER_OPTIONS))
        if unknown:
            hints = "".join(f"; {name}: {OTHER_DEEPSPEED_APEX_ARGUMENTS[name]}" for name in unknown
                            if name in OTHER_DEEPSPEED_APEX_ARGUMENTS)
            raise TypeError(f"FP16_Optimizer got unexpected keyword arguments {unknown}: it takes max_grad_norm, "
                            "process_group, model_parallel_groups, the loss scaler's options "
                            f"{list(_SCALER_OPTIONS)} and DeepSpeed's and apex's static_loss_scale, "
                            "dynamic_loss_scale, dynamic_loss_args, initial_dynamic_scale, clip_grad, verbose"
                            f"{hints}")
        scaler_options, max_grad_norm = _deepspeed_apex_options(
            scaler_options, max_grad_norm, static_loss_scale, dynamic_loss_scale, dynamic_loss_args,
            initial_dynamic_scale, clip_grad, verbose)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"FP16_Optimizer wraps a torch.optim.Optimizer or a DeepSpeed ZeRO stage 1, 2 or 3 optimizer, got "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
            )
        if isinstance(optimizer, FP16_Optimizer):
            raise TypeError("FP16_Optimizer: this optimizer is already wrapped (it is an FP16_Optimizer): use it as it "
                            "is, or wrap its .optimizer, which one FP16_Optimizer at a time may wrap")
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
        check_process_group(process_group, "FP16_Optimizer: process_group")
        for index, group in enumerate(model_parallel_groups):  # (None: the default group, as for process_group)
            check_process_group(group, f"FP16_Optimizer: model_parallel_groups[{index}]")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("FP16_Optimizer: the optimizer has no parameters")
        main_device = params[0].device
        scaler = DynamicLossScaler(**scaler_options, device=main_device)
        masters = (InnerMasters if isinstance(optimizer, FusedAdam) else WrapperMasters)(optimizer, max_grad_norm)

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
        self._masters = masters
        self._scaled_since_step = False  # (scale_loss since the last step(): gradients are scaled)
        self._warned_unscaled = False
        masters.apply()
        self._devices = sorted({p.device for p in params}, key=str)

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
        return self._masters.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Optional[float]) -> None:
        self._masters.max_grad_norm = check_max_grad_norm(value)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group to the wrapped optimizer (its own checks and defaults) and brings it under loss scaling:
        fp16/bf16 params get fp32 masters. On an error the group is not added."""
        self.optimizer.add_param_group(param_group)
        try:
            self._masters.sync()
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
        """The current loss scale (reads a device tensor: synchronises on CUDA). Settable, as in DeepSpeed's and
        apex's FP16_Optimizer: ``opt.loss_scale = 1024.0`` sets the current scale (a real number, finite, within the
        scaler's ``[min_scale, max_scale]``, kept as the nearest float32; TypeError/ValueError naming ``loss_scale``
        otherwise, changing nothing). The scale tensor is written in place (no host sync), so compiled steps see it;
        the growth tracker and hysteresis stay as they are, and a dynamic scaler goes on from the new value. Set it
        between ``step()`` and the next backward: gradients already scaled by the old scale are unscaled by the new
        one."""
        return float(self.scaler.scale.item())

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.scaler.set_scale(value, "loss_scale")

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name for :attr:`loss_scale` (read and set alike)."""
        return self.loss_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.scaler.set_scale(value, "cur_scale")

    def get_lr(self) -> Any:
        """The learning rate of the first param group, as DeepSpeed's ``FP16_Optimizer.get_lr()``."""
        return self.optimizer.param_groups[0]["lr"]

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global L2 norm of the last step()'s unscaled gradients, before clipping, as a 0-dim float32 tensor on
        the main device (no host sync): FusedAdam's own :attr:`~ort_optim.FusedAdam.last_grad_norm` when it is the
        wrapped optimizer (every step: the loss scale goes in as its grad_scale); otherwise the norm the clipping
        computed, so None without max_grad_norm (no pass computes it then). inf or NaN on an overflow."""
        return self._masters.last_grad_norm

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
        return self._masters.master_params

    # ---- the training step -------------------------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in float32, for callers that run backward themselves."""
        self._scaled_since_step = True
        return loss.float() * backends.to_device(self.scaler.scale, loss.device)

    def backward(self, loss: torch.Tensor, retain_graph: Optional[bool] = None, **kwargs: Any) -> None:
        """Backpropagates ``loss * scale`` (gradients accumulate, scaled, until step())."""
        self.scale_loss(loss).backward(retain_graph=retain_graph, **kwargs)

    def zero_grad(self, set_to_none: Optional[bool] = None, *, set_grads_to_None: Optional[bool] = None) -> None:
        """Clears the model's gradients (and the masters', which exist only inside step()): sets them to None
        (``set_to_none=True``, the default, as torch's and DeepSpeed's) or zeroes them in place (False).

        ``set_grads_to_None`` is apex's name for ``set_to_none`` (True or False). apex's default is False (zero in
        place); ours stays torch's True when neither is given. Giving both with different values raises ValueError
        naming both, changing nothing."""
        if set_grads_to_None is not None:
            if not isinstance(set_grads_to_None, bool):
                raise TypeError(f"zero_grad(): set_grads_to_None (apex's name for set_to_none) must be True or False, "
                                f"got {type(set_grads_to_None).__name__} {set_grads_to_None!r:.60}")
            if set_to_none is not None and bool(set_to_none) != set_grads_to_None:
                raise ValueError(f"zero_grad(): set_to_none={set_to_none!r} and set_grads_to_None="
                                 f"{set_grads_to_None!r} (apex's name for it) disagree; give one of them")
            set_to_none = set_grads_to_None
        self._masters.zero_grad(True if set_to_none is None else bool(set_to_none))

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> None:
        """apex's ``clip_master_grads``, refused: RuntimeError pointing to ``max_grad_norm``, nothing changed.

        apex fills the fp32 masters' gradients in ``backward`` (unscaled), so code can clip them between backward
        and step. Here they exist only inside ``step()``: with FusedAdam inside, its fused pass unscales the fp16
        gradients on the fly and never writes fp32 ones; with any other optimizer, ``step()`` copies the gradients
        into fp32 buffers and unscales them there, after the inf/NaN check. Between backward and step there are only
        the model's scaled fp16/bf16 gradients, so there is nothing that clipping "the master gradients" could act
        on. ``max_grad_norm`` does the same clipping (global L2 norm of the unscaled gradients, inside every step,
        skipped on an overflow) and ``last_grad_norm`` gives the norm before clipping."""
        raise RuntimeError(
            f"FP16_Optimizer.clip_master_grads(max_norm={max_norm!r}, norm_type={norm_type!r}) is not supported: the "
            "fp32 master gradients exist only inside step() (FusedAdam unscales in its fused pass; other optimizers' "
            "masters get their gradients there), so between backward and step there is nothing to clip. Set "
            "opt.max_grad_norm = max_norm once (or pass max_grad_norm=max_norm to FP16_Optimizer): every step() then "
            "clips the unscaled gradients to that global L2 norm (other norm types are not supported), and "
            "opt.last_grad_norm is the norm before clipping. Nothing was changed")

    def _overflow_groups(self) -> list:
        """The groups over which the overflow flag is MAX-reduced, in order: the data-parallel group (None: the
        default group), then the model-parallel groups."""
        return [self.process_group] + list(self.model_parallel_groups)

    def _reduce_found_inf(self, found_inf: torch.Tensor, groups: Optional[list] = None) -> torch.Tensor:
        """MAX over the data-parallel group and the model-parallel groups, or over groups where given (all ranks then
        decide alike)."""
        if not (dist.is_available() and dist.is_initialized()):
            return found_inf
        for group in self._overflow_groups() if groups is None else groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf

    def _distributed(self) -> bool:
        if not (dist.is_available() and dist.is_initialized()):
            return False
        return any(dist.get_world_size(g) > 1 for g in self._overflow_groups())

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Unscales, checks inf/NaN (all ranks), clips, and updates or skips; then adjusts the loss scale.

        A closure, if given, is called once (with grad enabled) first; it should call ``backward`` itself.
        Optimizers that need several evaluations per step (LBFGS) were refused at construction. Runs the step
        pre/post hooks (torch's machinery) on taken and skipped steps alike.
        """
        self._masters.sync()  # groups added since the last step: masters, or an error before anything is written
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        blocking = self._main_device.type != "cuda"
        # Inside a step that torch.compile traces, the min-scale flag is not read on the host (a read splits the
        # graph): it stays set on the device, and the next step run eagerly (or scaler.check) raises.
        traced = torch.compiler.is_compiling()
        if not blocking and not traced:
            self.scaler.check(blocking=False)  # a floor hit reported by an earlier step (no host sync)
        checked = self._masters.step(self)  # (whether it already read the scaler's min-scale flag on the host)
        if blocking and not checked and not traced:
            self.scaler.check(blocking=True)
        # (after a step that did not raise: its retry needs no new backward)
        if not self._scaled_since_step and not traced and not self._warned_unscaled:
            self._warned_unscaled = True  # (once per wrapper)
            warnings.warn(UNSCALED_BACKWARD, UserWarning, stacklevel=3)
        self._scaled_since_step = False
        return loss

    # ---- masters -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def refresh_master_params(self) -> None:
        """Copies the model's fp16/bf16 params into their fp32 masters: call it after writing the model's params
        directly (e.g. ``model.load_state_dict`` without the optimizer's checkpoint); otherwise the next step
        would overwrite them with the masters."""
        self._masters.refresh()

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{'format', 'optimizer', 'loss_scaler', 'master_params'}``: the wrapped optimizer's state_dict (whose
        params are the masters; FusedAdam keeps its masters in its own state as ``master_param``), the scaler's
        state and, for other optimizers, one fp32 master per parameter in param_groups order (None for fp32
        params); with FusedAdam, an empty list, or where some fp16/bf16 param has no FusedAdam state yet (no gradient
        so far), ``{'param': its value in fp32}`` for each such param and None for the others, which loading writes
        into them. Tensors and plain values only: loads with ``torch.load(weights_only=True)``. Runs the
        state_dict pre and post hooks registered on the wrapper, as torch's optimizers do."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        masters = self._masters.saved_masters()
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

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True) -> None:
        """Restores the wrapped optimizer, the scaler and the masters, then writes the masters (rounded) into the
        model's fp16/bf16 params, so resuming equals never stopping. Everything (format, keys, the loss_scaler's
        types, shapes, finite values and ranges, the masters' count, dtypes and shapes) is validated before
        anything changes; an error names the entry (e.g. ``state_dict['loss_scaler']['growth_tracker']``). The
        given dict is never modified nor aliased. Runs the load_state_dict pre and post hooks registered on the
        wrapper, as torch's optimizers do (a pre hook may return a replacement dict).

        ``load_optimizer_states=False`` (DeepSpeed's argument) loads the scaler's state and the fp32 masters only,
        as DeepSpeed's FP16_Optimizer does: the wrapped optimizer's state (moments, steps) and param group options
        (lr, ...) stay as they are. With FusedAdam inside, whose masters are part of its state, each saved
        ``master_param`` replaces the current one, and a param that has no state yet gets a fresh one (step 0, zero
        moments: what its first step would create) holding the saved master. DeepSpeed also restores its
        ``clip_grad`` from the checkpoint; ours keeps ``max_grad_norm`` as constructed, as it keeps the scaler's
        policy."""
        if not isinstance(load_optimizer_states, bool):
            raise TypeError(f"load_optimizer_states must be True or False, got {type(load_optimizer_states).__name__} "
                            f"{load_optimizer_states!r:.60}")
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
        self._masters.sync()
        scaler_values = self.scaler.validate_state_dict(state_dict["loss_scaler"], "state_dict['loss_scaler']")
        masters = state_dict["master_params"]
        if not isinstance(masters, list):
            raise TypeError(f"state_dict['master_params'] must be a list, got {type(masters).__name__}")
        self._masters.validate_masters(masters, "state_dict['master_params']", state_dict["optimizer"])
        # The wrapped optimizer validates its checkpoint before changing anything; nothing after it can fail.
        if load_optimizer_states:
            self._masters.load(state_dict["optimizer"], masters)
        else:
            self._masters.load_masters(state_dict["optimizer"], masters, "state_dict['optimizer']")
        self.scaler._load_values(scaler_values)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _constructor_signature() -> inspect.Signature:
    """FP16_Optimizer.__init__ as help() and editors show it: the loss scaler's options spelled out between the
    optimizer and the wrapper's own options."""
    own = list(inspect.signature(FP16_Optimizer.__init__).parameters.values())
    scaler = [option.replace(kind=inspect.Parameter.KEYWORD_ONLY) for option in _SCALER_OPTIONS.values()]
    return inspect.Signature(own[:2] + scaler + own[2:-1])


FP16_Optimizer.__init__.__signature__ = _constructor_signature()
# (and __new__'s, which inspect.signature(FP16_Optimizer) reads before __init__: it would show (optimizer=None, *args,
# **kwargs); a subclass with an __init__ of its own still shows that one)
FP16_Optimizer.__new__.__signature__ = FP16_Optimizer.__init__.__signature__
