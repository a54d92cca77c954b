"""Checkpoints of other low-bit Adam optimizers, read into FusedAdam's canonical checkpoint form.

:func:`canonical_checkpoint` recognises the state_dicts of torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8``
and of bitsandbytes' ``Adam8bit`` / ``AdamW8bit`` (and their paged variants), as read in torchao 0.18.0 and
bitsandbytes 0.50.2, and rewrites them as the canonical form of ort_optim._checkpoint: per parameter a ``step`` and
float32 moments holding exactly the values the source optimizer decodes (_checkpoint.Decoded: decoded a piece at a
time where the load checks and stores them), in param groups whose options give the source's update rule.
FusedAdam.load_state_dict then loads that as it loads any checkpoint: the same checks, and the same one conversion
from canonical values into this optimizer's moment storage (fp32, bf16, fp16, 8-bit, 4-bit, whatever
_checkpoint.from_canonical knows). Every other dict is handed back untouched.

Both libraries store a moment as codes and one float32 scale per block: value = qmap[code] * scale[block] (a
lookup table of code values; fp8 codes are their own values), exp_avg_sq holding v itself. Parameters under 4096
elements keep plain float32 moments in both. Nothing here calls an operator on torchao's state tensors (tensor
subclasses whose aten ops mostly raise): only their attributes are read, and those are plain tensors.

Any layout that is not exactly one of these (another optimizer, a key or attribute of another version, a missing
lookup table, an option that changes the update) raises a ValueError or TypeError that names the entry and what it
holds, before anything is built; the given dict is never written to.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch

from . import _checkpoint
from ._checkpoint import entry, require_data
from ._group_options import is_number, show
from ._spec import AdamWMode

TORCHAO_STATES = {  # class name -> what it is (the classes of torchao.optim.subclass_8bit, _4bit, _fp8)
    "OptimState8bit": "8-bit codes with a 256-value map (AdamW8bit)",
    "OptimState4bit": "4-bit codes, two per byte, with a 16-value map (AdamW4bit)",
    "OptimStateFp8": "float8_e4m3fn codes (AdamWFp8)",
}
TORCHAO_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay", "amsgrad"}  # (lr: a float32 tensor)
# Keys of the groups of torch's Adam/AdamW, ORT's FusedAdam and FusedAdam, which torchao's groups do not have.
OTHER_ADAM_GROUP_KEYS = {"foreach", "capturable", "differentiable", "fused", "maximize", "decoupled_weight_decay",
                         "bias_correction", "adam_w_mode"}
BNB_ONE_STATE_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay"}
BNB_QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes' state_dict() nests its tensors under it
BNB_STATE_KEYS = ("state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2")
# bitsandbytes' param groups carry AdEMAMix's options (alpha, t_alpha, t_beta3) whatever the optimizer; the others are
# its per-optimizer arguments, accepted here too where a wrapper saved them into the groups. Each has the type
# bitsandbytes gives it (a float, Optional[int], int or bool: a bool is not an int here, nor an int a bool) and is
# accepted only with the value under which bitsandbytes' Adam step is Adam's: a callable says whether a value is
# neutral.
BNB_GROUP_OPTIONS = {  # key -> (type, whether a value of it is neutral, what is accepted)
    "alpha": ("float", lambda v: v == 0, "0.0 (AdEMAMix's slow-momentum weight: nonzero is AdEMAMix, not Adam)"),
    "t_alpha": ("Optional[int]", lambda v: v is None, "None (AdEMAMix's alpha warm-up)"),
    "t_beta3": ("Optional[int]", lambda v: v is None, "None (AdEMAMix's beta3 warm-up)"),
    "max_unorm": ("float", lambda v: v == 0, "0.0 (update-norm clipping, which FusedAdam does not do)"),
    "percentile_clipping": ("int", lambda v: v == 100, "100 (gradient clipping by a percentile of past norms)"),
    "skip_zeros": ("bool", lambda v: v is False, "False (zero gradients skipped: a sparse update)"),
    "block_wise": ("bool", lambda v: v is True, "True (one scale per tensor: an older 8-bit layout)"),
    # how the state is stored, not what the step computes: the layout itself is read from the tensors
    "optim_bits": ("int", lambda v: v in (8, 32), "8 or 32"),
    "min_8bit_size": ("int", lambda v: v >= 0, "an int >= 0"),
    "is_paged": ("bool", lambda v: True, "True or False (paging moves the state, not the math)"),
}
BNB_OPTION_TYPES = {  # type -> (whether a value has it, its description in an error)
    "float": (is_number, "a number (a float; an int will do, a bool will not)"),
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an int (not a bool or float)"),
    "Optional[int]": (lambda v: v is None or isinstance(v, numbers.Integral) and not isinstance(v, bool),
                      "None or an int (not a bool)"),
    "bool": (lambda v: isinstance(v, bool), "True or False (a bool, not an int)"),
}
# The block sizes of bitsandbytes' blockwise 8-bit optimizer states (256 in 0.50, 2048 in earlier versions): the
# absmax count tells which.
BNB_BLOCK_SIZES = (256, 2048)


READ_LAYOUTS = ("torchao's AdamW8bit, AdamW4bit, AdamWFp8 and bitsandbytes' Adam8bit, AdamW8bit, PagedAdam8bit, "
                "PagedAdamW8bit")


def library(value: Any) -> str:
    """The top-level package that defines value's class: "torchao", "bitsandbytes", "torch", ..."""
    return type(value).__module__.split(".")[0]


