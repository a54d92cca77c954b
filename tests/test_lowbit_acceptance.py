"""Issue 13's acceptance criteria for 8-bit and 4-bit moments, black box: only FusedAdam's public API, torch's own
optimizers as the reference, and the numbers the issue states.

* ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` = ``torch.uint8`` / ``torch.uint4``, in every combination with each other
  and with float32, bfloat16 and float16 moments, for float32, bfloat16 and float16 params with and without master
  weights (and bfloat16 with stochastic rounding), in all three ``adam_w_mode``s, with and without amsgrad: every
  step stays finite and 20 steps track ``torch.optim.AdamW`` (``torch.optim.Adam`` with L2 decay for
  ``ADAM_L2_REGULARIZATION``) run in float32 on the same gradients, within the per-format tolerances of
  MOMENT_ERROR; so do maximize, param groups and a tensor lr. Steady gradients far below their block's largest move
  as far as the formats allow (STEADY_MOVEMENT: a characterisation of 4-bit's limits, which torch does not have).
* Memory, as the issue counts it: the bytes of every distinct storage in ``optimizer.state[p]`` except ``step``, per
  parameter: at most 2.05 (8-bit moments) and 1.05 (4-bit) for a 1e5-element and a 1001-element param, and for a
  small MLP's and odd shapes side by side in one optimizer (whose states share buffers). Tensors with
  a handful of elements cannot meet that with any block format (one scale per block: a 3-element param pays a whole
  4-byte scale per moment); there the bound is the format's own arithmetic, codes plus scales, nothing else.
  (torchao's AdamW8bit/4bit and bitsandbytes keep such tensors in float32 instead: 8 bytes per param.)
* The zero-point problem: a block with one huge gradient and the rest 1e-8 never makes any small element's update
  exceed a few lr, even with eps = 0.
* The lowest-memory configuration (bf16 params, no masters, ``stochastic_rounding=True``): 3-4 bytes per param of
  params and state, deterministic for its seed, the seed saved in the checkpoint, resume bit for bit.
* Checkpoints: ``torch.load(weights_only=True)`` round trips; resume bit for bit; loading twice equals loading once;
  the given dict is never changed; 8-bit <-> float32 <-> 4-bit conversions; ``FusedAdam.from_optimizer`` of a stepped
  ``torch.optim.AdamW`` continues like it.
  Power-of-two loss scaling gives the same bits; a deep copy continues with the same bits.
* Bad input is refused with a ValueError/TypeError naming the option, checkpoint entry or param, and changes nothing.

The tests that take the ``backend`` fixture run on the native CPU op and the pure-PyTorch reference; with
``ORT_OPTIM_BACKEND=triton TRITON_INTERPRET=1`` (``make test-triton``) on the Triton kernels, for which
``-k triton_subset`` selects the few cases small enough for the interpreter.
"""

from __future__ import annotations

import copy
import io
import itertools
import math

import pytest
import torch

from conftest import assert_same_snapshot, assert_tree_bitwise_equal, optimizer_snapshot
from ort_optim import AdamWMode, FusedAdam

MOMENTS = {"u8": torch.uint8, "u4": torch.uint4, "fp32": torch.float32, "bf16": torch.bfloat16,
           "fp16": torch.float16}
LOW_BIT = ("u8", "u4")
# every (exp_avg, exp_avg_sq) pair with at least one low-bit moment: 16 pairs
COMBOS = [(m, v) for m, v in itertools.product(MOMENTS, MOMENTS) if m in LOW_BIT or v in LOW_BIT]
# param dtype, master_weights, stochastic_rounding
PARAMS = {
    "fp32": (torch.float32, False, False),
    "bf16-master": (torch.bfloat16, True, False),
    "bf16": (torch.bfloat16, False, False),
    "bf16-sr": (torch.bfloat16, False, True),
    "fp16-master": (torch.float16, True, False),
    "fp16": (torch.float16, False, False),
}
LR, WD, EPS = 1e-2, 0.1, 1e-8


def _ids(combos):
    return ["-".join(c) for c in combos]


def _model_params(dtype=torch.float32, seed=0):
    """A weight of two 4-bit blocks and a partial third (odd element count: the last byte holds one code) and a
    bias of 5."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in ((9, 31), (5,))]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _fused(params, m, v, *, mode=AdamWMode.ADAMW_TORCH, amsgrad=False, master=False, sr=False, seed=0, lr=LR):
    return FusedAdam(params, lr=lr, adam_w_mode=mode, weight_decay=WD, eps=EPS, amsgrad=amsgrad,
                     master_weights=master, exp_avg_dtype=MOMENTS[m], exp_avg_sq_dtype=MOMENTS[v],
                     stochastic_rounding=sr, stochastic_rounding_seed=seed)


def _torch_twin(params, mode, amsgrad):
    """torch's optimizer with the same math in float32 (eps is negligible at 1e-8, so its placement is too)."""
    twin = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    if mode == AdamWMode.ADAM_L2_REGULARIZATION:
        return twin, torch.optim.Adam(twin, lr=LR, weight_decay=WD, eps=EPS, amsgrad=amsgrad)
    return twin, torch.optim.AdamW(twin, lr=LR, weight_decay=WD, eps=EPS, amsgrad=amsgrad)


