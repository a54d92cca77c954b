"""Models, data and option tables shared by several test modules (one source for each, like torch's OptimizerInfo).

* ``TinyLM``: an embedding tied to its output head, a branch used on even steps only, a frozen layer and a LayerNorm;
  ``LMCase`` and ``train_lm`` run it with ``step_in_backward`` on or off, for the modules that compare the two.
* ``Tiny``: a two-layer MLP and its seeded loss ``tiny_loss``.
* ``STATE_DTYPES``: the moment storage dtypes by their short names; ``PARAM_CASES``: param dtype, master weights and
  stochastic rounding by name.
* ``configurations`` and ``gradients``: hypothesis strategies of whole optimizer configurations (param sizes around
  every block and vector width the kernels split by, layouts, param and moment dtypes, per-group options) and of
  gradients (tiny to overflowing, with inf and NaN elements, missing), for the properties that step any
  configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from ort_optim import AdamWMode, FusedAdam, _spec

# Moment storage dtypes (exp_avg_dtype, exp_avg_sq_dtype) by short name: 8-bit and 4-bit codes, fp32, bf16, fp16.
STATE_DTYPES = {"u8": torch.uint8, "u4": torch.uint4, "fp32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16}
# name: (param dtype, master_weights, stochastic_rounding)
PARAM_CASES = {
    "fp32": (torch.float32, False, False),
    "bf16-master": (torch.bfloat16, True, False),
    "bf16": (torch.bfloat16, False, False),
    "bf16-sr": (torch.bfloat16, False, True),
    "fp16-master": (torch.float16, True, False),
    "fp16": (torch.float16, False, False),
}

LM_STEPS = 16  # iterations of train_lm
LM_VOCAB, LM_WIDTH = 11, 8


class TinyLM(torch.nn.Module):
    """An embedding tied to the output head (one param, two uses: its hook must fire once, after both gradients are
    accumulated), a hidden layer, a branch the loss uses on even steps only (no gradient on odd ones), a frozen layer
    and a LayerNorm."""

    def __init__(self, dtype: torch.dtype = torch.float32, branch_every: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(LM_VOCAB, LM_WIDTH)
        self.hidden = torch.nn.Linear(LM_WIDTH, LM_WIDTH)
        self.branch = torch.nn.Linear(LM_WIDTH, LM_WIDTH)
        self.frozen = torch.nn.Linear(LM_WIDTH, LM_WIDTH).requires_grad_(False)
        self.norm = torch.nn.LayerNorm(LM_WIDTH)
        self.head = torch.nn.Linear(LM_WIDTH, LM_VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.branch_every = branch_every
        self.to(dtype)

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(tokens[:, :-1])))
        if step % self.branch_every == 0:
            h = h + self.branch(h)
        h = self.norm(self.frozen(h))
        return F.cross_entropy(self.head(h).float().flatten(0, 1), tokens[:, 1:].flatten())


def lm_tokens(step: int) -> torch.Tensor:
    return torch.randint(0, LM_VOCAB, (3, 6), generator=torch.Generator().manual_seed(100 + step))


def decay_groups(model: TinyLM) -> list[dict]:
    """The usual split: no weight decay for biases and norms, their own lr."""
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}]


@dataclass
class LMCase:
    dtype: torch.dtype = torch.float32
    options: dict = field(default_factory=dict)
    groups: Callable[[TinyLM], list] = lambda model: list(model.parameters())
    zero_grad: str = "after step"  # "after step", "before backward", "set_to_none=False"
    branch_every: int = 2


def train_lm(case: LMCase, step_in_backward: bool, steps: int = LM_STEPS, first_step: int = 0, model=None, opt=None,
           scheduler_cls=None):
    model = model or TinyLM(case.dtype, case.branch_every)
    opt = opt or FusedAdam(case.groups(model), lr=1e-2, step_in_backward=step_in_backward, **case.options)
    scheduler = scheduler_cls(opt) if scheduler_cls else None
    for step in range(first_step, first_step + steps):
        if case.zero_grad == "before backward":
            opt.zero_grad()
        model(lm_tokens(step), step).backward()
        opt.step()
        if case.zero_grad == "after step":
            opt.zero_grad()
        elif case.zero_grad == "set_to_none=False":
            opt.zero_grad(set_to_none=False)
        if scheduler:
            scheduler.step()
    return model, opt


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def tiny_loss(model, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return model(torch.randn(5, 6, generator=g)).square().mean() * 50


# ---- drawn configurations ------------------------------------------------------------------------------------------

# Sizes around every block and vector width the kernels split by (16 lanes, 128/256-element low-bit and fp8 blocks,
# 1024-element fp16 blocks), layouts, param dtypes (with master weights or not) and moment dtypes.
SIZES_AROUND_BLOCKS = (0, 1, 3, 15, 16, 17, 127, 128, 129, 255, 256, 257, 513, 1023, 1024, 1025, 2049)
LAYOUTS = ("flat", "matrix", "transposed", "strided")
DRAWN_PARAMS = {"fp32": (torch.float32, False), "fp64": (torch.float64, False), "bf16": (torch.bfloat16, False),
                "fp16": (torch.float16, False), "bf16-master": (torch.bfloat16, True),
                "fp16-master": (torch.float16, True)}
MOMENT_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.uint4, torch.float8_e4m3fn,
                 torch.float8_e5m2)
# gradient magnitudes from float32's smallest normals to beyond float16's range and to v overflowing float32, and the
# values put into them
GRAD_MAGNITUDES = (0.0, 1e-38, 1e-20, 1e-6, 1e-2, 1.0, 3e2, 1e5, 1e21, 1e36)
SPECIAL_VALUES = (float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3e38)


@dataclass(frozen=True)
class Configuration:
    """A drawn optimizer: its params (sizes, layouts, one dtype), optimizer-wide options and 1-2 groups of options
    (the params dealt round-robin; an lr of "tensor" is a 0-dim tensor)."""
    dtype: torch.dtype
    sizes: tuple
    layouts: tuple
    options: dict
    groups: tuple

    def params(self) -> list[torch.nn.Parameter]:
        out = []
        for i, (size, layout) in enumerate(zip(self.sizes, self.layouts)):
            g = torch.Generator().manual_seed(i)
            if layout == "strided":
                out.append(torch.nn.Parameter((0.1 * torch.randn(2 * size, generator=g)).to(self.dtype)[::2]))
                continue
            value = (0.1 * torch.randn(size, generator=g)).to(self.dtype)
            if layout != "flat" and size % 3 == 0 and size:
                value = value.reshape(3, size // 3)
                if layout == "transposed":
                    value = value.t().contiguous().t()
            out.append(torch.nn.Parameter(value))
        return out

    def param_groups(self, params: list) -> list[dict]:
        n = len(self.groups)
        return [dict(group, params=params[k::n], lr=torch.tensor(0.01) if group["lr"] == "tensor" else group["lr"])
                for k, group in enumerate(self.groups) if params[k::n]]


@st.composite
def configurations(draw, clipping: bool = True) -> Configuration:
    dtype, master = DRAWN_PARAMS[draw(st.sampled_from(sorted(DRAWN_PARAMS)), "params")]
    sizes = tuple(draw(st.lists(st.sampled_from(SIZES_AROUND_BLOCKS), min_size=1, max_size=4), "sizes"))
    layouts = tuple(draw(st.sampled_from(LAYOUTS)) for _ in sizes)
    options = dict(master_weights=master, exp_avg_dtype=draw(st.sampled_from(MOMENT_DTYPES), "exp_avg_dtype"),
                   exp_avg_sq_dtype=draw(st.sampled_from(MOMENT_DTYPES), "exp_avg_sq_dtype"))
    if clipping:
        options["max_grad_norm"] = draw(st.sampled_from((None, 1.0, 1e-3)), "max_grad_norm")
    groups = tuple(dict(lr=draw(st.sampled_from((1e-3, 0.1, "tensor"))),
                        betas=draw(st.sampled_from(((0.9, 0.999), (0.0, 0.5), (0.99, 0.9999)))),
                        eps=draw(st.sampled_from((1e-8, 1e-6, 0.0))),
                        weight_decay=draw(st.sampled_from((0.0, 0.01, 1.5))),
                        adam_w_mode=draw(st.sampled_from(list(AdamWMode))),
                        bias_correction=draw(st.booleans()), amsgrad=draw(st.booleans()),
                        maximize=draw(st.booleans()),
                        stochastic_rounding=draw(st.booleans()) and dtype == torch.bfloat16 and not master)
                   for _ in range(draw(st.integers(1, 2), "groups")))
    return Configuration(dtype, sizes, layouts, options, groups)


def gradients(count: int, missing: bool = True):
    """Strategy: the gradients of `count` params for one step, each (magnitude, [(position, index into
    SPECIAL_VALUES)]) for gradient() to make, or (one in eight, where missing) None: no gradient."""
    present = st.tuples(st.sampled_from(GRAD_MAGNITUDES),
                        st.lists(st.tuples(st.integers(0, 10**4), st.integers(0, len(SPECIAL_VALUES) - 1)),
                                 max_size=2))
    one = st.integers(0, 7).flatmap(lambda k: st.none() if k == 7 else present) if missing else present
    return st.lists(one, min_size=count, max_size=count)


def gradient(p: torch.Tensor, spec: tuple, seed: int) -> torch.Tensor:
    """The gradient of param p that spec draws: normal values of its magnitude, special values at its positions."""
    magnitude, specials = spec
    grad = torch.randn(p.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * magnitude
    for position, which in specials:
        if p.numel():
            grad[position % p.numel()] = SPECIAL_VALUES[which]
    return grad.to(p.dtype).reshape(p.shape)


# ---- malformed calls of the ort_optim::adam_step_ op -------------------------------------------------------------

def op_arguments(param_dtype: torch.dtype = torch.float32, exp_avg="fp16", exp_avg_sq=torch.float32,
                 master: bool = False, amsgrad: bool = False, shapes=((5,), (7,), (3, 4)), device="cpu"):
    """A well-formed adam_step_ call: (its ten positional arguments as a list, its keywords). exp_avg and exp_avg_sq
    are a dtype or a block-scaled format: "fp16" (float16 codes, float32 scales per 1024), "q8" (uint8 codes of the
    param's shape, float32 scales per 256), "q4" (flat uint8 codes, two a byte, bfloat16 scales per 128)."""
    def state(kind, shape, numel):
        if kind == "fp16":
            return torch.zeros(shape, dtype=torch.float16), torch.ones(_spec.num_blocks(numel))
        if kind in ("q8", "q4"):
            fmt = _spec.Q8 if kind == "q8" else _spec.Q4
            return (torch.zeros(fmt.storage_shape(torch.Size(shape)), dtype=torch.uint8),
                    torch.ones(fmt.num_scales(numel), dtype=fmt.scale_dtype))
        return torch.zeros(shape, dtype=kind), None

    params, grads, ms, vs, vmaxs, masters, m_scales, v_scales, vmax_scales = ([] for _ in range(9))
    for shape in shapes:
        numel = torch.Size(shape).numel()
        params.append(torch.ones(shape, dtype=param_dtype))
        grads.append(torch.full(shape, 0.5, dtype=param_dtype))
        if master:
            masters.append(torch.ones(shape))
        for kind, store, scales in ((exp_avg, ms, m_scales), (exp_avg_sq, vs, v_scales)) + (
                ((exp_avg_sq, vmaxs, vmax_scales),) if amsgrad else ()):
            codes, s = state(kind, shape, numel)
            store.append(codes)
            if s is not None:
                scales.append(s)
    args = [params, grads, ms, vs, vmaxs, masters, m_scales, v_scales, vmax_scales,
            torch.zeros(len(shapes), dtype=torch.float64)]
    args = [[t.to(device) for t in a] if isinstance(a, list) else a.to(device) for a in args]
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adam_w_mode=1, bias_correction=True,
                  maximize=False)
    return args, kwargs