def reads_state_dict_of(optimizer: Any) -> bool:
    """Whether load_state_dict reads this optimizer's state_dict: torchao's and bitsandbytes' Adam optimizers (every
    class named Adam...: READ_LAYOUTS, their fp32 ones and torchao's _AdamW). Their other optimizers (Lion, SGD,
    RMSprop, AdEMAMix, LAMB, ...) keep the states of other update rules, which it refuses."""
    return library(optimizer) in ("torchao", "bitsandbytes") and "Adam" in type(optimizer).__name__


def _is_torchao(value: Any) -> bool:
    return library(value) == "torchao"


def _unreadable(value: Any) -> Optional[str]:
    """What a state value is when it is a tensor subclass wrapping other tensors (as torchao's) that no check can
    read, else None. DTensors are FusedAdam's own distributed states, read elsewhere, unless they wrap such a
    subclass (torchao's states of FSDP2 params)."""
    kind = type(value)
    if kind in (torch.Tensor, torch.nn.Parameter) or not hasattr(kind, "__tensor_flatten__"):
        return None
    if kind.__name__ == "DTensor" and kind.__module__.startswith("torch.distributed"):
        local = getattr(value, "_local_tensor", None)
        inner = _unreadable(local)
        return None if inner is None else f"a DTensor whose local tensor is {inner} (a sharded param's state)"
    return f"a {kind.__module__}.{kind.__name__}"


def source_of(state_dict: Any) -> Optional[str]:
    """Which library's optimizer saved this state_dict: "torchao", "bitsandbytes", or None (FusedAdam's, torch's,
    ORT's, or malformed: those go the usual way, whose checks report what is wrong)."""
    if not isinstance(state_dict, dict):
        return None
    states = state_dict.get("state")
    groups = state_dict.get("param_groups")
    states = list(states.values()) if isinstance(states, dict) else []
    groups = list(groups) if isinstance(groups, (list, tuple)) else []
    if any(isinstance(s, dict) and (BNB_QUANT_STATE_KEY in s or "state1" in s) for s in states):
        return "bitsandbytes"
    # before its first step a bitsandbytes optimizer saves no state, but its groups have AdEMAMix's keys
    if any(isinstance(g, dict) and {"alpha", "t_alpha", "t_beta3"} <= set(g) for g in groups):
        return "bitsandbytes"
    if any(isinstance(s, dict) and any(_is_torchao(v) for v in s.values()) for s in states):
        return "torchao"
    # before its first step, or with every param under 4096 elements, a torchao optimizer saves no state of its own,
    # but its groups have its keys, lr a tensor, and none of the keys the others save (torch's Adam and AdamW their
    # implementation switches, ORT's FusedAdam and ours bias_correction); keys an LR scheduler or the user added
    # (initial_lr, max_lr, a tag) are kept, as torch keeps them
    if groups and all(isinstance(g, dict) and TORCHAO_GROUP_KEYS <= set(g) and not OTHER_ADAM_GROUP_KEYS & set(g)
                      and type(g["lr"]) is torch.Tensor for g in groups):
        return "torchao"
    # bitsandbytes' one-state optimizers (Lion8bit, SGD8bit, RMSprop8bit) save groups of exactly these keys, with
    # eps = 0 (Lion) or beta2 = 0 (SGD's momentum and RMSprop's alpha go in betas[0]): not Adam, refused by
    # _bnb_group, also before their first step (after it, their 'state1' without a 'state2' tells)
    if any(_bnb_one_state_group(g) for g in groups):
        return "bitsandbytes"
    return None


