#!/usr/bin/env python
"""Which 4-bit moment format trains closest to fp32 moments? Candidate formats simulated on paired seeds.

    python tools/lowbit_4bit_study.py --tasks digits,zipf,gpt --seeds 0-29 --jobs 2 --out results/q4
    python tools/lowbit_4bit_study.py --quick                 # tiny sizes, two seeds: a smoke test
    python tools/lowbit_4bit_study.py --tasks digits --seeds 0-7 --baseline "FusedAdam fp32" \
        --candidates "FusedAdam fp32,FusedAdam uint4"         # the real optimizer (its backend), not the simulation

AdamW in float32 with torch.optim.AdamW's math (decoupled weight decay, eps outside the bias-corrected sqrt), whose
moments pass through a candidate format after every step as FusedAdam stores them: a step's update uses its exact new
moments, the next step starts from their decoded values. The encoders are ``ort_optim.formats``' (the reference for
every backend, stochastic rounding of exp_avg included), with a candidate's levels and block size; the
transformations a candidate adds (rank-1 normalisation, exp_avg relative to sqrt(v)) are written here.

Candidates (``CANDIDATES``; B/param counts codes and scales of both moments):

* ``4-bit``: the stored format, ``_spec.Q4`` (block 128, bfloat16 scales; sqrt(v) on 16 dense levels 0.001 .. 1,
  rounded stochastically in a step, unbiased in v: ``_spec.EXP_AVG_SQ_STOCHASTIC``; exp_avg as r = m / sqrt(v) on 7
  linear magnitudes k / 7, rounded stochastically, below 1/7 too: ``_spec.EXP_AVG_RELATIVE``), through ``formats``'
  own coupled encoder and decoder.
* ``4-bit decades``: the earlier 4-bit exp_avg, m itself on the levels 0, 0.1 .. 1 in decades (``DECADE_M``),
  rounded stochastically; sqrt(v) on the earlier decade map 0.001, 0.0055, 0.01, .. 1, nearest in 1/sqrt(v)
  (``Q4_NEAREST_V``). The candidates below build on it unless they say otherwise.
* ``4-bit nearest``: ``4-bit decades`` with exp_avg rounded to the nearest level instead.
* ``4-bit decades block 64``: ``4-bit decades`` with both moments in blocks of 64 (1.0625 B/param).
* ``geometric m + dense v``: denser levels where most elements of a block lie (exp_avg 0.01, 0.05, 0.12, 0.22,
  0.38, 0.62, 1; sqrt(v) 0.001, 0.004, 0.01, 0.02, ... 0.85, 1).
* ``rank-1 v``: sqrt(v) of a matrix normalised per element by min(its row's maximum, its column's maximum) (Li et al.
  2023, "Memory Efficient Optimizers with 4-bit States"), float32 row and column maxima; vectors keep blocks.
* ``Li et al.``: rank-1 v stored as v itself on the linear map without zero (k / 16, k = 1..16, nearest), exp_avg
  as in ``4-bit`` rounded to nearest.
* ``m/sqrt(v) linear``: the second moment as in ``4-bit``; exp_avg stored as ``r = m / sqrt(v_decoded)`` (the
  update's direction before bias correction, since the update is m / sqrt(v)), block-scaled on 7 linear magnitudes
  k / 7, rounded stochastically, toward zero below 1/7; decoded as ``r * sqrt(v_decoded)``. Same bytes as
  ``4-bit``: the simulation from which the stored format was chosen (u here is sqrt(v_decoded) in float32; the
  format reads u from the codes, and rounds stochastically below 1/7 too).
* ``m/sqrt(v) linear nearest``: the same, r rounded to the nearest level.
* ``FusedAdam uint4`` / ``FusedAdam fp32``: not a simulation: ``ort_optim.FusedAdam`` itself (adam_w_mode
  ADAMW_TORCH, whatever backend runs: the native CPU kernel where it is built) with ``torch.uint4`` moments / fp32
  moments. Pair them with ``--baseline "FusedAdam fp32"``. ``FusedAdam fp32 m + uint4 v``: an fp32 exp_avg beside
  the 4-bit exp_avg_sq (the second moment's share of the 4-bit difference). ``FusedAdam fp32 lr x1.027`` / ``x1.05``:
  fp32 moments at a 2.7% / 5% larger learning rate (what a uniformly larger mean update alone does).

Tasks (each seed fixes the initial weights and the batches; every candidate of a seed sees the same ones):

* ``digits``: the MLP of ``guides/examples/digits.py`` (64-256-256-10, LayerNorm, GELU) on scikit-learn's digits,
  AdamW lr 3e-3, weight decay 0.01, batch 64, 300 steps.
* ``digits-1e-3``: the quality harness's digits task (this MLP at lr 1e-3, ``guides/examples/lowbit_quality.py``).
* ``digits-plain``: the plain MLP (no LayerNorm, lr 3e-3) of ``guides/examples/lowbit_quality.py``.
* ``zipf``: the Zipf bag-of-tokens classifier of ``ort_optim.bench.lowbit.zipf_task`` (16384 x 32 embeddings).
* ``gpt``: the small GPT of ``guides/examples/lowbit_quality.py`` (2 layers x 64, 300 steps).

Reported per task and candidate: the paired relative difference of the mean training loss (over all steps) to the
baseline (``--baseline``, fp32 moments in the simulation by default), its mean over seeds with its standard error,
the ratio of the seed-averaged losses, the range over seeds.
Written to ``--out``: ``lowbit_4bit_study.json`` (every run) and ``lowbit_4bit_study.md`` (the table). With
``--update-error``: the update-space error of each candidate on the moments of one fp32 run (no training noise).
With ``--update-factor``: how much the 4-bit sqrt(v)'s stochastic rounding enlarges the update in expectation, on
the moments of fp32 runs (``update_factor``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "guides" / "examples"
for _path in (str(REPO), str(EXAMPLES)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from ort_optim import _spec, formats  # noqa: E402
from ort_optim.bench import lowbit  # noqa: E402
from ort_optim.bench.lowbit import TrainingRun  # noqa: E402

Q4 = _spec.Q4
DECADE_M = (0.0,) + _spec.decade_levels((1, 2, 4))
Q4_NEAREST_V = dataclasses.replace(Q4, exp_avg_sq_levels=_spec.decade_levels((1, 2, 4, 9)), exp_avg_sq_stochastic=False)
Q4_DECADES = dataclasses.replace(Q4_NEAREST_V, exp_avg_levels=DECADE_M, exp_avg_relative=False)
LINEAR_M = (0.0,) + tuple(k / 7 for k in range(1, 8))
GEOMETRIC_M = (0.0, 0.01, 0.05, 0.12, 0.22, 0.38, 0.62, 1.0)
DENSE_V = (0.001, 0.004, 0.01, 0.02, 0.04, 0.07, 0.1, 0.14, 0.19, 0.26, 0.34, 0.44, 0.56, 0.7, 0.85, 1.0)
LINEAR_V = tuple((k + 1) / 16 for k in range(16))
TOP_V = (0.001, 0.006, 0.02, 0.05, 0.1, 0.13, 0.16, 0.2, 0.25, 0.3, 0.37, 0.45, 0.55, 0.67, 0.82, 1.0)
GEOMETRIC_V = tuple(_spec._f32(10.0 ** (-3 + 3 * k / 15)) for k in range(16))
TARGET = 0.015  # the mean training loss of 4-bit moments within +1.5% of fp32 moments'


# ---- candidate formats ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A moment format: block quantisation with ``fmt``'s levels and block, plus the options below."""

    fmt: _spec.LowBitFormat = Q4_DECADES
    nearest: bool = False  # exp_avg (or r) rounded to the nearest level, not stochastically
    relative: bool = False  # exp_avg stored as r = m / sqrt(v_decoded)
    rank1: bool = False  # sqrt(v) of matrices normalised by min(row max, column max)
    linear_v: bool = False  # rank-1: v itself on LINEAR_V, nearest (Li et al.), not sqrt(v) on fmt's levels

    def bytes_per_param(self, shapes) -> float:
        total = count = 0
        for shape in shapes:
            n = math.prod(shape)
            count += n
            total += n * self.fmt.bits / 8 + self.fmt.num_scales(n) * self.fmt.scale_dtype.itemsize  # exp_avg
            if self.rank1 and len(shape) >= 2:
                total += n * self.fmt.bits / 8 + 4 * (shape[0] + n // shape[0])
            else:
                total += n * self.fmt.bits / 8 + self.fmt.num_scales(n) * self.fmt.scale_dtype.itemsize
        return total / count

    def second_moment(self, v: torch.Tensor, step: int = 0, m: torch.Tensor | None = None) -> torch.Tensor:
        """v -> its decoded value (step: the Adam step, for a format whose sqrt(v) rounds stochastically; m: that
        step's exp_avg, whose hash gives the random bits)."""
        if self.rank1 and v.dim() >= 2:
            return _rank1(v, self.fmt, self.linear_v)
        if self.fmt.exp_avg_sq_stochastic:  # a step's rounding: its random bits hash m and the step
            codes, scales = formats.quantize_low_bit(v, self.fmt, True, step, exp_avg=m)
            return formats.dequantize_low_bit(codes, scales, self.fmt, True, v.shape)
        codes, scales = formats.quantize_low_bit(v, self.fmt, True)
        return formats.dequantize_low_bit(codes, scales, self.fmt, True, v.shape)

    def first_moment(self, m: torch.Tensor, v_decoded: torch.Tensor, step: int, v: torch.Tensor) -> torch.Tensor:
        """m -> its decoded value (step: the Adam step, whose number the stochastic rounding mixes in; 0 rounds to
        nearest). v: the exact new second moment that second_moment stored as v_decoded."""
        if self.fmt.exp_avg_relative:  # the stored format: coded against the u that v's codes decode to
            root = formats.sqrt_f32(v_decoded)  # (= low_bit_root of v's codes: sqrt(u * u) is u in float32)
            codes, scales = formats.quantize_low_bit(m, self.fmt, False, 0 if self.nearest else step, root)
            return formats.dequantize_low_bit(codes, scales, self.fmt, False, m.shape, root)
        if not self.relative:
            codes, scales = formats.quantize_low_bit(m, self.fmt, False, 0 if self.nearest else step)
            return formats.dequantize_low_bit(codes, scales, self.fmt, False, m.shape)
        u = formats.sqrt_f32(v_decoded)
        r = torch.where(u > 0, m / torch.where(u > 0, u, torch.ones_like(u)), torch.zeros_like(m))
        codes, scales = formats.quantize_low_bit(r, self.fmt, False, 0 if self.nearest else step)
        return formats.dequantize_low_bit(codes, scales, self.fmt, False, m.shape) * u


def _rank1(v: torch.Tensor, fmt: _spec.LowBitFormat, linear_v: bool) -> torch.Tensor:
    """Rank-1 normalisation (Li et al. 2023): x = sqrt(v) (or v), per element divided by min(max of its row, max of
    its column) (a matrix's first dimension against the rest), coded on fmt's sqrt(v) levels nearest in 1/sqrt(v)
    (or on LINEAR_V, nearest)."""
    x = v if linear_v else formats.sqrt_f32(v)
    x2 = x.reshape(x.shape[0], -1)
    norm = torch.minimum(x2.amax(dim=1, keepdim=True), x2.amax(dim=0, keepdim=True))
    a = torch.where(norm > 0, x2 / torch.where(norm > 0, norm, torch.ones_like(norm)), torch.zeros_like(x2))
    a = a.clamp(max=1.0).reshape(-1).contiguous()
    levels = LINEAR_V if linear_v else fmt.exp_avg_sq_levels
    bounds = [(lo + hi) / 2 for lo, hi in zip(levels, levels[1:])] if linear_v else _spec.thresholds(levels, True)
    codes = torch.searchsorted(torch.tensor(bounds, dtype=torch.float32), a, right=True)
    decoded = (torch.tensor(levels, dtype=torch.float32)[codes].view_as(x2) * norm).view_as(v)
    return decoded if linear_v else decoded * decoded


@dataclasses.dataclass(frozen=True)
class Real:
    """ort_optim.FusedAdam itself with moments of these dtypes (not a simulation); lr_scale multiplies the task's
    learning rate (fp32 moments at the larger mean update that a format's rounding gives)."""

    dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype | None = None  # None: dtype
    lr_scale: float = 1.0

    @property
    def dtypes(self) -> tuple:
        return self.dtype, self.exp_avg_sq_dtype or self.dtype

    def bytes_per_param(self, shapes) -> float:
        total = 0.0
        for dtype in self.dtypes:
            fmt = _spec.LOW_BIT_FORMATS.get(dtype)
            for shape in shapes:
                n = math.prod(shape)
                total += n * dtype.itemsize if fmt is None else \
                    n * fmt.bits / 8 + fmt.num_scales(n) * fmt.scale_dtype.itemsize
        return total / sum(math.prod(s) for s in shapes)


CANDIDATES = {
    "fp32": None,
    "4-bit": Candidate(fmt=Q4),
    "4-bit decades": Candidate(),
    "4-bit nearest": Candidate(nearest=True),
    "4-bit decades block 64": Candidate(fmt=dataclasses.replace(Q4_DECADES, block=64)),
    "geometric m + dense v": Candidate(fmt=dataclasses.replace(Q4_DECADES, exp_avg_levels=GEOMETRIC_M,
                                                               exp_avg_sq_levels=DENSE_V)),
    "rank-1 v": Candidate(rank1=True),
    "Li et al.": Candidate(rank1=True, linear_v=True, nearest=True),
    "m/sqrt(v) linear": Candidate(fmt=dataclasses.replace(Q4_DECADES, exp_avg_levels=LINEAR_M), relative=True),
    "m/sqrt(v) linear nearest": Candidate(fmt=dataclasses.replace(Q4_DECADES, exp_avg_levels=LINEAR_M),
                                              relative=True, nearest=True),
    "4-bit nearest v": Candidate(fmt=Q4_NEAREST_V),
    "4-bit decade v": Candidate(fmt=dataclasses.replace(Q4, exp_avg_sq_levels=Q4_NEAREST_V.exp_avg_sq_levels)),
    "4-bit top v": Candidate(fmt=dataclasses.replace(Q4, exp_avg_sq_levels=TOP_V)),
    "4-bit geometric v": Candidate(fmt=dataclasses.replace(Q4, exp_avg_sq_levels=GEOMETRIC_V)),
    "4-bit block 64": Candidate(fmt=dataclasses.replace(Q4, block=64)),
    "4-bit nearest v block 32": Candidate(fmt=dataclasses.replace(Q4_NEAREST_V, block=32)),
    "4-bit nearest dense v": Candidate(fmt=dataclasses.replace(Q4_NEAREST_V, exp_avg_sq_levels=DENSE_V)),
    "FusedAdam uint4": Real(torch.uint4),
    "FusedAdam fp32": Real(torch.float32),
    "FusedAdam fp32 m + uint4 v": Real(torch.float32, torch.uint4),
    "FusedAdam fp32 lr x1.027": Real(torch.float32, lr_scale=1.027),
    "FusedAdam fp32 lr x1.05": Real(torch.float32, lr_scale=1.05),
}


# ---- AdamW with stored moments -------------------------------------------------------------------------------------


def train_fused(run: TrainingRun, real: Real) -> float:
    """The mean training loss over all steps (inf if it diverged) with ort_optim.FusedAdam (torch's AdamW math)."""
    from ort_optim import AdamWMode, FusedAdam

    groups = [dict(params=group["params"], weight_decay=group.get("weight_decay", 0.0)) for group in run.groups]
    exp_avg_dtype, exp_avg_sq_dtype = real.dtypes
    opt = FusedAdam(groups, lr=run.lr_at(0), betas=run.betas, eps=run.eps, adam_w_mode=AdamWMode.ADAMW_TORCH,
                    exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype)
    losses = []
    for step, batch in enumerate(run.batches, start=1):
        for group in opt.param_groups:
            group["lr"] = run.lr_at(step - 1) * real.lr_scale
        loss = run.loss(run.model, batch)
        loss.backward()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            return math.inf
        opt.step()
        opt.zero_grad(set_to_none=True)
    return statistics.fmean(losses)


def train(run: TrainingRun, candidate, snapshots: list | None = None, every: int = 10) -> float:
    """The mean training loss over all steps (inf if it diverged). snapshots: a list that receives (step, m, v) of
    every param at every ``every``-th step (the exact new moments, before any storage)."""
    if isinstance(candidate, Real):
        return train_fused(run, candidate)
    b1, b2 = run.betas
    params = [(p, group.get("weight_decay", 0.0)) for group in run.groups for p in group["params"]]
    state = {}
    losses = []
    for step, batch in enumerate(run.batches, start=1):
        lr = run.lr_at(step - 1)
        loss = run.loss(run.model, batch)
        loss.backward()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            return math.inf
        with torch.no_grad():
            for p, weight_decay in params:
                if p.grad is None:
                    continue
                m, v = state.get(p, (torch.zeros_like(p), torch.zeros_like(p)))
                p.mul_(1 - lr * weight_decay)
                m = m.lerp(p.grad, 1 - b1)
                v = v * b2 + (1 - b2) * p.grad * p.grad
                p.sub_((lr / (1 - b1 ** step)) * m / (v.sqrt() / math.sqrt(1 - b2 ** step) + run.eps))
                if snapshots is not None and step % every == 0:
                    snapshots.append((step, m.clone(), v.clone()))
                if candidate is not None:
                    v_stored = candidate.second_moment(v, step, m)
                    m, v = candidate.first_moment(m, v_stored, step, v), v_stored
                state[p] = (m, v)
                p.grad = None
    return statistics.fmean(losses)


@functools.lru_cache(maxsize=None)
def _digits_data(seed: int):
    import digits
    return digits.load_data(seed)


def digits_task(seed: int, steps: int = 300, lr: float = 3e-3) -> TrainingRun:
    import digits
    x_train, _, y_train, _ = _digits_data(seed)
    index = torch.randint(0, len(x_train), (steps, digits.BATCH), generator=torch.Generator().manual_seed(seed + 1))
    batches = [(x_train[i], y_train[i]) for i in index]
    torch.manual_seed(seed)
    model = digits.MLP()
    loss = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1])  # noqa: E731
    return TrainingRun(model, [dict(params=list(model.parameters()), weight_decay=1e-2)], batches, loss,
                       lambda step: lr)