def _step(params, opt, step):
    for p, g in zip(params, _grads(params, step)):
        p.grad = g
    opt.step()


def _train(params, opt, steps, first=0):
    for step in range(first, first + steps):
        _step(params, opt, step)


# ---- every combination trains like torch.optim.AdamW ------------------------------------------------------------

# How far 20 steps may end from torch's: ||p - p_torch|| / ||p_torch - p_0|| over all elements (L2), at most
# PARAM_ROUNDING[param case] + MOMENT_ERROR[exp_avg] + MOMENT_ERROR_SQ[exp_avg_sq]. Measured over three seeds with
# these i.i.d. gradients (noise: no signal for the moments to keep, the hardest case for a coarse exp_avg), with
# about 1.3x headroom: 8-bit exp_avg 0.02, 4-bit exp_avg 0.29-0.37 (7 magnitudes per sign, rounded stochastically:
# each step's update carries its rounding noise), 4-bit sqrt(v) 0.05-0.065, 8-bit sqrt(v) 0.004; bfloat16 params
# without masters 0.19-0.22 with any moments (round to nearest drops updates below half an ulp; stochastic rounding
# 0.17-0.19), with fp32 masters 0.03.
MOMENT_ERROR = {"u8": 0.04, "u4": 0.5, "fp32": 0.0, "bf16": 0.01, "fp16": 0.005}
MOMENT_ERROR_SQ = {"u8": 0.01, "u4": 0.1, "fp32": 0.0, "bf16": 0.01, "fp16": 0.005}
PARAM_ROUNDING = {"fp32": 0.0, "bf16-master": 0.04, "bf16": 0.3, "bf16-sr": 0.25, "fp16-master": 0.01, "fp16": 0.03}


def _assert_tracks_torch(param_case, m, v, mode=AdamWMode.ADAMW_TORCH, amsgrad=False, steps=20):
    dtype, master, sr = PARAMS[param_case]
    params = _model_params(dtype)
    start = torch.cat([p.detach().float().reshape(-1) for p in params])
    opt = _fused(params, m, v, mode=mode, amsgrad=amsgrad, master=master, sr=sr)
    twin, torch_opt = _torch_twin(params, mode, amsgrad)
    for step in range(steps):
        _step(params, opt, step)
        for q, p in zip(twin, params):
            q.grad = p.grad.float()  # the same gradient values
        torch_opt.step()
        assert all(bool(torch.isfinite(p).all()) for p in params), f"step {step}: a param is not finite"
    ours = torch.cat([p.detach().float().reshape(-1) for p in params])
    theirs = torch.cat([q.detach().reshape(-1) for q in twin])
    moved = float((theirs - start).norm())
    assert moved > 0.1 * steps * LR * math.sqrt(start.numel())  # (it trained)
    error = float((ours - theirs).norm()) / moved
    tolerance = PARAM_ROUNDING[param_case] + MOMENT_ERROR[m] + MOMENT_ERROR_SQ[v]
    assert error <= tolerance, f"{error:.4f} of torch's movement away from torch's params, allowed {tolerance}"


@pytest.mark.parametrize("param_case", PARAMS)
@pytest.mark.parametrize("combo", COMBOS, ids=_ids(COMBOS))
def test_every_moment_combination_and_param_dtype_tracks_torch_adamw(combo, param_case, backend):
    _assert_tracks_torch(param_case, *combo)


MODE_COMBOS = [("u8", "u8"), ("u4", "u4"), ("u8", "u4")]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("mode", list(AdamWMode), ids=[m.name for m in AdamWMode])
@pytest.mark.parametrize("combo", MODE_COMBOS, ids=_ids(MODE_COMBOS))
def test_every_mode_with_and_without_amsgrad_tracks_torch(combo, mode, amsgrad, backend):
    _assert_tracks_torch("fp32", *combo, mode=mode, amsgrad=amsgrad)


@pytest.mark.parametrize("case", [("u8", "u8", "bf16-master"), ("u4", "u4", "bf16-sr")], ids=["u8", "u4"])
def test_triton_subset_tracks_torch(case, backend):
    """Small cases of the two tests above, which ``-k triton_subset`` runs on the Triton kernels."""
    m, v, param_case = case
    _assert_tracks_torch(param_case, m, v, amsgrad=True, steps=5)