def _bnb_one_state_group(group: Any) -> bool:
    """Whether a param group is one of bitsandbytes' one-state optimizers (Lion8bit, SGD8bit, RMSprop8bit): exactly
    their keys, with eps = 0 (Lion) or beta2 = 0 (SGD's momentum and RMSprop's alpha are betas[0])."""
    if not (isinstance(group, dict) and set(group) == BNB_ONE_STATE_GROUP_KEYS):
        return False
    betas = group["betas"]
    beta2 = betas[1] if isinstance(betas, (tuple, list)) and len(betas) == 2 else None
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0 for v in (group["eps"], beta2))


def canonical_checkpoint(state_dict: Any) -> Any:
    """state_dict itself when no foreign layout is recognised; else a new canonical checkpoint with the same
    values (fresh tensors and containers; the given dict is not written to). Also refuses, naming the entry, a
    state tensor that is a tensor subclass of a kind it does not know, since no check of the usual path can read
    one. Quantised moments come back as _checkpoint.Decoded values, decoded a piece at a time where the load checks
    and stores them, so that no decoded copy of a whole moment is made (refusals name the canonical entry, which
    explain_entry then says what it is here)."""
    source = source_of(state_dict)
    if source is None:
        _refuse_unknown_subclasses(state_dict)
        return state_dict
    _check_top_level(state_dict, source)
    if source == "torchao":
        _one_torchao_layout(state_dict["state"])
        return {"state": {pid: _torchao_state(s, entry("state", pid))
                          for pid, s in state_dict["state"].items()},
                "param_groups": [_torchao_group(g, gi) for gi, g in enumerate(state_dict["param_groups"])]}
    states, sizes, first = {}, set(BNB_BLOCK_SIZES), None
    for pid, s in state_dict["state"].items():
        if isinstance(s, dict) and not s:
            # (an empty dict: torch.optim's state is a defaultdict, and reading the state of a param that has not
            # stepped yet leaves one, which state_dict() saves: no state yet, as torch.optim loads it)
            states[pid] = {}
            continue
        states[pid], fits = _bnb_state(s, entry("state", pid))
        if fits is not None and not (sizes & fits):
            # (one block size per bitsandbytes version, for every param's codes)
            raise ValueError(f"{entry('state', pid)}: its 'absmax' counts give blocks of "
                             f"{' or '.join(map(str, sorted(fits)))} elements but {first}'s give "
                             f"{' or '.join(map(str, sorted(sizes)))}: bitsandbytes blocks every param's codes alike, "
                             "so this checkpoint was pieced together or its scales cut")
        if fits is not None and sizes & fits != sizes:
            sizes, first = sizes & fits, entry("state", pid)  # (the entry that told the block size)
    return {"state": states, "param_groups": [_bnb_group(g, gi) for gi, g in enumerate(state_dict["param_groups"])]}


# What an entry of the canonical checkpoint that canonical_checkpoint makes holds, in the given layout's own words (for
# the errors of the checks that then run on that checkpoint).
DECODED_FROM = {
    "torchao": "its 'exp_avg' and 'exp_avg_sq' are torchao's quantised tensors of those names, decoded",
    "bitsandbytes": f"its 'exp_avg' is state1 and its 'exp_avg_sq' state2 of '{BNB_QUANT_STATE_KEY}' (or of the "
                    "state itself), each decoded with its absmax and qmap, and its 'step' is that state's step",
}


def entry_note(source: str) -> str:
    """What the entries of the canonical checkpoint made from a source's state_dict name there, for the errors and
    warnings of its load (which name those entries)."""
    return f"(in the Adam checkpoint read from this {source} state_dict: {DECODED_FROM[source]})"


def explain_entry(error: Exception, source: str) -> Exception:
    """error, raised by the checks of the canonical checkpoint made from a source's state_dict, with what its entry
    names there added (a new exception of the same type)."""
    return type(error)(f"{error} {entry_note(source)}")


