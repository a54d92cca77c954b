"""8-bit and 4-bit moments, fp16 second moments stored as sqrt(v), and stochastic rounding of bfloat16 params
(ops/README.md, "low-bit states" and "stochastic rounding").

The specification, as tests:

* Every format combination, mode, amsgrad and master-weight setting: the native op and the pure-PyTorch reference
  backend agree bit for bit (params, codes, scales, steps), and every step matches the float64 reference
  (tests/reference.py) whose independent quantiser rounds the new state the way the README says: a code may differ
  only where float32 rounding puts a value on the other side of a threshold.
* Memory, counted as the bytes of every distinct storage in ``optimizer.state`` except ``step``: at most 2.05 bytes
  per parameter (8-bit) and 1.05 (4-bit).
* A tiny or rare gradient never makes the update explode (the zero-point problem of the second moment).
* Quantisation is idempotent (hypothesis over zeros, subnormals, huge values, inf and NaN), so checkpoints (saved as
  unscaled float32) resume bit for bit; conversions between formats are explicit.
* Stochastic rounding is unbiased, deterministic for a seed, and resumes exactly.
"""

from __future__ import annotations

import copy
import io
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
from conftest import (assert_same_snapshot, assert_tree_bitwise_equal, bits, optimizer_snapshot, select_backend,
                      state_values)
from ort_optim import FusedAdam, formats
from ort_optim._spec import LOW_BIT_FORMATS, Q4, Q8
from ort_optim.backends import reference as reference_backend

STATE_DTYPES = {"u8": torch.uint8, "u4": torch.uint4, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp32": torch.float32}
# (exp_avg, exp_avg_sq): both low-bit formats alone and mixed, and each beside every other storage dtype
COMBOS = [("u8", "u8"), ("u4", "u4"), ("u8", "u4"), ("u4", "u8"), ("u8", "fp32"), ("fp32", "u4"), ("u4", "bf16"),
          ("fp16", "u8")]
# param dtype, master weights, stochastic rounding
PARAM_CASES = {"fp32": (torch.float32, False, False), "bf16-master": (torch.bfloat16, True, False),
               "bf16": (torch.bfloat16, False, False), "bf16-sr": (torch.bfloat16, False, True)}


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(300, 7), (129,), (5,), (), (1,)]  # several blocks with a partial last one, odd 4-bit sizes, 0-dim
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in shapes]