@pytest.mark.parametrize("combo", [("u8", "u8"), ("u4", "u4")], ids=["u8", "u4"])
def test_maximize_param_groups_and_a_tensor_lr_track_torch(combo, backend):
    """The per-group options torch.optim.AdamW has, with low-bit moments: two groups with their own lr (one a
    tensor) and weight decay, maximize."""
    params = _model_params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    start = torch.cat([p.detach().reshape(-1).clone() for p in params])

    def groups(ps, lr0):
        return [{"params": [ps[0]], "lr": lr0, "weight_decay": 0.3}, {"params": [ps[1]], "lr": 2 * LR}]

    opt = FusedAdam(groups(params, torch.tensor(LR)), adam_w_mode=AdamWMode.ADAMW_TORCH, eps=EPS, weight_decay=WD,
                    maximize=True, exp_avg_dtype=MOMENTS[combo[0]], exp_avg_sq_dtype=MOMENTS[combo[1]])
    torch_opt = torch.optim.AdamW(groups(twin, LR), eps=EPS, weight_decay=WD, maximize=True)
    _train(params, opt, 20)
    _train(twin, torch_opt, 20)
    ours = torch.cat([p.detach().reshape(-1) for p in params])
    theirs = torch.cat([q.detach().reshape(-1) for q in twin])
    assert float((ours - start) @ (theirs - start)) > 0  # (ascending, as torch's)
    error = float((ours - theirs).norm() / (theirs - start).norm())
    assert error <= MOMENT_ERROR[combo[0]] + MOMENT_ERROR_SQ[combo[1]], error


@pytest.mark.parametrize("combo", [("u8", "u4"), ("u4", "u8")], ids=_ids([("u8", "u4"), ("u4", "u8")]))
def test_loss_scaling_by_a_power_of_two_gives_the_same_bits(combo, backend):
    """step(grad_scale=1024) on gradients times 1024 (exact in float32) is the unscaled step, bit for bit; a
    non-finite scaled gradient skips the step and changes nothing."""
    runs = []
    for scale in (None, 1024.0):
        params = _model_params()
        opt = _fused(params, *combo)
        for step in range(4):
            for p, g in zip(params, _grads(params, step)):
                p.grad = g if scale is None else g * scale
            opt.step(grad_scale=scale)
        runs.append(_snapshot(opt))
    assert_same_snapshot(runs[0], runs[1])
    params = _model_params()
    opt = _fused(params, *combo)
    _train(params, opt, 2)
    for p, g in zip(params, _grads(params, 2)):
        p.grad = g * 1024
    params[1].grad[2] = math.inf
    before = optimizer_snapshot(opt)
    opt.step(grad_scale=1024.0)
    assert opt.last_step_skipped
    assert_same_snapshot(before, optimizer_snapshot(opt))


@pytest.mark.parametrize("combo", [("u8", "u8"), ("u4", "u4")], ids=["u8", "u4"])
def test_a_deep_copied_optimizer_continues_with_the_same_bits(combo):
    params, opt = _trained(*combo)
    copied = copy.deepcopy(opt)
    copied_params = copied.param_groups[0]["params"]
    _train(params, opt, 3, first=4)
    _train(copied_params, copied, 3, first=4)
    assert (copied.exp_avg_dtype, copied.exp_avg_sq_dtype) == (MOMENTS[combo[0]], MOMENTS[combo[1]])
    assert_same_snapshot(_snapshot(copied), _snapshot(opt))


# ---- memory -------------------------------------------------------------------------------------------------------


def state_bytes(opt) -> int:
    """Bytes of every distinct storage held in optimizer.state except the step counts (a storage shared by several
    state tensors counted once, whole: what the allocator holds, padding included)."""
    storages = {}
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


