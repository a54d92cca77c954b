"""Float64 reference implementations of what FusedAdam computes, written from the formulas, not from the kernel.

Sources: the three AdamWMode formulas as ORT (onnxruntime-training's FusedAdam), HF transformers' AdamW and torch
define them, torch.optim.AdamW (amsgrad, maximize, per-parameter steps), torch.nn.utils.clip_grad_norm_ (clipping) and
ops/README.md (the fp16 block scale rule, the storage dtypes). Everything here is deliberately plain: one parameter at
a time, one formula per line, float64 throughout, and no code shared with ort_optim.

Two levels:

* :func:`adam_update` is the textbook update of one float64 parameter by one gradient.
* :class:`ReferenceAdam` drives it over a parameter list the way FusedAdam is specified to: a step count per
  parameter, parameters without a gradient skipped, gradients unscaled by ``grad_scale``, an inf/NaN check that skips
  the whole step, clipping by the global norm, and the rounding that the storage dtypes impose (fp32 master semantics,
  parameters rounded to fp16/bf16, moments stored in fp32/bf16 or as fp16 codes with power-of-two block scales).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

ADAM_L2_REGULARIZATION = 0
ADAMW_TRANSFORMERS = 1
ADAMW_TORCH = 2

LOW_PRECISION = (torch.float16, torch.bfloat16)
FP16_BLOCK = 1024  # elements per fp16-state block (ops/README.md)


def adam_update(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mode: int,
    amsgrad: bool = False,
    maximize: bool = False,
    bias_correction: bool = True,
) -> torch.Tensor:
    """One Adam step of one parameter in float64. Returns the new parameter; updates ``state`` in place.

    ``state`` holds ``step`` (int, steps taken so far), ``m``, ``v`` and, with amsgrad, ``vmax`` (float64 tensors).
    """
    p = p.double()
    g = g.double()
    if maximize:
        g = -g  # ascend: the stored gradient is untouched, the update uses -g
    t = state["step"] + 1
    bc1 = 1.0 - beta1**t if bias_correction else 1.0
    bc2 = 1.0 - beta2**t if bias_correction else 1.0

    if mode == ADAM_L2_REGULARIZATION:
        g = g + weight_decay * p  # classic L2: the decay term enters both moments
    elif mode == ADAMW_TORCH:
        p = p * (1.0 - lr * weight_decay)  # torch.optim.AdamW: decoupled decay first, with the scheduled lr

    m = beta1 * state["m"] + (1.0 - beta1) * g
    v = beta2 * state["v"] + (1.0 - beta2) * g * g
    if amsgrad:
        vmax = torch.maximum(state["vmax"], v)  # max of the raw second moments; bias correction comes after
        state["vmax"] = vmax
        v_used = vmax
    else:
        v_used = v

    if mode == ADAMW_TORCH:
        # torch: eps is added to the bias-corrected sqrt(v_hat)
        m_hat = m / bc1
        v_hat = v_used / bc2
        p = p - lr * m_hat / (torch.sqrt(v_hat) + eps)
    else:
        # ORT / HF: eps is added to the raw sqrt(v); the bias corrections are folded into the step size
        step_size = lr * math.sqrt(bc2) / bc1
        p = p - step_size * m / (torch.sqrt(v_used) + eps)
        if mode == ADAMW_TRANSFORMERS:
            p = p - lr * weight_decay * p  # HF: decay after the update, applied to the new p, with the plain lr

    state["m"] = m
    state["v"] = v
    state["step"] = t
    return p


# ---- storage rounding ------------------------------------------------------------------------------------------


def round_to(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """x (float64) rounded to the values ``dtype`` can hold (nearest even), returned as float64."""
    if dtype is None or dtype == torch.float64:
        return x
    if dtype in LOW_PRECISION:
        # via float32, as every ort_optim path rounds float32 values; float64 -> float32 is exact enough here
        return x.float().to(dtype).double()
    return x.to(dtype).double()


def fp16_block_scale(amax: float) -> float:
    """The scale s = 2**k of a block with absolute maximum ``amax``: fp16(amax * s) lies in (16384, 32768]."""
    if not (amax > 0.0) or not math.isfinite(amax):
        return 1.0

    def fp16(value: float) -> float:
        return float(torch.tensor(value, dtype=torch.float32).half())

    k = math.floor(math.log2(32768.0 / amax))
    while k < 126 and fp16(amax * 2.0**k) <= 16384.0:
        k += 1
    while k > -126 and fp16(amax * 2.0**k) > 32768.0:
        k -= 1
    return 2.0 ** max(-126, min(126, k))


def round_fp16_blocks(x: torch.Tensor, no_zero: bool = False) -> torch.Tensor:
    """x (float64) as an fp16 state stores it: per 1024-element block (in flattened order) a power-of-two scale
    s = 2**k chosen by :func:`fp16_block_scale`'s rule, values rounded to fp16 after scaling. Returns the float64
    values the codes represent (code / s). Vectorised over blocks; :func:`fp16_block_scale` is the scalar form."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    if n == 0:
        return x.clone()
    padded = torch.nn.functional.pad(flat, (0, -n % FP16_BLOCK)).view(-1, FP16_BLOCK)
    magnitudes = padded.abs()
    amax = torch.where(torch.isfinite(magnitudes), magnitudes, torch.zeros_like(magnitudes)).amax(dim=1).double()
    usable = amax > 0
    safe = torch.where(usable, amax, torch.ones_like(amax))
    k = torch.floor(torch.log2(32768.0 / safe))  # first guess: amax * 2**k in (16384, 32768]
    for _ in range(2):  # fix the guess where rounding to fp16 leaves the interval
        k = torch.where((safe * 2.0**k).float().half().double() <= 16384.0, k + 1, k)
        k = torch.where((safe * 2.0**k).float().half().double() > 32768.0, k - 1, k)
    s = torch.where(usable, 2.0 ** k.clamp(-126, 126), torch.ones_like(amax)).float()
    codes = (padded * s[:, None]).half()
    if no_zero:
        codes = torch.where((codes == 0) & (padded > 0), torch.tensor(2.0**-24, dtype=torch.float16), codes)
    return (codes.float() / s[:, None]).reshape(-1)[:n].double().view(x.shape)