def digits_plain_task(seed: int, size: str) -> TrainingRun:
    import lowbit_quality
    return lowbit_quality.digits_plain_task(seed, torch.float32, size)


def gpt_task(seed: int, size: str) -> TrainingRun:
    import lowbit_quality
    return lowbit_quality.gpt_task(seed, torch.float32, size)


def make_task(task: str, seed: int, quick: bool) -> TrainingRun:
    size = "quick" if quick else "default"
    if task == "digits":
        return digits_task(seed, steps=60 if quick else 300)
    if task == "digits-plain":
        return digits_plain_task(seed, size)
    if task == "digits-1e-3":
        import lowbit_quality
        return lowbit_quality.digits_task(seed, torch.float32, size)
    if task == "zipf":
        return lowbit.zipf_task(seed, torch.float32, size)
    if task == "gpt":
        return gpt_task(seed, size)
    raise ValueError(f"unknown task {task!r}: choose from digits, digits-1e-3, digits-plain, zipf, gpt")


def run_one(job) -> dict:
    task, seed, name, quick = job
    torch.set_num_threads(1)
    run = make_task(task, seed, quick)
    shapes = [tuple(p.shape) for group in run.groups for p in group["params"]]
    candidate = CANDIDATES[name]
    return dict(task=task, seed=seed, candidate=name, mean_loss=train(run, candidate),
                bytes_per_param=candidate.bytes_per_param(shapes) if candidate else 8.0)


