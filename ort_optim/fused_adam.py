"""FusedAdam: a multi-tensor Adam/AdamW on ort_optim's own op, a drop-in for ORT's and for torch.optim.AdamW."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Union

import torch

from . import _checkpoint, _group_options, _migration, _plan, backends, formats
from ._backward_step import BackwardStep, loss_scaling_refused, max_grad_norm_refused
from ._checkpoint import MOMENT_KEYS
from ._fork import renewed_lock
from ._group_options import constructor_where, group_where
from ._layout import StateLayout
from ._plan import describe
from ._spec import SUPPORTED_PARAM_DTYPES, AdamWMode
from .formats import sqrt_f32
from .integrations import deepspeed, dtensor


# Whether step() takes its traced route under torch.compile (_init_group): the TorchDynamo it is tested with. Under
# older ones (torch 2.4's fails inside its optimizer support) the step runs eagerly, outside the graph.
_TRACED_STEP = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)

# Options the op takes as floats, read on the host: where a group holds one as a tensor, a compiled step runs the
# update outside the graph (_init_group), which validates it at every step as the eager step does. Traced, its value
# would be read past the validation, which runs when the step is traced: TorchDynamo guards a tensor's metadata, not
# its value, so a negative value written in place later would be stepped with.
_HOST_READ_OPTIONS = ("eps", "weight_decay")

# Parts of a step that measurements price by leaving them out (ort_optim/bench, tools/gpu_check.py); not options. A
# plain step's gradient norm summed by its update passes (last_grad_norm), and p.grad written back unscaled after a
# step with grad_scale. Steps read them; _leaving_out() switches them off for the steps taken inside it.
_PLAIN_NORM = True
_UNSCALE_GRADS = True


@contextlib.contextmanager
def _leaving_out(plain_norm: bool = False, unscale_grads: bool = False):
    """Steps taken inside leave out the parts named True: a plain step leaves last_grad_norm None (plain_norm), a
    step with grad_scale leaves p.grad scaled (unscale_grads)."""
    global _PLAIN_NORM, _UNSCALE_GRADS
    saved = _PLAIN_NORM, _UNSCALE_GRADS
    _PLAIN_NORM, _UNSCALE_GRADS = saved[0] and not plain_norm, saved[1] and not unscale_grads
    try:
        yield
    finally:
        _PLAIN_NORM, _UNSCALE_GRADS = saved


def _on_the_cpu(grad_scale: torch.Tensor, groups: list[dict]) -> bool:
    """Whether a tensor grad_scale is read by the op on the CPU (where it refuses a bad value; on a device a bad
    value skips the step): it and the first param are on the CPU."""
    first = next((p for group in groups for p in group["params"]), None)
    return grad_scale.device.type == "cpu" and (first is None or first.device.type == "cpu")


def _traced_hyperparameters(group: dict, device: torch.device) -> dict:
    """A group's hyperparameters as the op's keyword arguments in a step traced by torch.compile: those of the eager
    step, but the betas go to the op as ``betas_tensor`` (float64 [2] on the steps' device) and a float lr as
    ``lr_tensor`` (float64), so that values a scheduler changes at every step (``OneCycleLR(cycle_momentum=True)``
    writes a new float beta1 each time) need no new graph. TorchDynamo makes a float that changed since the last trace
    an input of the graph (automatic dynamic), but a float passed as an op's ``float`` argument is specialised again
    (a guard on its value: one graph per value), and so is one given to ``torch.tensor``, ``torch.as_tensor`` or
    ``torch.full``; one added to a tensor stays an input. Hence a float64 zero plus each value. The op reads the same
    float64 values (exactly the floats), so the step computes what the eager step computes."""
    hyper = _group_options.hyperparameters(group, traced=True)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    # (betas: floats, or one-element tensors of any shape and floating dtype, as the eager step takes them)
    betas = [(zero + _addable(beta)).reshape(()).to(torch.float64) for beta in group["betas"]]
    hyper.update(betas_tensor=torch.stack(betas))
    if hyper["lr_tensor"] is None:
        hyper.update(lr=0.0, lr_tensor=zero + _addable(group["lr"]))
    return hyper


def _addable(value: Any) -> Any:
    """A hyperparameter as _traced_hyperparameters adds it to a float64 tensor: a tensor, Python's and numpy's
    numbers as they are (a float that changed stays a graph input); any other real number the options take
    (``fractions.Fraction``, which a tensor does not add) as the float the eager step reads from it."""
    if isinstance(value, (torch.Tensor, float, int)) or type(value).__module__ == "numpy":
        return value
    return float(value)


def _group_hyperparameters(groups: list, device: torch.device) -> torch.Tensor:
    """Every group's (lr, beta1, beta2) as the op's ``group_hyperparameters`` (float64 [groups, 3] on ``device``), for
    the first op call of a traced step with several groups: the op checks them all before it writes anything, so a
    value out of range in any group (a graph input, which the check made while tracing does not see again) refuses the
    whole step rather than the groups after the first."""
    rows = []
    for group in groups:
        hyper = _traced_hyperparameters(group, device)
        rows.append(torch.cat([hyper["lr_tensor"].to(device=device, dtype=torch.float64).reshape(1),
                               hyper["betas_tensor"]]))
    return torch.stack(rows)


def _read_after(flag: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """flag, in a traced step, as a value that depends on the op having written ``steps`` (the flag, or 1 where a
    step count is negative, which none is): what reads last_found_inf in the same graph (FP16_Optimizer's scaler
    update) then runs after the op, so a step the op refuses changes nothing. Without it inductor fuses that update
    into the kernel that computes the flag, before the op. (A dependency through ``0 * steps`` is simplified away.)"""
    return torch.maximum(flag, (steps[:1] < 0).to(device=flag.device, dtype=flag.dtype).reshape(flag.shape))


def _release_with(optimizer: "FusedAdam", tensors: list) -> None:
    """Lets the graph being traced drop these tensors when the optimizer dies, as TorchDynamo arranges for the state
    tensors it finds itself in a torch.optim optimizer: tensors marked static are attributes of the compiled graph
    module, which the calling module's globals keep for the rest of the process (``torch._dynamo.reset()`` does not
    drop them), so without this a compiled train step kept every param and state alive after ``del model, opt``.
    Uses TorchDynamo's graph finalizers (private API: without them it does nothing)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        output = InstructionTranslator.current_tx().output
        add_graph_finalizer = output.add_graph_finalizer
    except Exception:  # (not tracing, or another TorchDynamo)
        return
    ids = {id(t) for t in tensors}
    context = output.tracing_context

    def init_finalizer(gm: torch.fx.GraphModule) -> None:
        names = [name for name, t in [*gm._buffers.items(), *gm._parameters.items()] if id(t) in ids]

        def clear() -> None:
            for name in names:
                gm._buffers.pop(name, None)
                gm._parameters.pop(name, None)
            for flat in (context.params_flat, getattr(context, "params_flat_unwrap_subclasses", None)):
                if flat:
                    flat.clear()

        weakref.finalize(optimizer, clear)

    add_graph_finalizer(init_finalizer)


class _CheckedOption:
    """An attribute checked when set (``check(name, value)`` raises, naming it, or returns nothing or the value to
    keep), stored as ``_<name>``."""

    def __init__(self, check: Callable[[str, Any], Any]) -> None:
        self.check = check

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        checked = self.check(self.name, value)
        setattr(obj, self.slot, value if checked is None else checked)


# Whether what TorchDynamo's first import leaves has been collected, or needs no collection: dynamo was imported
# before this module (then no optimizer's frames were on the stack when it was).
_dynamo_import_collected = "torch._dynamo" in sys.modules


@contextlib.contextmanager
def _frames_freed_if_dynamo_is_imported(hooks: bool):
    """Around code that may import TorchDynamo for the first time in the process (torch.optim.Optimizer's
    add_param_group, the hooks' torch._dynamo.disable, the constructor's own TorchDynamo-disabled wrapper, which
    imports it before the constructor's body runs): under torch 2.13 that import leaves a frame that refers to
    itself (torch.fx.wrap's), whose callers' frames, the constructor's (or unpickler's) with the optimizer among them,
    only the garbage collector frees. An optimizer stepping in backward (hooks) must go when deleted, or its hooks go
    on updating the params and taking their gradients until the collector's next full pass: that cycle is collected
    here, once per process, by the first optimizer with hooks made (or unpickled) once TorchDynamo is imported."""
    global _dynamo_import_collected
    yield
    if hooks and not _dynamo_import_collected and "torch._dynamo" in sys.modules:
        _dynamo_import_collected = True
        gc.collect()