def round_state(x: torch.Tensor, dtype: torch.dtype, second_moment: bool = False, step: int = 0) -> torch.Tensor:
    """x (float64) as a state of this storage dtype holds it. fp16 second moments store sqrt(v) (ops/README.md), so
    v is rounded as sqrt(v) is, then squared (in float32, as the kernels read it); low-bit states (torch.uint8,
    torch.uint4) as :func:`round_low_bit` describes (an exp_avg rounded stochastically with this step's bits)."""
    if dtype in LOW_BIT_DTYPES:
        return round_low_bit(x, dtype, second_moment, step)
    if dtype == torch.float16 and second_moment:
        root = round_fp16_blocks(x.float().double().sqrt().float().double(), no_zero=True)
        return (root.float() * root.float()).double()
    return round_fp16_blocks(x) if dtype == torch.float16 else round_to(x, dtype)


# ---- low-bit states, from the format's definition (ops/README.md, "low-bit states") -------------------------------
# The levels and block sizes are the specification's data (ort_optim._spec); the quantiser below is written from
# the README's rules: scale = block absmax (rounded to bfloat16 for 4-bit: to nearest, in a step stochastically),
# normalised a = fp32(|u| * fp32(1/s))
# clamped to 1; sqrt(v) (exp_avg_sq) takes the level nearest in 1/sqrt(v) (the 8-bit format's: in sqrt(v)), exp_avg
# the largest level <= a or, stochastically, the next one up (random bits: a hash of the step's new exp_avg's float32
# bits, the index and the step). A second moment's overflowed v (sqrt(v) = inf) reads back as inf, and its block is
# quantised by its other values.

LOW_BIT_DTYPES = (torch.uint8, torch.uint4)
_NO_ROOT = object()  # round_low_bit's inner call that codes r itself


def _low_bit_spec(dtype: torch.dtype):
    from ort_optim import _spec

    return _spec.LOW_BIT_FORMATS[dtype]


