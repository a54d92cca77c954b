"""fp8 moments (``exp_avg_dtype`` / ``exp_avg_sq_dtype`` = ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) and the
conversions of fp32 moments into 8-bit codes.

The fp8 format (ort_optim/_spec.py, ``Fp8Format``): float8 codes of the param's shape, one float32 power-of-two scale
per 256 elements, sqrt(v) for the second moment. Specified here against independent references:

* the codes of a conversion are torch's own float32 -> float8 conversion (round to nearest even) of the values divided
  by the scale, and the scale is the smallest power of two for which the block's largest magnitude converts to a
  finite value, both checked with torch's conversion, not with the encoder's bit arithmetic;
* inside a step the codes round stochastically: each code is one of the two float8 neighbours of the value, and the
  mean over many steps' random bits is the value (unbiased); the block's largest magnitude rounds to nearest;
* FusedAdam with fp8 moments follows torch.optim.AdamW (float64 formulas) within the format's precision over many
  steps, on both CPU backends bit for bit alike, resumes bit for bit from its checkpoint, and refuses invalid fp8
  state with the param named and nothing changed;
* 8-bit conversions (checkpoint loads of fp32 moments, ``from_optimizer``) round to nearest, with a mean absolute
  error no larger than bitsandbytes' blockwise dynamic quantizer's on the same tensor.

Tolerances are stated per test. The Triton kernels' fp8 parity is in the Triton tests; the training quality of the fp8
formats (mean loss within 1% of fp32 moments) in test_quality_within_one_percent below (quick sizes) and in
guides/low-bit-states.md (full runs).
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_tree_bitwise_equal, bits, optimizer_snapshot, assert_same_snapshot
from ort_optim import AdamWMode, FusedAdam
from ort_optim._spec import FP8_FORMATS, Q8
from ort_optim import formats

FP8 = list(FP8_FORMATS)
FP8_IDS = ["e4m3fn", "e5m2"]


def _torch_codes(u: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's own conversion (round to nearest even) of u / scale, per block of 256, as uint8 codes."""
    flat = u.reshape(-1)
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % 256)).view(-1, 256)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (blocks / safe[:, None]).to(dtype).view(torch.uint8).reshape(-1)[: flat.numel()]