def update_error(task: str, seed: int, names, quick: bool) -> list[dict]:
    """Without training noise: how much storing the moments changes the update. On the moments of one fp32 run
    (every 10th step), per candidate, sum((U' - U)**2) / sum(U**2) for both moments stored and for exp_avg alone,
    and the bias sum((U' - U) * U) / sum(U**2), with U = (m / bc1) / (sqrt(v / bc2) + eps) and U' from the decoded
    moments (the stochastic rounding's noise included)."""
    torch.set_num_threads(1)
    run = make_task(task, seed, quick)
    snapshots = []
    train(run, None, snapshots)
    b1, b2 = run.betas
    rows = []
    for name in names:
        candidate = CANDIDATES[name]
        if candidate is None:
            continue
        both = alone = bias = total = 0.0
        for step, m, v in snapshots:
            bc1, bc2 = 1 - b1 ** step, math.sqrt(1 - b2 ** step)
            exact = (m / bc1) / (v.sqrt() / bc2 + run.eps)
            v_stored = candidate.second_moment(v, step, m)
            m_stored = candidate.first_moment(m, v_stored, step, v)
            stored = (m_stored / bc1) / (v_stored.sqrt() / bc2 + run.eps)
            m_only = (m_stored / bc1) / (v.sqrt() / bc2 + run.eps)
            total += float(exact.double().square().sum())
            both += float((stored - exact).double().square().sum())
            alone += float((m_only - exact).double().square().sum())
            bias += float(((stored - exact).double() * exact.double()).sum())
        rows.append(dict(task=task, candidate=name, both=both / total, exp_avg=alone / total, bias=bias / total))
    return rows


