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

from ort_optim import AdamWMode, FusedAdam

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