def _refuse_unknown_subclasses(state_dict: Any) -> None:
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        return
    for pid, state in state_dict["state"].items():
        if not isinstance(state, dict):
            continue
        for key, value in state.items():
            what = _unreadable(value)
            if what is not None:
                raise TypeError(f"{entry('state', pid, key)} is {what}, a tensor subclass whose layout ort_optim does "
                                f"not read. FusedAdam reads plain tensors and the states of {READ_LAYOUTS} (of "
                                "unsharded params); convert this state to plain tensors first")


def _check_top_level(state_dict: dict, source: str) -> None:
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"state_dict ({source}'s layout) has no {key!r}")
    for key in state_dict:
        if key not in ("state", "param_groups"):
            raise ValueError(f"{entry(key)}: unknown key in a {source} optimizer state_dict, which has only 'state' "
                             "and 'param_groups'")
    if not isinstance(state_dict["state"], dict):
        raise TypeError(f"{entry('state')} must be a dict from parameter id to state, got {show(state_dict['state'])}")
    if not isinstance(state_dict["param_groups"], (list, tuple)):
        raise TypeError(f"{entry('param_groups')} must be a list of dicts, got {show(state_dict['param_groups'])}")
    for gi, group in enumerate(state_dict["param_groups"]):
        if not isinstance(group, dict):
            raise TypeError(f"{entry('param_groups', gi)} must be a dict, got {show(group)}")
    for pid, state in state_dict["state"].items():
        if not isinstance(state, dict):
            raise TypeError(f"{entry('state', pid)} must be a dict of state tensors, got {show(state)}")


def _adam_group(group: dict, gi: int, lr: Any) -> dict:
    """A source group as FusedAdam options with the source's math: torch's AdamW update (decoupled decay first,
    eps added to the bias-corrected sqrt(v)), no maximize; the keys not mapped here are kept as given (the usual
    checks refuse other optimizers' options)."""
    betas = group.get("betas")
    if isinstance(betas, (list, tuple)) and len(betas) == 3:
        raise ValueError(f"{entry('param_groups', gi, 'betas')} has three betas {tuple(betas)!r}: AdEMAMix's, "
                         "whose second momentum FusedAdam does not have")
    # (neither library saves these; a value that changes the update is not the source's math: refused, not replaced)
    for key, value in (("adam_w_mode", int(AdamWMode.ADAMW_TORCH)), ("bias_correction", True), ("maximize", False)):
        if key in group and not (isinstance(group[key], bool) == isinstance(value, bool) and group[key] == value):
            raise ValueError(f"{entry('param_groups', gi, key)} is {group[key]!r}, which changes the update; the "
                             f"source optimizer's update is torch's AdamW's ({key}={value!r})")
    out = dict(group)
    out["lr"] = lr
    out.update(adam_w_mode=int(AdamWMode.ADAMW_TORCH), bias_correction=True, maximize=False)
    return out


# ---- torchao -------------------------------------------------------------------------------------------------------


def _torchao_group(group: dict, gi: int) -> dict:
    """torchao's AdamW* groups: lr (a float32 tensor: their compiled step needs one; a float here), betas, eps,
    weight_decay, amsgrad. Their update is torch's AdamW (torchao.optim.adam.single_param_adam). torchao's
    Adam8bit/4bit/Fp8 (L2 decay) save the same groups: with weight_decay 0 they compute the same. An lr tensor that
    holds no value (on the meta device: a checkpoint loaded with map_location="meta") is kept as it is, for the
    usual checks to refuse by its entry."""
    lr = group.get("lr")
    if (type(lr) is torch.Tensor and lr.layout == torch.strided and not lr.is_nested and not lr.is_meta
            and lr.numel() == 1 and lr.is_floating_point()):
        lr = float(lr.detach().reshape(()).double().cpu())
    return _adam_group(group, gi, lr)