def low_bit_scales(u: torch.Tensor, dtype: torch.dtype, first_random: Optional[torch.Tensor] = None,
                   second_moment: bool = False, bf16_scale: str = "nearest") -> torch.Tensor:
    """float32 per-block scales of float32 values u (flat): each block's absolute maximum, rounded to bfloat16 where
    the format stores bfloat16 scales: to nearest even, or in a step (first_random: the 16 random bits of each
    block's first element) to one of the two bfloat16 values around it, up with probability (a^2 - lo^2) / (hi^2 -
    lo^2) for a second moment's sqrt(v) (unbiased in v) and (a - lo) / (hi - lo) otherwise, compared in float32 with
    the uniform number of the bits; NaN for a block holding inf or NaN. bf16_scale "below" / "above" (without
    first_random): the bfloat16 value at or below / the next one up instead of the nearest (the two candidates)."""
    fmt = _low_bit_spec(dtype)
    scales = []
    for index, start in enumerate(range(0, u.numel(), fmt.block)):
        amax = u[start:start + fmt.block].abs().max().reshape(())
        if fmt.scale_dtype == torch.bfloat16:
            nearest = amax.to(torch.bfloat16).float()
            if first_random is not None and bool(torch.isfinite(amax)) and float(nearest) != float(amax):
                lo = _bf16_below(float(amax))
                hi = _bf16_above(float(lo))
                uniform = uniform16(first_random[index])
                if second_moment:
                    up = bool(amax * amax - lo * lo > uniform * (hi * hi - lo * lo))
                else:
                    up = bool(amax - lo > uniform * (hi - lo))
                amax = hi if up else lo
            elif bf16_scale != "nearest" and bool(torch.isfinite(amax)) and float(nearest) != float(amax):
                lo = _bf16_below(float(amax))
                amax = lo if bf16_scale == "below" else _bf16_above(float(lo))
            else:
                amax = nearest
        amax = float(amax)
        # blocks below float32's smallest normal are zero blocks
        scales.append(math.nan if not math.isfinite(amax) else 0.0 if amax < 2.0**-126 else amax)
    return torch.tensor(scales, dtype=torch.float32)


def _bf16_below(x: float) -> torch.Tensor:
    """The largest bfloat16 value <= x (x finite, >= 0), as a float32 scalar tensor."""
    b = torch.bfloat16
    down = torch.tensor(x, dtype=torch.float32).to(b).float()
    return down if float(down) <= x else torch.nextafter(down.to(b), torch.tensor(0.0, dtype=b)).float()


def _bf16_above(lo: float) -> torch.Tensor:
    """The next bfloat16 value above lo (finite, >= 0), as a float32 scalar tensor (inf past the largest)."""
    b = torch.bfloat16
    return torch.nextafter(torch.tensor(lo, dtype=b), torch.tensor(math.inf, dtype=b)).float()