BYTES_PER_PARAM = {("u8", "u8"): 2.05, ("u4", "u4"): 1.05, ("u8", "u4"): 1.55, ("u4", "u8"): 1.55}
# codes plus scales of one moment with n elements: the formats' own arithmetic (8-bit: a byte per element and a
# float32 per 256; 4-bit: two codes per byte and a bfloat16 per 128)
FORMAT_BYTES = {"u8": lambda n: n + 4 * -(-n // 256), "u4": lambda n: (n + 1) // 2 + 2 * -(-n // 128)}


@pytest.mark.parametrize("numel", [100_000, 1001, 3, 1])
@pytest.mark.parametrize("combo", list(BYTES_PER_PARAM), ids=_ids(BYTES_PER_PARAM))
def test_state_bytes_per_parameter(combo, numel):
    p = torch.nn.Parameter(torch.randn(numel))
    opt = _fused([p], *combo)
    p.grad = torch.randn(numel)
    opt.step()
    measured = state_bytes(opt)
    assert measured == sum(FORMAT_BYTES[k](numel) for k in combo)  # nothing but codes and scales
    if numel >= 1000:  # (a few elements pay a whole block scale: 4.67 bytes/param for 3 elements in 8 bits)
        assert measured / numel <= BYTES_PER_PARAM[combo]


def test_state_bytes_per_parameter_of_a_model_with_odd_shapes():
    """Params of awkward sizes side by side in one optimizer: the MLP of examples/digits.py (64 -> 32 -> 10) and odd
    sizes. Each param's codes have a storage of their own (views of one buffer 64 bytes apart used to cost the MLP
    4%: 2.12 bytes/param), so the bytes are exactly the formats' codes and scales, counted per param or per distinct
    storage alike."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g))
              for shape in ((32, 64), (32,), (10, 32), (10,), (37, 129), (4097,), (1001, 3), (77,))]
    for combo in (("u8", "u8"), ("u4", "u4")):
        opt = _fused(params, *combo)
        _train(params, opt, 1)
        numel = sum(p.numel() for p in params)
        assert state_bytes(opt) / numel <= BYTES_PER_PARAM[combo]
        assert state_bytes(opt) == sum(FORMAT_BYTES[k](p.numel()) for p in params for k in combo)
        per_param = sum(t.untyped_storage().nbytes() for p in params for key, t in opt.state[p].items()
                        if key != "step")
        assert per_param == state_bytes(opt)
        # (and every view of codes starts 16-byte aligned, as the Triton kernels' vector accesses want)
        assert all(opt.state[p][key].data_ptr() % 16 == 0 for p in params for key in ("exp_avg", "exp_avg_sq"))


# ---- the zero-point problem: no exploding updates ----------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-8, 0.0], ids=["eps1e-8", "eps0"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("combo", [("u8", "u8"), ("u4", "u4"), ("fp32", "u4"), ("fp32", "u8")],
                         ids=_ids([("u8", "u8"), ("u4", "u4"), ("fp32", "u4"), ("fp32", "u8")]))
def test_a_second_moment_that_rounds_to_zero_never_makes_the_update_explode(combo, amsgrad, eps, backend):
    """One block of 128 elements (one 8-bit block, one 4-bit block): element 0 gets gradients of 1e4, the others
    1e-8 (their v is 1e-24 of the block's largest, below any code's resolution). torch's AdamW moves every element by
    about lr per step; every step of ours moves each element by at most 3 lr (Adam's own bound for a sudden gradient
    is (1 - beta1) / sqrt(1 - beta2) = 3.2 lr), for 20 steps, then again when the huge gradient stops."""
    lr = 1e-3
    p, q = torch.nn.Parameter(torch.zeros(128)), torch.nn.Parameter(torch.zeros(128))
    opt = FusedAdam([p], lr=lr, eps=eps, adam_w_mode=AdamWMode.ADAMW_TORCH, amsgrad=amsgrad, weight_decay=0.0,
                    exp_avg_dtype=MOMENTS[combo[0]], exp_avg_sq_dtype=MOMENTS[combo[1]])
    torch_opt = torch.optim.AdamW([q], lr=lr, eps=eps, amsgrad=amsgrad, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for step in range(30):
        grad = torch.randn(128, generator=g) * 1e-8
        if step < 20:
            grad[0] = 1e4
        before = p.detach().clone()
        p.grad, q.grad = grad, grad.clone()
        opt.step()
        torch_opt.step()
        change = (p.detach() - before).abs()
        assert bool(torch.isfinite(p).all()), f"step {step}"
        assert float(change.max()) <= 3 * lr, f"step {step}: element {int(change.argmax())} moved {float(change.max())}"
    assert float(p[0].detach()) == pytest.approx(float(q[0].detach()), rel=0.05)  # the huge one moved as torch's did


# Steady gradients, 8 blocks of 128 elements: element 0 of each block at 1, the others spread over 1e-4 .. 1 of
# it; 100 steps. fp32 AdamW moves every element by lr per step whatever its magnitude (Adam is scale-free per
# element). Block-quantised moments cannot: each element is stored relative to its block's largest. The ranges
# below are what the formats give (the movement over fp32 AdamW's, per band of gradient / block's largest),
# measured with 1.2x headroom; they are the formats' documented limits, not targets:
# * 4-bit exp_avg (smallest non-zero level 0.01, rounded toward zero below it): elements under 1% of their block's
#   largest barely move (torch: fully); above, exp_avg sits on one of two coarse levels for tens of steps at a time
#   (the stochastic rounding is unbiased per step, but 0.9 m + 0.1 g mostly rounds back to the level it came from), so
#   100 steps move 0.5-2.4x of fp32's.
# * 4-bit sqrt(v) (smallest level 0.001): elements under 1e-3 of their block's largest read a larger sqrt(v) than
#   theirs and move less (down to 0.11x), never more.
# * 8-bit: within 0.7-1.6x everywhere, 0.9-1.1x above 1e-2.
STEADY_BANDS = ((1e-4, 1e-3), (1e-3, 1e-2), (1e-2, 1e-1), (1e-1, 1.01))
STEADY_MOVEMENT = {  # per band: (least, most) movement over fp32 AdamW's
    ("u8", "u8"): ((0.55, 1.9), (0.65, 1.45), (0.75, 1.3), (0.75, 1.25)),
    ("u8", "u4"): ((0.09, 1.2), (0.25, 2.2), (0.4, 1.8), (0.55, 1.55)),
    ("u4", "u4"): ((0.0, 0.25), (0.0, 0.25), (0.1, 2.9), (0.4, 2.4)),
}


@pytest.mark.parametrize("combo", list(STEADY_MOVEMENT), ids=_ids(STEADY_MOVEMENT))
def test_steady_gradients_far_below_their_blocks_largest_move_as_the_formats_allow(combo, backend):
    n, lr, steps = 8 * 128, 1e-3, 100
    magnitude = torch.logspace(-4, 0, n)
    magnitude[::128] = 1.0
    p = torch.nn.Parameter(torch.zeros(n))
    opt = FusedAdam([p], lr=lr, eps=1e-8, adam_w_mode=AdamWMode.ADAMW_TORCH, exp_avg_dtype=MOMENTS[combo[0]],
                    exp_avg_sq_dtype=MOMENTS[combo[1]])
    for _ in range(steps):
        p.grad = magnitude.clone()
        opt.step()
    relative = -p.detach() / (steps * lr)  # fp32 AdamW: 1.0 for every element (to 1e-5)
    for (lo, hi), (least, most) in zip(STEADY_BANDS, STEADY_MOVEMENT[combo]):
        band = relative[(magnitude >= lo) & (magnitude < hi)]
        assert least <= float(band.min()) and float(band.max()) <= most, (lo, float(band.min()), float(band.max()))


# ---- the lowest-memory configuration ------------------------------------------------------------------------------


def _lowest(params, combo, seed):
    return _fused(params, *combo, sr=True, seed=seed)


def _saved_and_loaded(sd):
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _snapshot(opt) -> dict:
    """Params and every state tensor, bit for bit (gradients dropped: a resumed optimizer's params have none)."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None
    return optimizer_snapshot(opt)


@pytest.mark.parametrize("combo", [("u8", "u8"), ("u4", "u4")], ids=["u8", "u4"])
def test_lowest_memory_configuration_fits_3_to_4_bytes_per_param(combo):
    p = torch.nn.Parameter(torch.randn(100_000).to(torch.bfloat16))
    opt = _lowest([p], combo, seed=0)
    p.grad = torch.randn(100_000).to(torch.bfloat16)
    opt.step()
    total = (state_bytes(opt) + p.untyped_storage().nbytes()) / p.numel()
    assert 3.0 <= total <= {"u8": 4.05, "u4": 3.05}[combo[0]]
    assert "master_param" not in opt.state[p]


@pytest.mark.parametrize("combo", [("u8", "u8"), ("u4", "u4")], ids=["u8", "u4"])
def test_lowest_memory_configuration_is_deterministic_and_resumes_exactly_with_its_seed(combo, backend):
    """Same seed, same bits; another seed, other bits. The seed is saved in the checkpoint (weights_only-loadable)
    and wins over the resumed optimizer's own: 3 steps, save, 3 more equals 6 straight, bit for bit."""
    runs = []
    for seed in (7, 7, 8):
        params = _model_params(torch.bfloat16)
        opt = _lowest(params, combo, seed)
        _train(params, opt, 6)
        runs.append(_snapshot(opt))
    assert_same_snapshot(runs[0], runs[1])
    assert any(not torch.equal(runs[0][k], runs[2][k]) for k in ("p0.0", "p0.1"))

    params = _model_params(torch.bfloat16)
    opt = _lowest(params, combo, seed=7)
    _train(params, opt, 3)
    sd = _saved_and_loaded(opt.state_dict())
    assert [group["stochastic_rounding_seed"] for group in sd["param_groups"]] == [7]
    assert [group["stochastic_rounding"] for group in sd["param_groups"]] == [True]
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = _lowest(resumed_params, combo, seed=12345)  # (the checkpoint's seed replaces it)
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["stochastic_rounding_seed"] == 7
    _train(resumed_params, resumed, 3, first=3)
    assert_same_snapshot(_snapshot(resumed), runs[0])


# ---- checkpoints --------------------------------------------------------------------------------------------------

# (exp_avg, exp_avg_sq, param case, amsgrad)
CHECKPOINT_CASES = {
    "u8-fp32-params": ("u8", "u8", "fp32", False),
    "u4-amsgrad": ("u4", "u4", "fp32", True),
    "u8-u4-bf16-master": ("u8", "u4", "bf16-master", False),
    "u4-bf16-bf16-sr": ("u4", "bf16", "bf16-sr", True),
    "fp16-u8-fp16": ("fp16", "u8", "fp16", False),
}


def _checkpoint_optimizer(case, params=None):
    m, v, param_case, amsgrad = CHECKPOINT_CASES[case]
    dtype, master, sr = PARAMS[param_case]
    params = _model_params(dtype) if params is None else params
    return params, _fused(params, m, v, amsgrad=amsgrad, master=master, sr=sr, seed=3)


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_resume_is_bit_for_bit_and_loading_is_pure(case, backend):
    """Train 3, save through torch.save / torch.load(weights_only=True), continue 3: equal to 6 straight. Loading
    twice equals loading once, and the loaded dict is deep-equal to what it was before (nothing written into it)."""
    straight_params, straight = _checkpoint_optimizer(case)
    _train(straight_params, straight, 6)

    params, opt = _checkpoint_optimizer(case)
    _train(params, opt, 3)
    sd = opt.state_dict()
    loaded = _saved_and_loaded(sd)
    assert_tree_bitwise_equal(loaded, sd, "the round trip")
    pristine = copy.deepcopy(loaded)

    resumed_params, resumed = _checkpoint_optimizer(case, [torch.nn.Parameter(p.detach().clone()) for p in params])
    resumed.load_state_dict(loaded)
    assert_tree_bitwise_equal(loaded, pristine, "the loaded dict")
    assert_same_snapshot(_snapshot(resumed), _snapshot(opt))  # the state restored bit for bit

    twice_params, twice = _checkpoint_optimizer(case, [torch.nn.Parameter(p.detach().clone()) for p in params])
    twice.load_state_dict(loaded)
    twice.load_state_dict(loaded)
    assert_same_snapshot(_snapshot(twice), _snapshot(resumed))
    assert_tree_bitwise_equal(loaded, pristine, "the dict loaded twice")

    _train(resumed_params, resumed, 3, first=3)
    _train(twice_params, twice, 3, first=3)
    assert_same_snapshot(_snapshot(resumed), _snapshot(straight))
    assert_same_snapshot(_snapshot(twice), _snapshot(straight))
    # and the optimizer's own state was never shared with the checkpoint it gave
    _train(params, opt, 1, first=3)
    assert_tree_bitwise_equal(sd, pristine, "the saved dict after the saver stepped on")


def test_a_checkpoint_loads_with_weights_only_after_adam_w_mode_was_set_to_an_enum_member():
    """Assigning ``param_groups[i]['adam_w_mode'] = AdamWMode.ADAMW_TORCH`` (as the constructor accepts) must not
    put the enum class into the checkpoint: torch.load(weights_only=True) refuses classes it does not know."""
    params, opt = _trained("u8", "u4", amsgrad=False)
    opt.param_groups[0]["adam_w_mode"] = AdamWMode.ADAMW_TRANSFORMERS
    _train(params, opt, 1, first=4)
    loaded = _saved_and_loaded(opt.state_dict())
    assert type(loaded["param_groups"][0]["adam_w_mode"]) is int
    assert loaded["param_groups"][0]["adam_w_mode"] == AdamWMode.ADAMW_TRANSFORMERS
    assert opt.param_groups[0]["adam_w_mode"] is AdamWMode.ADAMW_TRANSFORMERS  # (the optimizer's own group as set)


def test_loading_an_optimizers_own_checkpoint_mid_run_changes_nothing(backend):
    runs = []
    for reload in (False, True):
        params, opt = _trained("u4", "u8")
        if reload:
            opt.load_state_dict(opt.state_dict())
        _train(params, opt, 3, first=4)
        runs.append(_snapshot(opt))
    assert_same_snapshot(runs[0], runs[1])


def _moments(sd):
    return {(i, key): t for i, state in sd["state"].items() for key, t in state.items() if key != "step"}


def _blockwise_error(values: torch.Tensor, exact: torch.Tensor, block: int, second_moment: bool) -> float:
    """Largest |values - exact| per block of the flat tensors, over that block's largest |exact| (sqrt(v) for second
    moments, the quantity the formats store)."""
    if second_moment:
        values, exact = values.sqrt(), exact.sqrt()
    flat_v, flat_e = values.reshape(-1).double(), exact.reshape(-1).double()
    worst = 0.0
    for start in range(0, flat_e.numel(), block):
        e, v = flat_e[start:start + block], flat_v[start:start + block]
        largest = float(e.abs().max())
        if largest > 0:
            worst = max(worst, float((v - e).abs().max()) / largest)
    return worst


# largest error of one stored value, over its block's largest (the gap between the top levels, rounding to nearest for
# sqrt(v); exp_avg rounds stochastically to either neighbour: the whole gap): 8-bit 0.9/64 per decade, 4-bit 0.9/4
QUANTISATION_ERROR = {"u8": (0.015, 0.008), "u4": (0.23, 0.11)}  # (exp_avg, sqrt(exp_avg_sq))
BLOCK = {"u8": 256, "u4": 128}


def _trained(m, v, amsgrad=True, steps=4):
    params = _model_params()
    opt = _fused(params, m, v, amsgrad=amsgrad)
    _train(params, opt, steps)
    return params, opt


@pytest.mark.parametrize("target", ["u8", "u4"])
@pytest.mark.parametrize("source", ["fp32", "u8", "u4"])
def test_checkpoints_convert_between_moment_formats(source, target, backend):
    """A checkpoint holds float32 values whatever the storage: loaded into fp32 moments it is the dequantised state
    exactly; loaded into low-bit moments it is quantised (each value within its format's rounding error of the
    checkpoint's), and the result continues to train."""
    params, opt = _trained(source, source)
    sd = opt.state_dict()
    for key, t in _moments(sd).items():
        assert t.dtype == torch.float32 and t.shape == params[key[0]].shape, key

    fp32_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fp32 = _fused(fp32_params, "fp32", "fp32", amsgrad=True)
    fp32.load_state_dict(sd)
    for (i, key), t in _moments(sd).items():
        assert torch.equal(fp32.state[fp32_params[i]][key], t), (i, key)  # dequantised: the very values

    low_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    low = _fused(low_params, target, target, amsgrad=True)
    low.load_state_dict(sd)
    assert low.state[low_params[0]]["exp_avg"].dtype == torch.uint8  # codes
    requantised = low.state_dict()
    for (i, key), t in _moments(sd).items():
        got = _moments(requantised)[(i, key)]
        second = key != "exp_avg"
        error = _blockwise_error(got, t, BLOCK[target], second)
        assert error <= QUANTISATION_ERROR[target][second], (i, key, error)
        if source == target:  # a format's own checkpoint loads back to the same values
            assert torch.equal(got, t), (i, key)
    _train(low_params, low, 2, first=4)
    assert all(bool(torch.isfinite(p).all()) for p in low_params)


def test_a_low_bit_checkpoint_loads_into_torch_adamw():
    params, opt = _trained("u8", "u4", amsgrad=False)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(twin, lr=LR, weight_decay=WD, eps=EPS)
    torch_opt.load_state_dict(opt.state_dict())
    sd = opt.state_dict()
    for i, q in enumerate(twin):
        assert torch.equal(torch_opt.state[q]["exp_avg"], sd["state"][i]["exp_avg"])
    _train(params, opt, 5, first=4)
    _train(twin, torch_opt, 5, first=4)
    for p, q in zip(params, twin):
        torch.testing.assert_close(p, q, rtol=0, atol=0.15 * 5 * LR)


@pytest.mark.parametrize("combo", [("u8", "u8"), ("u4", "u4")], ids=["u8", "u4"])
@pytest.mark.parametrize("source", ["AdamW", "AdamW-amsgrad", "Adam"])
def test_from_optimizer_continues_like_the_torch_optimizer(source, combo, backend):
    """A torch optimizer trained 5 steps, converted with FusedAdam.from_optimizer into low-bit moments: the same
    hyperparameters, and 10 more steps stay as close to the torch optimizer's own continuation as the formats track
    torch at all (TRACKING's bounds)."""
    params = _model_params()
    amsgrad = source == "AdamW-amsgrad"
    kwargs = dict(lr=LR, eps=EPS, amsgrad=amsgrad, betas=(0.8, 0.99))
    make = (lambda ps: torch.optim.Adam(ps, **kwargs)) if source == "Adam" else \
        (lambda ps: torch.optim.AdamW(ps, weight_decay=WD, **kwargs))
    torch_opt = make(params)
    _train(params, torch_opt, 5)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = make(twin)
    twin_opt.load_state_dict(torch_opt.state_dict())

    fused = FusedAdam.from_optimizer(torch_opt, exp_avg_dtype=MOMENTS[combo[0]], exp_avg_sq_dtype=MOMENTS[combo[1]])
    group = fused.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["amsgrad"]) == (LR, (0.8, 0.99), EPS, amsgrad)
    assert group["weight_decay"] == (0.0 if source == "Adam" else WD)
    assert all(fused.state[p]["exp_avg"].dtype == torch.uint8 for p in params)
    assert all(float(fused.state[p]["step"]) == 5 for p in params)

    start = torch.cat([p.detach().reshape(-1).clone() for p in params])
    _train(params, fused, 10, first=5)
    _train(twin, twin_opt, 10, first=5)
    ours = torch.cat([p.detach().reshape(-1) for p in params])
    theirs = torch.cat([q.detach().reshape(-1) for q in twin])
    error = float((ours - theirs).norm() / (theirs - start).norm())
    assert error <= MOMENT_ERROR[combo[0]] + MOMENT_ERROR_SQ[combo[1]], error


# ---- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["exp_avg_dtype", "exp_avg_sq_dtype"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.uint16, torch.float8_e4m3fn, torch.bool, "uint8"],
                         ids=["int8", "float64", "uint16", "float8", "bool", "str"])
def test_unsupported_moment_dtypes_are_refused_naming_the_option(option, dtype):
    params = _model_params()
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"{option} must be None, torch.float32, .*torch.uint8.*torch.uint4"):
        FusedAdam(params, **{option: dtype})
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def _damaged(key_path, value):
    """A change to a checkpoint of _trained("u8", "u4"): state_dict['state'][0][key] = value(the saved entry, the
    param); value None deletes it."""
    def damage(sd, params):
        state = sd["state"][0]
        if value is None:
            del state[key_path]
        else:
            state[key_path] = value(state.get(key_path), params[0])
    return damage