def _grads(params, step, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    out = []
    for p in params:
        # magnitudes over eight decades, so that blocks hold large and tiny moments side by side
        scale = torch.logspace(-8, 0, max(p.numel(), 1), dtype=torch.float32)[:p.numel()].view(p.shape)
        out.append((torch.randn(p.shape, generator=g) * scale).to(p.dtype))
    return out


def _optimizer(params, m, v, *, mode=2, amsgrad=False, master=False, sr=False, seed=0, lr=1e-2):
    return FusedAdam(params, lr=lr, adam_w_mode=mode, weight_decay=0.1, eps=1e-8, amsgrad=amsgrad,
                     master_weights=master, exp_avg_dtype=STATE_DTYPES[m], exp_avg_sq_dtype=STATE_DTYPES[v],
                     stochastic_rounding=sr, stochastic_rounding_seed=seed)


def _train(params, opt, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()


# ---- the two backends agree bit for bit ---------------------------------------------------------------------------


@pytest.mark.parametrize("param_case", PARAM_CASES)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("combo", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_native_and_reference_backends_agree_bit_for_bit(combo, mode, amsgrad, param_case, monkeypatch):
    dtype, master, sr = PARAM_CASES[param_case]
    snapshots = {}
    for name in ("native", "torch"):
        select_backend(monkeypatch, name)
        params = _params(dtype)
        opt = _optimizer(params, *combo, mode=mode, amsgrad=amsgrad, master=master, sr=sr)
        _train(params, opt, 4)
        snapshots[name] = optimizer_snapshot(opt)
    assert_same_snapshot(snapshots["native"], snapshots["torch"])


# ---- each step against the float64 reference --------------------------------------------------------------------


def _assert_state_rounded_as_specified(got: torch.Tensor, exact: torch.Tensor, dtype, second_moment, what):
    """got: the optimizer's decoded state; exact: the float64 reference's new state before storage rounding. The
    stored value is the reference quantiser's, except where float32 rounding of the inputs made a near-tie go the
    other way: then it is as close to the exact value as the reference's choice, up to that rounding. A low-bit
    exp_avg rounds stochastically with random bits hashed from its float32 value (which the float64 reference does
    not reproduce to the bit): it must be one of the two levels around the exact value."""
    slack = 1e-5 * float(exact.abs().max())
    if dtype in reference.LOW_BIT_DTYPES and not second_moment:
        down = reference.round_low_bit(exact, dtype, False, exp_avg_rounding="down")
        up = reference.round_low_bit(exact, dtype, False, exp_avg_rounding="up")
        between = (got.double() >= torch.minimum(down, up) - slack) & (got.double() <= torch.maximum(down, up) + slack)
        assert bool(between.all()), f"{what}: stored values outside the two levels around the exact ones"
        return
    want = reference.round_state(exact, dtype, second_moment)
    closer = (got.double() - exact).abs() <= (want - exact).abs() + slack
    assert bool(closer.all()), f"{what}: stored values farther from the exact ones than the specified rounding"
    # (a scale one float32 ulp apart changes every value of its block by an ulp, not its codes)
    other_code = (got.double() - want).abs() > 1e-5 * want.abs() + 1e-30
    assert float(other_code.double().mean()) <= 0.02, f"{what}: too many codes differ from the reference"


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("combo", [("u8", "u8"), ("u4", "u4"), ("u4", "u8")], ids=["u8-u8", "u4-u4", "u4-u8"])
def test_every_step_matches_the_float64_reference_that_quantises_the_same_way(combo, mode, amsgrad, backend,
                                                                              monkeypatch):
    params = _params()
    opt = _optimizer(params, *combo, mode=mode, amsgrad=amsgrad)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, mode=mode, amsgrad=amsgrad)
    m_dtype, v_dtype = STATE_DTYPES[combo[0]], STATE_DTYPES[combo[1]]
    for step in range(5):
        grads = _grads(params, step)
        before = []
        for p in params:
            state = {"step": step, "m": torch.zeros(p.shape, dtype=torch.float64),
                     "v": torch.zeros(p.shape, dtype=torch.float64), "vmax": torch.zeros(p.shape, dtype=torch.float64)}
            if opt.state.get(p):
                for key, ref_key in (("exp_avg", "m"), ("exp_avg_sq", "v"), ("max_exp_avg_sq", "vmax")):
                    if key in opt.state[p]:
                        state[ref_key] = state_values(opt, p, key).double()
            before.append((p.detach().double().clone(), state))
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for i, (p, g, (p0, state)) in enumerate(zip(params, grads, before)):
            expected = reference.adam_update(p0, g, state, **hyper)
            # the update uses this step's unquantised float32 moments: float32 rounding only
            torch.testing.assert_close(p.double(), expected, rtol=2e-6, atol=1e-2 * 1e-5)
            _assert_state_rounded_as_specified(state_values(opt, p, "exp_avg"), state["m"], m_dtype, False,
                                               f"step {step} params[{i}] exp_avg")
            _assert_state_rounded_as_specified(state_values(opt, p, "exp_avg_sq"), state["v"], v_dtype, True,
                                               f"step {step} params[{i}] exp_avg_sq")
            if amsgrad:
                _assert_state_rounded_as_specified(state_values(opt, p, "max_exp_avg_sq"), state["vmax"], v_dtype,
                                                   True, f"step {step} params[{i}] max_exp_avg_sq")


# ---- memory -------------------------------------------------------------------------------------------------------


def _gpt2_like_params(dtype):
    # a GPT-2 block's shapes, scaled down 4x in width: large matrices, where per-tensor padding does not count
    g = torch.Generator().manual_seed(0)
    shapes = [(192, 576), (576,), (192, 192), (192,), (768, 192), (768,), (192, 768), (192,), (1000, 192)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def state_bytes_per_param(opt) -> float:
    """Bytes of every distinct storage in optimizer.state (but step), per parameter."""
    storages = {}
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / sum(p.numel() for group in opt.param_groups for p in group["params"])


# configuration: (param dtype, exp_avg, exp_avg_sq, master, stochastic rounding, bound on the state's bytes per param)
MEMORY = {
    "fp32-params-fp32-moments": (torch.float32, "fp32", "fp32", False, False, 8.01),
    "fp32-params-8bit": (torch.float32, "u8", "u8", False, False, 2.05),
    "fp32-params-4bit": (torch.float32, "u4", "u4", False, False, 1.05),
    "fp32-params-8bit-m-4bit-v": (torch.float32, "u8", "u4", False, False, 1.55),
    "bf16-params-fp32-master-8bit": (torch.bfloat16, "u8", "u8", True, False, 6.05),
    "bf16-params-sr-8bit": (torch.bfloat16, "u8", "u8", False, True, 2.05),
    "bf16-params-sr-4bit": (torch.bfloat16, "u4", "u4", False, True, 1.05),
}


@pytest.mark.parametrize("config", MEMORY)
def test_state_bytes_per_parameter(config):
    dtype, m, v, master, sr, bound = MEMORY[config]
    params = _gpt2_like_params(dtype)
    opt = _optimizer(params, m, v, master=master, sr=sr)
    _train(params, opt, 1)
    measured = state_bytes_per_param(opt)
    assert measured <= bound, f"{config}: {measured:.4f} bytes/param of state, more than {bound}"
    # the formats' own arithmetic: codes plus one scale per block
    expected = sum(LOW_BIT_FORMATS[STATE_DTYPES[k]].bytes_per_element() if STATE_DTYPES[k] in LOW_BIT_FORMATS
                   else STATE_DTYPES[k].itemsize for k in (m, v)) + (4 if master else 0)
    assert measured == pytest.approx(expected, rel=2e-3)
    if sr:  # the lowest-memory configuration: params + state within 3-4 bytes per param (+ the scales)
        assert 3.0 <= measured + 2 <= 4.04


# ---- no explosion for tiny and rare gradients -------------------------------------------------------------------


@pytest.mark.parametrize("v", ["u8", "u4"])
@pytest.mark.parametrize("m", ["u8", "u4"])
def test_tiny_and_rare_gradients_never_make_the_update_explode(m, v, backend):
    """Per block, one element with gradients ~1, the others 1e-7 of it (their v is 1e-14 of the block's largest);
    and 'rare rows' that see a gradient every 25th step and exact zeros in between. After 200 steps every element
    moved at most a bounded multiple of fp32 AdamW's movement, and no step moved any element by more than 4 lr."""
    n, lr = 2 * 256, 1e-3
    runs = {}
    for name, dtypes in (("fp32", ("fp32", "fp32")), ("lowbit", (m, v))):
        p = torch.nn.Parameter(torch.zeros(n))
        opt = _optimizer([p], *dtypes, mode=2, lr=lr)
        g = torch.Generator().manual_seed(5)
        largest_step = 0.0
        for step in range(200):
            grad = torch.randn(n, generator=g) * 1e-7
            grad[::128] = torch.randn(n // 128, generator=g).sign()
            rare = slice(300, 340)
            grad[rare] = torch.randn(40, generator=g) * 1e-3 if step % 25 == 0 else 0.0
            before = p.detach().clone()
            p.grad = grad
            opt.step()
            largest_step = max(largest_step, float((p.detach() - before).abs().max()))
        assert bool(torch.isfinite(p).all())
        runs[name] = (p.detach().abs(), largest_step)
    moved, largest = runs["lowbit"]
    fp32_moved, _ = runs["fp32"]
    assert largest <= 4 * lr
    assert bool((moved <= 2.0 * fp32_moved + 10 * lr).all()), float((moved / fp32_moved.clamp_min(1e-30)).max())


@pytest.mark.parametrize("moment_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_an_element_with_a_gradient_1e7_of_its_blocks_largest_moves_like_fp32_adamw(moment_dtype, backend):
    """traps.md #22, issue 11 item 6: fp16 second moments hold sqrt(v), so an element whose v is 1e-14 of its
    block's largest keeps it; after 200 steps it has moved within 10% of fp32 AdamW (it used to move 5.1x)."""
    moved = {}
    for name, dtype in (("fp32", torch.float32), ("low", moment_dtype)):
        p = torch.nn.Parameter(torch.zeros(1024))
        opt = FusedAdam([p], lr=1e-3, eps=1e-12, adam_w_mode=2, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
        g = torch.Generator().manual_seed(0)
        for _ in range(200):
            grad = torch.randn(1024, generator=g).abs() + 0.5
            grad[7] = grad[7] * 1e-7
            p.grad = grad
            opt.step()
        moved[name] = float(p[7].detach().abs())
    assert moved["low"] == pytest.approx(moved["fp32"], rel=0.1)


# ---- idempotent quantisation: what makes a canonical checkpoint resume exactly ----------------------------------

_SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, -3e-42, 1e-39]


@st.composite
def _blocks_of_values(draw, second_moment: bool):
    """Float32 values: normal magnitudes from 2**-50 to 2**100, zeros, subnormals, inf and NaN; each block starts with
    an anchor (a normal value or a special one), so that a block's scale is normal, zero or non-finite. (A block of
    nothing but subnormals is the one case where a re-encode may move a code; README, "low-bit states".)"""
    normal = st.floats(min_value=2.0**-50, max_value=2.0**100, width=32)
    element = st.one_of(st.sampled_from(_SPECIAL), normal, normal.map(lambda x: -x))
    values = draw(st.lists(element, min_size=1, max_size=300))
    anchor = st.one_of(normal, st.sampled_from([0.0, math.nan, math.inf]))
    for start in range(0, len(values), 128):
        values[start] = draw(anchor)
    x = torch.tensor(values, dtype=torch.float32)
    return x.abs() if second_moment else x


@pytest.mark.parametrize("second_moment", [False, True], ids=["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint4, torch.float16], ids=["8bit", "4bit", "fp16"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_encode_decode_encode_gives_back_the_same_bits(dtype, second_moment, data):
    x = data.draw(_blocks_of_values(second_moment))
    codes, scales = formats.encode_state(x, dtype, second_moment)
    decoded = formats.decode_state(codes, scales, second_moment, x.shape)
    again, again_scales = formats.encode_state(decoded, dtype, second_moment)
    if dtype == torch.float16:  # fp16 codes are values: NaN stays NaN, its payload is not kept
        torch.testing.assert_close(again, codes, rtol=0, atol=0, equal_nan=True)
    else:
        assert torch.equal(bits(again), bits(codes))
    assert torch.equal(bits(again_scales), bits(scales))
    # a block with inf or NaN reads back as NaN; a finite block stays finite (values beyond the format's scale
    # dtype excepted: none here)
    block = LOW_BIT_FORMATS[dtype].block if dtype in LOW_BIT_FORMATS else 1024
    padded = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    finite_block = torch.isfinite(padded).all(dim=1).repeat_interleave(block)[:x.numel()]
    if dtype in LOW_BIT_FORMATS:
        assert bool((torch.isfinite(decoded) == finite_block).all())
    # precision: each finite element within half a level spacing of its block's scale times the largest spacing
    if dtype in LOW_BIT_FORMATS and second_moment is False:
        fmt = LOW_BIT_FORMATS[dtype]
        gap = max(b - a for a, b in zip(fmt.exp_avg_levels, fmt.exp_avg_levels[1:]))
        scale = scales.float().repeat_interleave(fmt.block)[:x.numel()]
        # (stochastic rounding: within a gap; blocks below 2**-126 are stored as zero)
        ok = ~finite_block | ((decoded - x).abs() <= gap * scale * (1 + 1e-6) + 2.0**-126)
        assert bool(ok.all())


# ---- exp_avg's stochastic rounding: unbiased, so a decaying moment decays as fp32's and never sticks --------------


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint4], ids=["8bit", "4bit"])
def test_exp_avg_rounding_is_unbiased_between_non_zero_levels(dtype):
    """Values between the lowest non-zero level and 1 (each block anchored at 1) are stored as one of their two
    neighbouring levels, and the mean error is zero within 4 standard errors. Rounding toward zero (the rule before)
    fails this by a wide margin, checked too so that the test can fail."""
    fmt = LOW_BIT_FORMATS[dtype]
    g = torch.Generator().manual_seed(0)
    x = fmt.exp_avg_levels[1] + (1.0 - fmt.exp_avg_levels[1]) * torch.rand(200 * fmt.block, generator=g)
    x[::fmt.block] = 1.0
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -x, x)
    decoded = formats.decode_state(*formats.encode_state(x, dtype, False), False, x.shape)
    down = reference.round_low_bit(x.double(), dtype, False, exp_avg_rounding="down")
    up = reference.round_low_bit(x.double(), dtype, False, exp_avg_rounding="up")
    assert bool(((decoded.double() == down) | (decoded.double() == up)).all())
    # each error of a magnitude is a two-point variable with variance <= spacing**2 / 4
    bound = 4 * float((up - down).pow(2).mean().sqrt()) / 2 / math.sqrt(x.numel())
    assert abs(float((decoded.double().abs() - x.double().abs()).mean())) <= bound
    assert abs(float((down.abs() - x.double().abs()).mean())) > 10 * bound  # toward zero: biased


@pytest.mark.parametrize("m", ["u8", "u4"])
def test_a_decaying_exp_avg_decays_like_fp32s_and_never_sticks(m, backend):
    """Rare rows: elements that see one gradient and then only zeros (m <- beta1 * m), in blocks whose largest
    moment keeps growing. Nearest rounding let such an m stick at a level (the row kept moving at its last speed:
    69x fp32 AdamW's drift); toward zero made it decay far too fast (4-bit: to 0 within 10 steps). Rounded
    stochastically, the rows' mean |m| stays within 15% of fp32's while it is above the lowest non-zero level."""
    n = 8 * 256
    g = torch.Generator().manual_seed(0)
    first = (0.5 + 0.5 * torch.rand(n, generator=g)) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    rows = torch.ones(n, dtype=torch.bool)
    rows[::128] = False
    moments = {}
    for name, dtypes in (("fp32", ("fp32", "fp32")), ("lowbit", (m, "fp32"))):
        p = torch.nn.Parameter(torch.zeros(n))
        opt = _optimizer([p], *dtypes, mode=2, lr=1e-3)
        moments[name] = []
        for step in range(30):
            grad = first.clone() if step == 0 else torch.zeros(n)
            grad[~rows] = 0.1  # every step: the block's largest moment, 0.1 * (1 - 0.9**t)
            p.grad = grad
            opt.step()
            if step + 1 in (10, 20, 30):
                moments[name].append(float(state_values(opt, p, "exp_avg")[rows].abs().mean()))
    ratios = [low / fp32 for low, fp32 in zip(moments["lowbit"], moments["fp32"])]
    assert all(0.85 <= r <= 1.15 for r in ratios), ratios


def test_the_code_maps_are_as_specified():
    for fmt in (Q8, Q4):
        for levels, signed in ((fmt.exp_avg_levels, True), (fmt.exp_avg_sq_levels, False)):
            assert list(levels) == sorted(set(levels)) and levels[-1] == 1.0
            assert len(levels) == (2 ** (fmt.bits - 1) if signed else 2 ** fmt.bits)
        assert fmt.exp_avg_levels[0] == 0.0, "exp_avg needs an exact zero (params without gradient stay put)"
        assert fmt.exp_avg_sq_levels[0] > 0.0, "no zero level for sqrt(v): the zero-point problem"
    assert Q8.bytes_per_element() * 2 <= 2.05 and Q4.bytes_per_element() * 2 <= 1.05


# ---- checkpoints --------------------------------------------------------------------------------------------------

CHECKPOINT_CASES = {
    "8bit-amsgrad": dict(m="u8", v="u8", amsgrad=True),
    "4bit": dict(m="u4", v="u4"),
    "8bit-m-fp16-v": dict(m="u8", v="fp16", amsgrad=True),
    "bf16-sr-4bit": dict(m="u4", v="u4", sr=True, seed=7, dtype=torch.bfloat16),
    "bf16-master-4bit-m": dict(m="u4", v="fp32", master=True, dtype=torch.bfloat16),
}


def _state_snapshot(opt) -> dict:
    """optimizer_snapshot without the gradients (a resumed optimizer's params have none yet)."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None
    return optimizer_snapshot(opt)


def _saved_and_loaded(sd):
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_resuming_from_a_checkpoint_equals_never_stopping_bit_for_bit(case, backend):
    kwargs = dict(CHECKPOINT_CASES[case])
    dtype = kwargs.pop("dtype", torch.float32)
    straight_params = _params(dtype)
    straight = _optimizer(straight_params, **kwargs)
    _train(straight_params, straight, 6)

    params = _params(dtype)
    opt = _optimizer(params, **kwargs)
    _train(params, opt, 3)
    sd = _saved_and_loaded(opt.state_dict())
    for key, value in sd["state"][0].items():
        assert value.dtype in (torch.float32, torch.float64), f"{key} saved as {value.dtype}: not canonical"
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = _optimizer(resumed_params, **kwargs)
    original = _saved_and_loaded(sd)
    resumed.load_state_dict(sd)
    assert_tree_bitwise_equal(sd, original, "the loaded dict")  # loading never changes the given dict
    twice = _optimizer([torch.nn.Parameter(p.detach().clone()) for p in params], **kwargs)
    twice.load_state_dict(sd)
    twice.load_state_dict(sd)
    assert_same_snapshot(_state_snapshot(twice), _state_snapshot(resumed))  # loading twice == once
    assert_same_snapshot(_state_snapshot(resumed), _state_snapshot(opt))  # the state restored bit for bit
    _train(resumed_params, resumed, 3, first=3)
    assert_same_snapshot(_state_snapshot(resumed), _state_snapshot(straight))


def test_an_8bit_checkpoint_loads_into_fp32_moments_dequantised_and_back_quantised(backend):
    params = _params()
    eight = _optimizer(params, "u8", "u4", amsgrad=True)
    _train(params, eight, 3)
    fp32 = _optimizer([torch.nn.Parameter(p.detach().clone()) for p in params], "fp32", "fp32", amsgrad=True)
    fp32.load_state_dict(eight.state_dict())
    for p, q in zip(params, fp32.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert fp32.state[q][key].dtype == torch.float32
            assert torch.equal(fp32.state[q][key], state_values(eight, p, key)), key
    back = _optimizer([torch.nn.Parameter(p.detach().clone()) for p in params], "u8", "u4", amsgrad=True)
    back.load_state_dict(fp32.state_dict())
    assert_same_snapshot(_state_snapshot(back), _state_snapshot(eight))
    # fp32 moments that never were 8-bit are quantised as the format says
    fresh = _optimizer([torch.nn.Parameter(torch.randn(600))], "fp32", "fp32")
    _train(fresh.param_groups[0]["params"], fresh, 2)
    quantised = _optimizer([torch.nn.Parameter(torch.randn(600))], "u8", "u8")
    quantised.load_state_dict(fresh.state_dict())
    p, q = fresh.param_groups[0]["params"][0], quantised.param_groups[0]["params"][0]
    codes, scales = formats.encode_state(fresh.state[p]["exp_avg_sq"], torch.uint8, True)
    assert torch.equal(quantised.state[q]["exp_avg_sq"], codes) and torch.equal(quantised.state[q]["exp_avg_sq_scale"],
                                                                                  scales)


def _train_randn(params, opt, steps, first=0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_from_torch_adamw_into_8bit_moments(backend):
    params = _params()
    torch_opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-8)
    _train_randn(params, torch_opt, 3)
    fused = FusedAdam.from_optimizer(torch_opt, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    for p in params:
        state = fused.state[p]
        assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg_scale"].dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            expected = reference.round_state(torch_opt.state[p][key].double(), torch.uint8, key == "exp_avg_sq")
            assert torch.equal(state_values(fused, p, key).double(), expected), key
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = torch.optim.AdamW(twin, lr=1e-2, weight_decay=0.1, eps=1e-8)
    twin_opt.load_state_dict(torch_opt.state_dict())
    _train_randn(params, fused, 3, first=3)
    _train_randn(twin, twin_opt, 3, first=3)
    for p, q in zip(params, twin):  # 8-bit moments continue close to torch's fp32 ones (3 steps of lr 1e-2)
        torch.testing.assert_close(p, q, rtol=0, atol=3e-3)


# ---- stochastic rounding ------------------------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased():
    """Values a third of the way between two bfloat16 neighbours: over many elements and steps, the rounded mean is
    the value (within 4 standard errors), while round-to-nearest is off by a third of an ulp."""
    x = torch.full((4096,), 1.0 + 2.0**-7 / 3)  # bf16's ulp at 1 is 2**-7
    ulp = 2.0**-7
    samples = torch.stack([reference_backend.round_bf16_stochastic(x, key=123, step=s).float() for s in range(1, 9)])
    assert set(samples.unique().tolist()) == {1.0, 1.0 + ulp}
    error = float(samples.double().mean()) - float(x[0])
    standard_error = ulp * math.sqrt(1 / 3 * 2 / 3) / math.sqrt(samples.numel())
    assert abs(error) < 4 * standard_error
    assert abs(float(x.to(torch.bfloat16).float().mean()) - float(x[0])) > 0.3 * ulp


def test_stochastic_rounding_lets_updates_below_half_an_ulp_accumulate(backend):
    """lr far below half a bfloat16 ulp: round-to-nearest never moves the param; stochastic rounding moves it by the
    fp32 amount on average."""
    moved = {}
    for sr in (False, True):
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = FusedAdam([p], lr=2.0**-7 / 20, adam_w_mode=2, stochastic_rounding=sr, stochastic_rounding_seed=3)
        for _ in range(40):
            p.grad = torch.ones_like(p)
            opt.step()
        moved[sr] = 1.0 - float(p.detach().float().mean())
    fp32_moved = 40 * 2.0**-7 / 20  # each step's update is lr (m/sqrt(v) = 1 for a constant gradient)
    assert moved[False] == 0.0
    assert moved[True] == pytest.approx(fp32_moved, rel=0.05)


def test_stochastic_rounding_is_deterministic_for_a_seed(backend):
    runs = []
    for seed in (0, 0, 1):
        params = _params(torch.bfloat16)
        opt = _optimizer(params, "u8", "u8", sr=True, seed=seed)
        _train(params, opt, 3)
        runs.append(torch.cat([p.detach().float().reshape(-1) for p in params]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_stochastic_rounding_is_refused_where_it_means_nothing():
    with pytest.raises(ValueError, match="stochastic_rounding"):
        FusedAdam(_params(torch.bfloat16), master_weights=True, stochastic_rounding=True)
    with pytest.raises(TypeError, match="stochastic_rounding"):
        FusedAdam(_params(torch.bfloat16), stochastic_rounding="yes")
    with pytest.raises(ValueError, match="stochastic_rounding_seed"):
        FusedAdam(_params(torch.bfloat16), stochastic_rounding=True, stochastic_rounding_seed=-1)


def _sr_checkpoint() -> dict:
    """A checkpoint of the lowest-memory configuration (bf16 params, stochastic rounding, no masters)."""
    params = _params(torch.bfloat16)
    opt = _optimizer(params, "u8", "u8", sr=True, seed=5)
    _train(params, opt, 2)
    return opt.state_dict()


@pytest.mark.parametrize("route", ["add_param_group", "assigned later", "load_state_dict"])
def test_stochastic_rounding_with_master_weights_is_refused_whichever_way_it_comes(route):
    """With master weights the fp32 master keeps the update exactly and stochastic rounding would be ignored: the
    constructor refuses it, and so do the other ways a group can get it, before anything changes."""
    params = _params(torch.bfloat16)
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    _train(params, opt, 2)
    before = optimizer_snapshot(opt)
    if route == "add_param_group":
        extra = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"param_groups\[1\]: stochastic_rounding=True .* master weights"):
            opt.add_param_group({"params": [extra], "stochastic_rounding": True})
        assert len(opt.param_groups) == 1
    elif route == "assigned later":
        opt.param_groups[0]["stochastic_rounding"] = True
        with pytest.raises(ValueError, match=r"param_groups\[0\]: stochastic_rounding=True .* master weights"):
            opt.step()
        opt.param_groups[0]["stochastic_rounding"] = False
    else:
        checkpoint = _sr_checkpoint()
        saved = copy.deepcopy(checkpoint)
        with pytest.raises(ValueError, match=r"state_dict\['param_groups'\]\[0\]\['stochastic_rounding'\]"):
            opt.load_state_dict(checkpoint)
        assert_tree_bitwise_equal(checkpoint, saved, "checkpoint")
        checkpoint["param_groups"][0]["stochastic_rounding"] = False  # the documented way: say so in the checkpoint
        opt2 = FusedAdam(_params(torch.bfloat16), lr=1e-2, master_weights=True)
        opt2.load_state_dict(checkpoint)
    assert_same_snapshot(optimizer_snapshot(opt), before)


# ---- bad input ----------------------------------------------------------------------------------------------------


def test_unknown_state_dtypes_are_refused():
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        FusedAdam(_params(), exp_avg_dtype=torch.int8)


@pytest.mark.parametrize("damage", ["no-scales", "scale-count", "scale-dtype", "4bit-size"])
def test_the_native_op_validates_low_bit_states_before_writing(damage, monkeypatch):
    select_backend(monkeypatch, "native")
    p = torch.randn(300)
    g = torch.randn(300)
    m, m_scales = formats.encode_state(torch.randn(300), torch.uint8, False)
    v, v_scales = formats.encode_state(torch.rand(300), torch.uint4, True)
    m_list, m_scale_list, v_list, v_scale_list = [m], [m_scales], [v], [v_scales]
    if damage == "no-scales":
        m_scale_list = []
    elif damage == "scale-count":
        m_scale_list = [m_scales[:1]]
    elif damage == "scale-dtype":
        m_scale_list = [m_scales.double()]
    else:
        v_list = [torch.zeros(300, dtype=torch.uint8)]
    before = [t.clone() for t in (p, *m_list, *v_list, *m_scale_list, *v_scale_list)]
    with pytest.raises(RuntimeError, match="exp_avg|state"):
        torch.ops.ort_optim.adam_step_([p], [g], m_list, v_list, [], [], m_scale_list, v_scale_list, [],
                                       torch.zeros(1, dtype=torch.float64), lr=1e-3, beta1=0.9, beta2=0.999,
                                       eps=1e-8, weight_decay=0.0, adam_w_mode=2, bias_correction=True,
                                       maximize=False)
    after = [p, *m_list, *v_list, *m_scale_list, *v_scale_list]
    for b, a in zip(before, after):
        assert torch.equal(bits(b), bits(a))


# ---- the step cache with low-bit states (issue 11's scenarios, ort_optim/_plan.py) -------------------------------


def _stepped(m="u8", v="u4", steps=2, **kwargs):
    params = _params()
    opt = _optimizer(params, m, v, **kwargs)
    _train(params, opt, steps)
    return params, opt


def _codes_of(values, dtype, second_moment):
    return formats.encode_state(values, dtype, second_moment)


# what is assigned to optimizer.state[p] of the 300x7 param of an optimizer with 8-bit exp_avg, 4-bit exp_avg_sq
ASSIGNED = {
    "float32 values": ({"exp_avg": lambda p: torch.full(p.shape, 0.25)}, {"exp_avg": torch.full((300, 7), 0.25)}),
    "4-bit codes into 8-bit": (
        {"exp_avg": lambda p: _codes_of(torch.full(p.shape, 0.25), torch.uint4, False)[0],
         "exp_avg_scale": lambda p: _codes_of(torch.full(p.shape, 0.25), torch.uint4, False)[1]},
        {"exp_avg": torch.full((300, 7), 0.25)}),
    "8-bit codes into 4-bit": (
        {"exp_avg_sq": lambda p: _codes_of(torch.full(p.shape, 4e-6), torch.uint8, True)[0],
         "exp_avg_sq_scale": lambda p: _codes_of(torch.full(p.shape, 4e-6), torch.uint8, True)[1]},
        {"exp_avg_sq": formats.decode_state(*_codes_of(torch.full((300, 7), 4e-6), torch.uint8, True),
                                                      True, (300, 7))}),
}


@pytest.mark.parametrize("assigned", ASSIGNED)
def test_assigned_moments_are_adopted_into_the_low_bit_layout(assigned, backend):
    """A float tensor, or the codes and scales of the other low-bit format, assigned to a moment: taken as values and
    quantised into this optimizer's format before the step (exactly as a checkpoint of those values loads)."""
    params, opt = _stepped()
    p = params[0]
    entries, values = ASSIGNED[assigned]
    for key, make in entries.items():
        opt.state[p][key] = make(p)
    expected_params = [torch.nn.Parameter(q.detach().clone()) for q in params]
    expected = _optimizer(expected_params, "u8", "u4")
    sd = opt.state_dict()
    for key, value in values.items():
        sd["state"][0][key] = value
    expected.load_state_dict(sd)
    _train(params, opt, 1, first=2)
    _train(expected_params, expected, 1, first=2)
    assert opt.state[p]["exp_avg"].dtype == torch.uint8 and opt.state[p]["exp_avg_scale"].dtype == torch.float32
    assert opt.state[p]["exp_avg_sq"].shape == (1050,) and opt.state[p]["exp_avg_sq_scale"].dtype == torch.bfloat16
    assert_same_snapshot(_state_snapshot(opt), _state_snapshot(expected))


def test_low_bit_states_in_the_layout_are_used_as_is(backend):
    """Codes and scales of the optimizer's own format (a moment reset, say) are taken as they are: no copy."""
    params, opt = _stepped()
    p = params[1]
    codes, scales = _codes_of(torch.full(p.shape, -0.5), torch.uint8, False)
    opt.state[p]["exp_avg"], opt.state[p]["exp_avg_scale"] = codes, scales
    _train(params, opt, 1, first=2)
    assert opt.state[p]["exp_avg"] is codes and opt.state[p]["exp_avg_scale"] is scales
    # m + (1 - beta1) * (g - m) from m = -0.5, in float32, then coded by the 8-bit format
    g = _grads(params, 2)[1]
    m = torch.full(p.shape, -0.5)
    m = m + torch.tensor(1.0 - 0.9, dtype=torch.float32) * (g - m)
    # (the third step: its number is mixed into the stochastic rounding)
    expected = formats.decode_state(*formats.quantize_low_bit(m, Q8, False, step=3), False, p.shape)
    assert torch.equal(bits(state_values(opt, p, "exp_avg")), bits(expected))


def _set(key, make):
    def damage(opt, p):
        opt.state[p][key] = make(p)
    return damage


LOW_BIT_REFUSALS = {
    "codes without scales": (lambda opt, p: opt.state[p].pop("exp_avg_scale"), r"\['exp_avg_scale'\] must hold"),
    "scales of another count": (_set("exp_avg_scale", lambda p: torch.ones(3)), r"\['exp_avg_scale'\] must be a"),
    "negative scales": (_set("exp_avg_sq_scale", lambda p: -torch.ones(2, dtype=torch.bfloat16)),
                        r"\['exp_avg_sq_scale'\] holds negative"),
    "float64 scales": (_set("exp_avg_scale", lambda p: torch.ones(1, dtype=torch.float64)),
                       r"\['exp_avg_scale'\] must hold"),
    "4-bit codes of another size": (_set("exp_avg_sq", lambda p: torch.zeros(p.numel(), dtype=torch.uint8)),
                                    r"\['exp_avg_sq'\] has shape \(129,\) but 4-bit codes"),
}


@pytest.mark.parametrize("damage", LOW_BIT_REFUSALS)
def test_low_bit_states_that_cannot_be_honoured_are_refused_naming_the_param_and_key(damage, backend):
    params, opt = _stepped()
    for p, g in zip(params, _grads(params, 2)):
        p.grad = g
    change, message = LOW_BIT_REFUSALS[damage]
    change(opt, params[1])
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(129,\).*" + message):
        opt.step()
    assert_same_snapshot(before, optimizer_snapshot(opt))


def _reallocate_in_place(t: torch.Tensor, decoys: list) -> None:
    """untyped_storage().resize_(0) then resize_(n) with the data copied back (CPU offload, FSDP); a decoy allocated
    in between may take the freed block."""
    storage = t.untyped_storage()
    saved, nbytes = torch.empty(0, dtype=torch.uint8).set_(storage.clone()), storage.nbytes()
    storage.resize_(0)
    decoys.append(torch.full((nbytes // 4 + 1,), 7.0))
    storage.resize_(nbytes)
    torch.empty(0, dtype=torch.uint8).set_(storage).copy_(saved)


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"])
def test_low_bit_codes_and_scales_reallocated_in_place_are_followed(key, backend):
    """The plan re-validates the code buffers and their scales at every step: a storage re-allocated in place is
    written where it now is (bit for bit as without the offload), never into the freed memory."""
    params, opt = _stepped(amsgrad=True)
    straight_params, straight = _stepped(amsgrad=True)
    decoys = []
    _reallocate_in_place(opt.state[params[1]][key], decoys)
    _train(params, opt, 2, first=2)
    _train(straight_params, straight, 2, first=2)
    assert_same_snapshot(_state_snapshot(opt), _state_snapshot(straight))
    assert all(bool((decoy == 7.0).all()) for decoy in decoys), "a step wrote into freed memory"


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq_scale"])
def test_a_low_bit_storage_still_freed_at_step_time_is_refused(key, backend):
    params, opt = _stepped()
    for p, g in zip(params, _grads(params, 2)):
        p.grad = g
    storage = opt.state[params[0]][key].untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    try:
        with pytest.raises(ValueError, match=re.escape(f"param_groups[0]['params'][0] (shape (300, 7)") + ".*"
                           + re.escape(f"['{key}'] has a storage of 0 bytes")):
            opt.step()
    finally:
        storage.resize_(nbytes)


def test_stochastic_rounding_keys_follow_the_group_options(backend):
    """The rounding keys are part of the plan: changing a group's seed between steps takes effect at once."""
    runs = []
    for change in (False, True):
        params = _params(torch.bfloat16)
        opt = _optimizer(params, "u8", "u4", sr=True, seed=1)
        _train(params, opt, 2)
        if change:
            opt.param_groups[0]["stochastic_rounding_seed"] = 2
        _train(params, opt, 1, first=2)
        runs.append(torch.cat([p.detach().float().reshape(-1) for p in params]))
    fresh_params = _params(torch.bfloat16)
    fresh = _optimizer(fresh_params, "u8", "u4", sr=True, seed=1)
    _train(fresh_params, fresh, 2)
    fresh.load_state_dict(dict(fresh.state_dict(), param_groups=[
        dict(group, stochastic_rounding_seed=2) for group in fresh.state_dict()["param_groups"]]))
    _train(fresh_params, fresh, 1, first=2)
    assert not torch.equal(runs[0], runs[1])
    assert torch.equal(runs[1], torch.cat([p.detach().float().reshape(-1) for p in fresh_params]))


@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "stochastic-rounding"])
def test_step_in_backward_equals_step_with_low_bit_states(sr, backend):
    results = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 3))
        model.to(torch.bfloat16)
        opt = FusedAdam(model.parameters(), lr=1e-2, exp_avg_dtype=torch.uint4, exp_avg_sq_dtype=torch.uint8,
                        stochastic_rounding=sr, stochastic_rounding_seed=5, step_in_backward=in_backward)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            x = torch.randn(8, 40, generator=g).bfloat16()
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append(optimizer_snapshot(opt))
    assert_same_snapshot(results[0], results[1])


def test_a_scaled_step_writes_the_unscaled_gradients_back_with_low_bit_states(backend):
    """grad_scale with 8-bit/4-bit moments: the same step as with unscaled gradients (a power-of-two scale divides
    exactly), and p.grad holds g / grad_scale afterwards."""
    params, opt = _stepped()
    twin_params, twin = _stepped()
    grads = _grads(params, 2)
    for p, q, g in zip(params, twin_params, grads):
        p.grad = g * 1024.0
        q.grad = g.clone()
    opt.step(grad_scale=1024.0)
    twin.step()
    for p, g in zip(params, grads):
        assert torch.equal(bits(p.grad), bits(g))
    assert_same_snapshot(_state_snapshot(opt), _state_snapshot(twin))
