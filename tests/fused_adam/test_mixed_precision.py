"""Mixed precision in FusedAdam, as a specification.

* fp16/bf16 params with ``master_weights=True`` keep an fp32 master; the param is the master rounded to nearest even.
* Moments can be stored in fp32, bf16 or fp16 (fp16 with a power-of-two scale per 1024-element block); every
  combination matches the float64 reference within what its storage dtype can hold.
* fp16 moments neither flush tiny nor overflow huge values; all-zero tensors stay exactly zero.
* ``max_grad_norm`` clips like torch.nn.utils.clip_grad_norm_, ``grad_scale`` unscales inside the kernel,
  ``found_inf`` and inf/NaN gradients skip the step without changing anything, and torch.amp.GradScaler drives
  FusedAdam through its fused-optimizer protocol.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (BACKENDS, assert_bitwise_equal, assert_same_snapshot, optimizer_snapshot, select_backend,
                      state_values)
from reference import ReferenceAdam

from ort_optim import AdamWMode, FusedAdam
from ort_optim._spec import QUANT_BLOCK

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARAM_CASES = {  # name: (param dtype, master_weights)
    "fp32": (torch.float32, False),
    "fp16-master": (torch.float16, True),
    "bf16-master": (torch.bfloat16, True),
}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11,
                 torch.float64: 2.0**-53}


def _params(dtype, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return (scale * torch.randn(shape, generator=g)).to(dtype)

    big = randn(4, 12)
    return [
        torch.nn.Parameter(randn()),
        torch.nn.Parameter(randn(2 * QUANT_BLOCK + 3)),  # three fp16-state blocks, the last one partial
        torch.nn.Parameter(big[:, 1::3]),  # non-contiguous
        torch.nn.Parameter(randn(0)),
    ]


def _grads(params, step, scale=1.0, seed=11):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return [(scale * torch.randn(p.shape, generator=g)).to(p.dtype) for p in params]


# ---- master weights ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_master_weights_are_fp32_and_the_param_is_the_master_rounded_to_nearest_even(dtype, backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params = _params(dtype)
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, master_weights=True)
    for step in range(20):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
        for p in params:
            master = opt.state[p]["master_param"]
            assert master.dtype == torch.float32 and master.is_contiguous() and master.shape == p.shape
            assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.float32
            assert_bitwise_equal(p.detach(), master.to(dtype), "param vs master rounded to nearest even")
    # and the masters really carry more precision than the params (the updates are below the param's ulp)
    assert any(not torch.equal(opt.state[p]["master_param"], p.detach().float()) for p in params if p.numel())


@pytest.mark.parametrize("backend", BACKENDS)
def test_master_weights_do_not_apply_to_fp32_and_fp64_params(backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    opt = FusedAdam(params, master_weights=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        assert "master_param" not in opt.state[p]
        assert opt.state[p]["exp_avg"].dtype == p.dtype


# ---- moment storage dtypes -----------------------------------------------------------------------------------------


def _moment_dtype_params():
    """(param case, m dtype, v dtype) for the runs against the float64 reference: the fast tier runs every (m, v)
    pair once, the param cases in turn (so each param case meets every m dtype and every v dtype); the slow tier the
    other param cases. The Triton suite, which leaves the slow tier out, runs every combination."""
    for pi, param_case in enumerate(PARAM_CASES):
        for mi, m_dtype in enumerate(STATE_DTYPES):
            for vi, v_dtype in enumerate(STATE_DTYPES):
                fast = pi == (mi + vi) % len(PARAM_CASES) or BACKENDS == ("triton",)
                yield pytest.param(param_case, m_dtype, v_dtype, marks=[] if fast else [pytest.mark.slow],
                                   id=f"{param_case}-m-{m_dtype}-v-{v_dtype}")


# Steps per run: 100 on the CPU backends; 25 through Triton's interpreter, where a step of these five blocks of 1024
# costs 0.05-0.12 s of interpretation (100 steps of the 27 combinations: about 4 CPU-minutes). The Triton
# step itself is compared bit for bit with the native op and a numpy model for every moment-dtype combination, mode
# and amsgrad (tests/triton_backend/test_triton.py). The tolerance is the same: fewer steps leave fewer storage
# roundings that float32 noise can flip.
MOMENT_DTYPE_STEPS = 25 if BACKENDS == ("triton",) else 100


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("param_case,m_dtype,v_dtype", list(_moment_dtype_params()))
def test_every_moment_dtype_matches_the_float64_reference(param_case, m_dtype, v_dtype, backend, monkeypatch):
    """MOMENT_DTYPE_STEPS steps with amsgrad; the reference stores the moments exactly as specified (fp16: codes with
    the block scale rule), so the tolerance is a few roundings of the state dtype on top of float32 arithmetic."""
    select_backend(monkeypatch, backend)
    dtype, master = PARAM_CASES[param_case]
    m_dt, v_dt = STATE_DTYPES[m_dtype], STATE_DTYPES[v_dtype]
    params = _params(dtype)
    kwargs = dict(lr=3e-3, eps=1e-8, weight_decay=0.05, amsgrad=True, master_weights=master,
                  exp_avg_dtype=m_dt, exp_avg_sq_dtype=v_dt)
    opt = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, **kwargs)
    reference = ReferenceAdam(params, mode=2, **kwargs)
    for step in range(MOMENT_DTYPE_STEPS):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        reference.step(grads)
    for i, p in enumerate(params):
        state = opt.state[p]
        for key, want in (("exp_avg", m_dt), ("exp_avg_sq", v_dt), ("max_exp_avg_sq", v_dt)):
            assert state[key].dtype == want
            if want == torch.float16:  # one fp32 scale per block of 1024 elements
                assert state[key + "_scale"].dtype == torch.float32
                assert state[key + "_scale"].shape == (math.ceil(p.numel() / QUANT_BLOCK),)
            else:
                assert key + "_scale" not in state
        # params: the reference rounds the moments like the kernel, so they differ only where float32 noise sends a
        # storage rounding the other way; each such flip changes one update (about lr) by about u_state, and a
        # handful happen in 100 steps (measured: at most 4.4 lr * u_state). The param dtype adds one ulp (2 u).
        # (fp16 second moments are stored as sqrt(v): the relative rounding of v is twice fp16's)
        u_state = max(UNIT_ROUNDOFF[m_dt], UNIT_ROUNDOFF[v_dt] * (2 if v_dt == torch.float16 else 1))
        u_param = UNIT_ROUNDOFF[dtype] * 2
        torch.testing.assert_close(p.double(), reference.param(i), rtol=u_param + 200 * 2.0**-24,
                                   atol=8 * kwargs["lr"] * u_state + 1e-7)
        for key, ref_key, dt in (("exp_avg", "m", m_dt), ("exp_avg_sq", "v", v_dt), ("max_exp_avg_sq", "vmax", v_dt)):
            expected = reference.states[i][ref_key]
            magnitude = float(expected.abs().max()) if expected.numel() else 0.0
            torch.testing.assert_close(state_values(opt, p, key).double(), expected, rtol=0,
                                       atol=max(4 * UNIT_ROUNDOFF[dt], 200 * 2.0**-24) * magnitude + 1e-30)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_magnitude", [1e-8, 1e4], ids=["tiny-1e-8", "huge-1e4"])
def test_fp16_moments_neither_flush_nor_overflow(grad_magnitude, backend, monkeypatch):
    """v = (1 - beta2) * g**2 is 1e-19 for g ~ 1e-8 (a plain fp16 state flushes it to 0) and 1e5 for g ~ 1e4 (a
    plain fp16 state overflows to inf); block-scaled fp16 states keep both to fp16 precision."""
    select_backend(monkeypatch, backend)
    params = [torch.nn.Parameter(torch.randn(1500)), torch.nn.Parameter(torch.randn(()))]
    kwargs = dict(lr=1e-3, eps=1e-30, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    opt = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, **kwargs)
    reference = ReferenceAdam(params, mode=2, **kwargs)
    for step in range(10):
        grads = _grads(params, step, scale=grad_magnitude)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        reference.step(grads)
    for i, p in enumerate(params):
        expected_v = reference.states[i]["v"]
        plain = expected_v.half()  # what an unscaled fp16 state would hold
        assert bool((plain == 0).all()) if grad_magnitude < 1 else bool(torch.isinf(plain).any())
        for key, ref_key in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            got = state_values(opt, p, key).double()
            expected = reference.states[i][ref_key]
            assert bool(torch.isfinite(got).all()) and bool((got != 0).all())
            torch.testing.assert_close(got, expected, rtol=4 * 2.0**-11, atol=0)
        # a storage rounding that float32 noise sends the other way changes one update by about lr * 2**-11
        torch.testing.assert_close(p.double(), reference.param(i), rtol=1e-6, atol=8 * kwargs["lr"] * 2.0**-11)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
def test_all_zero_tensors_stay_exactly_zero_with_unit_scales(state_dtype, backend, monkeypatch):
    """Zero params and zero grads: moments stay 0 (no NaN from a 0/0 scale), fp16 block scales are 1, and a zero
    block next to a non-zero block does not disturb it."""
    select_backend(monkeypatch, backend)
    dt = STATE_DTYPES[state_dtype]
    zero = torch.nn.Parameter(torch.zeros(QUANT_BLOCK + 5))
    mixed = torch.nn.Parameter(torch.zeros(2 * QUANT_BLOCK))
    opt = FusedAdam([zero, mixed], lr=1e-2, weight_decay=0.1, exp_avg_dtype=dt, exp_avg_sq_dtype=dt,
                    amsgrad=True)
    for _ in range(3):
        zero.grad = torch.zeros_like(zero)
        mixed.grad = torch.cat([torch.zeros(QUANT_BLOCK), torch.full((QUANT_BLOCK,), 0.5)])
        opt.step()
    assert bool((zero == 0).all()) and bool((mixed[:QUANT_BLOCK] == 0).all())
    assert bool((mixed[QUANT_BLOCK:] < 0).all())
    for p in (zero, mixed):
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            values = state_values(opt, p, key)
            assert bool(torch.isfinite(values).all())
            assert bool((values[:QUANT_BLOCK] == 0).all())
            if dt == torch.float16:
                scales = opt.state[p][key + "_scale"]
                assert float(scales[0]) == 1.0
                if p is zero:
                    assert bool((scales == 1).all())


# ---- clipping and unscaling ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_norm", [0.5, 50.0], ids=["clipping", "below-the-threshold"])
def test_max_grad_norm_equals_clip_grad_norm_then_the_same_update(max_norm, backend, monkeypatch):
    """FusedAdam(max_grad_norm=c) == torch.nn.utils.clip_grad_norm_(params, c) followed by FusedAdam without it.
    The global norm is summed in a different order (float64 per chunk vs torch's per-tensor norms), so the clip
    coefficient may differ in its last float32 bit."""
    select_backend(monkeypatch, backend)
    ours = _params(torch.float32, seed=1)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, max_grad_norm=max_norm)
    ref = FusedAdam(theirs, lr=1e-2, weight_decay=0.1)
    for step in range(20):
        for a, b, g in zip(ours, theirs, _grads(ours, step, scale=0.5)):
            a.grad, b.grad = g, g.clone()
        before = [a.grad.clone() for a in ours]
        norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        assert (float(norm) > max_norm) == (max_norm == 0.5)
        opt.step()
        ref.step()
        for a, g in zip(ours, before):
            assert_bitwise_equal(a.grad, g, "the stored gradient is not clipped in place")
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)
        assert not opt.last_step_skipped


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_clipping_fp16_and_bf16_grads_matches_the_float64_reference(dtype, backend, monkeypatch):
    """Low-precision grads are clipped in float32 inside the kernel (torch's clip_grad_norm_ would round the scaled
    grads back to fp16/bf16), with grad_scale: unscale first, then clip by the unscaled norm."""
    select_backend(monkeypatch, backend)
    params = _params(dtype, seed=2)
    kwargs = dict(lr=1e-2, weight_decay=0.1, master_weights=True, max_grad_norm=0.3)
    opt = FusedAdam(params, **kwargs)
    reference = ReferenceAdam(params, **kwargs)
    for step in range(20):
        grads = _grads(params, step, scale=0.5 * 64)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step(grad_scale=64.0)
        assert not reference.step(grads, grad_scale=64.0)
    for i, p in enumerate(params):
        torch.testing.assert_close(opt.state[p]["master_param"].double(), reference.master[i], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("scale", [1024.0, 3.0, 0.25], ids=["power-of-two", "three", "below-one"])
def test_grad_scale_divides_the_grads_inside_the_kernel(scale, scale_kind, backend, monkeypatch):
    """step(grad_scale=s) on grads * s == step() on grads: bit for bit when s is a power of two (fp16 grads with
    fp32 masters; unscaling is exact), to float32 rounding otherwise (fp32 grads). The stored .grad is unscaled, as
    torch's fused AdamW leaves it (tests/fused_adam/test_scaling.py)."""
    select_backend(monkeypatch, backend)
    exact = math.log2(scale).is_integer()
    ours = _params(torch.float16 if exact else torch.float32, seed=3)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedAdam(ours, lr=1e-2, master_weights=True, maximize=True)
    ref = FusedAdam(theirs, lr=1e-2, master_weights=True, maximize=True)
    for step in range(10):
        grads = _grads(ours, step)
        for a, b, g in zip(ours, theirs, grads):
            a.grad, b.grad = (g.float() * scale).to(g.dtype), g
        scaled = [a.grad.clone() for a in ours]
        opt.step(grad_scale=torch.tensor(scale) if scale_kind == "tensor" else scale)
        ref.step()
        for a, g in zip(ours, scaled):
            assert_bitwise_equal(a.grad, (g.float() / scale).to(g.dtype), "grad")
    for a, b in zip(ours, theirs):
        if exact:
            assert_bitwise_equal(a.detach(), b.detach(), "param")
            assert_bitwise_equal(opt.state[a]["master_param"], ref.state[b]["master_param"], "master")
        else:
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


# ---- skipped steps -------------------------------------------------------------------------------------------------


def _trained(dtype=torch.float16, **kwargs):
    params = _params(dtype, seed=4)
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, amsgrad=True, master_weights=True,
                    exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16, **kwargs)
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("found_inf", [1.0, float("inf"), float("nan")], ids=["one", "inf", "nan"])
def test_a_nonzero_found_inf_makes_the_step_a_no_op(found_inf, backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params, opt = _trained()
    for p, g in zip(params, _grads(params, 99)):
        p.grad = g
    before = optimizer_snapshot(opt)
    opt.step(found_inf=torch.tensor([found_inf]))
    assert opt.last_step_skipped
    assert_same_snapshot(before, optimizer_snapshot(opt))
    opt.step(found_inf=torch.tensor([0.0]))
    assert not opt.last_step_skipped
    assert all(float(opt.state[p]["step"]) == 4 for p in params)


NON_FINITE = {
    "inf-with-grad-scale": (float("inf"), dict(grad_scale=256.0), {}),
    "nan-with-grad-scale-tensor": (float("nan"), dict(grad_scale=torch.tensor(256.0)), {}),
    "-inf-with-clipping": (float("-inf"), {}, dict(max_grad_norm=1.0)),
    "nan-with-clipping-and-grad-scale": (float("nan"), dict(grad_scale=8.0), dict(max_grad_norm=1.0)),
    # the check is on the unscaled grads: with grad_scale < 1, unscaling a finite fp32 grad overflows
    "finite-grad-that-overflows-when-unscaled": (3e38, dict(grad_scale=0.25), {}),
    # the global norm is formed in float32: beyond about 1.8e19 it is inf; skipping beats a clip coefficient of 0
    # (which would turn the step into weight decay alone), as guides/fused-adam.md documents
    "finite-grad-whose-norm-exceeds-float32-with-clipping": (1e20, {}, dict(max_grad_norm=1.0)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", NON_FINITE, ids=str)
def test_non_finite_grads_skip_the_step_and_change_nothing_bit_for_bit(case, backend, monkeypatch):
    """Nothing changes: no param, master, moment, scale or step count; last_step_skipped says so; the next good
    step continues as if the bad one had never been attempted."""
    select_backend(monkeypatch, backend)
    bad_value, step_kwargs, opt_kwargs = NON_FINITE[case]
    dtype = torch.float32 if bad_value in (3e38, 1e20) else torch.float16  # values beyond fp16's range
    params, opt = _trained(dtype, **opt_kwargs)
    twin_params, twin = _trained(dtype, **opt_kwargs)
    grads = _grads(params, 50)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    params[1].grad[7] = bad_value
    before = optimizer_snapshot(opt)
    opt.step(**step_kwargs)
    assert opt.last_step_skipped
    assert_same_snapshot(before, optimizer_snapshot(opt))
    # the next step equals the twin's, which never saw the bad gradient
    good_kwargs = {k: v for k, v in step_kwargs.items() if k == "grad_scale"}
    for p, q, g in zip(params, twin_params, grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step(**good_kwargs)
    twin.step(**good_kwargs)
    assert not opt.last_step_skipped
    for p, q in zip(params, twin_params):
        assert_bitwise_equal(p.detach(), q.detach(), "param")
        for key in opt.state[p]:
            assert_bitwise_equal(opt.state[p][key], twin.state[q][key], key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_first_step_counts_no_step_and_moves_nothing(backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params = _params(torch.float16, seed=5)
    values = [p.detach().clone() for p in params]
    opt = FusedAdam(params, weight_decay=0.1, master_weights=True)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    params[1].grad[0] = float("inf")
    opt.step(grad_scale=2.0)
    assert opt.last_step_skipped
    for p, v in zip(params, values):
        assert_bitwise_equal(p.detach(), v, "param")
        assert not opt.state.get(p) or float(opt.state[p]["step"]) == 0


# ---- torch.amp.GradScaler ------------------------------------------------------------------------------------------


def _grad_scaler(**kwargs):
    """torch.amp.GradScaler for the CPU; torch 2.4 has it already (torch.amp.GradScaler(device="cpu")), and
    torch.cpu.amp.GradScaler is its deprecated alias."""
    return torch.amp.GradScaler("cpu", **kwargs)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("unscale_first", [False, True], ids=["fused-unscale", "scaler-unscale-then-clip"])
def test_grad_scaler_drives_fused_adam_like_an_unscaled_run(unscale_first, backend, monkeypatch):
    """scaler.scale(loss).backward(); scaler.step(opt); scaler.update() == the same run without scaling, bit for
    bit (power-of-two scales unscale exactly); an injected inf skips the step and halves the scale."""
    select_backend(monkeypatch, backend)
    scaled_model, plain_model = _mlp(), _mlp()
    opt = FusedAdam(scaled_model.parameters(), lr=1e-2, weight_decay=0.01)
    ref = FusedAdam(plain_model.parameters(), lr=1e-2, weight_decay=0.01)
    scaler = _grad_scaler(init_scale=2.0**12, growth_interval=3)
    gen = torch.Generator().manual_seed(6)
    scales = []
    for step in range(12):
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        opt.zero_grad()
        ref.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(scaled_model(x), y)).backward()
        torch.nn.functional.mse_loss(plain_model(x), y).backward()
        inject = step == 5
        if inject:
            next(scaled_model.parameters()).grad[0, 0] = float("inf")
        if unscale_first:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(scaled_model.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.5)
        scales.append(scaler.get_scale())
        before = optimizer_snapshot(opt)
        scaler.step(opt)
        scaler.update()
        if inject:
            assert opt.last_step_skipped
            assert_same_snapshot(before, optimizer_snapshot(opt))
            assert scaler.get_scale() == scales[-1] / 2
        else:
            assert not opt.last_step_skipped
            ref.step()
        for a, b in zip(scaled_model.parameters(), plain_model.parameters()):
            assert_bitwise_equal(a.detach(), b.detach(), f"step {step}")
    assert max(scales) > scales[0], "the scale grew during the run (growth_interval=3)"
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf"), "GradScaler removes what it set"


# ---- torch's default dtype -----------------------------------------------------------------------------------------

DEFAULT_DTYPE_STATES = {"fp16": torch.float16, "8-bit": torch.uint8, "fp8": torch.float8_e4m3fn}


def _steps_and_resume(moment_dtype: torch.dtype) -> dict:
    """Three steps, a checkpoint loaded into a fresh optimizer, one more step of each: the params and states."""
    def fresh():
        generator = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float32))
                  for shape in [(QUANT_BLOCK + 5,), (6, 7)]]
        return params, FusedAdam(params, lr=1e-2, weight_decay=1e-2, exp_avg_dtype=moment_dtype,
                                 exp_avg_sq_dtype=moment_dtype)

    def step(params, opt, seed):
        generator = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float32)
        opt.step()

    params, opt = fresh()
    for seed in range(3):
        step(params, opt, seed)
    resumed_params, resumed = fresh()
    with torch.no_grad():
        for p, q in zip(resumed_params, params):
            p.copy_(q)
    resumed.load_state_dict(opt.state_dict())
    step(params, opt, 3)
    step(resumed_params, resumed, 3)
    return {"trained": optimizer_snapshot(opt), "resumed": optimizer_snapshot(resumed)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("default_dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("moment_dtype", DEFAULT_DTYPE_STATES.values(), ids=DEFAULT_DTYPE_STATES.keys())
def test_steps_and_checkpoints_do_not_depend_on_torchs_default_dtype(moment_dtype, default_dtype, backend,
                                                                     monkeypatch):
    """torch.set_default_dtype changes what torch's factory functions make; the states the optimizer makes (fp16
    moments' float32 block scales included) and the steps stay as under float32, bit for bit, as torch.optim.AdamW's
    do."""
    select_backend(monkeypatch, backend)
    expected = _steps_and_resume(moment_dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        run = _steps_and_resume(moment_dtype)
    finally:
        torch.set_default_dtype(previous)
    for name in expected:
        assert_same_snapshot(expected[name], run[name])