# The malformed calls' tensors are made on the device of the call's own (a replaced tensor's, or the steps').
def _set(index, i, value):
    """args[index][i] = value(the tensor it replaces)."""
    def mutate(args, kwargs):
        args[index][i] = value(args[index][i])
    return mutate


def _zeros(*shape, dtype=torch.float32):
    return lambda t: torch.zeros(shape, dtype=dtype, device=t.device)


def _keyword(name, value):
    """kwargs[name] = value(the steps)."""
    def mutate(args, kwargs):
        kwargs[name] = value(args[9])
    return mutate


def _steps(value):
    def mutate(args, kwargs):
        args[9] = value(args[9])
    return mutate


def _append_float64_param(args, kwargs):
    for index in range(4):
        args[index].append(torch.zeros(2, dtype=torch.float64, device=args[0][0].device))
    args[9] = torch.zeros(len(args[0]), dtype=torch.float64, device=args[9].device)


_F32_STATES = dict(exp_avg=torch.float32)
_RULE = "; states must be float32, bfloat16, float16, uint8 (low-bit codes) or float8_e4m3fn / float8_e5m2 (fp8 codes)"

# (id, op_arguments' options, what makes the call malformed, the native op's words after "ort_optim::adam_step_: ").
# Each breaks one rule of ops/README.md's adam_step_ inputs; every backend refuses it with a RuntimeError in these
# words, before it writes anything. (The CPU op's steps and rounding_keys live on the CPU: the Python backends take
# them on any device, and leave the word out.)
MALFORMED_OP_CALLS = [
    ("grads-list-too-short", {}, lambda a, k: a[1].pop(), "grads has 2 tensors but params has 3"),
    ("exp_avgs-list-too-long", {}, lambda a, k: a[2].append(a[2][0].clone()), "exp_avgs has 4 tensors but params has 3"),
    ("one-master-for-three-params", dict(param_dtype=torch.bfloat16, master=True), lambda a, k: a[5].pop(),
     "master_params has 2 tensors but params has 3 (pass n tensors or none)"),
    ("max-scales-without-max-states", dict(exp_avg_sq="fp16"), lambda a, k: a[8].extend(s.clone() for s in a[7]),
     "max_exp_avg_sq_scales given without max_exp_avg_sqs"),
    ("max-states-without-their-scales", dict(exp_avg_sq="fp16", amsgrad=True), lambda a, k: a[8].clear(),
     "max_exp_avg_sqs share exp_avg_sqs' dtype, so both or neither need scales"),
    ("steps-float32", {}, _steps(lambda s: s.float()), "steps must be a contiguous float64 CPU tensor of shape [3]"),
    ("steps-one-too-many", {}, _steps(_zeros(4, dtype=torch.float64)),
     "steps must be a contiguous float64 CPU tensor of shape [3]"),
    ("steps-non-contiguous", {}, _steps(lambda s: _zeros(6, dtype=torch.float64)(s)[::2]),
     "steps must be a contiguous float64 CPU tensor of shape [3]"),
    ("param-int32", _F32_STATES, _set(0, 1, lambda p: p.int()),
     "params[1] has dtype Int; supported are float32, float64, float16 and bfloat16"),
    ("master-for-an-fp32-param", {}, lambda a, k: a[5].extend(p.clone() for p in a[0]),
     "master_params given but params[0] is Float; master weights are for float16/bfloat16 params"),
    ("expanded-param", _F32_STATES, _set(0, 1, lambda p: _zeros(1)(p).expand(7)),
     "params[1] overlaps itself (an expand()ed tensor), so it cannot hold one updated value per element: give it its "
     "own memory (param.clone())"),
    ("exp_avg-wrong-shape", _F32_STATES, _set(2, 1, _zeros(8)),
     "exp_avgs[1] has shape [8] but params[1] has shape [7]"),
    ("exp_avg_sq-non-contiguous", {}, _set(3, 2, lambda t: _zeros(4, 3)(t).t()), "exp_avg_sqs[2] must be contiguous"),
    ("exp_avg-int32", _F32_STATES, _set(2, 0, lambda t: t.int()), "exp_avgs[0] has dtype Int" + _RULE),
    ("float32-state-of-a-float64-param", dict(param_dtype=torch.float64, exp_avg=torch.float64,
                                              exp_avg_sq=torch.float64),
     _set(3, 0, lambda t: t.float()), "exp_avg_sqs[0] has dtype Float; float64 params need float64 states"),
    ("max-state-of-another-dtype", dict(amsgrad=True), _set(4, 0, lambda t: t.bfloat16()),
     "max_exp_avg_sqs[0] must have the dtype of exp_avg_sqs[0]"),
    ("master-wrong-shape", dict(param_dtype=torch.bfloat16, master=True), _set(5, 1, _zeros(8)),
     "master_params[1] has shape [8] but params[1] has shape [7]"),
    ("master-bfloat16", dict(param_dtype=torch.bfloat16, master=True), _set(5, 0, lambda t: t.bfloat16()),
     "master_params[0] must be a contiguous float32 tensor"),
    ("scales-of-a-float32-state", {}, lambda a, k: a[7].extend(_zeros(1)(p) for p in a[0]),
     "exp_avg_sq_scales[0] is given but the state it scales is Float, not float16, uint8 or fp8"),
    ("fp16-state-wrong-number-of-scales", {}, _set(6, 2, _zeros(2)),
     "exp_avg_scales[2] must be a contiguous float32 tensor of 1 block scales on the state's device"),
    ("uint8-state-without-scales", _F32_STATES, _set(2, 0, lambda t: t.to(torch.uint8)),
     "the uint8 (low-bit) state scaled by exp_avg_scales[0] needs its block scales; exp_avg_scales is empty"),
    ("fp8-state-without-scales", _F32_STATES, _set(2, 0, lambda t: t.to(torch.float8_e4m3fn)),
     "the Float8_e4m3fn (fp8) state scaled by exp_avg_scales[0] needs its block scales; exp_avg_scales is empty"),
    ("8-bit-state-wrong-number-of-scales", dict(exp_avg="q8"), _set(6, 0, _zeros(2)),
     "exp_avg_scales[0] has 2 scales; a 8-bit state of 5 elements has 1 blocks of 256"),
    ("uint8-state-float16-scales", dict(exp_avg="q8"), _set(6, 0, lambda s: s.half()),
     "exp_avg_scales[0] has dtype Half; uint8 states take float32 scales (8-bit codes) or bfloat16 scales (4-bit "
     "codes, two per byte)"),
    ("8-bit-state-wrong-shape", dict(exp_avg="q8"), _set(2, 2, _zeros(12, dtype=torch.uint8)),
     "the 8-bit state scaled by exp_avg_scales[2] has shape [12] but params[2] has shape [3, 4]"),
    ("4-bit-state-not-flat", dict(exp_avg="q4", exp_avg_sq="q4"), _set(3, 0, _zeros(5, dtype=torch.uint8)),
     "the 4-bit state scaled by exp_avg_sq_scales[0] must be a flat uint8 tensor of 3 bytes (two codes each), got "
     "shape [5]"),
    ("4-bit-exp_avg-beside-a-float32-exp_avg_sq", dict(exp_avg="q4"), lambda a, k: None,
     "exp_avgs[0] holds 4-bit codes, which are coded relative to a 4-bit exp_avg_sq, but exp_avg_sqs[0] is not 4-bit "
     "codes: store both moments as torch.uint4"),
    ("float64-beside-float32", _F32_STATES, _append_float64_param,
     "float64 params cannot share a call with other dtypes; group them separately"),
    ("grad-wrong-shape", {}, _set(1, 1, _zeros(8)), "grads[1] has shape [8] but params[1] has shape [7]"),
    ("grad-float64-for-a-float32-param", {}, _set(1, 0, lambda g: g.double()),
     "grads[0] has dtype Double for a Float parameter"),
    ("grad-int32", {}, _set(1, 2, lambda g: g.int()), "grads[2] has dtype Int for a Float parameter"),
    ("float32-grad-for-a-float64-param", dict(param_dtype=torch.float64, exp_avg=torch.float64,
                                              exp_avg_sq=torch.float64),
     _set(1, 1, lambda g: g.float()), "grads[1] has dtype Float for a Double parameter"),
    ("lr_tensor-of-two-elements", {}, _keyword("lr_tensor", _zeros(2)),
     "lr_tensor must have exactly one element, got 2"),
    ("grad_scale-of-no-elements", {}, _keyword("grad_scale", _zeros(0)),
     "grad_scale must have exactly one element, got 0"),
    ("rounding_keys-int32", dict(param_dtype=torch.bfloat16), _keyword("rounding_keys", _zeros(3, dtype=torch.int32)),
     "rounding_keys must be a contiguous int64 CPU tensor of shape [3]"),
    ("rounding_keys-non-contiguous", dict(param_dtype=torch.bfloat16),
     _keyword("rounding_keys", lambda s: _zeros(6, dtype=torch.int64)(s)[::2]),
     "rounding_keys must be a contiguous int64 CPU tensor of shape [3]"),
    ("rounding_keys-for-float32-params", {}, _keyword("rounding_keys", _zeros(3, dtype=torch.int64)),
     "rounding_keys (stochastic rounding) given but params[0] is Float; stochastic rounding is for bfloat16 params "
     "without master weights"),
    ("adam_w_mode-3", {}, lambda a, k: k.update(adam_w_mode=3), "adam_w_mode must be 0, 1 or 2, got 3"),
]