def update_factor(task: str, seed: int, quick: bool, every: int = 25) -> dict:
    """The 4-bit sqrt(v)'s expected effect on the update, exactly (no sampling), on the moments of one fp32 run
    (every ``every``-th step): an element whose sqrt(v) lies at a = sqrt(v) / s in its block (s: the block's
    bfloat16 scale) between the levels lo < a <= hi is stored as hi with probability p = (a^2 - lo^2) / (hi^2 - lo^2),
    so its update m / sqrt(v) is multiplied in expectation by f = a (p / hi + (1 - p) / lo) >= 1 (Jensen); below the
    lowest level it is stored as that level, f = a / lowest < 1. Reported: the mean of f weighted by the element's
    |update| |m| / sqrt(v) ("factor"), and the share of the |update| in elements below the lowest level with their
    mean f, and in the bottom three gaps (a < the fourth level)."""
    torch.set_num_threads(1)
    run = make_task(task, seed, quick)
    snapshots = []
    train(run, None, snapshots, every)
    levels = torch.tensor(Q4.exp_avg_sq_levels, dtype=torch.float64)
    weight = weighted = below = below_f = bottom = 0.0
    for _, m, v in snapshots:
        codes, scales = formats.quantize_low_bit(v, Q4, True)  # (the block scales; the codes are not used)
        u = formats.sqrt_f32(v).double().reshape(-1)
        s = scales.double().abs().repeat_interleave(Q4.block)[: u.numel()]
        a = torch.where(s > 0, u / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(u)).clamp(max=1.0)
        hi_index = torch.searchsorted(levels, a).clamp(1, len(levels) - 1)  # levels[i-1] < a <= levels[i]
        lo, hi = levels[hi_index - 1], levels[hi_index]
        p = (a * a - lo * lo) / (hi * hi - lo * lo)
        f = torch.where(a < levels[0], a / levels[0], a * (p / hi + (1 - p) / lo))
        w = torch.where(u > 0, m.double().abs().reshape(-1) / torch.where(u > 0, u, torch.ones_like(u)),
                        torch.zeros_like(u))
        weight += float(w.sum())
        weighted += float((w * f).sum())
        low = a < levels[0]
        below += float(w[low].sum())
        below_f += float((w * f)[low].sum())
        bottom += float(w[a < levels[3]].sum())
    return dict(task=task, seed=seed, factor=weighted / weight, below_share=below / weight,
                below_factor=below_f / below if below else math.nan, bottom_share=bottom / weight)