# what a checkpoint of an optimizer with 8-bit exp_avg and 4-bit exp_avg_sq might be given instead of its own
CORRUPT_CHECKPOINTS = {
    # the optimizer's storage instead of the canonical values: 8-bit codes, 4-bit packed codes, their scales
    "8-bit codes as exp_avg": (_damaged("exp_avg", lambda t, p: torch.zeros(p.shape, dtype=torch.uint8)),
                               TypeError, r"\['exp_avg'\] must be a floating-point tensor"),
    "4-bit codes of the wrong shape": (_damaged("exp_avg_sq", lambda t, p: torch.zeros((p.numel() + 1) // 2)),
                                       ValueError, r"\['exp_avg_sq'\] has shape \(140,\), the parameter \(9, 31\)"),
    "a block-scale entry": (_damaged("exp_avg_scale", lambda t, p: torch.ones(2)),
                            ValueError, r"\['exp_avg_scale'\]: unknown key"),
    "scales of the wrong dtype": (_damaged("exp_avg_sq_scale", lambda t, p: torch.ones(3, dtype=torch.float64)),
                                  ValueError, r"\['exp_avg_sq_scale'\]: unknown key"),
    "a missing second moment": (_damaged("exp_avg_sq", None), ValueError, r" has no 'exp_avg_sq'"),
    "a negative second moment": (_damaged("exp_avg_sq", lambda t, p: -t - 1.0), ValueError,
                                 r"\['exp_avg_sq'\] holds negative values"),
    "a NaN moment": (_damaged("exp_avg", lambda t, p: t.index_fill(0, torch.tensor([3]), math.nan)), ValueError,
                     r"\['exp_avg'\] holds inf or NaN"),
    "a value beyond float32": (_damaged("exp_avg", lambda t, p: t.double().index_fill(0, torch.tensor([1]), 1e300)),
                               ValueError, r"\['exp_avg'\] holds inf or NaN once converted"),
    "a missing step": (_damaged("step", None), ValueError, r" has no 'step'"),
    "a fractional step": (_damaged("step", lambda t, p: torch.tensor(2.5, dtype=torch.float64)), ValueError,
                          r"\['step'\] must be a whole number"),
}


@pytest.mark.parametrize("damage", CORRUPT_CHECKPOINTS)
def test_a_corrupt_checkpoint_is_refused_naming_the_entry_and_changes_nothing(damage):
    params, opt = _trained("u8", "u4", amsgrad=False)
    change, error, message = CORRUPT_CHECKPOINTS[damage]
    sd = opt.state_dict()
    change(sd, params)
    given = copy.deepcopy(sd)
    target_params, target = _trained("u8", "u4", amsgrad=False, steps=2)
    before = optimizer_snapshot(target)
    with pytest.raises(error, match=r"state_dict\['state'\]\[0\]" + message):
        target.load_state_dict(sd)
    assert_same_snapshot(before, optimizer_snapshot(target))
    assert_tree_bitwise_equal(sd, given, "the given dict")
    _train(target_params, target, 1, first=2)  # and it still trains


def _set_state(key, make):
    def damage(opt, p):
        opt.state[p][key] = make(p)
    return damage


# what may be put into optimizer.state[p] of the (9, 31) param of an optimizer with 8-bit exp_avg, 4-bit exp_avg_sq
CORRUPT_STATES = {
    "8-bit codes of the wrong shape": (_set_state("exp_avg", lambda p: torch.zeros(p.numel() - 1, dtype=torch.uint8)),
                                       r"\['exp_avg'\] has shape"),
    "4-bit codes unpacked": (_set_state("exp_avg_sq", lambda p: torch.zeros(p.numel(), dtype=torch.uint8)),
                             r"\['exp_avg_sq'\] has shape \(279,\) but 4-bit codes"),
    "missing scales": (lambda opt, p: opt.state[p].pop("exp_avg_scale"), r"\['exp_avg_scale'\] must hold"),
    "scales of the wrong dtype": (_set_state("exp_avg_scale", lambda p: torch.ones(2, dtype=torch.float64)),
                                  r"\['exp_avg_scale'\] must hold"),
    "too few scales": (_set_state("exp_avg_sq_scale", lambda p: torch.ones(1, dtype=torch.bfloat16)),
                       r"\['exp_avg_sq_scale'\] must be a"),
    "negative scales": (_set_state("exp_avg_scale", lambda p: -torch.ones(2)),
                                 r"\['exp_avg_scale'\] holds negative"),
}


@pytest.mark.parametrize("damage", CORRUPT_STATES)
def test_corrupt_low_bit_state_is_refused_at_the_step_naming_the_param_and_changes_nothing(damage, backend):
    params, opt = _trained("u8", "u4", amsgrad=False)
    for p, g in zip(params, _grads(params, 4)):
        p.grad = g
    change, message = CORRUPT_STATES[damage]
    change(opt, params[0])
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*" + message):
        opt.step()
    assert_same_snapshot(before, optimizer_snapshot(opt))