def _test_tensor(second: bool, seed: int = 0) -> torch.Tensor:
    """Blocks of very different magnitudes, exact powers of two, a zero block, tiny values, both signs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 300, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen) * 6)
    x[3] = 0.0
    x[5, :9] = torch.tensor([2.0 ** -20, 1.0, 0.5, 448.0, 57344.0, 1e-30, -1e-30, 3e-38, 2.0 ** 100])
    x[7] *= 1e-25  # a block whose scale would fall below the format's smallest: a zero block
    return x * x if second else x


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("second", [False, True], ids=["exp_avg", "exp_avg_sq"])
def test_conversion_is_torchs_float8_conversion_of_the_values_over_a_power_of_two(dtype, second):
    fmt = FP8_FORMATS[dtype]
    x = _test_tensor(second)
    codes, scales = formats.quantize_fp8(x, fmt, second)
    assert codes.dtype == dtype and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.numel() == math.ceil(x.numel() / 256)
    u = formats.sqrt_f32(x) if second else x
    amax = torch.nn.functional.pad(u.reshape(-1).abs(), (0, -u.numel() % 256)).view(-1, 256).amax(dim=1)
    usable = scales > 0
    mantissa, exponent = torch.frexp(scales[usable])
    assert bool((mantissa == 0.5).all()), "scales are powers of two"
    # the smallest power of two under which the largest magnitude rounds (to nearest even) to at most the largest
    # finite value: below max_value + half its step, or on that tie where the even neighbour is max_value (e4m3fn's
    # 448 = 1.110b * 2**8 is even, e5m2's 57344 = 1.11b * 2**15 is odd). (torch's conversion saturates in some
    # versions and not in others, so the bound is written out.)
    half = 2.0 ** (fmt.emax - fmt.mantissa_bits - 1)
    tie_stays = fmt.mantissa_bits == 3

    def fits(y):
        return (y < fmt.max_value + half) | ((y == fmt.max_value + half) & tie_stays)

    assert bool(fits(amax[usable] / scales[usable]).all())
    assert not bool(fits(amax[usable] / (scales[usable] / 2)).any())
    # zero blocks: all-zero ones and those whose scale would be below 2**min_exponent
    zero = scales == 0
    assert bool(((amax == 0) | (amax < 2.0 ** (fmt.min_exponent + fmt.emax)))[zero].all())
    assert torch.equal(scales.isnan(), ~amax.isfinite())  # (v = 2**200 overflows: a NaN block)
    expected = _torch_codes(u, scales, dtype)
    got = codes.view(torch.uint8).reshape(-1)
    in_usable = usable.repeat_interleave(256)[: x.numel()]
    if second:  # sqrt(v) never codes to 0 in a usable block (no zero level: the zero-point problem)
        expected = torch.where(expected == 0, torch.ones_like(expected), expected)
    else:  # no -0
        expected = torch.where(expected == 0x80, torch.zeros_like(expected), expected)
    assert torch.equal(got[in_usable], expected[in_usable])
    assert bool((got[~in_usable] == 0).all())
    # decoding is the float8 value times the scale, exactly
    values = formats.decode_state(codes, scales, second, x.shape)
    u_back = codes.float().reshape(-1) * scales.repeat_interleave(256)[: x.numel()]
    assert torch.equal(bits(values.reshape(-1)), bits(u_back * u_back if second else u_back))  # (NaN blocks too)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("second", [False, True], ids=["exp_avg", "exp_avg_sq"])
def test_encoding_is_idempotent_so_checkpoints_are_canonical(dtype, second):
    """decode -> encode gives the same codes and scales, after a conversion and after a step's stochastic rounding."""
    fmt = FP8_FORMATS[dtype]
    for step in (0, 1, 7):
        x = _test_tensor(second, seed=step)
        codes, scales = formats.quantize_fp8(x, fmt, second, step, exp_avg=torch.randn(x.shape))
        again = formats.quantize_fp8(formats.decode_state(codes, scales, second, codes.shape), fmt, second)
        assert torch.equal(again[0].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(bits(again[1]), bits(scales))


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_a_steps_rounding_is_stochastic_between_the_two_neighbours_and_unbiased(dtype):
    fmt = FP8_FORMATS[dtype]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, generator=gen)
    x[0] = 4.0  # the block's largest: rounds to nearest
    nearest_codes, scales = formats.quantize_fp8(x, fmt, False)
    s = float(scales[0])
    y = x / s
    # the format's non-negative finite values (torch's decoding of every code), and |y|'s neighbours among them
    grid = torch.arange(fmt.max_code + 1, dtype=torch.uint8).view(dtype).float()
    upper = grid[torch.searchsorted(grid, y.abs())]
    lower = grid[torch.searchsorted(grid, y.abs(), right=True) - 1]
    draws = torch.stack([formats.quantize_fp8(x, fmt, False, step)[0].float().abs() for step in range(1, 401)])
    assert bool(((draws == lower) | (draws == upper)).all()), "every code is one of the two neighbours"
    assert bool((draws[:, 0] == nearest_codes.float()[0]).all()), "the block's largest rounds to nearest"
    # unbiased: the mean of 400 draws within 4 standard errors of |y| (Bernoulli spread (upper - lower) / 2 at most)
    err = (draws.mean(0) - y.abs())[1:]
    assert bool((err.abs() <= 4 * (upper - lower)[1:] * 0.5 / math.sqrt(400) + 1e-7).all()), float(err.abs().max())


def _adamw_float64(p0, grads, lr, betas, eps, wd):
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    for t, g in enumerate(grads, 1):
        g = g.double()
        p *= 1 - lr * wd
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p -= lr / (1 - betas[0] ** t) * m / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return p


@pytest.mark.parametrize("m_dtype,v_dtype", [(torch.float8_e4m3fn, torch.float8_e4m3fn),
                                              (torch.float8_e5m2, torch.float8_e5m2),
                                              (torch.float8_e4m3fn, torch.float8_e5m2)],
                         ids=["e4m3fn", "e5m2", "e4m3fn-m-e5m2-v"])