class StateNameError(KeyError, ValueError):
    """A state the state accessors (:meth:`FusedAdam.get_unscaled_state`, :meth:`FusedAdam.set_scaled_state`) cannot
    find: an unknown ``state_name``, or a param without that state. A KeyError, as TransformerEngine's accessors
    raise, and a ValueError, as this library's other refusals of a value; its text is the message itself."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


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

    With amsgrad, :math:`\max_{s\le t} v_s` replaces :math:`v_t` in the denominator; with maximize, :math:`-g_t`
    replaces :math:`g_t`. Each parameter has its own step count :math:`t`; parameters without a gradient are skipped.
    ops/README.md gives the exact order of operations and roundings every backend follows: :math:`m_t` is formed as
    torch.optim.AdamW forms it, ``exp_avg.lerp_(grad, 1 - beta1)`` in both of torch's forms (where the weight
    :math:`w = 1 - \beta_1`, rounded to the compute dtype, is at least 0.5, :math:`g - (1 - w)(g - m)`: with
    :math:`\beta_1 = 0`, :math:`m_t = g_t` exactly), where
    ORT's, apex's and DeepSpeed's kernels compute :math:`\beta_1 m + (1-\beta_1) g` (the same value, other roundings).

    Args:
        params: parameters or param groups (dicts), as for any torch optimizer.
        lr: learning rate :math:`\eta` (default 1e-3); a float or a one-element floating-point tensor.
        bias_correction: divide by :math:`1-\beta^t` (default True).
        betas: :math:`(\beta_1, \beta_2)` (default (0.9, 0.999)).
        eps: :math:`\epsilon` (default 1e-6, ORT's real default; torch's AdamW uses 1e-8).
        adam_w_mode: the weight-decay variant (default ``ADAMW_TRANSFORMERS``, as ORT). A bool, apex's form of this
            argument, is refused (ORT read True as ``ADAMW_TRANSFORMERS``; apex's True is ``ADAMW_TORCH``'s math).
        weight_decay: :math:`\lambda` (default 0.0, as ORT; torch's AdamW uses 1e-2).
        set_grad_none: ``zero_grad()`` sets gradients to None (default True); an explicit
            ``zero_grad(set_to_none=False)`` zeroes them all the same, as torch's (ORT's FusedAdam ignores the
            argument while this is True).
        amsgrad: use :math:`\max_{s\le t} v_s` in the denominator (default False).
        maximize: ascend instead of descend (default False).
        master_weights: keep an fp32 master copy (``state['master_param']``) of fp16/bf16 params; the update is done
            on the master and the param receives it rounded to nearest even (default False). The master, made from
            the param at its first step, is the value the optimizer updates: a value written into the param itself
            later (``model.load_state_dict``, ``p.copy_``, ``p.data = ...``) is overwritten by the master at the
            param's next step. After loading a model-only checkpoint, also load the optimizer's checkpoint (it
            carries the masters), or copy the params into the masters: ``optimizer.state[p]['master_param'].copy_(p)``
            for every ``p`` with state.
        master_weight_dtype: the masters' dtype, taken as TransformerEngine's FusedAdam takes it so that code written
            for it constructs FusedAdam unchanged: torch.float32 only (the default; other dtypes are refused naming
            this option, whatever ``master_weights`` says, where TE ignores it without masters and keeps fp16
            masters with a scale: a bf16 param's stochastic rounding is the low-memory choice here). A refused dtype
            here, in ``exp_avg_dtype``/``exp_avg_sq_dtype`` or of a param raises a ValueError that is also a
            RuntimeError, the type TE's, apex's, DeepSpeed's and ORT's FusedAdam raise for a dtype they do not
            support.
        exp_avg_dtype, exp_avg_sq_dtype: storage dtype of the moments: torch.float32, torch.bfloat16,
            torch.float16, torch.uint8 (8-bit), torch.uint4 (4-bit), torch.float8_e4m3fn or torch.float8_e5m2
            (fp8), in any combination (torch.uint8 is 8-bit blockwise codes, not TransformerEngine's FusedAdam's
            torch.uint8, which is fp8 e4m3 with one scale per tensor: for fp8 moments pass torch.float8_e4m3fn)
            (default None: float32 for fp16/bf16 params with master weights, else the param's dtype; float64 params
            always keep float64 states). fp16 moments are stored with one power-of-two scale per 1024 elements, by the block's largest
            finite magnitude (exp_avg_sq as sqrt(v), never read back as 0), so they neither overflow nor flush to
            zero; rounded to nearest, as bfloat16 moments, a v that moves by less than half an ulp a step stays
            (guides/low-bit-states.md, Caveats). 8-bit and 4-bit moments are block-quantised
            codes (``state[key]``, uint8; 4-bit packed two per byte, flat) with block scales in
            ``state[key + '_scale']``: m and v together take 2.03 (8-bit) or 1.03 (4-bit) bytes per parameter
            instead of 8; exp_avg rounds stochastically between its two neighbouring levels (ops/README.md,
            "low-bit states"; guides/low-bit-states.md). Checkpoints stay canonical (unscaled float32) and load into
            any of these formats. fp8 moments are float8 codes (``state[key]``, the param's shape) with one
            power-of-two float32 scale per 256 elements in ``state[key + '_scale']`` (2.03 bytes per parameter for
            both; exp_avg_sq as sqrt(v), never read as 0), encoded by exponent and mantissa arithmetic, rounded
            stochastically in a step and to nearest even in conversions; e4m3fn for both moments trains best. In
            the 8-bit, 4-bit and fp8 formats a v that overflows float32 (a gradient element above about 5.8e20)
            is kept as inf, as torch.optim.AdamW keeps it (that element's updates are 0), without touching its
            block's other elements (a block scale with its sign bit set marks the block, ops/README.md).
        stochastic_rounding: round the update of bfloat16 params (without master weights; refused with
            master_weights=True, no effect on other dtypes) stochastically instead of to nearest, so that updates
            smaller than half a bfloat16 ulp still accumulate on average (default False; a param-group option).
            The random bits are a counter-based hash of (stochastic_rounding_seed, the param's step, its position
            over all param groups, the element index): deterministic, and a resumed run continues exactly.
        stochastic_rounding_seed: an int in [0, 2**64) (default 0; a param-group option, saved in checkpoints).
        max_grad_norm: when set, clip the gradients by their global L2 norm over all params (default None), inside
            the fused step, after unscaling. That norm (and ``grad_scale``'s inf/NaN check) cannot take params on the
            meta device beside params with values: such a step is refused, naming both, before anything changes.
        capturable: promise that step() will be captured in a CUDA graph (default False). Steps and bias
            corrections already live on the device and step() never synchronises; this additionally refuses what a
            graph cannot replay: an lr tensor on another device, a float grad_scale. A float lr is baked into the
            graph at capture: to change it between replays, make it a device tensor and update it in place.
        step_in_backward: update each parameter during backward, as soon as its gradient is complete, and free the
            gradient (default False).
        process_group: a torch.distributed group over which plain (non-DTensor) params are replicas, as under DDP:
            the clipping norm and the inf/NaN skip become one decision for the group, in one all-reduce of two
            floats per step (default None: each process decides alone, as torch's optimizers).
        pipeline_group: a torch.distributed group over ranks that hold different params of one model (pipeline
            stages, or DeepSpeed's ZeRO partitions), whose sums of squares and inf flags are added in one more
            all-reduce of the same two floats (default None). A DeepSpeed ZeRO client with ``max_grad_norm`` needs
            it (the ZeRO data-parallel group).
        foreach, fused, differentiable: torch.optim.AdamW's choice of implementation, accepted so that its
            callers construct FusedAdam unchanged (``fused=True`` included). ``foreach`` and ``fused`` (None, True or
            False) change nothing: the step is always one multi-tensor kernel per bucket. ``differentiable`` must be
            False: the step updates in place through its own op, which autograd does not differentiate.

    ``torch.compile`` (torch >= 2.13, as tested). A ``step()`` inside a compiled function traces to one call of the
    registered op ``torch.ops.ort_optim.adam_step_`` per bucket (and ``grad_stats`` with ``grad_scale`` or
    ``max_grad_norm``), with no graph break of its own and no recompile while nothing changes: a tensor lr changed in
    place by a scheduler (``LambdaLR``), per-group options, ``step(grad_scale=<tensor>)``, ``max_grad_norm`` and
    ``FP16_Optimizer(FusedAdam)`` were each run 40 steps with the same graphs throughout and results bit for bit those
    of the eager step; so were drawn configurations of every param and moment dtype, master weights, group option,
    clipping and gradients with inf and NaN (the clip coefficient's square root is correctly rounded in both: torch's
    own CPU float32 sqrt is not, and a compiled one is). What cannot be traced runs outside the graph, in
    ``_init_group`` (which TorchDynamo calls eagerly when it traces, as for torch.optim's optimizers): the option
    checks, state creation and adoption, and the plan. TorchDynamo's guards on what the step then reads (params and
    gradients, which params have one, the group dicts and their float options, ``optimizer.state``'s mutation count, the
    plan) stand in for the per-step check: any change re-traces, which validates again. So inside a compiled step the
    value of a tensor lr is checked when the step is traced, not at every step. A float lr and the betas reach the op as
    float64 tensors made inside the graph (``lr_tensor``, ``betas_tensor``), so a scheduler that writes new floats at
    every step costs one recompile, not one per value: ``OneCycleLR(cycle_momentum=True)`` (a new float lr and beta1 at
    every step) compiles twice (TorchDynamo traces a float as a constant first, and as a graph input once it has
    changed) and then runs one graph for 40 steps, bit for bit the eager results; torch.optim.AdamW's compiled step
    recompiles at every step until TorchDynamo's recompile limit (8 graphs), then runs eagerly. eps and weight_decay
    stay floats of the op: a change recompiles. Not traced (the update runs eagerly, outside the graph: one graph
    break): ``step_in_backward``, DTensor params, ``process_group``/``pipeline_group``, a backend other than
    the native library (``ORT_OPTIM_BACKEND=torch``), tensor eps/weight_decay (read on the host; a tensor lr and
    tensor betas are traced). States get a storage each when the step is traced (those an eager step laid out as
    views of one buffer are copied once: inductor would copy the whole buffer around the op at every step).
    ``FP16_Optimizer(FusedAdam)``: its scaler updates on the device; the min-scale flag is read by the next eager step
    (guides/fused-adam.md, "torch.compile"). Older torch (2.4.1): best effort, the update runs outside the graph (one
    graph break; the eager update). A FusedAdam made inside a compiled function is made eagerly, outside the graph
    (one graph break, as torch.optim.AdamW's ``add_param_group``), with every option as given, on any torch; its steps
    are then traced as above.

    TransformerEngine's FusedAdam's state accessors are here with its names and argument order:
    :meth:`get_unscaled_state` ``(param, state_name)`` returns a state's float32 values decoded from whatever format
    it is stored in, and :meth:`set_scaled_state` ``(param, state_name, unscaled_state)`` encodes float32 values into
    it, over every moment format here (float32, bfloat16, fp16 with block scales, 8-bit, 4-bit, fp8) and
    ``'master_param'``. Where they differ from TE's: the result of get is always a copy (TE's is the state itself for
    a float32 state); set never writes its argument (TE scales it in place) and takes float64 for a float64 param's
    moments; ``'max_exp_avg_sq'`` (amsgrad) is a fourth name; a missing state or an unknown name is a
    :class:`StateNameError` (a KeyError, as TE's, and a ValueError), a tensor that is not one of the optimizer's params
    a ValueError (TE: a KeyError from get, a state made for it by set), a wrong dtype a TypeError and a wrong shape a
    ValueError (TE: an assertion or torch's error), each naming what is wrong and changing nothing.

    ``step(closure=None, *, grad_scale=None, found_inf=None)``: ``grad_scale`` (float or one-element floating-point
    tensor, finite and non-zero in float32, as torch's GradScaler keeps its scale) divides every gradient inside the
    kernel, and the step leaves the unscaled gradient in ``p.grad``; ``found_inf`` (one-element tensor) turns the step
    into a no-op when non-zero. With ``grad_scale`` or ``max_grad_norm`` the step also skips itself on inf/NaN gradients
    (:attr:`last_step_skipped`, :attr:`last_grad_norm`); in distributed training (DTensor params, ``process_group``,
    ``pipeline_group``) that flag is all-reduced with the norm, so every rank skips alike, while a ``found_inf`` given
    by the caller is taken as given on each rank, as torch's fused optimizers take it (torch.amp.GradScaler and
    FP16_Optimizer hand every rank the same one).

    A gradient the step cannot use (sparse, of another shape or device than its param, float64 on a param of another
    dtype or the other way round; with ``grad_scale``, one that overlaps itself or shares memory with its own param,
    ``p.grad = p.detach()``, as the param cannot hold both its update and the unscaled gradient: torch's fused AdamW
    writes one over the other) raises :class:`GradientError`, naming the param, before anything is written: a
    ValueError like every refused input here, and a RuntimeError like torch.optim.AdamW's error for a sparse gradient.
    A float32, float16 or bfloat16 gradient updates a float32, float16 or bfloat16 param whatever their two dtypes
    (a gradient set by hand after ``p.grad_dtype = None``, which torch 2.13 has and torch 2.4 has not: torch 2.4
    refuses to set a gradient of another dtype): the step reads it in float32, where torch.optim.AdamW raises for a
    gradient of another dtype than its param.

    guides/fused-adam.md holds the rest of the contract: the step's cache and what it notices, what is refused, the
    autograd version counters, loss scaling and skipped steps, ``step_in_backward``, and distributed training.
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
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: Optional[torch.dtype] = None,
        exp_avg_sq_dtype: Optional[torch.dtype] = None,
        max_grad_norm: Optional[float] = None,
        capturable: bool = False,
        step_in_backward: bool = False,
        stochastic_rounding: bool = False,
        stochastic_rounding_seed: int = 0,
        process_group: Any = None,
        pipeline_group: Any = None,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        differentiable: bool = False,
    ):
        _group_options.check_positional_order(bias_correction)
        _group_options.check_torch_implementation_options(foreach, fused, differentiable)
        _group_options.check_optimizer_options(
            master_weights, master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype, max_grad_norm,
            dict(set_grad_none=set_grad_none, capturable=capturable, step_in_backward=step_in_backward))
        _group_options.check_process_group(process_group, "FusedAdam: process_group")
        _group_options.check_process_group(pipeline_group, "FusedAdam: pipeline_group")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, adam_w_mode=adam_w_mode,
            weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, stochastic_rounding=stochastic_rounding,
            stochastic_rounding_seed=stochastic_rounding_seed,
        )
        # checked as given (a refused list is named a list), then held as a tuple
        _group_options.check_group(defaults, constructor_where, _group_options.WideOptions(
            master_weights, exp_avg_dtype, exp_avg_sq_dtype, max_grad_norm))
        defaults["betas"] = tuple(betas)
        self.set_grad_none = set_grad_none
        self.master_weights = master_weights
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.max_grad_norm = max_grad_norm
        self.capturable = capturable
        self._plan: Optional[_plan.Plan] = None  # the step cache (ort_optim/_plan.py)
        self._stepping = renewed_lock(self, "_stepping", threading.RLock)  # (eager steps, one at a time: _update)
        self._checked_groups = _group_options.CheckedGroups()  # the options last accepted (steps, backward updates)
        # The last step's report (last_grad_norm, last_found_inf): a dict, whose writes a step traced by
        # torch.compile replays (TorchDynamo drops attribute writes on an optimizer made inside a traced step).
        self._last: dict[str, Optional[torch.Tensor]] = {"grad_norm": None, "found_inf": None}
        self._finishes_backward = False  # (step(): backward updated params since the last step() or zero_grad())
        self._step_in_backward = step_in_backward
        self._backward: Optional[BackwardStep] = None
        self._partitions_checked = False  # (max_grad_norm under a DeepSpeed ZeRO/BF16 optimizer: once)
        self.process_group = process_group
        self.pipeline_group = pipeline_group
        if step_in_backward and max_grad_norm is not None:
            raise max_grad_norm_refused(max_grad_norm)
        if step_in_backward and process_group is not None:
            raise ValueError(
                "process_group is for params replicated over ranks (DDP), whose gradients are averaged across the "
                "ranks during backward, after step_in_backward=True would already have updated each param with its "
                "local gradient. Use step_in_backward=False in distributed training"
            )
        with _frames_freed_if_dynamo_is_imported(step_in_backward):
            super().__init__(params, defaults)
            if step_in_backward:
                self._watch_backward()

    # Made inside a function that torch.compile traces, the optimizer is built eagerly (a graph break), as
    # torch.optim's optimizers are from their add_param_group on: the constructor reads option tensors on the host
    # (a graph break of its own), and TorchDynamo loses the attributes written through the checked options'
    # setters (_CheckedOption) before such a break.
    __init__ = torch._disable_dynamo(__init__)

    @property
    def state(self) -> _plan.OptimizerState:
        """Per-param state, as torch.optim's ``optimizer.state``: a defaultdict of dicts that marks its mutations,
        so that the step notices them (guides/fused-adam.md)."""
        return self._state_container

    @state.setter
    def state(self, value) -> None:
        container = value if isinstance(value, _plan.OptimizerState) else _plan.OptimizerState(value)
        listener = weakref.WeakMethod(self._release_plans)
        previous = self.__dict__.get("_state_container")
        if previous is not None and previous is not container:  # (kept elsewhere, its changes are not this one's)
            previous.remove_listener(listener)
        container.add_listener(listener)
        self._state_container = container
        self._release_plans()

    def _release_plans(self) -> None:
        """Drops the step plans, which hold the state tensors they were built for, when the state changes (the next
        step plans again anyway): a state the user dropped or replaced is freed at once, as with torch.optim."""
        self._plan = None
        if getattr(self, "_backward", None) is not None:
            self._backward.release_plans()

    # Constructor options that torch.optim.Optimizer's pickling (copy.deepcopy, torch.save of the optimizer) would
    # otherwise drop: it keeps only defaults, state and param_groups.
    # (process_group and pipeline_group are not among them: a process group belongs to its process; a copy decides
    # alone until given one)
    _OPTIONS = ("set_grad_none", "master_weights", "exp_avg_dtype", "exp_avg_sq_dtype", "max_grad_norm", "capturable",
                "step_in_backward")

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._OPTIONS})
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_step_in_backward", state.pop("step_in_backward", False))
        with _frames_freed_if_dynamo_is_imported(state["_step_in_backward"]):
            self._set_state(state)

    def _set_state(self, state: dict) -> None:
        state.setdefault("process_group", None)
        state.setdefault("pipeline_group", None)
        super().__setstate__(state)  # (it puts "state" into __dict__, under the property: wrap it)
        self.state = self.__dict__.pop("state", self.__dict__.get("_state_container", {}))
        for name, attribute in vars(FusedAdam).items():  # (likewise: through their checked setters)
            if isinstance(attribute, _CheckedOption) and name in self.__dict__:
                setattr(self, name, self.__dict__.pop(name))
        self._plan = None  # the cache (native plans cannot be copied): rebuilt at the next step
        self._stepping = renewed_lock(self, "_stepping", threading.RLock)
        self._checked_groups = _group_options.CheckedGroups()
        self._partitions_checked = False
        self._last = {"grad_norm": None, "found_inf": None}
        self._backward = None
        if self.step_in_backward:  # hooks on the copy's own params
            self._watch_backward()

    @property
    def step_in_backward(self) -> bool:
        """Whether backward updates each param (the constructor's ``step_in_backward``; False once
        :meth:`remove_backward_hooks` ended it). Read-only: hooks are made with the optimizer, and a flag changed
        later would neither make nor remove them."""
        return self._step_in_backward

    @step_in_backward.setter
    def step_in_backward(self, value: Any) -> None:
        raise AttributeError(
            f"FusedAdam.step_in_backward is fixed at construction (setting it to {value!r} would neither add nor "
            "remove the backward hooks): call remove_backward_hooks() to end it, or make a new FusedAdam(..., "
            "step_in_backward=True) to start it. Nothing was changed")

    def _watch_backward(self) -> None:
        """step_in_backward: hooks every param (ort_optim/_backward_step.py)."""
        self._check_no_shared_memory()
        self._backward = BackwardStep(self)
        for group_index, group in enumerate(self.param_groups):
            self._backward.watch(group_index, group)

    def _check_no_shared_memory(self) -> None:
        """step_in_backward refuses params that share memory up front: per-parameter updates would update the shared
        elements several times, and no step() sees all gradients at once to check it. A lazy module's param, which has
        no memory until its first forward, is refused too: run that forward before making the optimizer."""
        for group_index, group in enumerate(self.param_groups):
            for index, p in enumerate(group["params"]):
                if torch.nn.parameter.is_lazy(p):
                    raise ValueError(
                        f"{_plan.describe(group_index, index, p)} is a lazy module's parameter, which gets its shape "
                        "and memory at the module's first forward; step_in_backward needs them when the optimizer is "
                        "made (it checks the params for shared memory and hooks each one): run one forward first, "
                        "or use step_in_backward=False")
        _plan._check_overlap([(group_index, index, p) for group_index, group in enumerate(self.param_groups)
                              for index, p in enumerate(group["params"])])

    def remove_backward_hooks(self) -> None:
        """Ends ``step_in_backward``: removes the hooks from the params, so that backward only accumulates gradients
        again, for this optimizer's ``step()`` (which then works as with ``step_in_backward=False``, loss scaling
        included) or for another optimizer. Deleting the optimizer does the same only once nothing else refers to
        it (an lr scheduler does); until then its hooks keep updating the params and freeing their gradients."""
        if self._backward is not None:
            self._backward.remove()
            self._backward = None
        self._step_in_backward = False

    def accumulate(self):
        """A context manager for gradient accumulation with ``step_in_backward=True``: backward calls inside it only
        accumulate gradients; the next backward outside it updates each parameter with the sum, as ``step()`` would
        have after all of them. Without step_in_backward it changes nothing (gradients accumulate anyway)::

            for i, batch in enumerate(micro_batches):
                with optimizer.accumulate() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    model(batch).loss.backward()
            optimizer.step()  # updates only the params whose hooks did not fire

        Running every micro-batch's backward inside it works too: then ``step()`` updates each param with the sum,
        as without step_in_backward (but the gradients all exist at once, as without it). A backward outside it
        always updates: accumulating without it steps once per backward, as torch's optimizer-in-backward recipe.
        """
        return self._backward.accumulate() if self._backward is not None else contextlib.nullcontext()

    # ---- configuration ------------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        self._check_not_listed_already(param_group)
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        group = self.param_groups[group_index]
        try:
            _group_options.check_group(group, group_where(group_index), self._wide_options)
            group["adam_w_mode"] = int(group["adam_w_mode"])  # a plain int, so checkpoints load with weights_only
            for index, p in enumerate(group["params"]):
                if p.dtype not in SUPPORTED_PARAM_DTYPES:
                    raise _group_options.UnsupportedDtypeError(
                        f"{describe(group_index, index, p)}: FusedAdam supports float32, float64, float16 and "
                        f"bfloat16 params, not {p.dtype} (complex params: make the param the real pairs, "
                        "nn.Parameter(torch.view_as_real(w).clone()), and use torch.view_as_complex(param) in the "
                        "forward; float8 params: train "
                        "bfloat16 or float32 weights and cast them to float8 in the forward, as float8 training "
                        "recipes do)"
                    )
                dtensor.check_placements(p, describe(group_index, index, p))
                problem = _plan.param_memory_problem(dtensor.local(p))
                if problem is not None:
                    raise ValueError(f"{describe(group_index, index, p)} {problem}")
                if dtensor.is_dtensor(p) and self.step_in_backward:
                    raise ValueError(
                        f"{describe(group_index, index, p)} is {dtensor.describe_layout(p)}: step_in_backward=True "
                        "does not support DTensor params (their gradients are completed by the engine's own "
                        "collectives, not by autograd's accumulation); use step_in_backward=False")
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise
        group["params"] = _plan.ParamList(group["params"])
        if getattr(self, "_backward", None) is not None:
            try:
                self._check_no_shared_memory()
                self._backward.check_not_hooked_elsewhere(group_index, group)
            except ValueError:
                self.param_groups.pop()
                raise
            self._backward.watch(group_index, group)

    def _check_not_listed_already(self, param_group: dict) -> None:
        """Refuses a param of a new group that a group already lists, naming both places, before anything changes
        (torch.optim's add_param_group refuses it too, without saying which one: "some parameters appear in more than
        one parameter group"). Its params are read as torch.optim reads them, an iterator made a list."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is None or isinstance(params, set):  # (refused by torch.optim itself)
            return
        elif not isinstance(params, (list, tuple)):
            params = param_group["params"] = list(params)
        listed = {id(p): (group_index, index, p) for group_index, group in enumerate(self.param_groups)
                  for index, p in enumerate(group["params"])}
        for index, p in enumerate(params):
            if isinstance(p, torch.Tensor) and id(p) in listed:
                raise ValueError(
                    f"{describe(len(self.param_groups), index, p)} is {describe(*listed[id(p)])} listed again: each "
                    "parameter belongs to one param group (torch.optim refuses it too: 'some parameters appear in "
                    "more than one parameter group'). Leave it out of the new group, or remove it from the other "
                    "one first; nothing was changed")

    # Optimizer-wide options that may change between steps (FP16_Optimizer switches master_weights on and sets
    # max_grad_norm; a run may move its moments to another dtype, which the next step converts them to), checked when
    # set, as at construction: a bad value raises there, naming the option, and nothing changes. So are the flags that
    # code written for apex's and DeepSpeed's FusedAdam sets as attributes (set_grad_none) and that every step reads
    # (capturable): a "False" from a config file is refused there too, not read as True.
    master_weights = _CheckedOption(_group_options.check_flag)
    set_grad_none = _CheckedOption(_group_options.check_flag)
    capturable = _CheckedOption(_group_options.check_flag)
    exp_avg_dtype = _CheckedOption(_group_options.check_dtype_option)
    exp_avg_sq_dtype = _CheckedOption(_group_options.check_dtype_option)
    max_grad_norm = _CheckedOption(lambda name, value: _group_options.check_max_grad_norm(value))

    @property
    def _layout(self) -> StateLayout:
        """How this optimizer stores state now (ort_optim/_layout.py): its master_weights and state dtype options."""
        return self._wide_options.layout

    @property
    def _wide_options(self) -> _group_options.WideOptions:
        """Its optimizer-wide options now, which a param group may only repeat."""
        return _group_options.WideOptions(self.master_weights, self.exp_avg_dtype, self.exp_avg_sq_dtype,
                                          self.max_grad_norm)

    @property
    def _has_dtensors(self) -> bool:
        """Any DTensor param (however it got into param_groups): their states are local pieces, their steps reduce
        globally."""
        return any(dtensor.is_dtensor(p) for group in self.param_groups for p in group["params"])

    # ---- the step -----------------------------------------------------------------------------------------------

    @property
    def last_found_inf(self) -> Optional[torch.Tensor]:
        """The last step()'s skip flag as a one-element float32 tensor on the params' device (non-zero: skipped),
        or None when no loss scaling, clipping or ``found_inf`` was involved. A ``found_inf`` passed to step() is not
        handed back: this is a tensor of its own, 1.0 where it was non-zero, 0.0 elsewhere (so zeroing that buffer for
        the next iteration does not change it). Reading it never synchronises."""
        return self._last["found_inf"]

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global L2 norm of the last step()'s gradients, unscaled (divided by ``grad_scale``) and before
        clipping, as a 0-dim float32 tensor on the params' device: what ``torch.nn.utils.clip_grad_norm_`` returns
        as the total norm. It comes from a pass that reads the gradients anyway, never from an extra one: the
        statistics pass of unscaling and clipping (``grad_scale`` or ``max_grad_norm``), or, in a plain step of one
        process, the update pass itself: the native CPU plan sums the squares of each work item as it loads it, and
        the Triton kernels (CUDA) sum the squares of the gradients each program loads into a float64 partial per
        program, added by one more tiny program in a fixed order (deterministic for a given launch; float32
        squares, so a plain step's norm above about 1.8e19 reads inf). The two sum in different orders, so their
        norms of the same gradients may differ in the last bit or so (relative 1e-6), where the params, states and
        skip decisions of the two agree bit for bit. A plain step on the reference backend
        (pure PyTorch: ``ORT_OPTIM_BACKEND=torch``, or CUDA without triton), or with DTensor params or a
        process_group (where the norm would need a collective of its own), or traced by torch.compile (the registered
        op returns nothing; with grad_scale or max_grad_norm the statistics pass gives the norm), or eager on the
        CPU right after compiled steps (up to three in a row step through their plan, the op), leaves it None, and
        so does a step whose params span several of these paths when one of them cannot report; so do updates made in
        backward
        (step_in_backward: a step() after a backward that updated params, which finishes only the rest; not one after
        backward calls that all ran inside accumulate(), a normal step over every gradient). A step without any gradient
        reports 0.0 where one with gradients would report their norm (clip_grad_norm_ returns 0 for no gradients), and
        leaves last_found_inf None (nothing was checked). Under CUDA graph capture (capturable=True) the norm tensor of
        the captured step is rewritten by each replay. inf or NaN when a gradient is (a step with grad_scale or
        max_grad_norm is then skipped; a plain step is not, like torch.optim.AdamW). A step given ``found_inf`` alone
        (torch.amp.GradScaler after ``scaler.unscale_(optimizer)``, an apex-style overflow flag) reports the norm of the
        gradients as its update pass reads them, so after the caller's own unscaling and clipping (``clip_grad_norm_``
        returned the norm from before its clipping), and NaN when found_inf skips the step (the skipped pass reads no
        gradient). Reading it never synchronises. Always float32,
        where ``clip_grad_norm_`` returns the gradients' dtype: an fp16 norm overflows at 65504 and a bf16 one keeps
        three significant digits, while the sums behind this one are taken in float32 or wider."""
        return self._last["grad_norm"]

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step() was skipped because of inf/NaN gradients or a non-zero found_inf.

        On CUDA reading this synchronises with the device; step() itself never does.
        """
        return self._last["found_inf"] is not None and bool(self._last["found_inf"].item() != 0)

    def step(
        self,
        closure: Optional[Callable[[], Any]] = None,
        *,
        grad_scale: Optional[Union[float, torch.Tensor]] = None,
        found_inf: Optional[torch.Tensor] = None,
    ):
        """Performs one optimization step; see the class docstring for grad_scale and found_inf."""
        if torch.compiler.is_compiling():
            with torch.no_grad():
                return self._step(closure, grad_scale, found_inf)
        # Eager: torch.no_grad() as the two calls into torch's grad mode that its context manager makes, without
        # the context manager's Python layers (a step on thousands of small params is short enough to notice them).
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._step(closure, grad_scale, found_inf)
        finally:
            torch._C._set_grad_enabled(grad_enabled)

    def _step(self, closure, grad_scale, found_inf):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler hands these over as attributes to optimizers with _step_supports_amp_scaling.
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        # Whether backward updated params since the last step() or zero_grad(): this step() then finishes only the
        # rest, and its norm would be of that rest alone (last_grad_norm stays None). After backward calls that all
        # ran inside accumulate(), it is a normal step over every gradient, and reports their norm.
        backward = self._backward
        self._finishes_backward = backward is not None and backward.updated_any
        if backward is not None:
            if not backward.setup_checked:  # (once)
                backward.check_setup(self)
            backward.check_updated_once()
            backward.restore_hooks()
            if grad_scale is not None or found_inf is not None:
                raise loss_scaling_refused()
        number_scale = grad_scale is not None and not isinstance(grad_scale, torch.Tensor)
        # A float grad_scale in a traced step goes into the graph as a float64 tensor made there (as a float lr:
        # _traced_hyperparameters), so that a new value is a graph input, not a guard and a new graph each; checking
        # its value on the host would split the graph, once it is one. The op checks it instead (on the CPU; on CUDA
        # a scale that cannot unscale skips the step, as a tensor grad_scale does). Elsewhere it is checked here.
        traceable = torch.compiler.is_compiling() and _TRACED_STEP and self._backward is None
        traced_float = traceable and number_scale and isinstance(grad_scale, float) and not self.capturable
        if grad_scale is not None or found_inf is not None:
            _group_options.check_scaling_arguments(None if traced_float else grad_scale, found_inf)
        if traceable and self._init_group(unscales=grad_scale is not None, number_scale=number_scale):
            # Traced by torch.compile: _init_group ran outside the graph (validated everything, planned); what it
            # read is guarded by TorchDynamo, and the check below makes the plan's own rule part of those guards, so
            # any change re-traces (and re-validates) instead of stepping with a stale plan.
            if traced_float:
                device = next(p.device for group in self.param_groups for p in group["params"])
                grad_scale = torch.zeros((), dtype=torch.float64, device=device) + grad_scale
            plan = self._plan
            if not (plan.describes(self.param_groups, self.state, self._layout, native=False)
                    and all(planned.read_grads() for planned in plan.groups)):
                raise RuntimeError("ort_optim: a traced FusedAdam step found its plan out of date; please report")
            self._launch(plan, grad_scale, found_inf, traced=True)
            plan.forget()  # (as an eager step: zero_grad(set_to_none=True) then frees the gradients)
            return loss
        if traced_float:  # (not traced after all: checked as the eager step checks it)
            _group_options.check_scaling_arguments(grad_scale, None)
        if torch.compiler.is_compiling():
            # Not traced (an older TorchDynamo, whose inductor cannot functionalize an op that mutates tensor lists;
            # DTensor params, a process or pipeline group, ops that are not registered, step_in_backward, an option or
            # state that is refused): the update runs eagerly, one graph break, raising as it does eagerly
            self._update_outside_graph(grad_scale, found_inf)
        else:
            self._update(grad_scale, found_inf)
        return loss

    def _update(self, grad_scale, found_inf) -> None:
        """The step after its closure and argument checks: validate what changed, plan if needed, launch. One thread
        at a time: steps of one optimizer called from several threads run one after the other (torch.optim's
        optimizers make no such promise; here the native plans hold per-step data, which a second thread's step
        would overwrite under the first's kernel)."""
        with self._stepping:
            self._update_alone(grad_scale, found_inf)

    def _update_alone(self, grad_scale, found_inf) -> None:
        hypers = self._validate_options(grad_scale)
        # The one step path: the plan (valid, or built again after validating everything), then the backend ops.
        plan = self._plan
        groups, state, layout = self.param_groups, self.state, self._layout
        if plan is None or not (plan.serves_eager_steps() and plan.read_grads_if_valid(groups, state, layout)):
            if isinstance(grad_scale, torch.Tensor) and _on_the_cpu(grad_scale, groups):
                # (the op checks it at every step, but planning creates and converts states before the op runs)
                _group_options.check_grad_scale_value(float(grad_scale))
            self._reduction()  # (params on meshes it refuses: raised before the new plan creates any state)
            if grad_scale is not None or self.max_grad_norm is not None:
                self._check_norm_devices()
            plan = self._plan = _plan.build(groups, state, layout, unscales=grad_scale is not None and _UNSCALE_GRADS)
            # (a plan describes what it was built from: if not, this is a bug, not a user error)
            if not plan.read_grads_if_valid(groups, state, layout):
                raise RuntimeError(
                    "ort_optim: a FusedAdam plan was not valid right after it was built: another thread changed a param "
                    "or its gradient during step() (torch.utils.swap_tensors, .data =, .grad =); if none did, please "
                    "report")
        try:
            if plan.has_dtensors:  # (gradients laid out unlike their DTensor params: to their layout, once per step)
                plan.resolve_grads(writes_grads=grad_scale is not None and _UNSCALE_GRADS)
            self._launch(plan, grad_scale, found_inf, hypers)
        finally:
            plan.forget()  # (the gradients are the caller's again: zero_grad(set_to_none=True) frees them)
        if plan.traced:
            plan.stepped_eagerly()

    if not _TRACED_STEP:
        # Older TorchDynamo never traces the update, also where it runs step()'s own frame eagerly but compiles the
        # frames it calls (after it gave up on that frame: a step_in_backward optimizer compiled earlier in the
        # process made it compile _launch, whose op its inductor cannot functionalize).
        _update = torch._disable_dynamo(_update)

    @torch._disable_dynamo
    def _update_outside_graph(self, grad_scale, found_inf) -> None:
        """_update, run eagerly where a compiled function calls it: one function that TorchDynamo skips, the same at
        every call (a wrapper made per call is a new function each time, and each re-traces the calling frame)."""
        self._update(grad_scale, found_inf)

    def _init_group(self, unscales: bool = False, number_scale: bool = False) -> bool:
        """The part of a step that torch.compile cannot trace, run outside the graph: TorchDynamo calls an optimizer's
        ``_init_group`` eagerly when it traces ``step()`` (as for torch.optim's optimizers) and guards the state and
        gradients it then reads. Validates the options, then builds the plan (without native plans: the traced step
        calls the registered op, which traces as one node) unless the current one still holds. False where the traced
        path does not apply: DTensor params or a process/pipeline group (their collectives), ops that are not
        registered (ORT_OPTIM_BACKEND=torch, no native library), or a tensor eps or weight_decay (_HOST_READ_OPTIONS):
        the update then runs eagerly, outside the graph (_update_outside_graph). Also False for an option or a state it
        refuses: the eager update then raises the error itself (an error out of this call would reach the user wrapped
        in TorchDynamo's own). unscales: the step writes unscaled gradients back (a grad_scale), whose overlap check
        reads what a traced step cannot (a host int per non-contiguous gradient: a graph break, after which
        TorchDynamo's restarted analysis diverged).
        number_scale: that grad_scale is a number, which capturable=True refuses (before anything is planned).
        A tensor grad_scale's value is not read here (one made inside the compiled function is no value TorchDynamo
        can hand over): a first compiled step refused for it by the op has made the states by then."""
        try:
            self._validate_options(None)
        except (ValueError, TypeError):
            return False
        if any(isinstance(group[key], torch.Tensor) for group in self.param_groups for key in _HOST_READ_OPTIONS):
            return False
        if self.capturable and number_scale:
            return False
        if self.process_group is not None or self.pipeline_group is not None or self._has_dtensors:
            return False
        devices = {p.device for group in self.param_groups for p in group["params"]}
        if not all(backends.implementation(d) is torch.ops.ort_optim for d in devices):
            return False
        layout = self._layout
        plan = self._plan
        if plan is None or not (plan.describes(self.param_groups, self.state, layout, native=False)
                                and all(planned.read_grads_if_current() for planned in plan.groups)):
            try:
                if unscales or self.max_grad_norm is not None:
                    self._check_norm_devices()
                self._plan = _plan.build(self.param_groups, self.state, layout, traced=True, unscales=unscales)
            except (ValueError, TypeError):
                return False
        elif unscales:  # (a new plan checked them)
            try:
                _plan.check_grads_writable(list(self._plan.buckets()))
            except ValueError:
                return False
        # The optimizer's own tensors (states, masters, scales, steps) are guarded by identity, as torch.optim's
        # states are: a guard on each one's metadata (and on aliasing among them) cost more than the step itself on
        # small models (64 params of 16 x 16: 2277 guards, 0.68x torch.optim.AdamW's compiled step; by identity
        # 1491, 1.0x). Their metadata is the plan's to check (an in-place change of a state's shape or dtype makes the
        # compiled graph's input check raise, writing nothing); the params keep their metadata guards, so
        # `p.data = t` of other metadata re-traces and plans again as the eager step does (of the same metadata it
        # does not: the graph steps t, unchecked for memory shared with another param).
        static = [t for planned in self._plan.groups for bucket in planned.buckets
                  for t in [t for lst in bucket.state_lists() + [bucket.step_tensors] for t in lst] + [bucket.steps]]
        for tensor in static:
            torch._dynamo.mark_static_address(tensor, guard=True)
        _release_with(self, static + [p for group in self.param_groups for p in group["params"]])
        return True

    def _validate_options(self, grad_scale) -> list[dict]:
        """What a step checks before it plans: every group's options (those that changed since the last step that
        accepted them, or that are tensors: _group_options.CheckedGroups), capturable's demands, and clipping under a
        DeepSpeed optimizer that shows it part of the gradients (once). Returns each group's hyperparameters as the
        op's keyword arguments."""
        hypers = self._checked_groups.hyperparameters(self.param_groups, self._wide_options)
        _group_options.check_dtype_pair(self.exp_avg_dtype, self.exp_avg_sq_dtype)  # (each may have changed alone)
        if self.capturable:  # checked before anything changes (state creation included), like everything else
            self._check_capturable_grad_scale(grad_scale)
            for group_index, group in enumerate(self.param_groups):
                lr = group["lr"]
                if isinstance(lr, torch.Tensor):
                    for p in group["params"]:
                        if p.grad is not None and p.device != lr.device:
                            raise ValueError(f"param_groups[{group_index}]: capturable=True needs lr on the params' "
                                             f"device ({p.device}), got a tensor on {lr.device}")
        if self.max_grad_norm is not None and not self._partitions_checked:
            self._check_clipping_sees_every_partition()
        return hypers

    def _check_capturable_grad_scale(self, grad_scale) -> None:
        if self.capturable and grad_scale is not None and not isinstance(grad_scale, torch.Tensor):
            raise ValueError("capturable=True: pass grad_scale as a tensor on the params' device (a float is copied "
                             "to the device at every step, which a CUDA graph cannot capture)")

    def _check_norm_devices(self) -> None:
        """A step with grad_scale or max_grad_norm adds every gradient's squares into one norm (and one inf/NaN
        check), which a param on the meta device, without values, cannot join beside params with values: refused
        naming one of each, before anything changes (state creation included), where torch.nn.utils.clip_grad_norm_
        fails to copy out of the meta tensor."""
        meta = other = None
        for group_index, group in enumerate(self.param_groups):
            for index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.is_meta and meta is None:
                    meta = describe(group_index, index, p)
                elif not p.is_meta and other is None:
                    other = (describe(group_index, index, p), p.device)
        if meta is not None and other is not None:
            raise ValueError(
                f"{meta} is on the meta device and {other[0]} on {other[1]}: a step with grad_scale or max_grad_norm "
                "takes one norm (and one inf/NaN check) over the gradients of all param groups, and meta tensors "
                "have no values to add into it. Step the meta params with an optimizer of their own (or give them "
                "memory first: module.to_empty(device=...)), or set max_grad_norm=None and step without grad_scale. "
                "Nothing was changed")

    def _check_clipping_sees_every_partition(self) -> None:
        """Refuses max_grad_norm in an optimizer whose step() DeepSpeed shows only part of the model's gradients,
        before anything changes (ort_optim/integrations/deepspeed.py, clipping_holder):

        * ZeRO stages 1-3 (and BF16_Optimizer) step it on this rank's partition only: alone it would clip every rank
          by the norm of its own slice of the gradients, and skip alone on an inf/NaN, where the model's norm is the
          sum over the partitions (measured, 2 ranks, 5 steps: 5e-3 away from DeepSpeed's own gradient_clipping); a
          process_group would count the partitions as replicas. ``pipeline_group`` (the ZeRO data-parallel group)
          adds the partitions' sums.
        * ZeRO stages 1-3 call step() once per param group (stage 3: per sub-group), each call seeing one group's
          gradients, whatever the world size: each group would be clipped by its own norm (measured, 2 groups, 5
          steps: 1.5e-3 to 7.8e-3 away from DeepSpeed's gradient_clipping, with or without pipeline_group). No
          option of FusedAdam adds the groups' sums: DeepSpeed's gradient_clipping is the way.

        Runs once, a heap scan, only where DeepSpeed is imported and torch.distributed initialised."""
        scanned, holder, partitioned, apart = deepspeed.clipping_holder(self)
        if holder is not None and apart > 1:
            raise ValueError(
                f"FusedAdam(max_grad_norm={self.max_grad_norm}) is stepped by DeepSpeed's {type(holder).__name__} "
                f"one param group at a time ({apart} step() calls per step, one per param group or ZeRO-3 "
                "sub-group, each seeing only that group's gradients), so it would clip each group by its own norm, "
                "not the model's. Nothing was updated. Leave max_grad_norm=None and set DeepSpeed's "
                "\"gradient_clipping\" in its config (DeepSpeed clips every group by the norm of the whole model)")
        if holder is not None and partitioned and self.pipeline_group is None:
            raise ValueError(
                f"FusedAdam(max_grad_norm={self.max_grad_norm}) is stepped by DeepSpeed's {type(holder).__name__} "
                "on this rank's partition of the gradients only, so it would clip every rank by the norm of its own "
                "partition, not the model's. Nothing was updated. Leave max_grad_norm=None and set DeepSpeed's "
                "\"gradient_clipping\" in its config (DeepSpeed clips the partitions by the global norm), or pass "
                "pipeline_group=<the ZeRO data-parallel group> (engine.optimizer.dp_process_group): the partitions "
                "are disjoint, like pipeline stages, and their sums of squares are then added")
        self._partitions_checked = scanned

    def _launch(self, plan: _plan.Plan, grad_scale, found_inf, hypers: Optional[list[dict]] = None,
                traced: bool = False) -> None:
        """The one route from a valid plan to the kernels, whatever the backend: every bucket has a runner
        (ort_optim.backends: check, stats, step; the plan has checked them). A step that unscales or clips first
        reduces the buckets' gradient statistics into one (over the ranks too, when they decide together), from which
        backends.scaling makes the multiplier and the skip flag; then one runner step per bucket applies them. Sets
        the step's report: last_grad_norm and last_found_inf. hypers: each group's hyperparameters as validated
        (_validate_options). traced: the step is traced by torch.compile (its float lr and betas go to the op as
        tensors, see _traced_hyperparameters)."""
        buckets = list(plan.buckets())
        scaled = grad_scale is not None or self.max_grad_norm is not None
        # (the reduction carries the clipping norm and the skip decision: needed only when the step computes them;
        # the valid plan knows whether there are DTensor params, which spares a scan of every param per step)
        reduction = self._reduction(has_dtensors=plan.has_dtensors) if scaled else None
        if not buckets and reduction is None:
            # No gradient at all: nothing to update or check. The norm is 0, as clip_grad_norm_ returns for no
            # gradients, wherever a step with gradients would report one (not the rest of updates in backward).
            self._last["found_inf"] = None
            device = next((p.device for group in self.param_groups for p in group["params"]), _plan.CPU)
            reports = scaled or (
                _PLAIN_NORM and not self._finishes_backward and self._decides_alone(plan.has_dtensors)
                and (backends.runs_natively(device) or backends.update_reports_grad_norm(device)))
            self._last["grad_norm"] = torch.zeros((), dtype=torch.float32, device=device) if reports else None
            return
        unscaled = self._grad_scale_per_device(buckets, grad_scale) if grad_scale is not None else None
        if scaled:
            devices = list(dict.fromkeys(bucket.params[0].device for _, _, bucket in buckets)) or [
                next((p.device for group in self.param_groups for p in group["params"]), _plan.CPU)]
            if len(devices) > 1 and any(device.type == "meta" for device in devices):
                self._check_norm_devices()  # (raises, naming them)
            stats = self._global_grad_stats(buckets, backends.main_device(devices), reduction)
            multiplier, grad_norm, skip = backends.scaling(stats, grad_scale, self.max_grad_norm, found_inf)
            per_device = {device: backends.to_device(multiplier, device).reshape(1) for device in devices}
            scaling = backends.Scaling(per_device, skip, unscaled)
            report = {"grad_norm": grad_norm, "found_inf": skip}
        else:  # (then there are buckets: a step without any returned above)
            scaling = backends.Scaling(found_inf=found_inf)
            # The caller's own tensor (any dtype, 0-dim or not, a buffer it may zero for the next iteration, as apex's
            # overflow buffer is): last_found_inf is this step's verdict as a float32 [1] of its own on the params'
            # device (the first bucket's), computed there (no host sync), so a reference kept to it does not change
            # with the buffer.
            report = {"grad_norm": None, "found_inf": None if found_inf is None else (
                found_inf.to(buckets[0][2].params[0].device).reshape(()) != 0).float().reshape(1)}
        if unscaled and not traced and (len(buckets) > 1 or buckets[0][2].native is None):  # (traced: _init_group)
            _plan.check_grads_writable(buckets)
        # A plain step reports the norm too where the update's own pass can sum the squares it reads.
        plain_norm = self._plain_norm_from_update(plan, buckets, grad_scale, found_inf)
        stats = []
        for index, (group_index, group, bucket) in enumerate(buckets):
            try:
                hyper = _traced_hyperparameters(group, bucket.steps.device) if traced else hypers[group_index]
                if traced and index == 0 and len(self.param_groups) > 1:
                    hyper["group_hyperparameters"] = _group_hyperparameters(self.param_groups, bucket.steps.device)
                stats.append(bucket.runner.step(hyper, scaling, grad_norm=plain_norm))
            except (RuntimeError, ValueError) as exc:  # (the plan validated the inputs: this names what it missed)
                raise _plan.name_op_error(exc, group_index, bucket) from exc
        if plain_norm:  # the buckets' sums of squares added in bucket order, as _global_grad_stats
            if len(stats) == 1:
                total = stats[0]
            else:
                main = backends.main_device(s.device for s in stats)
                total = sum(backends.to_device(s, main) for s in stats)
            report["grad_norm"] = sqrt_f32(total[0])
        if traced and report["found_inf"] is not None:
            report["found_inf"] = _read_after(report["found_inf"], buckets[-1][2].steps)
        self._last.update(report)  # (after the updates: a step that raised reports what the last one did)

    def _plain_norm_from_update(self, plan: _plan.Plan, buckets: list, grad_scale, found_inf) -> bool:
        """Whether this step's update passes report the gradients' norm (last_grad_norm without a stats pass): a
        plain step (no grad_scale or max_grad_norm; a found_inf alone is fine: a pass it skips reports NaN) of one
        process over plain params, every bucket's runner able to (the native CPU plans and the Triton kernels sum the
        squares of the gradients they load), and not the remainder of updates that step_in_backward made in backward
        since the last step() or zero_grad() (its norm would be of that remainder only). Elsewhere (the reference
        backend, DTensor or process_group steps, whose norm would have to be all-reduced) a plain step leaves
        last_grad_norm None: all buckets or none."""
        return (_PLAIN_NORM and grad_scale is None and self.max_grad_norm is None
                and not self._finishes_backward and bool(buckets) and self._decides_alone(plan.has_dtensors)
                and all(bucket.runner.reports_norm for _, _, bucket in buckets))

    def _grad_scale_per_device(self, buckets: list, grad_scale) -> Optional[dict]:
        """grad_scale as a one-element float32 tensor per device, for the op to write p.grad back unscaled (as
        torch's fused AdamW does); None when there is no grad_scale."""
        if grad_scale is None or not _UNSCALE_GRADS:
            return None
        devices = dict.fromkeys(bucket.params[0].device for _, _, bucket in buckets)
        if isinstance(grad_scale, torch.Tensor):
            return {d: backends.to_device(grad_scale, d, torch.float32).reshape(1) for d in devices}
        # (a fill on the device, not a copy from the host: no synchronisation)
        return {d: torch.full((1,), float(grad_scale), dtype=torch.float32, device=d) for d in devices}

    @staticmethod
    def _global_grad_stats(buckets: list, device: torch.device, reduction: Optional[dtensor.Reduction] = None
                           ) -> torch.Tensor:
        """float32 [2] on device: [sum of squares of every gradient of the step, non-zero if any is inf/NaN], one
        grad_stats pass per bucket, added in bucket order (deterministic). The one place where the gradients'
        global statistics are reduced: over the ranks of `reduction` too when there is one, in the step's one
        collective (integrations/dtensor.py), each gradient weighted by 1 / (the ranks holding the same elements)."""
        per_bucket = [FusedAdam._bucket_stats(group, bucket, reduction) for _, group, bucket in buckets]
        if not per_bucket:  # (a rank without gradients: its share of the reduction)
            return dtensor.all_reduce_stats(torch.zeros(2, dtype=torch.float32, device=device), reduction)
        stats = sum(backends.to_device(s, device) for s in per_bucket)
        return dtensor.all_reduce_stats(stats, reduction)

    @staticmethod
    def _bucket_stats(group: dict, bucket: _plan.Bucket, reduction: Optional[dtensor.Reduction]) -> torch.Tensor:
        """grad_stats of a bucket's gradients (weighted for the reduction, when there is one)."""
        if reduction is None:
            return bucket.runner.stats()
        if bucket.native is not None:  # (plain params only: DTensor buckets have none), so one weight for all
            return bucket.runner.stats() * dtensor.weight(bucket.params[0], reduction)
        by_weight: dict[float, list[torch.Tensor]] = {}
        for i, g in zip(bucket.indices, bucket.grads):
            by_weight.setdefault(dtensor.weight(group["params"][i], reduction), []).append(g)
        return sum(backends.grad_stats(grads) * w for w, grads in by_weight.items())

    def _decides_alone(self, has_dtensors: bool) -> bool:
        """Whether this process's gradients are all the gradients of the step (no process_group, pipeline_group
        or DTensor params): their norm and inf/NaN check need no collective."""
        return self.process_group is None and self.pipeline_group is None and not has_dtensors

    def _reduction(self, has_dtensors: Optional[bool] = None) -> Optional[dtensor.Reduction]:
        """Where the global norm and skip decision are all-reduced (None: this process decides alone).
        has_dtensors: whether any param is a DTensor, when the caller knows (a valid plan does)."""
        if self._decides_alone(self._has_dtensors if has_dtensors is None else has_dtensors):
            return None
        return dtensor.reduction_for((p for group in self.param_groups for p in group["params"]), self.process_group,
                                     self.pipeline_group)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clears the gradients; set_to_none defaults to the constructor's set_grad_none (True, as ORT). With
        step_in_backward, first raises as step() does if a param updated in backward has a gradient again
        (DistributedDataParallel), and connects the hooks of params swapped by torch.utils.swap_tensors again."""
        if self._backward is not None:
            self._backward.check_updated_once()
            self._backward.restore_hooks()
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    # ---- states one at a time (TransformerEngine's FusedAdam's accessors) ---------------------------------------

    # The states get_unscaled_state and set_scaled_state name: TransformerEngine's three, and amsgrad's running maximum.
    _STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param", "max_exp_avg_sq")

    def _state_entry(self, param: Any, state_name: Any, verb: str) -> tuple[str, torch.Tensor, Optional[dict], dict]:
        """(the param's description, its local tensor, its state or None, its param group) for the state accessors,
        after checking that state_name is one they take and that param is one of this optimizer's params."""
        if not isinstance(state_name, str) or state_name not in self._STATE_NAMES:
            raise StateNameError(f"{verb}: state_name must be one of {', '.join(map(repr, self._STATE_NAMES))}, "
                                 f"got {state_name!r}")
        for group_index, group in enumerate(self.param_groups):
            for index, p in enumerate(group["params"]):
                if p is param:
                    state = self.state.get(p)
                    return describe(group_index, index, p), dtensor.local(p), (state if state else None), group
        got = (f"a tensor of shape {tuple(param.shape)}, {param.dtype}" if isinstance(param, torch.Tensor)
               else type(param).__name__)
        raise ValueError(f"{verb}: param must be one of this optimizer's params (the tensor listed in param_groups), "
                         f"got {got}")

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """The state ``state_name`` of ``param`` as its values: a fresh float32 tensor of the param's shape (float64
        for a float64 param's moments; a DTensor param's local piece), decoded from whatever format it is stored in
        (float32, bfloat16, fp16 with block scales, 8-bit, 4-bit, fp8), as ``state_dict()`` saves it.
        TransformerEngine's FusedAdam's method of the same name and arguments: ``state_name`` is ``'exp_avg'``,
        ``'exp_avg_sq'`` (v itself, not its square root as fp16 and fp8 store it), ``'master_param'`` or, with
        amsgrad, ``'max_exp_avg_sq'``. Where TE hands back the state tensor itself for a float32 state (writing into
        it writes the state), this always returns a copy: write values with :meth:`set_scaled_state`. A param
        without that state (not stepped yet; no master without master_weights) or an unknown ``state_name`` raises
        :class:`StateNameError` naming it (a KeyError, as TE raises, and a ValueError); a tensor that is not one of
        this optimizer's params raises ValueError."""
        where, local, state, _ = self._state_entry(param, state_name, "get_unscaled_state")
        if state is None or state_name not in state:
            raise StateNameError(f"get_unscaled_state: {where} has no {state_name!r} state"
                                 + (" yet (its first step makes it)" if state is None else ""))
        if state_name == "master_param":
            return state["master_param"].detach().to(torch.float32, copy=True)
        return _checkpoint.to_canonical(state, state_name, local.shape)

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Writes values into the state ``state_name`` of ``param``, encoded into the format it is stored in
        (float32, bfloat16, fp16 with block scales, 8-bit, 4-bit, fp8; rounded to nearest, as a loaded checkpoint
        is), so that :meth:`get_unscaled_state` then returns them as that format holds them. TransformerEngine's
        FusedAdam's method of the same name and argument order (``state_name`` as there, plus ``'max_exp_avg_sq'``
        with amsgrad). ``unscaled_state``: a float32 tensor (float64 for a float64 param's moments; TE takes float32
        only) of the param's shape (a DTensor param's local piece), on any device; second moments non-negative. It
        is read, never written (TE scales it in place). A param not stepped yet gets its state first, as its first
        step would make it (step 0, zero moments, the master from the param), as TE makes the missing state; a
        state the optimizer does not keep (``'master_param'`` without master_weights, ``'max_exp_avg_sq'`` without
        amsgrad) is refused. A 4-bit ``'exp_avg'`` is coded relative to ``'exp_avg_sq'`` as stored at the call: set
        ``'exp_avg_sq'`` first (as load_state_dict writes them); values it cannot code (non-zero where its sqrt(v) is
        0, as in a state not made yet: TE's order, exp_avg first) are refused, and setting ``'exp_avg_sq'``
        afterwards keeps ``'exp_avg'`` as that format held it. Finite values the storage cannot hold (float32's
        largest in bfloat16 moments) are refused, as load_state_dict refuses them; inf and NaN are stored as given,
        with a RuntimeWarning, as load_state_dict stores and warns about them. Anything refused raises ValueError or
        TypeError naming it, and changes nothing."""
        where, local, state, group = self._state_entry(param, state_name, "set_scaled_state")
        what = f"set_scaled_state({where}, {state_name!r})"
        *_, has_master = self._layout.dtypes(local)
        kept = {"master_param": has_master, "max_exp_avg_sq": bool(group["amsgrad"])}.get(state_name, True)
        if not (kept or (state is not None and state_name in state)):
            raise ValueError(f"{what}: this optimizer keeps no such state for it ("
                             + ("master_weights=False, or the param is not float16/bfloat16" if state_name ==
                                "master_param" else "amsgrad=False") + ")")
        if not isinstance(unscaled_state, torch.Tensor):
            raise TypeError(f"{what}: unscaled_state must be a tensor, got {type(unscaled_state).__name__}")
        dtype = torch.float32 if state_name == "master_param" else _checkpoint.canonical_dtype(local)
        if unscaled_state.dtype != dtype or unscaled_state.layout != torch.strided:
            raise TypeError(f"{what}: unscaled_state must be a dense {dtype} tensor (the state's values, unscaled), "
                            f"got {unscaled_state.dtype}" + ("" if unscaled_state.layout == torch.strided else
                                                            f" ({unscaled_state.layout})"))
        if unscaled_state.shape != local.shape:
            raise ValueError(f"{what}: unscaled_state has shape {tuple(unscaled_state.shape)}, the param "
                             f"{tuple(local.shape)}")
        _checkpoint.require_data(unscaled_state, what)
        if local.is_meta:
            raise ValueError(f"{what}: the param is on the meta device, whose states hold no values")
        values = unscaled_state.detach().to(local.device, copy=True)
        if state_name not in ("exp_avg", "master_param") and bool((values < 0).any()):
            raise ValueError(f"{what}: unscaled_state holds negative values; a second moment is a mean of squares")
        if state_name == "exp_avg" and self._uncodable_exp_avg(local, state, values):
            raise ValueError(f"{what}: a 4-bit exp_avg is coded relative to its exp_avg_sq (m / sqrt(v)), whose "
                             "sqrt(v) is 0 where unscaled_state is not" + (" (no state yet)" if state is None else "")
                             + ": set 'exp_avg_sq' first, then 'exp_avg' (the order load_state_dict writes them in)")
        # Written into copies of what changes (a state not made yet: made as the first step makes it), stored by the
        # rule load_state_dict stores by (a finite value the storage cannot hold is refused), then put in place.
        trial = self._layout.init_state(local, bool(group["amsgrad"])) if state is None else dict(state)
        if state_name not in trial:  # (a master or maximum switched on since the state was made)
            fresh = self._layout.init_state(local, True)
            trial.update({key: fresh[key] for key in (state_name, state_name + "_scale") if key in fresh})
        relative = "exp_avg" in trial and formats.is_relative(trial["exp_avg"], trial.get("exp_avg_scale"))
        written = [state_name] + (["exp_avg"] if state_name == "exp_avg_sq" and relative else [])
        keys = [key for name in written for key in (name, name + "_scale") if key in trial]
        if state is not None:
            trial.update({key: trial[key].detach().clone() for key in keys if key in state})
        exp_avg = _checkpoint.to_canonical(trial, "exp_avg", local.shape) if len(written) > 1 else None
        finite = bool(torch.isfinite(values).all())
        diverged = state_name != "master_param" and not finite
        _checkpoint.store(trial, state_name, values, dtype, diverged, f"{what}: unscaled_state")
        if exp_avg is not None:  # (coded relative to exp_avg_sq: again, against its new values)
            _checkpoint.store(trial, "exp_avg", exp_avg, dtype, diverged, f"{what}: exp_avg, coded again against it,")
        if state is None:
            self.state[param] = trial
        else:
            for key in keys:
                if key in state:
                    state[key].copy_(trial[key])
                else:
                    state[key] = trial[key]
        if not finite:
            warnings.warn(f"{what}: unscaled_state holds inf or NaN; stored as given (an inf second moment keeps its "
                          "element's update at 0, as in torch.optim.AdamW; a NaN moment or master makes its element "
                          "of the param NaN at the next step)", RuntimeWarning, stacklevel=2)

    def _uncodable_exp_avg(self, local: torch.Tensor, state: Optional[dict], values: torch.Tensor) -> bool:
        """Whether exp_avg values cannot be held by a 4-bit exp_avg (relative to its exp_avg_sq): non-zero where the
        stored exp_avg_sq's sqrt(v) is 0 (everywhere in a state not made yet), which codes as 0."""
        if state is not None and "exp_avg" in state:
            if not formats.is_relative(state["exp_avg"], state.get("exp_avg_scale")):
                return False
            root = formats.state_root(state["exp_avg_sq"].detach(), state.get("exp_avg_sq_scale"), local.shape)
            return bool(((root == 0) & (values != 0)).any())
        return self._layout.dtypes(local)[0] == torch.uint4 and bool((values != 0).any())

    # ---- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch.optim.AdamW's layout in canonical form: fresh tensors, moments and masters unscaled float32
        (float64 for float64 params), a float64 per-parameter ``step`` (torch's AdamW keeps a float32 one, which stops
        counting at 2**24; torch loads either and reads it as a number). It loads into FusedAdam with any state
        dtypes, into torch.optim.AdamW (and, as every group also saves ``decoupled_weight_decay``, True but for
        ``ADAM_L2_REGULARIZATION``, into torch >= 2.5's ``Adam(decoupled_weight_decay=True)``; the groups' keys do
        not depend on the mode, which DCP's loads by key need), and with ``torch.load(weights_only=True)``
        (numpy scalars that an LR scheduler put into the groups are saved as Python numbers, enums as ints). The
        per-element states of DTensor params are DTensors laid out like their params (``step`` stays a plain tensor),
        which is what ``torch.distributed.checkpoint`` saves and reshards. Params on the meta device (a model built
        there for deferred initialisation) have their states there, ``step`` included (torch.optim keeps its step
        count on the CPU), and their checkpoint holds meta tensors. Hooks registered with
        ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` run as in torch.optim: the pre hooks
        first, before the groups and states are read (a pre hook may drop the state of a param it took out of
        ``param_groups``), the post hooks last, on this canonical form (which they may replace). Entries of
        ``optimizer.state[p]`` that the optimizer does not keep (``state[p]['my_ema'] = t``) are left out, with a
        RuntimeWarning naming them, where torch.optim saves them: load_state_dict refuses unknown state keys, which is
        how another optimizer's checkpoint shows."""
        # The hooks run here, in torch.optim.Optimizer.state_dict's order around what this method makes: the pre
        # hooks first, before anything is read (one may tidy optimizer.state or the groups), the post hooks on the
        # canonical form. torch's state_dict, which packs, runs with no hooks of its own to run, so a hook that a
        # pre hook registers is in the optimizer's own table, as it is in torch's.
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        params = [p for group in self.param_groups for p in group["params"]]  # torch's ids are these positions
        self._drop_state_of_removed_params(params)
        pre_hooks, post_hooks = self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_pre_hooks = type(pre_hooks)()
        self._optimizer_state_dict_post_hooks = type(post_hooks)()
        try:
            packed = super().state_dict()
        finally:
            self._optimizer_state_dict_pre_hooks = pre_hooks
            self._optimizer_state_dict_post_hooks = post_hooks
        # (4-bit codes are flat: decoding needs each param's shape, its local piece's for DTensor params)
        sd = _checkpoint.canonical(packed, {i: dtensor.local(p).shape for i, p in enumerate(params)
                                            if not torch.nn.parameter.is_lazy(p)})  # (no state before its forward)
        if self._has_dtensors:
            for index, state in sd["state"].items():
                for key in MOMENT_KEYS + ("master_param",):
                    if key in state:
                        state[key] = dtensor.wrap_like(params[index], state[key])
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _drop_state_of_removed_params(self, params: list) -> None:
        """A checkpoint numbers states by their params' positions in param_groups, so a state whose tensor is in no
        group has no number (torch.optim raises a bare KeyError there). An empty one (left by reading
        ``optimizer.state[p]``) holds nothing and is dropped; one with state tensors is refused, naming it, before
        anything changes: dropping it silently would lose moments the user may still want."""
        listed = {id(p) for p in params}
        removed = [t for t in self.state if id(t) not in listed]
        for t in removed:
            if self.state[t] and not isinstance(t, torch.Tensor):
                raise ValueError(
                    f"state_dict(): optimizer.state[{t!r}] is keyed by something other than a param: FusedAdam keeps "
                    "only per-param state, which a checkpoint numbers by the params' positions (torch.optim saves "
                    "such entries as they are). Keep optimizer-wide values outside optimizer.state (an attribute, "
                    "or a key of your own checkpoint dict) and delete this one (del optimizer.state[key])")
            if self.state[t]:
                what = f"a tensor of shape {tuple(t.shape)}, {t.dtype}"
                raise ValueError(
                    f"state_dict(): optimizer.state holds the state of {what} that is in no param group (a param "
                    "removed from param_groups after it was stepped), and a checkpoint can only number the states "
                    "of listed params. Delete it (del optimizer.state[p]) to save without it, or put the param back "
                    "into a param group (add_param_group) to save it")
        for t in removed:
            del self.state[t]

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a FusedAdam, torch.optim.Adam/AdamW or ORT FusedAdam checkpoint, or one of torchao's or
        bitsandbytes' low-bit Adam optimizers, all or nothing (with DTensor params on every rank: each checks its own
        pieces, and where one refuses, every rank raises before anything changes).

        Every entry is checked before anything changes, strictly: group options must have their types (``maximize``,
        ``amsgrad`` and ``bias_correction`` real bools: a ``"False"`` from a JSON/YAML export is refused, not read as
        True; ``adam_w_mode`` an AdamWMode or the int 0/1/2), numbers finite and in range; every parameter id an int
        (or a parameter name) listed once (torch.optim's load reads the bools True and False as the ids 1 and 0,
        which equal them as dict keys; no state_dict() saves a bool, so FusedAdam refuses one, as wherever an int
        belongs); each state a dict of exactly the Adam keys, its ``step`` a whole number in [0, 2**53] (a number or
        a one-element tensor), its moments and master floating-point tensors of the parameter's shape (second moments
        non-negative; finite values that overflow when converted to float32 are refused). A bad entry raises
        ValueError (bad value) or TypeError (wrong type) naming it, for example ``state_dict['state'][3]['step']``,
        and leaves the optimizer as it was.

        A checkpoint this optimizer saved while it could step always loads, and resuming from it equals not stopping,
        bit for bit: the checks refuse malformed input, not values training produces (one saved after ``amsgrad`` was
        switched on mid-run, which its step refuses too, is refused alike: its states have no ``max_exp_avg_sq``; one
        saved after amsgrad was switched off keeps its ``max_exp_avg_sq``, as the run and torch.optim's load do, so
        switching amsgrad on again resumes alike).
        inf and NaN in moments and masters load as they are, with a RuntimeWarning naming the entries: a second
        moment whose square overflowed float32 is inf, as torch.optim.AdamW keeps it (that element's update stays 0,
        in fp32 and low-bit moments alike), and a run that diverged before it was saved has inf/NaN moments or masters
        (torch loads them too). A finite value that this optimizer's storage dtype cannot hold (beyond bfloat16's
        range, say) is refused. Then new state tensors are built as copies in this optimizer's storage dtypes: the
        given dict and its tensors are never written to, so loading the same dict twice equals loading it once. Each
        entry is checked where it is and converted into its state a piece of 2**20 elements at a time, so the load's
        memory is the new state plus temporaries of about one piece (guides/migration.md, "Checkpoints"; the pieces
        store the same bits as a conversion of the whole entry). A
        state without ``master_param`` (a checkpoint of an optimizer without master weights) gets its master at the
        param's next step, from the param as it is then, as a state made before ``master_weights`` was switched on
        does: model weights loaded after this call are kept. So does a
        state whose ``master_param`` is in its param's float16/bfloat16 dtype, which is what torch.optim's load
        makes of FusedAdam's float32 master (it casts state tensors to the param's dtype and then never updates
        that key: after torch.optim.AdamW trained on, the master is the one of the step before torch's first). Such
        a master holds no more than the param, so leaving it out loses nothing and keeps what torch trained.

        Into params on the meta device (a model built there for deferred initialisation) a checkpoint loads as into
        torch.optim's: its entries are checked as above (values where they are, a piece at a time, so that the load
        makes no full-size copy of them; a meta checkpoint, this optimizer's over meta params, has none), and the
        states made are on the meta device, without values.

        Group options missing from the checkpoint keep this optimizer's values (ORT's FusedAdam saves no
        ``adam_w_mode``, ``amsgrad`` or ``maximize``; torch's no ``adam_w_mode``), and ORT's per-group ``step``
        becomes every listed parameter's step; apex's, DeepSpeed's and TransformerEngine's FusedAdam save theirs alike
        and load alike (TransformerEngine's float32 ``master_param`` included; its ``store_param_remainders=True``
        form, an int16 ``master_param`` holding half of each master, is refused, the error saying what to do).
        torch's implementation switches (``foreach``, ``fused``, ...) are dropped. Other keys (a scheduler's
        ``initial_lr``, your own tags) are kept, as torch keeps them.

        torch.optim.Adam with ``weight_decay > 0`` is L2 decay with torch's eps placement, which no FusedAdam mode
        reproduces: its checkpoints are refused where that can be told, that is when the group says
        ``decoupled_weight_decay=False`` (torch >= 2.5 saves it). Checkpoints of torch 2.4 and earlier cannot be told
        apart from torch.optim.AdamW's (same keys, same state): they load as decoupled decay with this optimizer's
        ``adam_w_mode``, so know where yours came from. To load such moments deliberately, put ``adam_w_mode`` in the
        checkpoint's groups.

        Low-bit optimizers of other libraries (ort_optim/_migration.py, guides/low-bit-states.md "Migrating from
        torchao and bitsandbytes"): the state_dicts of torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8``
        (torchao 0.18) and of bitsandbytes' ``Adam8bit``, ``AdamW8bit`` and their paged variants (bitsandbytes 0.50)
        are recognised and read as canonical checkpoints first. Each moment is decoded exactly as its library does,
        ``value = qmap[code] * scale[block]`` in float32 (fp8 codes are their own values; params under 4096
        elements have plain float32 moments), and then stored as every checkpoint is, in this optimizer's moment dtypes
        (8-bit and 4-bit moments are quantised once more, in their own formats). Each moment is decoded a piece at a
        time where it is checked and stored, never whole (into params on the meta device: checked, and not kept),
        except into DTensor params: each rank decodes every moment whole, once, to cut its piece from it as from a
        full tensor. Steps are kept; lr, betas, eps,
        weight_decay (and torchao's amsgrad) are taken from the groups, with ``adam_w_mode=ADAMW_TORCH``,
        ``bias_correction=True`` and ``maximize=False``: both libraries' update is torch.optim.AdamW's (bitsandbytes'
        Adam8bit too: its step decays like AdamW's; its CUDA kernel decays after the update, a difference of lr * wd
        times the update). bitsandbytes' extra group options (AdEMAMix's ``alpha``, ``t_alpha``, ``t_beta3``;
        ``max_unorm``, ``percentile_clipping``, ...) are accepted only at the value that leaves Adam's step as it is
        (``alpha=0``, ``t_alpha=None``, ...) and with the type bitsandbytes stores (``skip_zeros=0`` and
        ``min_8bit_size=True`` are refused: a bool is not an int there, nor an int a bool), and refused otherwise,
        naming the key. A layout that is not exactly one of these (another torchao state class, a bitsandbytes key
        of another optimizer or version, codes without their ``qmap``, any other tensor subclass) is refused naming
        the entry, and nothing changes. torchao's Adam8bit/4bit/Fp8 save the same layout as its AdamW classes and
        load as AdamW: with weight_decay > 0 their L2 decay cannot be told from the checkpoint.

        Hooks registered with ``register_load_state_dict_pre_hook`` (given a shallow copy of ``state_dict``; what
        one returns is loaded instead) and ``register_load_state_dict_post_hook`` run as in torch.optim.
        """
        # The hooks of torch.optim.Optimizer.load_state_dict, as it runs them: the pre hooks on a shallow copy (they
        # may return a new dict), the post hooks after loading.
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        source = _migration.source_of(state_dict)  # torchao's, bitsandbytes': read as canonical
        state_dict = _migration.canonical_checkpoint(state_dict)
        try:
            if self._has_dtensors:
                try:
                    prepared = self._prepare_local_load(state_dict)
                except (ValueError, TypeError) as refused:
                    self._agree_on_load(refused)
                    raise
                self._agree_on_load(None)
            else:
                prepared = _checkpoint.prepare_load(self.param_groups, state_dict, self._wide_options)
        except (ValueError, TypeError) as error:
            if source is None:  # (not read from another library's layout)
                raise
            raise _migration.explain_entry(error, source) from error
        for group, new_group in zip(self.param_groups, prepared.groups):
            params = group["params"]
            group.clear()
            group.update(new_group, params=params)
        self.state.clear()
        self.state.update(prepared.state)  # (the state's version changes: the next step plans again)
        _checkpoint.warn_nonfinite(prepared.nonfinite, "" if source is None else _migration.entry_note(source))
        _checkpoint.warn_dropped_masters(prepared.dropped_masters)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _agree_on_load(self, refused: Optional[Exception]) -> None:
        """A load into DTensor params is checked on each rank's pieces, so one rank can refuse what another accepts
        (a bad element in its rows of a full checkpoint): the ranks all-reduce whether any refused, over the group the
        steps decide over, and each raises before anything changes where one did, so that all load or none."""
        reduction = self._reduction(has_dtensors=True)
        if reduction is None:
            return
        device = next(dtensor.local(p).device for group in self.param_groups for p in group["params"])
        flags = dtensor.all_reduce_stats(
            torch.tensor([0.0, 1.0 if refused else 0.0], dtype=torch.float32, device=device), reduction)
        if refused is None and float(flags[1]) > 0:
            raise ValueError("load_state_dict: another rank refused this checkpoint for its own pieces of the DTensor "
                             "states (its error names the entry), so this rank loads nothing either; nothing changed")

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
                    if isinstance(saved.get(key), _checkpoint.Decoded):  # (another library's moment: whole, to cut)
                        saved[key] = saved[key].full()
                    if isinstance(saved.get(key), torch.Tensor):
                        where = _checkpoint.entry("state", saved_id, key)
                        saved[key] = dtensor.local_like(p, saved[key], where)
                local_state[saved_id] = saved
            state_dict = {**state_dict, "state": local_state}
        except (KeyError, TypeError, AttributeError):
            pass
        locals_ = [{**group, "params": [dtensor.local(p) for p in group["params"]]} for group in self.param_groups]
        prepared = _checkpoint.prepare_load(locals_, state_dict, self._wide_options)
        param_of = {id(dtensor.local(p)): p for group in self.param_groups for p in group["params"]}
        prepared.state = {param_of[id(local)]: state for local, state in prepared.state.items()}
        return prepared

    # ---- conversion ---------------------------------------------------------------------------------------------

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **kwargs) -> "FusedAdam":
        """An equivalent FusedAdam (param groups, hyperparameters and state) for a torch.optim.Adam or AdamW.

        Both map to ``AdamWMode.ADAMW_TORCH`` (torch's eps placement), so the result continues exactly as torch
        would. torch.optim.Adam with weight_decay > 0 (L2 decay with torch's eps placement) has no FusedAdam mode
        and is refused rather than converted approximately. Extra keyword arguments set the options torch's
        optimizers do not have (master_weights, exp_avg_dtype, max_grad_norm, ...) and are passed to the constructor;
        the math's options (lr, betas, eps, weight_decay, amsgrad, maximize, adam_w_mode, bias_correction) come from
        the optimizer and are refused here (change them in ``param_groups`` afterwards if you mean to). A
        learning-rate scheduler made on ``optimizer`` keeps scheduling ``optimizer``'s groups, not the result's: make
        it again on the result, load the old one's ``state_dict()`` and set each group's lr to its ``get_last_lr()``
        (guides/migration.md). A torchao or bitsandbytes Adam optimizer is refused naming the way its run continues:
        ``load_state_dict(its state_dict())`` (their other optimizers' states follow other update rules, which
        load_state_dict refuses).
        """
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            hint = "" if not _migration.reads_state_dict_of(optimizer) else (
                f"; a {_migration.library(optimizer)} optimizer's run continues through its state_dict: "
                "FusedAdam(params, ...).load_state_dict(optimizer.state_dict()) reads torchao's and bitsandbytes' "
                "Adam layouts (guides/low-bit-states.md, \"Migrating from torchao and bitsandbytes\")")
            raise TypeError(
                f"FusedAdam.from_optimizer converts torch.optim.Adam and torch.optim.AdamW, got "
                f"{type(optimizer).__name__}{hint}"
            )
        fixed = sorted(set(kwargs) & {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "adam_w_mode",
                                      "bias_correction"})
        if fixed:  # (as defaults they would be silently overridden by the groups' values)
            raise TypeError(
                f"FusedAdam.from_optimizer: {', '.join(fixed)} come from the optimizer's param groups, so that the "
                f"result computes what it computed; set them in the returned optimizer's param_groups instead")
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        groups = []
        for index, group in enumerate(optimizer.param_groups):
            if group.get("differentiable"):
                raise _group_options.differentiable_refused(f"param_groups[{index}]: differentiable")
            if not decoupled and group["weight_decay"] != 0 and not group.get("decoupled_weight_decay", False):
                raise _group_options.torch_adam_l2_refused(
                    f"param_groups[{index}]: decoupled_weight_decay", group["weight_decay"],
                    "construct FusedAdam with adam_w_mode (AdamWMode.ADAMW_TORCH for decoupled decay, "
                    "AdamWMode.ADAM_L2_REGULARIZATION for ORT's L2, eps outside the bias correction) and load the "
                    "optimizer's state_dict() into it with that 'adam_w_mode' added to its param groups")
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