def _fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser on a uint32 array (numpy's uint32 products wrap)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def moment_random_bits(exp_avg: torch.Tensor, step: int) -> np.ndarray:
    """uint32 random bits of a moment's stochastic rounding in a step: fmix32(bits(m[e]) ^ e * 0x9E3779B1 ^
    (step * 0x85EBCA77 + 0x6A09E667)) for the step's new exp_avg m (float32, flat), element index e."""
    with np.errstate(over="ignore"):
        bits = exp_avg.float().numpy().view(np.uint32)
        e = np.arange(bits.size, dtype=np.uint32)
        salt = np.uint32((step * 0x85EBCA77 + 0x6A09E667) % 2**32)
        return _fmix32(bits ^ (e * np.uint32(0x9E3779B1)) ^ salt)


def uniform16(r16: torch.Tensor) -> torch.Tensor:
    """The stochastic rounding's uniform number from 16 random bits: (r16 + 1/2) / 2**16, in float32."""
    return (r16.double() + 0.5).float() * torch.tensor(2.0**-16)


def round_low_bit(x: torch.Tensor, dtype: torch.dtype, second_moment: bool, step: int = 0,
                  exp_avg_rounding: str = "stochastic", root: Optional[torch.Tensor] = None,
                  as_root: bool = False, exp_avg: Optional[torch.Tensor] = None,
                  bf16_scale: str = "nearest") -> torch.Tensor:
    """x (float64) as a low-bit state reads back, as float64. exp_avg_rounding: "stochastic" (the format's rule,
    random bits from step; step 0, a conversion outside a step: the nearest level, ties up), or "down" / "up": the
    level at or below / the next one up (the two candidates). root: for the 4-bit exp_avg, the decoded sqrt(v) u of
    its exp_avg_sq (float32 values): what is coded is then r = m / u (the float64 quotient rounded to float32, which
    is the correctly rounded float32 one; 0 where u = 0), and it reads back as q * u in float32 (0 where q = 0).
    as_root: for a second moment, sqrt(v) as its codes read back (level * scale; inf for an overflowed v), not v.
    A 4-bit second moment in a step (step != 0) rounds stochastically too (exp_avg_rounding applies to it).
    exp_avg: the step's new exp_avg m, whose hash gives the random bits (x itself for an exp_avg): exp_avg takes the
    hash's top 16 bits, a second moment its low 16; a level is left upward iff the fraction of the gap exceeds
    (r16 + 1/2) / 2**16. bf16_scale: with exp_avg_rounding "down" or "up", the bfloat16 scales' rounding
    (low_bit_scales: "nearest", or the candidates of a step's stochastic rounding, "below" and "above")."""
    if exp_avg is None:
        assert not (second_moment and step and exp_avg_rounding == "stochastic" and dtype == torch.uint4), \
            "a 4-bit second moment rounds with the random bits of the step's exp_avg: pass exp_avg"
        exp_avg = x
    fmt = _low_bit_spec(dtype)
    if not second_moment and fmt.exp_avg_relative and root is not _NO_ROOT:
        assert root is not None, "the 4-bit exp_avg is coded relative to its exp_avg_sq's sqrt(v): pass root"
        u = root.reshape(-1).double()
        r = torch.where(u == 0, torch.zeros_like(u), x.reshape(-1).float().double() / u).float()
        q = round_low_bit(r.double(), dtype, False, step, exp_avg_rounding, root=_NO_ROOT, exp_avg=exp_avg,
                          bf16_scale=bf16_scale)
        q = q.float()
        return torch.where(q == 0, torch.zeros_like(q), q * u.float()).double().view(x.shape)
    levels = torch.tensor(fmt.exp_avg_sq_levels if second_moment else fmt.exp_avg_levels, dtype=torch.float32)
    # sqrt(v): the nearest level in 1/sqrt(v) (thresholds 2ab / (a + b) between levels a < b, in float64, rounded to
    # float32), or in a format whose sqrt(v) rounds to the nearest in sqrt(v) itself (exp_avg_sq_nearest "root", the
    # 8-bit one) the arithmetic midpoints (a + b) / 2; exp_avg: the level at or below (thresholds at the levels), after
    # the factor 1 + 2**-20 that keeps decoded levels on themselves (exp_avg's top threshold is the format's exp_avg_top, so the
    # block's largest element keeps the top code), then, from a non-zero level, one up with probability
    # (a - lo) / (hi - lo)
    # sqrt(v) in a step of the 4-bit format: like exp_avg (the level at or below after the factor 1 + 2**-20, top
    # threshold exp_avg_top), then one up with probability (a^2 - lo^2) / (hi^2 - lo^2), unbiased in v, from every
    # level below the top one; random bits: the low 16 of the step's exp_avg hash
    v_stochastic = second_moment and step != 0 and fmt.exp_avg_sq_stochastic
    low, high = levels[:-1].double(), levels[1:].double()
    midpoints = (low + high) / 2.0 if fmt.exp_avg_sq_nearest == "root" else 2.0 * low * high / (low + high)
    thresholds = midpoints.float() if second_moment and not v_stochastic else torch.cat(
        [levels[1:-1], torch.tensor([fmt.exp_avg_top])])
    flat = x.reshape(-1).float()
    u = flat.double().sqrt().float() if second_moment else flat  # correctly rounded float32 sqrt
    hashed = moment_random_bits(exp_avg.reshape(-1).float(), step).astype(np.int64)
    random = torch.from_numpy(hashed & 0xFFFF if second_moment else hashed >> 16)
    # in a step, a bfloat16 scale rounds stochastically with the bits of its block's first element
    first = random[::fmt.block] if step != 0 and exp_avg_rounding == "stochastic" else None
    scales = low_bit_scales(u, dtype, first, second_moment, bf16_scale)
    out = torch.empty_like(u)
    for b, s in enumerate(scales.tolist()):
        chunk = u[b * fmt.block:(b + 1) * fmt.block]
        overflowed = torch.isposinf(chunk) if second_moment else torch.zeros_like(chunk, dtype=torch.bool)
        if second_moment and bool(overflowed.any()) and not bool(chunk.isnan().any()):
            # v overflowed float32 (as torch.optim.AdamW keeps it, inf): that element reads back as inf; the block
            # is quantised by its finite values, which take a level >= levels[1] (level 0 is the overflow's code)
            s = float(low_bit_scales(torch.where(overflowed, torch.zeros_like(chunk), chunk), dtype,
                                     None if first is None else first[b:b + 1], second_moment, bf16_scale)[0])
        elif not math.isfinite(s):
            out[b * fmt.block:(b + 1) * fmt.block] = math.nan
            continue
        inv = torch.tensor(1.0, dtype=torch.float32) / s if s > 0 else torch.tensor(0.0)
        a = chunk.abs() * inv
        snapped = a * torch.tensor(1.0 + 2.0**-20, dtype=torch.float32) if not second_moment or v_stochastic else a
        index = (snapped.clamp(max=1.0)[:, None] >= thresholds[None, :]).sum(dim=1)
        if v_stochastic:
            nxt = levels[(index + 1).clamp(max=len(levels) - 1)]
            lowered = (a.view(torch.int32) - 8).clamp(min=0).view(torch.float32)  # 8 float32 ulps down
            r = random[b * fmt.block:(b + 1) * fmt.block]
            lo2, hi2 = levels[index] * levels[index], nxt * nxt  # float32 squares
            threshold = uniform16(r) * (hi2 - lo2)
            up = (lowered * lowered - lo2) > threshold if exp_avg_rounding == "stochastic" else torch.full_like(
                a, exp_avg_rounding == "up", dtype=torch.bool)
            index = index + ((index < len(levels) - 1) & up).long()
        if not second_moment and exp_avg_rounding != "down":
            # and above zero: toward zero below levels[1], except the 4-bit exp_avg of m / sqrt(v), stochastic there too
            below_top = ((index >= 0) if fmt.exp_avg_relative else (index > 0)) & (index < len(levels) - 1)
            if exp_avg_rounding == "up":
                up = below_top
            elif step == 0:  # a conversion outside a step (checkpoint loads, from_optimizer): the nearest level
                nxt = levels[(index + 1).clamp(max=len(levels) - 1)]
                up = (index < len(levels) - 1) & ((a - levels[index]) >= (nxt - a))
            else:
                nxt = levels[(index + 1).clamp(max=len(levels) - 1)]
                lowered = (a.view(torch.int32) - 8).clamp(min=0).view(torch.float32)  # 8 float32 ulps down
                r = random[b * fmt.block:(b + 1) * fmt.block]
                threshold = uniform16(r) * (nxt - levels[index])
                up = below_top & ((lowered - levels[index]) > threshold)
            index = index + up.long()
        if bool(overflowed.any()):
            index = index.clamp(min=1)
        value = levels[index] * torch.tensor(s, dtype=torch.float32)
        value = torch.where(overflowed, torch.full_like(value, math.inf), value)
        value = torch.where((chunk < 0) & (index > 0), -value, value) if not second_moment else value
        out[b * fmt.block:(b + 1) * fmt.block] = value * value if second_moment and not as_root else value
    return out.double().view(x.shape)


def state_layout(
    param_dtype: torch.dtype,
    master_weights: bool,
    exp_avg_dtype: Optional[torch.dtype],
    exp_avg_sq_dtype: Optional[torch.dtype],
) -> tuple[torch.dtype, torch.dtype, bool]:
    """(exp_avg dtype, exp_avg_sq dtype, has fp32 master) as FusedAdam's docstring specifies them."""
    if param_dtype == torch.float64:
        return torch.float64, torch.float64, False
    has_master = master_weights and param_dtype in LOW_PRECISION
    default = torch.float32 if has_master else param_dtype
    return exp_avg_dtype or default, exp_avg_sq_dtype or default, has_master


# ---- the optimizer-level reference -----------------------------------------------------------------------------


def global_clip_coef(grads: Sequence[torch.Tensor], max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (||g||_2 + 1e-6), clamped to at most 1."""
    total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    return min(max_norm / (total + 1e-6), 1.0)


class ReferenceAdam:
    """Float64 model of FusedAdam over a list of parameters (one param group).

    ``master`` holds each parameter's exact value: float64 for float64 params, rounded to float32 after each step
    for float32 params and for fp16/bf16 params with master weights (fp32 master semantics), rounded to the param
    dtype for fp16/bf16 params without masters. :meth:`param` gives what the model's parameter holds (the master
    rounded to the param dtype). Moments are rounded to their storage dtype after each step when ``round_states``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        mode: int = ADAMW_TRANSFORMERS,
        amsgrad: bool = False,
        maximize: bool = False,
        bias_correction: bool = True,
        master_weights: bool = False,
        exp_avg_dtype: Optional[torch.dtype] = None,
        exp_avg_sq_dtype: Optional[torch.dtype] = None,
        max_grad_norm: Optional[float] = None,
        round_states: bool = True,
    ):
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, mode=mode,
                          amsgrad=amsgrad, maximize=maximize, bias_correction=bias_correction)
        self.dtypes = [p.dtype for p in params]
        self.layouts = [state_layout(p.dtype, master_weights, exp_avg_dtype, exp_avg_sq_dtype) for p in params]
        self.master = [p.detach().double().clone() for p in params]
        self.states: list[Optional[dict]] = [None] * len(params)
        self.max_grad_norm = max_grad_norm
        self.round_states = round_states

    def _master_dtype(self, i: int) -> torch.dtype:
        dtype = self.dtypes[i]
        if dtype == torch.float64:
            return torch.float64
        if dtype in LOW_PRECISION and not self.layouts[i][2]:
            return dtype  # no master: the value lives in the fp16/bf16 parameter itself
        return torch.float32

    def param(self, i: int) -> torch.Tensor:
        """The parameter's value as its dtype holds it, as float64."""
        return round_to(self.master[i], self.dtypes[i])

    def steps(self) -> list[int]:
        return [0 if s is None else s["step"] for s in self.states]

    def step(
        self,
        grads: Sequence[Optional[torch.Tensor]],
        *,
        lr: Optional[float] = None,
        grad_scale: Optional[float] = None,
    ) -> bool:
        """One optimizer step; returns True when it was skipped (inf/NaN gradients after unscaling)."""
        hyper = dict(self.hyper)
        if lr is not None:
            hyper["lr"] = lr
        active = [i for i, g in enumerate(grads) if g is not None]
        unscaled = {i: grads[i].double() / (1.0 if grad_scale is None else grad_scale) for i in active}
        if grad_scale is not None or self.max_grad_norm is not None:
            if not all(bool(torch.isfinite(g).all()) for g in unscaled.values()):
                return True  # skipped: nothing changes
        if self.max_grad_norm is not None:
            coef = global_clip_coef(list(unscaled.values()), self.max_grad_norm)
            unscaled = {i: g * coef for i, g in unscaled.items()}
        for i in active:
            m_dtype, v_dtype, _ = self.layouts[i]
            if self.states[i] is None:
                zeros = torch.zeros_like(self.master[i])
                self.states[i] = {"step": 0, "m": zeros, "v": zeros, "vmax": zeros}
            state = self.states[i]
            p = adam_update(self.master[i], unscaled[i], state, **hyper)
            self.master[i] = round_to(p, self._master_dtype(i))
            if self.round_states:
                state["m"] = round_state(state["m"], m_dtype)
                state["v"] = round_state(state["v"], v_dtype, second_moment=True)
                if hyper["amsgrad"]:
                    state["vmax"] = round_state(state["vmax"], v_dtype, second_moment=True)
        return False