# The keys of a torchao AdamW* state (max_exp_avg_sq with amsgrad).
TORCHAO_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _one_torchao_layout(states: dict) -> None:
    """Each torchao optimizer keeps every quantised state in one class (OptimState8bit, OptimState4bit or
    OptimStateFp8): a checkpoint mixing them was pieced together from several runs, not saved by one, and is refused
    naming the first entry of a second class."""
    first = None
    for pid, state in states.items():
        for key, value in state.items() if isinstance(state, dict) else ():
            if not _is_torchao(value):
                continue
            kind = type(value).__name__
            if first is None:
                first = (kind, entry("state", pid) + f"[{key!r}]")
            elif kind != first[0]:
                raise ValueError(f"{entry('state', pid)}[{key!r}] is a torchao {kind} but {first[1]} is a torchao "
                                 f"{first[0]}: one torchao optimizer keeps all its states in one format, so this "
                                 "checkpoint mixes the states of different optimizers, which no run continues from. "
                                 "Load each optimizer's own checkpoint")


def _torchao_state(state: dict, where: str) -> dict:
    if not isinstance(state, dict):
        return state  # (the usual checks name it)
    for key in state:
        if key not in TORCHAO_STATE_KEYS:
            raise ValueError(f"{where}[{key!r}]: a key a torchao Adam state does not have (it has "
                             f"{', '.join(map(repr, TORCHAO_STATE_KEYS))}); a layout ort_optim does not read")
    out = {}
    for key, value in state.items():
        if _is_torchao(value):
            out[key] = _torchao_values(value, f"{where}[{key!r}]")
        elif _unreadable(value) is not None:
            raise TypeError(f"{where}[{key!r}] is {_unreadable(value)}, a tensor subclass ort_optim does not read, in "
                            f"a torchao optimizer state (it reads the states of {READ_LAYOUTS}, of unsharded params)")
        else:  # the step (a float32 tensor), or the plain moments of a param under 4096 elements (its dtype): as
            out[key] = value  # they are; the usual checks read them (and copy, never write)
    return out


