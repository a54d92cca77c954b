"""Models, data and option tables shared by several test modules (one source for each, like torch's OptimizerInfo).

* ``TinyLM``: an embedding tied to its output head, a branch used on even steps only, a frozen layer and a LayerNorm;
  ``LMCase`` and ``train_lm`` run it with ``step_in_backward`` on or off, for the modules that compare the two.
* ``Tiny``: a two-layer MLP and its seeded loss ``tiny_loss``.
* ``STATE_DTYPES``: the moment storage dtypes by their short names; ``PARAM_CASES``: param dtype, master weights and
  stochastic rounding by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ort_optim import FusedAdam

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