# ---- report --------------------------------------------------------------------------------------------------------


def summarise(records, baseline: str = "fp32") -> list[dict]:
    """Per task and candidate: the paired relative differences to the baseline over the seeds both ran."""
    losses = {(r["task"], r["candidate"], r["seed"]): r["mean_loss"] for r in records}
    rows = []
    for task in dict.fromkeys(r["task"] for r in records):
        for name in dict.fromkeys(r["candidate"] for r in records if r["task"] == task):
            if name == baseline:
                continue
            seeds = sorted(s for (t, c, s) in losses if t == task and c == name and (task, baseline, s) in losses)
            if not seeds:
                continue
            base = [losses[(task, baseline, s)] for s in seeds]
            mine = [losses[(task, name, s)] for s in seeds]
            diffs = [(x - y) / y for x, y in zip(mine, base)]
            se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
            mean = statistics.fmean(diffs)
            rows.append(dict(task=task, candidate=name, seeds=len(seeds), mean=mean, se=se,
                             ratio=statistics.fmean(mine) / statistics.fmean(base) - 1, low=min(diffs),
                             high=max(diffs), within=mean <= TARGET,
                             bytes_per_param=next(r["bytes_per_param"] for r in records
                                                  if r["task"] == task and r["candidate"] == name)))
    return rows