def _attr(value: Any, name: str, where: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    kind = type(value).__name__
    if not hasattr(value, name):
        raise ValueError(f"{where}: torchao {kind} without {name!r}, a layout ort_optim does not read (it reads "
                         "torchao 0.18's: codes, scale and, for 8-bit and 4-bit, qmap)")
    t = getattr(value, name)
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{where}: torchao {kind}.{name} must be a plain tensor, got {show(t)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{where}: torchao {kind}.{name} must be {dtype}, got {show(t)}")
    require_data(t, f"{where}: torchao {kind}.{name}")
    return t.detach()


def _torchao_values(value: Any, where: str) -> Any:
    """The float32 values a torchao OptimState* holds, decoded from its attributes as its dequantize() does, a piece
    at a time where the load checks and stores them (_checkpoint.Decoded)."""
    kind = type(value).__name__
    if kind not in TORCHAO_STATES:
        raise ValueError(f"{where} is torchao's {kind}, a state layout ort_optim does not read; it reads "
                         + ", ".join(f"{name} ({what})" for name, what in TORCHAO_STATES.items()))
    scale = _attr(value, "scale", where, torch.float32).reshape(-1)
    if kind == "OptimStateFp8":
        codes = _attr(value, "codes", where, torch.float8_e4m3fn)
        shape, table = codes.shape, None
        flat = codes.reshape(-1)
        n = flat.numel()
    elif kind == "OptimState8bit":
        codes = _attr(value, "codes", where, torch.uint8)
        shape, table = codes.shape, _attr(value, "qmap", where, torch.float32).reshape(-1)
        flat = codes.reshape(-1)
        n = flat.numel()
    else:  # two 4-bit codes per byte, the first element in the high nibble (torchao's packing: codes[::2] << 4)
        codes = _attr(value, "codes", where, torch.uint8).reshape(-1)
        shape = getattr(value, "_shape", None)
        if not (isinstance(shape, (tuple, list, torch.Size)) and all(isinstance(d, int) for d in shape)):
            raise ValueError(f"{where}: torchao OptimState4bit without its '_shape' (the param's shape), a layout "
                             "ort_optim does not read")
        shape = torch.Size(shape)
        if math.prod(shape) != 2 * codes.numel():
            raise ValueError(f"{where}: torchao OptimState4bit of shape {tuple(shape)} holds {codes.numel()} bytes "
                             f"of codes, not {math.prod(shape) // 2}")
        table = _attr(value, "qmap", where, torch.float32).reshape(-1)
        flat, n = codes, 2 * codes.numel()
    levels = {"OptimState8bit": 256, "OptimState4bit": 16}.get(kind)
    if table is not None and table.numel() != levels:
        raise ValueError(f"{where}: torchao {kind}.qmap has {table.numel()} values, its codes {levels}")
    if scale.numel() == 0 or n % scale.numel():
        raise ValueError(f"{where}: torchao {kind} with {n} elements and {scale.numel()} block scales (torchao's "
                         "blocks divide the tensor evenly)")
    block = n // scale.numel()
    scale = scale.to(flat.device)
    table = None if table is None else table.to(flat.device)

    def decode(start: int, stop: int) -> torch.Tensor:
        if kind == "OptimState4bit":
            pairs = flat[start // 2:(stop + 1) // 2]
            codes = torch.stack([pairs >> 4, pairs & 0xF], dim=1).reshape(-1)[start % 2:start % 2 + stop - start]
        else:
            codes = flat[start:stop]
        values = codes.float() if table is None else table[codes.long()]
        return values * scale[torch.arange(start, stop, device=flat.device) // block]

    return _checkpoint.Decoded(torch.Size(shape), flat.device, decode)


# ---- bitsandbytes --------------------------------------------------------------------------------------------------


def _bnb_group(group: dict, gi: int) -> dict:
    """bitsandbytes' Adam groups: lr, betas, eps, weight_decay and AdEMAMix's alpha, t_alpha, t_beta3. Adam8bit and
    AdamW8bit run the same step ("adam"): on CPU (bitsandbytes.backends.cpu.ops) exactly torch's AdamW (p *= 1 -
    lr * wd, then p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)); the CUDA kernel applies the decay after the
    update instead, which differs by lr * wd times the update. No amsgrad."""
    if _bnb_one_state_group(group):
        raise ValueError(f"{entry('param_groups', gi)} is a bitsandbytes one-state optimizer's group (eps "
                         f"{group['eps']!r}, betas {group['betas']!r}: Lion8bit's, SGD8bit's or "
                         "RMSprop8bit's, which keep one moment and step by another rule than Adam's); FusedAdam "
                         "continues only bitsandbytes' Adam8bit and AdamW8bit (and their paged variants)")
    out = dict(group)
    for key, (kind, neutral, expected) in BNB_GROUP_OPTIONS.items():
        if key in out:
            value = out.pop(key)
            has_type, described = BNB_OPTION_TYPES[kind]
            if not has_type(value):
                raise TypeError(f"{entry('param_groups', gi, key)} must be {described}, as bitsandbytes stores it, "
                                f"got {show(value)}; a bitsandbytes Adam state continues in FusedAdam only with "
                                f"{key}={expected}")
            if not neutral(value):
                raise ValueError(f"{entry('param_groups', gi, key)} is {value!r}; a bitsandbytes Adam state "
                                 f"continues in FusedAdam only with {key}={expected}")
    if out.get("amsgrad", False) is not False:
        raise ValueError(f"{entry('param_groups', gi, 'amsgrad')} is {out['amsgrad']!r}; bitsandbytes' 8-bit Adam "
                         "has no amsgrad state")
    out["amsgrad"] = False
    return _adam_group(out, gi, out.get("lr"))


def _bnb_block_sizes(n: int, blocks: int, where: str) -> frozenset[int]:
    """The bitsandbytes block sizes that give n elements this many blocks (both, where all n are one block)."""
    sizes = frozenset(b for b in BNB_BLOCK_SIZES if -(-n // b) == blocks)
    if not sizes:
        raise ValueError(f"{where}: {blocks} block scales for {n} elements fit no bitsandbytes block size "
                         f"({' or '.join(map(str, BNB_BLOCK_SIZES))} elements per block)")
    return sizes


def _bnb_decode(quant: dict, i: int, where: str) -> tuple[Any, Optional[frozenset[int]]]:
    """state{i} decoded, and the block sizes its scales fit: float32 states as they are (None); uint8 codes as
    qmap{i}[code] * absmax{i}[block], a piece at a time where the load checks and stores them (_checkpoint.Decoded)."""
    codes = quant.get(f"state{i}")
    if not isinstance(codes, torch.Tensor) or type(codes) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{where}['state{i}'] must be a plain tensor, got {show(codes)}")
    require_data(codes, f"{where}['state{i}']")
    if codes.dtype != torch.uint8:
        for key in (f"qmap{i}", f"absmax{i}"):
            if key in quant:
                raise ValueError(f"{where}[{key!r}] goes with 8-bit codes, but state{i} is {codes.dtype}")
        # (a param under min_8bit_size: plain float32 moments, read (never written) by the usual checks)
        return codes, None
    parts = {}
    for key in (f"qmap{i}", f"absmax{i}"):
        t = quant.get(key)
        if t is None:
            raise ValueError(f"{where} has 8-bit state{i} but no {key!r}, without which its codes have no values "
                             "(a layout ort_optim does not read)")
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dtype != torch.float32:
            raise TypeError(f"{where}[{key!r}] must be a plain float32 tensor, got {show(t)}")
        require_data(t, f"{where}[{key!r}]")
        parts[key] = t.detach().reshape(-1)
    qmap, absmax = parts[f"qmap{i}"], parts[f"absmax{i}"]
    if qmap.numel() != 256:
        raise ValueError(f"{where}['qmap{i}'] has {qmap.numel()} values; 8-bit codes need 256")
    flat = codes.detach().reshape(-1)
    n = flat.numel()
    sizes = _bnb_block_sizes(n, absmax.numel(), f"{where}['absmax{i}']")
    block = min(sizes)  # (where both fit, all n elements are one block either way)
    qmap, absmax = qmap.to(flat.device), absmax.to(flat.device)

    def decode(start: int, stop: int) -> torch.Tensor:
        return qmap[flat[start:stop].long()] * absmax[torch.arange(start, stop, device=flat.device) // block]

    return _checkpoint.Decoded(codes.shape, flat.device, decode), sizes


def _bnb_state(state: dict, where: str) -> tuple[dict, Optional[frozenset[int]]]:
    """A bitsandbytes Adam state as an Adam checkpoint's, and the block sizes its codes' scales fit (None: plain
    float32 moments)."""
    quant, quant_where = state, where
    if BNB_QUANT_STATE_KEY in state:
        quant, quant_where = state[BNB_QUANT_STATE_KEY], f"{where}[{BNB_QUANT_STATE_KEY!r}]"
        if not isinstance(quant, dict):
            raise TypeError(f"{quant_where} must be a dict of state tensors, got {show(quant)}")
        for key in state:
            if key not in ("step", BNB_QUANT_STATE_KEY):
                raise ValueError(f"{where}[{key!r}]: a key a bitsandbytes Adam state does not have (it has 'step' and "
                                 f"{BNB_QUANT_STATE_KEY!r}); a layout ort_optim does not read")
    for key in quant:
        if key not in BNB_STATE_KEYS + (("step",) if quant is state else ()):
            raise ValueError(f"{quant_where}[{key!r}]: a bitsandbytes state key ort_optim does not read (an Adam "
                             f"state has {', '.join(BNB_STATE_KEYS)}; {key!r} belongs to another optimizer, option or "
                             "version)")
    if "state1" in quant and "state2" not in quant:
        raise ValueError(f"{quant_where} has 'state1' but no 'state2': one moment, the state of bitsandbytes' Lion, "
                         "SGD with momentum, RMSprop or Adagrad, not of Adam (whose v is state2). FusedAdam continues "
                         f"{READ_LAYOUTS}")
    for i in (1, 2):
        if f"state{i}" not in quant:
            raise ValueError(f"{quant_where} has no 'state{i}' (bitsandbytes' Adam moment {'m' if i == 1 else 'v'})")
    (m, m_fits), (v, v_fits) = (_bnb_decode(quant, i, quant_where) for i in (1, 2))
    fits = m_fits if v_fits is None else v_fits if m_fits is None else m_fits & v_fits
    if fits is not None and not fits:  # (one block size per optimizer, in every version: both moments blocked alike)
        raise ValueError(f"{quant_where}: 'absmax1' gives blocks of {min(m_fits)} elements but 'absmax2' blocks of "
                         f"{min(v_fits)} (their counts: {quant['absmax1'].numel()} and {quant['absmax2'].numel()}); "
                         "bitsandbytes blocks both moments alike, so one of them was cut or replaced")
    out = {"exp_avg": m, "exp_avg_sq": v}
    if "step" in state:
        out["step"] = state["step"]  # an int; the usual checks validate it
    return out, fits