def test_many_steps_follow_adamw_within_the_formats_precision(backend, m_dtype, v_dtype):
    """100 steps of noisy gradients with a drift: the param's movement within 10% (e4m3fn) / 18% (e5m2 v) relative
    (L2) of float64 AdamW's (measured: 7.7-7.9% and 12-13.5% on two seeds; fp32 moments 4e-6, 8-bit moments 1.3%).
    The bound is the fp8 rounding of m and sqrt(v) (relative steps of 1/16-1/8 and 1/8-1/4), stochastic in a step:
    unbiased, but its noise in sqrt(v) decays only with beta2, so it adds up over steps per element (the loss on the
    quality tasks stays within 0.3% of fp32 moments: guides/low-bit-states.md)."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(40, 70, generator=gen)
    grads = [torch.randn(40, 70, generator=gen) * 0.1 + 0.05 for _ in range(100)]
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 1e-2
    p = torch.nn.Parameter(p0.clone())
    opt = FusedAdam([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, adam_w_mode=AdamWMode.ADAMW_TORCH,
                    exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = _adamw_float64(p0, grads, lr, betas, eps, wd)
    rel = float((p.detach().double() - expected).norm() / (expected - p0.double()).norm())
    assert rel <= (0.10 if v_dtype == torch.float8_e4m3fn else 0.18), rel
    assert opt.state[p]["exp_avg"].dtype == m_dtype and opt.state[p]["exp_avg_sq"].dtype == v_dtype


@pytest.mark.parametrize("amsgrad", [False, True])
def test_both_cpu_backends_give_the_same_bits(amsgrad, monkeypatch):
    from conftest import select_backend

    gen = torch.Generator().manual_seed(1)
    shapes = [(300, 7), (5,), (), (1024,)]
    results = []
    for name in ("native", "torch"):
        select_backend(monkeypatch, name)
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(9))) for s in shapes]
        opt = FusedAdam(params, lr=1e-2, amsgrad=amsgrad, exp_avg_dtype=torch.float8_e4m3fn,
                        exp_avg_sq_dtype=torch.float8_e5m2)
        g = torch.Generator().manual_seed(2)
        for _ in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 10.0 ** float(torch.randint(-6, 2, (), generator=g))
            opt.step()
        results.append(optimizer_snapshot(opt))
    assert_same_snapshot(*results)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_resume_from_a_checkpoint_is_bit_exact(backend, dtype, amsgrad):
    gen = torch.Generator().manual_seed(4)
    shapes = [(33, 20), (7,), ()]

    def make():
        params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        return params, FusedAdam(params, lr=1e-2, amsgrad=amsgrad, weight_decay=0.1, exp_avg_dtype=dtype,
                                 exp_avg_sq_dtype=dtype)

    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(8)]
    params, opt = make()
    for step in range(4):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
    ckpt = copy.deepcopy(opt.state_dict())
    assert all(v.dtype == torch.float32 for s in ckpt["state"].values() for k, v in s.items() if k != "step")
    params2, opt2 = make()
    with torch.no_grad():
        for p2, p in zip(params2, params):
            p2.copy_(p)
    opt2.load_state_dict(ckpt)
    assert_tree_bitwise_equal({i: dict(opt.state[p]) for i, p in enumerate(params)},
                              {i: dict(opt2.state[p]) for i, p in enumerate(params2)})
    for step in range(4, 8):
        for ps in (params, params2):
            for p, g in zip(ps, grads[step]):
                p.grad = g.clone()
        opt.step()
        opt2.step()
    for p, p2 in zip(params, params2):
        assert torch.equal(bits(p), bits(p2))


def test_state_bytes_per_param_at_most_2_05():
    from ort_optim.bench.lowbit import memory

    params = [torch.nn.Parameter(torch.randn(768, 768)), torch.nn.Parameter(torch.randn(3072, 768))]
    opt = FusedAdam(params, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert memory(opt)["state_bytes_per_param"] == pytest.approx(2 * (1 + 4 / 256))
    assert memory(opt)["state_bytes_per_param"] <= 2.05


def test_nan_and_inf_blocks_read_as_nan_and_tiny_v_never_as_zero():
    fmt = FP8_FORMATS[torch.float8_e4m3fn]
    x = torch.rand(4 * 256) + 0.5
    x[3] = float("nan")
    x[300] = float("inf")
    x[600] = 1e-12  # sqrt(v) 1e-6 below its block's largest: rounds up to the smallest code, never to 0
    codes, scales = formats.quantize_fp8(x, fmt, True)
    assert bool(scales[:2].isnan().all()) and bool((scales[2:] > 0).all())
    assert bool((codes.view(torch.uint8)[:512] == 0).all())
    values = formats.decode_state(codes, scales, True, x.shape)
    assert bool(values[:512].isnan().all())
    assert float(values[600]) > 0.0


@pytest.mark.parametrize("breakage", ["scale not a power of two", "scale count", "scale dtype", "negative scale"])
def test_invalid_fp8_state_is_refused_naming_the_param_and_nothing_changes(backend, breakage):
    p = torch.nn.Parameter(torch.randn(300))
    opt = FusedAdam([p], lr=1e-2, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn)
    p.grad = torch.randn(300)
    opt.step()
    scale = opt.state[p]["exp_avg_scale"]
    if breakage == "scale not a power of two":
        opt.state[p]["exp_avg_scale"] = scale * 1.5
    elif breakage == "scale count":
        opt.state[p]["exp_avg_scale"] = scale[:1].clone()
    elif breakage == "scale dtype":
        opt.state[p]["exp_avg_scale"] = scale.double()
    else:
        opt.state[p]["exp_avg_scale"] = -scale
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*exp_avg_scale"):
        opt.step()
    assert_same_snapshot(before, optimizer_snapshot(opt))


def test_from_an_fp32_checkpoint_and_from_optimizer():
    """torch.optim.AdamW's moments load into fp8 as their nearest codes (a conversion), and from_optimizer does the
    same; the two give the same state."""
    p = torch.nn.Parameter(torch.randn(50, 30))
    torch_opt = torch.optim.AdamW([p], lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        torch_opt.step()
    p2 = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdam([p2], lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, exp_avg_dtype=torch.float8_e4m3fn,
                    exp_avg_sq_dtype=torch.float8_e4m3fn)
    opt.load_state_dict(torch_opt.state_dict())
    state = opt.state[p2]
    fmt = FP8_FORMATS[torch.float8_e4m3fn]
    for key, second in (("exp_avg", False), ("exp_avg_sq", True)):
        codes, scales = formats.quantize_fp8(torch_opt.state[p][key], fmt, second)
        assert torch.equal(state[key].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(state[key + "_scale"], scales)
    converted = FusedAdam.from_optimizer(torch_opt, exp_avg_dtype=torch.float8_e4m3fn,
                                         exp_avg_sq_dtype=torch.float8_e4m3fn)
    assert torch.equal(converted.state[p]["exp_avg"].view(torch.uint8), state["exp_avg"].view(torch.uint8))


# ---- 8-bit conversions ---------------------------------------------------------------------------------------------


def _bitsandbytes_blockwise_error(x: torch.Tensor):
    """bitsandbytes' blockwise dynamic quantizer's mean absolute error on x with its defaults (quantize_blockwise,
    blocks of 4096: what its own test bounds by 0.011), or None where bitsandbytes is absent."""
    try:
        import bitsandbytes.functional as F
    except Exception:
        return None
    codes, state = F.quantize_blockwise(x)
    return float((F.dequantize_blockwise(codes, state) - x).abs().mean())


def test_8bit_conversion_rounds_to_nearest_no_worse_than_bitsandbytes():
    """Loading fp32 moments into 8-bit codes (checkpoints, from_optimizer) picks the nearest level (the exp_avg
    levels' nearest; sqrt(v) nearest in 1/sqrt(v), as in a step), so its mean absolute error on randn(1024, 1024)
    (0.00856; 0.0114 with the step's stochastic rounding) is at most bitsandbytes' blockwise dynamic quantizer's with
    its defaults on the same tensor (0.0100), and below 0.011 (bitsandbytes' own test bound) where bitsandbytes is
    absent. (With bitsandbytes' blocks of 256, as in its optimizers, its error is 0.00853: its map has one more
    level than our sign-magnitude one.)"""
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    codes, scales = formats.encode_state(x, torch.uint8, False)
    values = formats.decode_state(codes, scales, False, x.shape)
    ours = float((values - x).abs().mean())
    levels = torch.tensor(Q8.exp_avg_levels)
    levels = torch.cat([-levels.flip(0), levels])
    blocks = x.view(-1, 256)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    nearest = levels[(blocks / amax).unsqueeze(-1).sub(levels).abs().argmin(-1)] * amax
    # every code is the nearest level, up to the float32 rounding of |x| / scale at a midpoint (1e-6 of the scale)
    assert bool(((values.view(-1, 256) - blocks).abs() <= (nearest - blocks).abs() + 1e-6 * amax).all())
    theirs = _bitsandbytes_blockwise_error(x)
    assert ours <= (theirs if theirs is not None else 0.011), (ours, theirs)


def test_8bit_step_rounding_stays_stochastic():
    """Inside a step exp_avg still rounds stochastically: the same values give different codes at different steps."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 0.3
    a = formats.quantize_low_bit(x, Q8, False, step=1)[0]
    b = formats.quantize_low_bit(x, Q8, False, step=2)[0]
    c = formats.quantize_low_bit(x, Q8, False, step=0)[0]
    assert not torch.equal(a, b) and not torch.equal(a, c)


# ---- quality -------------------------------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "guides" / "examples"


def test_quality_within_one_percent(tmp_path):
    """The quality harness's three tasks in their quick sizes (one seed): fp8 moments' mean training loss within 1%
    of fp32 moments (either direction), and bf16 params with stochastic rounding + fp8 moments within 2% of the bf16
    run with fp32 master weights."""
    sys.path.insert(0, str(EXAMPLES))
    import lowbit_quality

    threads = torch.get_num_threads()
    try:
        status = lowbit_quality.main(["--quick", "--tasks", "zipf,digits,gpt", "--configs", "fp8,bf16 SR + fp8",
                                      "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    import json

    summary = json.loads((tmp_path / "lowbit_quality.json").read_text())["summary"]
    for row in summary:
        if row["config"] in ("fp8", "bf16 SR + fp8"):
            assert not row["diverged"]
            assert abs(row["rel_diff_vs_baseline"]) <= row["tolerance"], row


# ---- FSDP2 and torch.distributed.checkpoint ---------------------------------------------------------------------

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def _fsdp_fp8_scenarios(rank, world_size, tmp_dir):
    """FSDP2 (2 ranks, uneven shards) with fp8 moments (e4m3fn m, e5m2 v, amsgrad): the states are fp8 pieces of
    each rank's shard; a dcp.save / dcp.load checkpoint at the same world size resumes bit for bit; the saved moments
    are the decoded float32 values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ort_optim.integrations import dtensor

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 301), torch.nn.GELU(), torch.nn.Linear(301, 3))
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, FusedAdam(model.parameters(), lr=1e-2, amsgrad=True, adam_w_mode=AdamWMode.ADAMW_TORCH,
                                exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e5m2)

    def train(model, opt, steps, start):
        for step in range(start, start + steps):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
            opt.step()

    def full(t):
        return (t.full_tensor() if dtensor.is_dtensor(t) else t).detach().clone()

    path = str(Path(tmp_dir) / "fp8")
    model, opt = make()
    train(model, opt, 3, 0)
    first = next(iter(model.parameters()))
    local_state = opt.state[first]
    dtypes = (local_state["exp_avg"].dtype, local_state["exp_avg_sq"].dtype, local_state["max_exp_avg_sq"].dtype)
    model_sd, optim_sd = get_state_dict(model, opt)
    saved_dtypes = sorted({str(v.dtype) for s in optim_sd["state"].values() for k, v in s.items() if k != "step"})
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    train(model, opt, 3, 3)
    uninterrupted = [full(p) for p in model.parameters()]
    model, opt = make()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(model, opt, 3, 3)
    return {"dtypes": [str(d) for d in dtypes], "saved_dtypes": saved_dtypes, "uninterrupted": uninterrupted,
            "resumed": [full(p) for p in model.parameters()]}


@pytest.mark.skipif(TORCH_VERSION < (2, 6), reason=f"FSDP2 and torch.distributed.checkpoint on CPU with gloo need "
                    f"torch >= 2.6; this environment has torch {torch.__version__}")
def test_fsdp2_fp8_states_and_dcp_resume_bit_for_bit(tmp_path):
    from distributed_harness import run_ranks

    for rank, out in enumerate(run_ranks(_fsdp_fp8_scenarios, 2, tmp_path)):
        assert out["dtypes"] == ["torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e5m2"], (rank, out)
        assert "torch.float32" in out["saved_dtypes"] and not any("float8" in d for d in out["saved_dtypes"])
        for a, b in zip(out["resumed"], out["uninterrupted"]):
            assert torch.equal(bits(a), bits(b)), rank
