"""FusedAdam checkpoints: the canonical saved form, strict validation of what is loaded, and the conversions between
the canonical form and each way a state can be stored.

The canonical form is ``torch.optim.AdamW``'s layout with plain values: per parameter a float64 ``step`` and unscaled
moments (float32, float64 for float64 params), plus ``master_param`` (float32) where FusedAdam keeps masters. It
loads into FusedAdam whatever its state dtypes, into torch.optim.AdamW, and with ``torch.load(weights_only=True)``.

Loading is two phases: :func:`prepare_load` checks every entry and builds the new param groups and states as fresh
tensors without touching the optimizer (or the given dict); the caller then swaps them in. Every error is a
ValueError (a bad value) or TypeError (a value of the wrong type) whose message starts with the entry it is about,
written as an expression: ``state_dict['state'][3]['step']``.

One pair of functions converts moments between storage and the canonical form, dispatching on how the state stores
them (:func:`storage_layout`): :func:`to_canonical` and :func:`from_canonical`. A new storage format extends these
three functions and nothing else.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ._group_options import (OPTIMIZER_WIDE_KEYS, TORCH_GROUP_KEYS, WideOptions, check_group, finite_number, show,
                             torch_adam_l2_refused, wide_option_value)
from ._spec import MAX_STEP, AdamWMode
from . import formats

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# The order in which moments are written into storage: a 4-bit exp_avg is coded relative to its exp_avg_sq as stored
# (ort_optim._spec.EXP_AVG_RELATIVE), so exp_avg_sq goes first.
CONVERSION_ORDER = ("exp_avg_sq", "max_exp_avg_sq", "exp_avg")
CHECKPOINT_KEYS = ("step",) + MOMENT_KEYS + ("master_param",)
# torch.distributed.checkpoint's flattened optimizer state dict (StateDictOptions(flatten_optimizer_state_dict=True),
# torchtitan's default) is unflattened by the keys of the live optimizer.state[p], which holds the block scales of
# fp16 and low-bit moments next to them: a key the canonical checkpoint never has comes back as an empty dict, and so
# does a master the checkpoint does not have (one without masters loaded into master weights). Only that placeholder
# is ignored, and only for these keys: a master given so is a master not given.
UNFLATTEN_PLACEHOLDER_KEYS = tuple(f"{key}_scale" for key in MOMENT_KEYS) + ("master_param",)
# Every checkpoint of the Adam family has these (ORT's, torch's, ours); the other options default to this
# optimizer's current values when missing (ORT's FusedAdam saves no adam_w_mode, amsgrad or maximize).
REQUIRED_GROUP_KEYS = ("params", "lr", "betas", "eps", "weight_decay")
# The options of other torch optimizers: a group carrying one comes from an optimizer whose state cannot continue here.
FOREIGN_OPTIMIZERS = {"SGD": ("momentum", "dampening", "nesterov"), "RMSprop": ("alpha", "centered", "momentum"),
                      "Adagrad": ("lr_decay", "initial_accumulator_value"), "NAdam": ("momentum_decay",),
                      "Adadelta": ("rho",), "ASGD": ("lambd", "t0", "alpha"), "Rprop": ("etas", "step_sizes")}
FOREIGN_OPTION_KEYS = tuple(dict.fromkeys(key for keys in FOREIGN_OPTIMIZERS.values() for key in keys))

def entry(*keys) -> str:
    """The expression that names an entry of a checkpoint: entry('state', 3, 'step') == "state_dict['state'][3]['step']"."""
    return "state_dict" + "".join(f"[{key!r}]" for key in keys)


# ---- conversions between storage and the canonical form ------------------------------------------------------------


def storage_layout(state: dict, key: str) -> str:
    """How ``state[key]`` is stored (ops/README.md): "plain" (the values themselves, in any float dtype), "fp16"
    (float16 codes, one float32 scale per 1024 elements in ``state[key + '_scale']``; exp_avg_sq and max_exp_avg_sq
    hold sqrt(v)), "8-bit" or "4-bit" (uint8 codes and block scales, see ort_optim._spec.LowBitFormat), "fp8 e4m3" or
    "fp8 e5m2" (float8 codes and power-of-two block scales, ort_optim._spec.Fp8Format)."""
    scales = state.get(key + "_scale")
    return "plain" if scales is None else formats.state_format(state[key], scales)


def canonical_dtype(param: torch.Tensor) -> torch.dtype:
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _root(state: dict, key: str, shape: torch.Size) -> Optional[torch.Tensor]:
    """For a 4-bit exp_avg, which is coded relative to its exp_avg_sq (ort_optim._spec.EXP_AVG_RELATIVE): the
    decoded sqrt(v) of ``state['exp_avg_sq']`` as stored now; None for every other moment."""
    scales = state.get(key + "_scale")
    if key != "exp_avg" or not formats.is_relative(state[key], scales):
        return None
    if "exp_avg_sq" not in state:
        raise ValueError("a 4-bit exp_avg is coded relative to its exp_avg_sq, which this state lacks")
    return formats.state_root(state["exp_avg_sq"].detach(), state.get("exp_avg_sq_scale"), shape)


def to_canonical(state: dict, key: str, shape: torch.Size) -> torch.Tensor:
    """The moment ``state[key]`` of a param of this shape as a fresh unscaled float32 tensor (float64 when stored as
    float64). Every layout decodes through formats.decode_state, the one definition of the stored formats (a 4-bit
    exp_avg through its exp_avg_sq as stored with it)."""
    scales = state.get(key + "_scale")
    value = formats.decode_state(state[key].detach(), None if scales is None else scales.detach(),
                                   key != "exp_avg", shape, _root(state, key, shape))
    return value.to(torch.float64 if value.dtype == torch.float64 else torch.float32, copy=True)


def from_canonical(state: dict, key: str, value: torch.Tensor) -> None:
    """Writes canonical values (float32/float64, the param's shape, the state's device) into the storage of
    ``state[key]`` (and its companions, such as the block scales), in place. Every format is idempotent:
    from_canonical(to_canonical(state)) writes back the same bits, which is what makes a resume exact (a NaN comes
    back as a NaN, its sign and payload not kept: conversions between float widths, torch's included, change them).
    A 4-bit exp_avg is coded relative to ``state['exp_avg_sq']`` as stored at the call: write exp_avg_sq first
    (:data:`CONVERSION_ORDER`)."""
    layout = storage_layout(state, key)
    if layout == "plain":
        state[key].copy_(value)
        return
    scales = state[key + "_scale"]
    codes, new_scales = formats.encode_state(value, {"fp16": torch.float16, "8-bit": torch.uint8, "4-bit": torch.uint4,
                                                     "fp8 e4m3": torch.float8_e4m3fn,
                                                     "fp8 e5m2": torch.float8_e5m2}[layout], key != "exp_avg",
                                             _root(state, key, value.shape))
    state[key].copy_(codes.view(state[key].shape))
    scales.copy_(new_scales)


def stored_piece(state: dict, start: int, stop: int) -> dict:
    """The flat elements [start, stop) of a param's state as a state of their own, for to_canonical and
    from_canonical with a shape of stop - start elements: views of each moment's and the master's storage, and of
    the block scales that code those elements, so that writing the piece writes the state. start is a multiple of
    formats.BLOCK_MULTIPLE (it starts a block, and a byte of 4-bit codes, in every format), and the state's tensors
    are contiguous, as a layout's init_state makes them; whole blocks encode and decode apart from the others, so a
    state written a piece at a time holds the bits of one written whole."""
    part = {}
    for key in MOMENT_KEYS + ("master_param",):
        if key not in state:
            continue
        flat = state[key].view(-1)
        layout = storage_layout(state, key)
        if layout == "plain":
            part[key] = flat[start:stop]
            continue
        scales = state[key + "_scale"]
        block = formats.scale_block(state[key], scales)
        part[key] = flat[start // 2:(stop + 1) // 2] if layout == "4-bit" else flat[start:stop]  # (two codes a byte)
        part[key + "_scale"] = scales[start // block:-(-stop // block)]
    return part


# ---- saving --------------------------------------------------------------------------------------------------------


def canonical_state(state: dict, shape: torch.Size) -> dict:
    """One parameter's state in canonical form: fresh tensors, nothing shared with the optimizer. A param on the meta
    device has its state there, step count included (a tensor without a value): its canonical form stays there too."""
    step = state["step"].detach()
    out = {"step": step.to("meta" if step.is_meta else "cpu", torch.float64, copy=True).reshape(())}
    for key in MOMENT_KEYS:
        if key in state:
            out[key] = to_canonical(state, key, shape)
    if "master_param" in state:
        out["master_param"] = state["master_param"].detach().clone()
    return out


def _kept_key(key: Any) -> bool:
    """A key of a param's state that the optimizer keeps (and a checkpoint saves, in canonical form): the step, the
    moments and the master, and the block scales of moments stored scaled (read into their canonical values)."""
    return key in CHECKPOINT_KEYS or (isinstance(key, str) and key.endswith("_scale")
                                      and key[:-len("_scale")] in MOMENT_KEYS)


def canonical(state_dict: dict, shapes: dict) -> dict:
    """torch.optim.Optimizer.state_dict()'s output (which shares tensors with the optimizer) made canonical; shapes:
    each saved param index's shape (4-bit codes are stored flat). Entries of a param's state that the optimizer does
    not keep (``optimizer.state[p]['my_ema'] = t``) are not saved, with a RuntimeWarning naming them: a load refuses
    unknown state keys (they are how another optimizer's checkpoint shows), so a checkpoint that carried them would
    not load back. torch.optim saves them; save them beside the checkpoint instead."""
    # Reading optimizer.state[p] creates an empty entry (it is a defaultdict): such params have no state to save.
    state = {}
    not_saved = []
    for index, s in state_dict["state"].items():
        if s:
            try:
                state[index] = canonical_state(s, shapes[index])
            except ValueError as error:  # (a state assigned between steps that the next step would refuse too)
                raise ValueError(f"state_dict(): the state of param {index} cannot be read: {error}") from error
            not_saved += [f"state[{index}][{key!r}]" for key in s if not _kept_key(key)]
    if not_saved:
        warnings.warn(
            f"state_dict(): {_listed(not_saved)}: not saved. FusedAdam's checkpoints hold the optimizer's own state "
            f"(the keys {', '.join(map(repr, CHECKPOINT_KEYS))}), and its load_state_dict refuses other keys, as "
            "they are what another optimizer's checkpoint holds. Save your own per-param entries beside the "
            "checkpoint (torch.optim.AdamW saves whatever optimizer.state holds)", RuntimeWarning, stacklevel=3)
    groups = []
    for group in state_dict["param_groups"]:
        # tensor-valued entries (an lr tensor, a scheduler's initial_lr) are copies too: a scheduler that fills the lr
        # in place must not write into a saved checkpoint, nor the checkpoint's user into the optimizer
        saved = {key: value if key == "params" else _copy(value, plain_values=True) for key, value in group.items()}
        if "adam_w_mode" in saved:
            # torch >= 2.5 reads a group without it as decoupled_weight_decay=False: loaded into
            # torch.optim.Adam(decoupled_weight_decay=True), torch's AdamW math would silently become L2 decay. Saved
            # whatever the mode (True for both decoupled modes), so that the groups' keys do not depend on it: DCP
            # loads strictly by key, and a mode changed mid-run would change them.
            saved["decoupled_weight_decay"] = saved["adam_w_mode"] != AdamWMode.ADAM_L2_REGULARIZATION
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def _copy(value: Any, plain_values: bool = False) -> Any:
    """A copy of a group entry: tensors cloned, containers rebuilt, other values shared (they are immutable).
    plain_values (saving): enums become their values, numpy scalars Python numbers and dtypes their names
    (``'torch.uint4'``), since an enum (an AdamWMode assigned to param_groups[i]['adam_w_mode']), a numpy scalar (the
    lr of an LR scheduler whose lambda computes with numpy, e.g. a cosine) or a dtype that torch does not allow there
    (torch 2.4's torch.uint4: a group repeating the optimizer's exp_avg_dtype, as ZeroRedundancyOptimizer's are)
    makes a checkpoint unloadable with weights_only=True; loading keeps what it is given, as it is given (a dtype's
    name read back as the dtype)."""
    if plain_values and isinstance(value, enum.Enum):
        return value.value
    if plain_values and isinstance(value, torch.dtype):
        return str(value)
    if (plain_values and isinstance(value, numbers.Number) and type(value) not in (bool, int, float, complex)
            and hasattr(value, "item")):
        return value.item()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copy(item, plain_values) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value)(_copy(item, plain_values) for item in value) if type(value) in (list, tuple)
                else copy.deepcopy(value))
    return value


# ---- validation of single values -----------------------------------------------------------------------------------


def require_data(value: torch.Tensor, where: str, meta_ok: bool = False) -> None:
    """A tensor a checkpoint's values are read from: dense, and off the meta device (which holds no values), unless
    meta_ok (an entry for a param on the meta device, which keeps no values either)."""
    if value.layout != torch.strided or value.is_nested or (value.is_meta and not meta_ok):
        hint = ("; a tensor on the meta device holds no values (a checkpoint loaded with map_location='meta'): load "
                "the checkpoint onto the CPU or the params' device" if value.is_meta else "")
        raise TypeError(f"{where} must be a dense tensor with data, got {show(value)}{hint}")


def _require_scalar_tensor(value: torch.Tensor, where: str) -> float:
    """The value of a one-element real tensor (of any shape, as torch.optim reads a step)."""
    require_data(value, where)
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{where} must be a real number, got {show(value)}")
    if value.numel() != 1:
        raise ValueError(f"{where} must hold exactly one number, got {show(value)}")
    number = float(value.item())  # (one host read, whatever its shape, a DTensor too)
    if not math.isfinite(number):
        raise ValueError(f"{where} must be finite, got {number}")
    return number


def check_step(value: Any, where: str, meta_ok: bool = False) -> Optional[float]:
    """A step count: a number or a one-element tensor holding a whole number in [0, 2**53]. meta_ok: the step of a
    param on the meta device, which may be a one-element real tensor there, without a value (None)."""
    if meta_ok and isinstance(value, torch.Tensor) and value.is_meta:
        require_data(value, where, meta_ok=True)
        if value.dtype == torch.bool or value.is_complex() or value.numel() != 1:
            raise TypeError(f"{where} must be a one-element real tensor, got {show(value)}")
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # (compared exactly: range, not finite)
        number = float(value) if abs(value) <= MAX_STEP else math.inf
    else:
        number = _require_scalar_tensor(value, where) if isinstance(value, torch.Tensor) else finite_number(value, where)
    require_step_range(value, number, where)
    return number


def require_step_range(value: Any, number: float, where: str) -> None:
    """The rule of a step count's value (number: value as a float): a whole number in [0, 2**53]. An integer is
    compared exactly (integer_value: an int above 2**53 rounds to 2**53 as a float)."""
    exact = integer_value(value)
    if not (0 <= (number if exact is None else exact) <= MAX_STEP and number == int(number)):
        raise ValueError(f"{where} must be a whole number in [0, 2**53], got {number if exact is None else exact!r}")


def integer_value(value: Any) -> Optional[int]:
    """The exact value of an integer step count (an int, numpy's too, or a one-element integer tensor with data), which
    float64 may round (2**53 + 1 to 2**53); None for any other value."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta and value.dtype != torch.bool
            and not value.is_floating_point() and not value.is_complex()):
        return int(value.detach().reshape(()).cpu().item())
    return None


def _check_id(value: Any, where: str) -> None:
    # torch saves positions (ints); FSDP's full optimizer state dicts key by parameter names (str). A bool is refused
    # although torch.optim's load takes it (True equals 1 as a dict key): no state_dict() saves one.
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        why = (" (torch.optim's load_state_dict reads True as the id 1 and False as 0, since a bool equals its int as "
               "a dict key, but no optimizer saves a bool id: write the position as an int)"
               if isinstance(value, bool) else "")
        raise TypeError(f"{where} must be a parameter id (an int, as optimizer.state_dict() saves), got "
                        f"{show(value)}{why}")


@dataclass(frozen=True)
class Decoded:
    """A checkpoint entry given as float32 values of a shape that are decoded a piece at a time: decode(start, stop)
    gives its flat elements [start, stop) on device. What ort_optim._migration makes of another library's quantised
    moments: the load checks and stores them a piece at a time as it does any entry, so no decoded copy of a whole
    moment is made (:meth:`full` makes one, where a whole tensor is needed)."""

    shape: torch.Size
    device: torch.device
    decode: Callable[[int, int], torch.Tensor]

    def pieces(self, limit: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, the flat values [start, start + limit)), in order (the last piece fewer)."""
        n = math.prod(self.shape)
        for start in range(0, n, limit):
            yield start, self.decode(start, min(start + limit, n))

    def full(self) -> torch.Tensor:
        out = torch.empty(math.prod(self.shape), dtype=torch.float32, device=self.device)
        for start, piece in self.pieces(CHECK_CHUNK):
            out[start:start + piece.numel()] = piece
        return out.view(self.shape)


def _check_moment(value: Any, param: torch.Tensor, key: str, where: str, listed: str) -> Any:
    """A moment or master of the checkpoint, checked: what the load stores it from (see below).

    What is refused is what training cannot produce: a tensor that is not a dense floating-point one of the param's
    shape, a finite value that overflows when converted to float32 (a foreign float64 checkpoint), and a negative
    second moment (a mean of squares; -inf included). inf and NaN are values training does produce (a second moment
    whose square overflowed float32, as torch.optim.AdamW keeps it; the moments and masters of a diverged run): they
    load as they are, and load_state_dict warns (:func:`warn_nonfinite`). For a param on the meta device, which keeps
    no values, the result is on the meta device, as torch.optim's load makes it; for any other param the result is the
    checkpoint's own tensor (detached, not to be written to), which :func:`store` converts into the state a piece at
    a time. Either way the values are checked where they are, :data:`CHECK_CHUNK` elements at a time: a load makes
    no full-size copy of an entry besides the state it fills (a meta entry has no values to check)."""
    dtype = entry_dtype(param, key)
    if isinstance(value, Decoded):
        _require_shape(value, param, where, listed)
        _check_values(lambda: ((piece, piece.to(dtype)) for piece in _pieces(value)), key, where)
        return torch.empty(param.shape, dtype=dtype, device="meta") if param.is_meta else value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {show(value)}")
    require_data(value, where, meta_ok=param.is_meta)
    if not value.is_floating_point():
        if key == "master_param" and value.dtype == torch.int16:
            raise TypeError(
                f"{where} must be a floating-point tensor, got {show(value)}: an int16 master_param is what "
                "TransformerEngine's FusedAdam(store_param_remainders=True) saves, the low 16 bits of each fp32 "
                "master, whose high 16 bits are the bfloat16 param as it was when saved. FusedAdam keeps whole fp32 "
                "masters and cannot rebuild them from the checkpoint: delete the 'master_param' entries to load the "
                "moments (each master is then made from its param at the param's next step, without those 16 "
                "bits), or save the checkpoint from TransformerEngine with store_param_remainders=False")
        raise TypeError(f"{where} must be a floating-point tensor, got {show(value)}")
    _require_shape(value, param, where, listed)
    source = value.detach()
    if not source.is_meta:
        _check_values(lambda: ((piece, piece.to(dtype)) for piece in _pieces(source)), key, where)
    return source.to("meta", dtype, copy=True) if param.is_meta else source


def _require_shape(value: Any, param: torch.Tensor, where: str, listed: str) -> None:
    if value.shape != param.shape:
        raise ValueError(f"{where} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)} (the one whose "
                         f"id {listed} gives)")


def entry_dtype(param: torch.Tensor, key: str) -> torch.dtype:
    """The canonical dtype of a checkpoint entry of this param: float32 for a master, canonical_dtype for a moment."""
    return torch.float32 if key == "master_param" else canonical_dtype(param)


# A checkpoint's entry is checked this many elements at a time (_check_moment), and written into the state as many,
# rounded up to whole blocks of every stored format (store, stored_piece).
CHECK_CHUNK = 1 << 20


def _check_values(pieces: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]], key: str, where: str) -> None:
    """The rules on the values of a moment or master (:func:`_check_moment`), read from pieces(): pairs of the
    checkpoint's values and the same converted to the canonical dtype, which together cover the entry (the whole of
    it in one pair, or one piece at a time). Each rule reads every piece before the next rule, so an entry that
    breaks two is refused for the same one however it is cut."""
    def overflows(source: torch.Tensor, converted: torch.Tensor) -> bool:
        if source.element_size() == 1:  # float8: exact in float32, where torch has isfinite (not for float8 itself)
            source = source.float()
        return bool((torch.isfinite(source) & ~torch.isfinite(converted)).any())

    if any(overflows(source, converted) for source, converted in pieces()):
        raise ValueError(f"{where} holds inf or NaN once converted to float32 (values beyond its range)")
    if key != "exp_avg" and key != "master_param" and any(bool((converted < 0).any()) for _, converted in pieces()):
        raise ValueError(f"{where} holds negative values; a second moment is a mean of squares")


def _chunks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of t that cover each of its elements once, each of at most limit elements (or a single element), in
    order; no copies, whatever t's strides."""
    if t.is_contiguous():
        t = t.view(-1)
    if t.numel() <= limit or t.dim() == 0:
        yield t
    elif t[0].numel() > limit:
        for row in t:
            yield from _chunks(row, limit)
    else:
        rows = limit // t[0].numel()
        for start in range(0, t.shape[0], rows):
            yield t[start:start + rows]


def _pieces(source: Any) -> Iterator[torch.Tensor]:
    """A checked entry's values (a tensor or a Decoded), :data:`CHECK_CHUNK` elements at a time (tensors: views)."""
    return (piece for _, piece in source.pieces(CHECK_CHUNK)) if isinstance(source, Decoded) else _chunks(
        source, CHECK_CHUNK)


def _flat_pieces(t: Any, limit: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, piece): the elements of t (a tensor or a Decoded) in their flat order, limit at a time (the last piece
    fewer), each piece a flat tensor of the elements [start, start + limit): views where t is a contiguous tensor,
    else copies of one piece each."""
    if isinstance(t, Decoded):
        yield from t.pieces(limit)
        return
    if t.is_contiguous():
        flat = t.view(-1)
        for start in range(0, flat.numel(), limit):
            yield start, flat[start:start + limit]
        return
    buffered, count, start = [], 0, 0
    for piece in _chunks(t, limit):
        piece = piece.reshape(-1)  # (at most limit elements)
        while piece.numel():
            taken = min(limit - count, piece.numel())
            buffered.append(piece[:taken])
            count, piece = count + taken, piece[taken:]
            if count == limit:
                yield start, torch.cat(buffered)
                buffered, count, start = [], 0, start + limit
    if buffered:
        yield start, torch.cat(buffered)


def _all_finite(source: Any, dtype: torch.dtype) -> bool:
    """Whether a checked entry (_check_moment) holds no inf or NaN, read a piece at a time in its canonical dtype
    (where torch has isfinite: not for float8)."""
    return all(bool(torch.isfinite(piece.to(dtype)).all()) for piece in _pieces(source))


def _listed(entries: list[str]) -> str:
    """The first three entries, and how many more, for a warning."""
    return ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")


def warn_nonfinite(entries: list[str], note: str = "") -> None:
    """The warning of a load whose moments or masters hold inf or NaN (loaded as they are, see :func:`_check_moment`).
    note: what those entries are in the dict given to load_state_dict, where it was read from another layout
    (ort_optim._migration.entry_note)."""
    if not entries:
        return
    warnings.warn(
        f"load_state_dict: {_listed(entries)}{' ' + note if note else ''} {'holds' if len(entries) == 1 else 'hold'} "
        "inf or NaN; loaded as they "
        "are, so training continues exactly as it would have without the checkpoint (a second moment whose square "
        "overflowed float32 stays inf, as in "
        "torch.optim.AdamW, and its element's update stays 0; NaN moments or masters mean the run had diverged "
        "before it was saved)", RuntimeWarning, stacklevel=3)


def warn_dropped_masters(entries: list[str]) -> None:
    """The warning of a load whose fp32 masters this optimizer does not keep (master_weights=False, or an fp32
    param): the params' own values are what the run continues from."""
    if not entries:
        return
    warnings.warn(
        f"load_state_dict: {_listed(entries)}: this optimizer keeps no fp32 master weights for "
        f"{'that param' if len(entries) == 1 else 'those params'} (master_weights=False, or an fp32 param), so the "
        "checkpoint's masters are not loaded and the run continues from the params' own values (what the model's "
        "state_dict restored: the masters rounded to the param dtype). Build the optimizer with master_weights=True "
        "to continue with them", RuntimeWarning, stacklevel=3)


# ---- loading -------------------------------------------------------------------------------------------------------


@dataclass
class PreparedLoad:
    """What load_state_dict swaps in once everything checked out: new param groups (without the params, which stay
    the optimizer's own) and new per-parameter states."""

    groups: list[dict]
    state: dict
    nonfinite: list[str]  # the entries holding inf or NaN, loaded as they are (warn_nonfinite once the load is done)
    dropped_masters: list[str]  # masters of params this optimizer keeps none for (warn_dropped_masters)


def _torch_adam_with_l2(saved: dict) -> bool:
    """A torch.optim.Adam group with L2 weight decay, where that can be told (torch >= 2.5 saves
    decoupled_weight_decay; earlier torch.optim.Adam and AdamW groups have the same keys)."""
    return ("adam_w_mode" not in saved and saved.get("decoupled_weight_decay") is False
            and isinstance(saved.get("weight_decay"), (int, float)) and not isinstance(saved["weight_decay"], bool)
            and saved["weight_decay"] > 0)


def _foreign_optimizers(keys: set) -> list[str]:
    """The torch optimizers whose options a group with these keys carries: those it has all the options of, else
    those it has any of."""
    whole = [name for name, own in FOREIGN_OPTIMIZERS.items() if set(own) <= keys]
    return whole or [name for name, own in FOREIGN_OPTIMIZERS.items() if set(own) & keys]


def _foreign_torch_optimizer(saved: dict) -> bool:
    """A group saved by a torch optimizer other than Adam and AdamW (RAdam, Adamax, ...), as far as its keys tell:
    torch's optimizers save their implementation switches (foreach, differentiable, ...), and Adam and AdamW always
    save amsgrad too, which RAdam and Adamax do not have (NAdam's momentum_decay is a FOREIGN_OPTIMIZERS option)."""
    return "amsgrad" not in saved and "adam_w_mode" not in saved and any(
        key in saved for key in ("foreach", "differentiable", "capturable"))


def _carried_master(saved: dict, p: torch.Tensor) -> bool:
    """Whether a state's master_param is in the param's own float16/bfloat16 dtype, as torch.optim's load makes of
    FusedAdam's float32 master: torch casts every state tensor but the step to its param's dtype and keeps a key it
    does not know as it is, never updating it, so after torch.optim.AdamW trained on a FusedAdam checkpoint its
    master is the one of the step before torch's first. Such a master holds no more than the param (FusedAdam's
    masters are float32), so it is left out, and the param's next step makes the master from the param, as for a
    checkpoint without masters: nothing is lost, and what torch trained is kept."""
    master = saved.get("master_param")
    return (isinstance(master, torch.Tensor) and p.dtype in (torch.float16, torch.bfloat16)
            and master.dtype == p.dtype)


def prepare_load(param_groups: list[dict], state_dict: Any, options: WideOptions) -> PreparedLoad:
    """Checks a checkpoint against the optimizer's param groups (their options as check_group checks them, against
    the optimizer's own options) and builds the new groups and states (fresh tensors laid out as options.layout says,
    then filled). Changes nothing it is given; raises ValueError or TypeError naming the entry."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict with 'state' and 'param_groups' (from optimizer.state_dict()), "
                        f"got {show(state_dict)}")
    if "optimizer" in state_dict and "loss_scaler" in state_dict and "state" not in state_dict:
        raise ValueError("state_dict is an FP16_Optimizer checkpoint ('optimizer', 'loss_scaler', 'master_params'): "
                         "load it with FP16_Optimizer.load_state_dict, or pass its state_dict['optimizer'] here to "
                         "load the FusedAdam inside alone (without the loss scaler's state)")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"state_dict must be a dict with 'state' and 'param_groups' (from "
                             f"optimizer.state_dict()); {entry(key)} is missing")
    for key in state_dict:
        if key not in ("state", "param_groups"):
            raise ValueError(f"{entry(key)}: unknown key; an optimizer checkpoint has only 'state' and "
                             "'param_groups' (pass the optimizer's part of a bigger checkpoint)")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)):
        raise TypeError(f"{entry('param_groups')} must be a list of dicts, got {show(saved_groups)}")
    if not isinstance(saved_state, dict):
        raise TypeError(f"{entry('state')} must be a dict from parameter id to state dict, got {show(saved_state)}")
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"{entry('param_groups')} has {len(saved_groups)} param groups but this optimizer has "
                         f"{len(param_groups)}")

    init_state = options.layout.init_state
    id_to_param: dict[Any, tuple[int, int, torch.Tensor]] = {}  # saved id -> (group, position, param)
    new_groups, group_steps = [], []
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if not isinstance(saved, dict):
            raise TypeError(f"{entry('param_groups', gi)} must be a dict, got {show(saved)}")
        foreign = [key for key in FOREIGN_OPTION_KEYS if key in saved]
        if foreign:
            names = " or ".join(_foreign_optimizers(set(saved)))
            raise ValueError(f"{entry('param_groups', gi)} has {foreign}, options of torch.optim's {names}, not of "
                             "Adam: its state cannot continue as Adam. Load it into the optimizer that saved it; to "
                             "start FusedAdam from its params, load only the model's weights")
        for key in REQUIRED_GROUP_KEYS:
            if key not in saved:
                raise ValueError(f"{entry('param_groups', gi)} has no {key!r}, so it is not an Adam checkpoint (its "
                                 f"keys: {', '.join(map(repr, saved))}); a checkpoint of Adam has "
                                 f"{', '.join(map(repr, REQUIRED_GROUP_KEYS))}")
        if _foreign_torch_optimizer(saved):
            raise ValueError(
                f"{entry('param_groups', gi)} comes from a torch optimizer other than Adam and AdamW (it has torch's "
                "implementation switches but no 'amsgrad', which Adam and AdamW always save: RAdam, Adamax, ...): "
                "its state follows other update rules and cannot continue as Adam. Load it into the optimizer that "
                "saved it; to start FusedAdam from its params, load only the model's weights")
        ids = saved["params"]
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{entry('param_groups', gi, 'params')} must be a list of parameter ids, got {show(ids)}")
        if len(ids) != len(group["params"]):
            raise ValueError(f"{entry('param_groups', gi, 'params')} lists {len(ids)} params but this optimizer's "
                             f"param_groups[{gi}] has {len(group['params'])}")
        for j, (saved_id, p) in enumerate(zip(ids, group["params"])):
            _check_id(saved_id, entry("param_groups", gi, "params", j))
            if saved_id in id_to_param:
                raise ValueError(f"{entry('param_groups', gi, 'params', j)}: parameter id {saved_id!r} is listed "
                                 "twice; each parameter has one id")
            id_to_param[saved_id] = (gi, j, p)
        if _torch_adam_with_l2(saved):
            raise torch_adam_l2_refused(
                entry("param_groups", gi, "decoupled_weight_decay"), saved["weight_decay"],
                "add 'adam_w_mode' (AdamWMode.ADAMW_TORCH for decoupled decay, AdamWMode.ADAM_L2_REGULARIZATION for "
                "ORT's L2) to the checkpoint's param groups")
        new_group = {key: value for key, value in group.items()}
        for key, value in saved.items():
            # (torch's group keys say how torch ran the update, dropped; an L2-decay checkpoint is refused above)
            if key not in ("params", "step") and key not in TORCH_GROUP_KEYS:
                # copies (an lr tensor: the scheduler fills it in place), so the given dict stays untouched
                new_group[key] = wide_option_value(key, _copy(value)) if key in OPTIMIZER_WIDE_KEYS else _copy(value)
        check_group(new_group, lambda key, gi=gi: entry("param_groups", gi, key), options)
        new_group["adam_w_mode"] = int(new_group["adam_w_mode"])  # a plain int, so checkpoints load with weights_only
        new_group["betas"] = tuple(new_group["betas"])
        new_groups.append(new_group)
        # ORT's FusedAdam keeps one step per group; ours and torch's are per parameter
        group_steps.append(None if "step" not in saved else check_step(saved["step"], entry("param_groups", gi, "step")))

    new_state: dict[torch.Tensor, dict] = {}
    nonfinite: list[str] = []
    dropped_masters: list[str] = []
    for saved_id, saved in saved_state.items():
        where = entry("state", saved_id)
        _check_id(saved_id, f"{where} (its key)")
        if saved_id not in id_to_param:
            raise ValueError(f"{where}: parameter id {saved_id!r} is listed in no {entry('param_groups')}[i]"
                             "['params']")
        gi, j, p = id_to_param[saved_id]
        if isinstance(saved, dict):
            saved = {key: value for key, value in saved.items()
                     if not (key in UNFLATTEN_PLACEHOLDER_KEYS and isinstance(value, dict) and not value)}
        if isinstance(saved, dict) and not saved:
            # torch.optim's state is a defaultdict: reading state[p] of a param that has not stepped yet leaves an empty
            # dict, which its state_dict() saves. No state yet, as torch.optim loads it.
            continue
        if isinstance(saved, dict) and _carried_master(saved, p):
            saved = {key: value for key, value in saved.items() if key != "master_param"}
        new_state[p] = _state_from_checkpoint(p, saved, new_groups[gi], gi, group_steps[gi], where, init_state,
                                              nonfinite, listed=entry("param_groups", gi, "params", j))
        if "master_param" in saved and "master_param" not in new_state[p]:
            dropped_masters.append(f"{where}['master_param']")
    for group in new_groups:
        del group["params"]
    return PreparedLoad(new_groups, new_state, nonfinite, dropped_masters)


def _state_from_checkpoint(p: torch.Tensor, saved: Any, group: dict, group_index: int, group_step: Optional[float],
                           where: str, init_state: Callable[[torch.Tensor, bool], dict], nonfinite: list[str],
                           listed: str) -> dict:
    """The state of param p as the checkpoint's entry saved (at where) gives it; listed: the param_groups entry that
    gives p's id (errors about p's shape name it: ids swapped there are the usual cause)."""
    if not isinstance(saved, dict):
        raise TypeError(f"{where} must be a dict of state tensors, got {show(saved)}")
    for key in saved:
        if key not in CHECKPOINT_KEYS:
            raise ValueError(f"{where}[{key!r}]: unknown key; an Adam state has some of {list(CHECKPOINT_KEYS)}")
    required = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
    for key in required:
        if key not in saved:
            raise ValueError(f"{where} has no {key!r}" + (
                f", which its group's amsgrad=True needs ({entry('param_groups', group_index, 'amsgrad')}, or this "
                "optimizer's where the checkpoint has none)" if key == "max_exp_avg_sq" else ""))
    if "step" in saved:
        step = check_step(saved["step"], f"{where}['step']", meta_ok=p.is_meta)
    elif group_step is not None:
        step = group_step
    else:
        raise ValueError(f"{where} has no 'step' (nor does its param group, {entry('param_groups', group_index)}, "
                         "have one, as ORT's FusedAdam saves)")
    values = {key: _check_moment(saved[key], p, key, f"{where}[{key!r}]", listed)
              for key in MOMENT_KEYS + ("master_param",) if key in saved}
    # (a max_exp_avg_sq under amsgrad=False is kept, as torch.optim keeps it: a run that switched amsgrad off keeps
    # it and saves it, and switching amsgrad on again then resumes from it)
    state = init_state(p, bool(group["amsgrad"]) or "max_exp_avg_sq" in values)
    if p.is_meta:  # (its state, on the meta device, keeps no values: those checked above have nowhere to go)
        if "master_param" in state and "master_param" not in values:
            del state["master_param"]
        return state
    # the moments and master holding inf or NaN: loaded as they are, and warned about (warn_nonfinite)
    held_nonfinite = [key for key, value in values.items() if not _all_finite(value, entry_dtype(p, key))]
    nonfinite += [f"{where}[{key!r}]" for key in held_nonfinite]
    state["step"].fill_(step)
    # (a NaN or inf in a moment makes its whole block NaN in block-scaled storage, as a step that meets it does:
    # ops/README.md; those NaN are the checkpoint's own, not values out of range)
    diverged = any(key in MOMENT_KEYS for key in held_nonfinite)
    for key in CONVERSION_ORDER:
        if key in state:
            store(state, key, values[key], entry_dtype(p, key), diverged, f"{where}[{key!r}]")
    if "master_param" in state:
        if "master_param" in values:
            store(state, "master_param", values["master_param"], torch.float32, diverged, f"{where}['master_param']")
        else:
            # made from the param at its next step, as for any state without one: from what the param holds then
            # (the model's weights are often loaded after the optimizer's state)
            del state["master_param"]
    return state


def store(state: dict, key: str, source: Any, dtype: torch.dtype, diverged: bool, where: str) -> None:
    """Writes a checked entry of the checkpoint (_check_moment: the param's shape, any float dtype and device; or the
    values given to FusedAdam.set_scaled_state) into a state not yet in use, state[key], as from_canonical writes its
    canonical (dtype) values, :data:`CHECK_CHUNK` elements at a time
    (rounded up to whole blocks: stored_piece), so that the load makes no temporary of the whole entry; the pieces
    give the bits of the whole.
    Refuses what the storage cannot hold, read back piece by piece: a float32 value beyond bfloat16's largest rounds
    to inf there (inf and NaN that the checkpoint holds stay what they are, and diverged, where a moment holds them,
    a NaN of block-scaled storage is theirs; a finite value must stay finite). The state is the caller's own (the
    load's new state, the accessor's copies), so a refusal here leaves the optimizer as it was."""
    limit = -(-CHECK_CHUNK // formats.BLOCK_MULTIPLE) * formats.BLOCK_MULTIPLE
    for start, piece in _flat_pieces(source, limit):
        part = stored_piece(state, start, start + piece.numel())
        value = piece.to(state[key].device, dtype)
        from_canonical(part, key, value)
        stored = to_canonical(part, key, value.shape)
        lost = torch.isfinite(value) & (torch.isinf(stored) if diverged else ~torch.isfinite(stored))
        if bool(lost.any()):
            storage = storage_layout(state, key)
            raise ValueError(f"{where} holds values beyond the range of this optimizer's "
                             f"{state[key].dtype if storage == 'plain' else storage} {key} storage")