def markdown(rows) -> str:
    lines = ["| task | candidate | state B/param | seeds | paired mean vs fp32 moments | s.e. | ratio of means | "
             "per-seed range | within +1.5% |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['candidate']} | {r['bytes_per_param']:.3f} | {r['seeds']} | "
                     f"{100 * r['mean']:+.2f}% | {100 * r['se']:.2f} | {100 * r['ratio']:+.2f}% | "
                     f"{100 * r['low']:+.1f} .. {100 * r['high']:+.1f} | {'yes' if r['within'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def parse_seeds(text: str) -> list[int]:
    seeds = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        seeds.extend(range(int(first), int(last or first) + 1))
    return seeds


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="digits,zipf,gpt")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--seeds", default="0-2", help="e.g. 0-29 or 0,3,5")
    parser.add_argument("--baseline", default="fp32", help="the candidate the others are paired against")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and seeds 0-1: a smoke test")
    parser.add_argument("--out", default="results")
    parser.add_argument("--update-error", action="store_true",
                        help="instead of training every candidate: the update-space error on one fp32 run per task "
                             "(the first seed)")
    parser.add_argument("--update-factor", action="store_true",
                        help="instead of training: the 4-bit sqrt(v)'s expected update factor on the moments of one "
                             "fp32 run per task and seed (exact, no sampling)")
    args = parser.parse_args(argv)
    names = args.candidates.split(",")
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidates {unknown}: choose from {list(CANDIDATES)}")
    if args.baseline not in CANDIDATES:
        parser.error(f"unknown baseline {args.baseline!r}: choose from {list(CANDIDATES)}")
    if args.baseline not in names:
        names.insert(0, args.baseline)
    seeds = [0, 1] if args.quick else parse_seeds(args.seeds)
    if args.update_factor:
        rows = [update_factor(task, seed, args.quick) for task in args.tasks.split(",") for seed in seeds]
        print("| task | seed | expected update factor | |update| share below the lowest level (its factor) | "
              "|update| share below the fourth level |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['task']} | {r['seed']} | {r['factor']:.4f} | {100 * r['below_share']:.2f}% "
                  f"({r['below_factor']:.3f}) | {100 * r['bottom_share']:.2f}% |")
        return rows
    if args.update_error:
        rows = [row for task in args.tasks.split(",") for row in update_error(task, seeds[0], names, args.quick)]
        print("| task | candidate | both moments | exp_avg alone | bias |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['task']} | {r['candidate']} | {r['both']:.3f} | {r['exp_avg']:.3f} | {r['bias']:+.3f} |")
        return rows
    jobs = [(task, seed, name, args.quick) for task in args.tasks.split(",") for seed in seeds for name in names]
    records = []
    with multiprocessing.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else _Serial() as pool:
        for record in pool.imap_unordered(run_one, jobs):
            records.append(record)
            print(json.dumps(record), flush=True)
    rows = summarise(records, args.baseline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lowbit_4bit_study.json").write_text(json.dumps(dict(records=records, summary=rows), indent=1))
    (out / "lowbit_4bit_study.md").write_text(markdown(rows))
    print(markdown(rows))
    return rows


class _Serial:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def imap_unordered(fn, jobs):
        return map(fn, jobs)


if __name__ == "__main__":
    main()
