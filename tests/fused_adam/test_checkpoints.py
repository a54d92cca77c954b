"""FusedAdam checkpoints, as a specification.

* The saved form is canonical: fresh tensors, moments and masters unscaled float32 (float64 for float64 params), a
  float64 step per parameter, loadable with torch.load(weights_only=True), into FusedAdam with any state dtypes and
  into torch.optim.AdamW; torch.optim.Adam/AdamW and ORT FusedAdam checkpoints load into FusedAdam.
* Loading never writes to the caller's dict, validates everything before changing anything, and is idempotent.
* Resuming equals never stopping, bit for bit, for every state dtype configuration and param layout.
* Any checkpoint, fuzzed (hypothesis): valid checkpoints mutated (values of the wrong type, shape, dtype or device;
  NaN, inf and huge numbers; keys deleted and added; containers converted or swapped; other optimizers' checkpoints:
  torch SGD, Adam and AdamW, ORT's FusedAdam with its per-group step). Every load either restores exactly (the loaded
  optimizer holds what the checkpoint says, within the storage dtype's rounding; its own checkpoint restores it bit for
  bit; a checkpoint that means the same as the original continues bit for bit like the original), or raises
  ValueError or TypeError whose message starts with the entry it is about (``state_dict['state'][1]['step']``) and
  names the mutated entry, one of its ancestors or descendants; in both cases the given dict is never written, and
  after a refusal the optimizer and the model are bit-identical. The number of examples per property is bounded for
  ``make check``; ORT_OPTIM_FUZZ_EXAMPLES sets it for long fuzzing (tests/conftest.py).
* Any checkpoint of any drawn configuration (param sizes, layouts and dtypes, moment formats, master weights,
  options, after steps with gradients holding inf and NaN) loads into any other configuration of the same params, or
  is refused naming the entry with nothing changed; what loaded saves a checkpoint that restores it exactly, and
  continues bit for bit like a twin loaded from that checkpoint (a property).
"""

from __future__ import annotations

import copy
import io
import math
import re
import sys
import warnings

import pytest
import torch
from cases import Configuration, configurations, gradient, gradients
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from conftest import (
    BACKENDS,
    ROOT,
    run_python,
    assert_bitwise_equal,
    assert_bitwise_equal_but_nan_bits,
    assert_same_snapshot,
    assert_same_snapshot_but_nan_bits,
    assert_tree_bitwise_equal,
    LargestAllocation,
    LargestTemporary,
    optimizer_snapshot,
    select_backend,
    fuzz_examples,
)
from reference import ReferenceAdam

from ort_optim import AdamWMode, FusedAdam, formats
from ort_optim._checkpoint import entry, to_canonical
from ort_optim._spec import QUANT_BLOCK

def _roundtrip(obj):
    """torch.save to memory, then torch.load(weights_only=True): only tensors and plain containers may be in it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _set_grads(params, step, seed=21):
    g = torch.Generator().manual_seed(seed * 1009 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _steps(opt, params, first, count, **step_kwargs):
    for step in range(first, first + count):
        _set_grads(params, step)
        opt.step(**step_kwargs)


def _fp32_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(QUANT_BLOCK + 9,
            generator=g)), torch.nn.Parameter(torch.randn((), generator=g))]


def _clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _assert_same_optimizers(a_params, a, b_params, b):
    for p, q in zip(a_params, b_params):
        assert_bitwise_equal(p.detach(), q.detach(), "param")
        assert a.state[p].keys() == b.state[q].keys()
        for key in a.state[p]:
            assert_bitwise_equal(a.state[p][key], b.state[q][key], key)
    for ga, gb in zip(a.param_groups, b.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"}.keys() == {k for k in gb if k != "params"}


# ---- the saved form ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_is_canonical_fresh_unscaled_fp32_and_mutating_it_changes_nothing(backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params = [torch.nn.Parameter(torch.randn(QUANT_BLOCK + 3).half()), torch.nn.Parameter(torch.randn(4).bfloat16())]
    opt = FusedAdam(params, lr=torch.tensor(1e-2), amsgrad=True, master_weights=True,
                    exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16)
    fp64 = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    opt64 = FusedAdam([fp64], amsgrad=True)
    _steps(opt, params, 0, 3)
    _steps(opt64, [fp64], 0, 3)
    for o, ps in ((opt, params), (opt64, [fp64])):
        before = optimizer_snapshot(o)
        sd = o.state_dict()
        for index, p in enumerate(ps):
            saved = sd["state"][index]
            wide = torch.float64 if p.dtype == torch.float64 else torch.float32
            masters = {"master_param"} if p.dtype != torch.float64 else set()
            assert set(saved) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"} | masters, "no *_scale keys"
            assert saved["step"].dtype == torch.float64 and saved["step"].shape == () and float(saved["step"]) == 3
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") + tuple(masters):
                assert saved[key].dtype == wide and saved[key].shape == p.shape
                assert saved[key].data_ptr() != o.state[p][key].data_ptr()
            if p.dtype == torch.float16:  # unscaled: the fp16 codes divided by their block scales
                expected = formats.dequantize_fp16(o.state[p]["exp_avg"], o.state[p]["exp_avg_scale"])
                assert_bitwise_equal(saved["exp_avg"], expected, "exp_avg")
        # fresh tensors: writing into the dict (as a careless caller might) does not reach the optimizer
        for saved in sd["state"].values():
            for value in saved.values():
                value.fill_(123.0)
        if isinstance(sd["param_groups"][0]["lr"], torch.Tensor):
            sd["param_groups"][0]["lr"].fill_(5.0)
        assert_same_snapshot(before, optimizer_snapshot(o))


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_load_with_torch_load_weights_only(backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params = _fp32_params()
    opt = FusedAdam(params, lr=torch.tensor(1e-3), amsgrad=True, exp_avg_dtype=torch.float16,
                    adam_w_mode=AdamWMode.ADAMW_TORCH)
    torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    _steps(opt, params, 0, 2)
    sd = _roundtrip(opt.state_dict())
    assert sd["param_groups"][0]["adam_w_mode"] == 2 and type(sd["param_groups"][0]["adam_w_mode"]) is int
    twin = FusedAdam(_clone_params(params), lr=torch.tensor(1e-3), amsgrad=True, exp_avg_dtype=torch.float16)
    twin.load_state_dict(sd)


@pytest.mark.no_interpreter  # (meta params step through the native op's fake kernel, not Triton's interpreter)
def test_params_on_the_meta_device_step_plan_again_and_save_as_torch_adamws_do(backend):
    """A model built on the meta device (deferred initialisation) steps, plans again and saves its state, as with
    torch.optim.AdamW, on either CPU backend: states on the meta device, without values (torch keeps its step count on
    the CPU, this optimizer keeps it with the param's other states), and the checkpoint loads into torch.optim.AdamW
    over meta params."""

    def meta_param(n):
        p = torch.nn.Parameter(torch.empty(n, device="meta"))
        p.grad = torch.empty(n, device="meta")
        return p

    first, late = meta_param(5), meta_param(3)
    opt = FusedAdam([first], adam_w_mode=AdamWMode.ADAMW_TORCH)
    opt.step()
    opt.param_groups[0]["params"].append(late)  # (plans again: the first param's state is checked then)
    opt.step()
    sd = opt.state_dict()
    for index, p in enumerate((first, late)):
        assert sorted(sd["state"][index]) == ["exp_avg", "exp_avg_sq", "step"]
        for key, value in sd["state"][index].items():
            assert value.is_meta and value.shape == (() if key == "step" else p.shape), (index, key)
    theirs = torch.optim.AdamW([meta_param(5), meta_param(3)])
    theirs.load_state_dict(sd)
    assert all(value.is_meta for state in theirs.state.values() for value in state.values())


@pytest.mark.no_interpreter  # (meta params step through the native op's fake kernel, not Triton's interpreter)
@pytest.mark.parametrize("moments", ["bf16", "scaled-fp16", "u8", "u4", "e4m3", "e5m2"])
def test_params_on_the_meta_device_with_coded_moments_step_plan_again_save_and_load(moments, backend):
    """With bfloat16, block-scaled fp16, 8-bit, 4-bit or fp8 moments too, amsgrad's max_exp_avg_sq included, on either
    CPU backend: the block scales on the meta device have no values to check, so a step that plans again,
    state_dict() and a load into another optimizer over meta params go through, states on the meta device."""
    dtype = {"bf16": torch.bfloat16, "scaled-fp16": torch.float16, "u8": torch.uint8, "u4": torch.uint4,
             "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[moments]

    def meta_param(n):
        p = torch.nn.Parameter(torch.empty(n, device="meta"))
        p.grad = torch.empty(n, device="meta")
        return p

    opt = FusedAdam([meta_param(300)], amsgrad=True, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    opt.step()
    opt.param_groups[0]["params"].append(meta_param(3))  # (plans again: the first param's codes are checked then)
    opt.step()
    twin = FusedAdam([meta_param(300), meta_param(3)], amsgrad=True, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    twin.load_state_dict(opt.state_dict())
    twin.step()
    assert all("max_exp_avg_sq" in state for state in twin.state.values())
    assert all(value.is_meta for state in twin.state.values() for value in state.values())


# ---- load_state_dict's contract ------------------------------------------------------------------------------------


def _trained_mixed():
    params = [torch.nn.Parameter(torch.randn(QUANT_BLOCK + 3).half()), torch.nn.Parameter(torch.randn(6))]
    opt = FusedAdam(params, lr=torch.tensor(1e-2), weight_decay=0.1, amsgrad=True, master_weights=True,
                    exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    _steps(opt, params, 0, 4)
    return params, opt


def _fresh_like(params, **kwargs):
    twin_params = _clone_params(params)
    return twin_params, FusedAdam(twin_params, lr=torch.tensor(1e-2), weight_decay=0.1, amsgrad=True,
                                  master_weights=True, exp_avg_dtype=torch.float16,
                                  exp_avg_sq_dtype=torch.float16, **kwargs)


def _saved_and_two_fresh():
    """The state_dict of _trained_mixed(), and two fresh optimizers (with their params) that could load it."""
    params, opt = _trained_mixed()
    return opt.state_dict(), _fresh_like(params), _fresh_like(params)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_state_dict_never_writes_to_the_given_dict_not_even_after_later_steps(backend, monkeypatch):
    """A loader that scaled fp16 states in place (or kept the dict's lr tensor for the scheduler to fill) would
    corrupt the checkpoint it was given."""
    select_backend(monkeypatch, backend)
    params, opt = _trained_mixed()
    sd = opt.state_dict()
    pristine = copy.deepcopy(sd)
    twin_params, twin = _fresh_like(params)
    scheduler = torch.optim.lr_scheduler.StepLR(twin, step_size=1, gamma=0.5)
    twin.load_state_dict(sd)
    assert_tree_bitwise_equal(sd, pristine)
    for step in range(4, 8):
        _set_grads(twin_params, step)
        twin.step()
        scheduler.step()
    assert_tree_bitwise_equal(sd, pristine)


def test_loading_the_same_dict_twice_equals_loading_it_once(backend):
    sd, (once_params, once), (twice_params, twice) = _saved_and_two_fresh()
    once.load_state_dict(sd)
    twice.load_state_dict(sd)
    twice.load_state_dict(sd)
    _assert_same_optimizers(once_params, once, twice_params, twice)
    assert_tree_bitwise_equal(once.state_dict(), twice.state_dict())
    assert_tree_bitwise_equal(once.state_dict(), sd)


def test_one_dict_loaded_into_two_optimizers_gives_two_identical_independent_optimizers(backend):
    sd, (a_params, a), (b_params, b) = _saved_and_two_fresh()
    a.load_state_dict(sd)
    b.load_state_dict(sd)
    _assert_same_optimizers(a_params, a, b_params, b)
    b_before = optimizer_snapshot(b)
    _steps(a, a_params, 4, 3)  # stepping one leaves the other alone: they share no tensor
    assert_same_snapshot(b_before, optimizer_snapshot(b))
    _steps(b, b_params, 4, 3)
    _assert_same_optimizers(a_params, a, b_params, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_in_process_transfer_leaves_the_source_optimizer_unchanged(backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params, source = _trained_mixed()
    before = optimizer_snapshot(source)
    target_params, target = _fresh_like(params, max_grad_norm=1.0)
    target.load_state_dict(source.state_dict())
    torch.optim.lr_scheduler.StepLR(target, step_size=1, gamma=0.5)
    _steps(target, target_params, 4, 5, grad_scale=8.0)
    target.param_groups[0]["lr"].fill_(7.0)
    assert_same_snapshot(before, optimizer_snapshot(source))


@pytest.mark.no_interpreter  # (meta params step through the native op's fake kernel, not Triton's interpreter)
def test_a_checkpoint_loads_into_params_on_the_meta_device_as_into_torch_adamws_and_is_checked_alike(backend):
    """torch.optim.AdamW over meta params loads a checkpoint (its states then on the meta device, without values); so
    does FusedAdam, on either CPU backend, which checks the checkpoint's values where they are, and then steps and
    saves."""
    source = torch.nn.Parameter(torch.randn(5))
    torch_optimizer = torch.optim.AdamW([source])
    source.grad = torch.ones(5)
    torch_optimizer.step()
    saved = torch_optimizer.state_dict()

    def meta_optimizer():
        p = torch.nn.Parameter(torch.empty(5, device="meta"))
        return p, FusedAdam([p], adam_w_mode=AdamWMode.ADAMW_TORCH)

    p, opt = meta_optimizer()
    opt.load_state_dict(saved)
    assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "step"]
    assert all(value.is_meta for value in opt.state[p].values())
    p.grad = torch.empty(5, device="meta")
    opt.step()
    again, twin = meta_optimizer()
    twin.load_state_dict(opt.state_dict())  # (its own checkpoint: meta tensors, for meta params)
    assert all(value.is_meta for value in twin.state[again].values())
    bad = copy.deepcopy(saved)
    bad["state"][0]["exp_avg_sq"] = -bad["state"][0]["exp_avg_sq"]
    p, opt = meta_optimizer()
    with pytest.raises(ValueError, match=re.escape("state_dict['state'][0]['exp_avg_sq'] holds negative values")):
        opt.load_state_dict(bad)
    assert not opt.state


@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float8_e4m3fn])
@pytest.mark.parametrize("master_weights", [False, True])
def test_a_checkpoint_loads_into_meta_params_checked_piece_by_piece_without_a_full_size_copy(
        saved_dtype, master_weights, monkeypatch):
    """Into params on the meta device a checkpoint's values are checked where they are, CHECK_CHUNK elements at a
    time (strided entries too): the load makes no copy of a whole entry (torch.optim.AdamW's makes none: its states
    become meta tensors), and refuses what it refuses for params with data, for the same rule."""
    from ort_optim import _checkpoint
    monkeypatch.setattr(_checkpoint, "CHECK_CHUNK", 1000)
    shape = (100, 120)  # 12 chunks
    param_dtype = torch.float16 if master_weights else torch.float32

    def saved_entry(fill, changed=()):
        wide = torch.full((100, 240), fill, dtype=torch.float64)
        for index, value in changed:
            wide[:, ::2][index] = value
        return wide.to(saved_dtype)[:, ::2]  # (strided)

    def checkpoint(**changed):
        fills = {"exp_avg": 0.5, "exp_avg_sq": 0.25, "master_param": 1.0}
        state = {"step": torch.tensor(3.0)}
        for key in ["exp_avg", "exp_avg_sq"] + ["master_param"] * master_weights:
            state[key] = saved_entry(fills[key], changed.get(key, ()))
        return {"state": {0: state}, "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999),
                                                        "eps": 1e-8, "weight_decay": 0.0}]}

    def load(device, saved):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=param_dtype, device=device))
        opt = FusedAdam([p], master_weights=master_weights)
        with LargestAllocation() as largest:
            opt.load_state_dict(saved)
        return opt, p, largest.nbytes

    opt, p, nbytes = load("meta", checkpoint())
    assert all(value.is_meta for value in opt.state[p].values())
    assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq"] + ["master_param"] * master_weights + ["step"]
    assert 0 < nbytes <= _checkpoint.CHECK_CHUNK * 8, nbytes  # (a piece of float64 at most)
    bad = [((-1, -1), -1.0)]  # (in the last piece)
    if saved_dtype == torch.float64:
        bad.append(((0, 0), 1e300))  # (beyond float32, in the first piece: the rule checked first)
    refusal = "holds inf or NaN once converted to float32" if len(bad) == 2 else "holds negative values"
    for device in ("cpu", "meta"):
        with pytest.raises(ValueError, match=re.escape(f"state_dict['state'][0]['exp_avg_sq'] {refusal}")):
            load(device, checkpoint(exp_avg_sq=bad))


PIECEWISE_DTYPES = [None, torch.bfloat16, torch.float16, torch.uint8, torch.uint4, torch.float8_e4m3fn,
                    torch.float8_e5m2]


def _piecewise_checkpoint(saved_dtype: torch.dtype, strided: bool, shape=(37, 301)) -> dict:
    """A checkpoint of one bf16 param with masters, its entries in saved_dtype (strided: transposed views)."""
    g = torch.Generator().manual_seed(5)
    values = {"exp_avg": torch.randn(shape, generator=g, dtype=torch.float64) * 1e-2,
              "exp_avg_sq": torch.rand(shape, generator=g, dtype=torch.float64) * 1e-4,
              "master_param": torch.randn(shape, generator=g, dtype=torch.float64)}
    values["exp_avg_sq"][0, :300] = 0.0  # (a zero block)
    state = {"step": torch.tensor(5.0)}
    for key, value in values.items():
        value = value.to(saved_dtype)
        state[key] = value.t().contiguous().t() if strided else value
    return {"state": {0: state}, "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                    "weight_decay": 0.0}]}


@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("state_dtype", PIECEWISE_DTYPES, ids=str)
def test_a_checkpoint_is_stored_piece_by_piece_as_the_bits_of_its_whole_conversion(state_dtype, strided, saved_dtype,
                                                                                   monkeypatch):
    """Into params with data an entry is checked and stored CHECK_CHUNK elements at a time (writes rounded up to
    whole blocks of every format, so 4-bit codes and block scales are never split): the state holds exactly the bits
    of the entry converted to its canonical dtype and stored whole (from_canonical), in every storage format, from
    contiguous and strided entries alike."""
    from ort_optim import _checkpoint
    monkeypatch.setattr(_checkpoint, "CHECK_CHUNK", 1000)  # (11137 elements: 11 write pieces of 1024, a partial one)
    sd = _piecewise_checkpoint(saved_dtype, strided)
    p = torch.nn.Parameter(torch.zeros(37, 301, dtype=torch.bfloat16))
    opt = FusedAdam([p], master_weights=True, exp_avg_dtype=state_dtype, exp_avg_sq_dtype=state_dtype)
    opt.load_state_dict(sd)
    whole = opt._wide_options.layout.init_state(p, False)
    for key in _checkpoint.CONVERSION_ORDER + ("master_param",):
        if key in whole:
            _checkpoint.from_canonical(whole, key, sd["state"][0][key].to(torch.float32))
    assert sorted(opt.state[p]) == sorted(whole)
    for key, expected in whole.items():
        if key != "step":
            assert_bitwise_equal(opt.state[p][key], expected, key)


@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("state_dtype", PIECEWISE_DTYPES, ids=str)
def test_a_checkpoint_loads_into_params_with_data_without_a_full_size_temporary(state_dtype, strided, saved_dtype,
                                                                                monkeypatch):
    """A load makes the state it fills and, besides it, temporaries of one piece at most: the values are checked
    where they are and converted, stored and read back CHECK_CHUNK elements at a time (writes rounded up to
    BLOCK_MULTIPLE), so no entry is copied, cast, quantised or decoded whole. Without the pieces its peak memory was
    about 3 times the state's (three full-size temporaries per entry: the canonical copy, the check's masks, the
    read-back); torch.optim.AdamW's load makes at most one cast copy per entry. The largest temporary is an int64
    (or float64) tensor of one write piece: 8 bytes per element of 1024, against 48,000 bytes for one float32 entry.
    A strided entry is gathered into its write pieces a piece at a time, never into one copy of the whole."""
    from ort_optim import _checkpoint
    monkeypatch.setattr(_checkpoint, "CHECK_CHUNK", 1000)
    sd = _piecewise_checkpoint(saved_dtype, strided=strided, shape=(100, 120))
    p = torch.nn.Parameter(torch.zeros(100, 120, dtype=torch.bfloat16))
    opt = FusedAdam([p], master_weights=True, exp_avg_dtype=state_dtype, exp_avg_sq_dtype=state_dtype)
    with LargestTemporary() as allocations:
        opt.load_state_dict(sd)
    nbytes, op = allocations.besides(opt.state[p].values())
    assert 0 < nbytes <= 8 * formats.BLOCK_MULTIPLE < 4 * p.numel(), (nbytes, op)


@pytest.mark.parametrize("check_chunk", [1000, 1 << 20], ids=["pieces", "one piece"])
@pytest.mark.parametrize("meta", [False, True], ids=["data", "meta"])
def test_an_entry_that_breaks_two_rules_is_refused_for_the_same_one_however_it_is_cut(check_chunk, meta, monkeypatch):
    """Each rule reads the whole entry before the next: an exp_avg_sq negative in its first piece and beyond float32
    in its last is refused for the value beyond float32 (the rule checked first), whether the check reads it in
    pieces or whole, as for an entry whose two breaks are the other way round."""
    from ort_optim import _checkpoint
    monkeypatch.setattr(_checkpoint, "CHECK_CHUNK", check_chunk)
    exp_avg_sq = torch.full((100, 120), 0.25, dtype=torch.float64)
    exp_avg_sq[0, 0], exp_avg_sq[-1, -1] = -1.0, 1e300
    sd = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(100, 120), "exp_avg_sq": exp_avg_sq}},
          "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}]}
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(100, 120, device="meta" if meta else "cpu"))])
    with pytest.raises(ValueError, match=re.escape("state_dict['state'][0]['exp_avg_sq'] holds inf or NaN once "
                                                   "converted to float32")):
        opt.load_state_dict(sd)
    assert not opt.state


def test_a_float64_params_checkpoint_beyond_float32s_range_loads_as_finite_values_without_a_warning():
    """A float64 param keeps float64 states: values beyond float32's range (1e300) are finite there, so they load
    as they are, and the load warns of no inf or NaN."""
    p = torch.nn.Parameter(torch.zeros(3000, dtype=torch.float64))
    opt = FusedAdam([p])
    values = {"exp_avg": torch.full((3000,), -1e300, dtype=torch.float64),
              "exp_avg_sq": torch.full((3000,), 1e300, dtype=torch.float64)}
    sd = {"state": {0: {"step": torch.tensor(3.0), **values}},
          "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(sd)
    for key, value in values.items():
        assert_bitwise_equal(opt.state[p][key], value, key)


# ---- resume == never stopping, bit for bit -------------------------------------------------------------------------

STATE_CONFIGS = {  # name: (param dtype, master_weights, exp_avg_dtype, exp_avg_sq_dtype)
    "fp32": (torch.float32, False, None, None),
    "fp32-fp16-moments": (torch.float32, False, torch.float16, torch.float16),
    "fp32-bf16-moments": (torch.float32, False, torch.bfloat16, torch.bfloat16),
    "fp32-mixed-fp16-bf16": (torch.float32, False, torch.float16, torch.bfloat16),
    "fp16-no-master": (torch.float16, False, None, None),  # fp16 params, fp16 (block-scaled) moments
    "fp16-master": (torch.float16, True, None, None),  # fp32 master and moments
    "fp16-master-fp16-moments": (torch.float16, True, torch.float16, torch.float16),
    "bf16-no-master": (torch.bfloat16, False, None, None),
    "bf16-master-mixed-bf16-fp16": (torch.bfloat16, True, torch.bfloat16, torch.float16),
    "fp64": (torch.float64, False, None, None),
}


def _layout_param(layout: str, values: torch.Tensor) -> torch.nn.Parameter:
    """A param holding ``values`` in the given memory layout."""
    if layout == "non-contiguous":  # a strided view of a bigger buffer
        base = torch.zeros(values.shape[0], 3 * values.shape[1], dtype=values.dtype)
        view = base[:, 1::3]
        view.copy_(values)
        return torch.nn.Parameter(view)
    return torch.nn.Parameter(values.clone())


LAYOUTS = {
    "contiguous": lambda g: torch.randn(2 * QUANT_BLOCK + 5, generator=g),  # three fp16-state blocks
    "zero-dim": lambda g: torch.randn((), generator=g),
    "non-contiguous": lambda g: torch.randn(40, 30, generator=g),  # 1200 elements: two blocks
    "empty": lambda g: torch.randn(0, 4, generator=g),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("config", STATE_CONFIGS, ids=str)
def test_resuming_from_a_checkpoint_equals_never_stopping_bit_for_bit(config, layout, backend, monkeypatch):
    """Train 5 steps, checkpoint (optimizer, scheduler and the model's params) through torch.save/torch.load
    (weights_only=True), rebuild everything, load, train 5 more: identical to training 10 steps without stopping,
    bit for bit: params, masters, moment codes and scales, steps."""
    select_backend(monkeypatch, backend)
    dtype, master, m_dtype, v_dtype = STATE_CONFIGS[config]
    g = torch.Generator().manual_seed(31)
    companion = torch.randn(7, generator=g).to(dtype)
    values = LAYOUTS[layout](g).to(dtype)
    kwargs = dict(lr=1e-2, weight_decay=0.1, amsgrad=True, master_weights=master, exp_avg_dtype=m_dtype,
                  exp_avg_sq_dtype=v_dtype, adam_w_mode=AdamWMode.ADAMW_TORCH)

    def build(param_values):
        params = [_layout_param(layout, param_values[0]), torch.nn.Parameter(param_values[1].clone())]
        opt = FusedAdam(params, **kwargs)
        return params, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    def train(params, opt, scheduler, first, count):
        for step in range(first, first + count):
            _set_grads(params, step)
            opt.step(grad_scale=4.0)
            scheduler.step()

    straight = build([values, companion])
    train(*straight, 0, 10)

    stopped = build([values, companion])
    train(*stopped, 0, 5)
    checkpoint = _roundtrip({
        "model": [p.detach() for p in stopped[0]],
        "optimizer": stopped[1].state_dict(),
        "scheduler": stopped[2].state_dict(),
    })
    del stopped
    resumed = build(checkpoint["model"])
    resumed[1].load_state_dict(checkpoint["optimizer"])
    resumed[2].load_state_dict(checkpoint["scheduler"])
    assert resumed[0][0].is_contiguous() == (layout != "non-contiguous")
    train(*resumed, 5, 5)

    _assert_same_optimizers(straight[0], straight[1], resumed[0], resumed[1])
    assert float(resumed[1].state[resumed[0][1]]["step"]) == 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_max_exp_avg_sq_kept_after_amsgrad_was_switched_off_is_loaded_so_switching_it_on_again_resumes_alike(
        backend, monkeypatch):
    """A run that switches amsgrad off keeps max_exp_avg_sq (as torch.optim.AdamW does) and saves it: loaded, it is
    kept too, so that switching amsgrad on again continues the resumed run as the one that never stopped, as with
    torch.optim.AdamW, whose load keeps it."""
    select_backend(monkeypatch, backend)

    def run(make, resume):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 4))
        opt = make([p])
        for i in range(3):
            p.grad = torch.full((4,), 3.0 - i)
            opt.step()
        opt.param_groups[0]["amsgrad"] = False
        p.grad = torch.ones(4)
        opt.step()
        if resume:
            saved = opt.state_dict()
            p = torch.nn.Parameter(p.detach().clone())
            opt = make([p])
            opt.load_state_dict(saved)
            assert "max_exp_avg_sq" in opt.state[p]
        opt.param_groups[0]["amsgrad"] = True
        p.grad = torch.full((4,), 0.5)
        opt.step()
        return p.detach()

    def ours(params):
        return FusedAdam(params, amsgrad=True, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2)

    def theirs(params):
        return torch.optim.AdamW(params, amsgrad=True, foreach=False)

    assert_bitwise_equal(run(ours, resume=True), run(ours, resume=False), "resumed")
    torch.testing.assert_close(run(ours, resume=True), run(theirs, resume=True), **TOL)


# ---- the fp16 quantiser --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_magnitude", [1e-12, 1e-3, 1.0, 1e4], ids=lambda m: f"grads-{m:g}")
def test_the_kernels_fp16_states_survive_dequantize_then_quantize_exactly(grad_magnitude, backend, monkeypatch):
    """After real steps, formats.quantize_fp16(dequantize_fp16(codes, scales)) gives back the kernel's own codes
    and scales: what makes a checkpoint (saved unscaled) restore bit for bit."""
    select_backend(monkeypatch, backend)
    p = torch.nn.Parameter(torch.randn(3 * QUANT_BLOCK + 17))
    opt = FusedAdam([p], amsgrad=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16, eps=1e-30)
    gen = torch.Generator().manual_seed(9)
    for _ in range(4):
        # very different magnitudes per block, and one all-zero block
        p.grad = torch.randn(p.shape, generator=gen) * grad_magnitude * torch.logspace(-6, 6, p.numel())
        p.grad[QUANT_BLOCK:2 * QUANT_BLOCK] = 0
        opt.step()
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        codes, scales = opt.state[p][key], opt.state[p][key + "_scale"]
        assert codes.dtype == torch.float16 and scales.shape == (4,)
        assert float(scales[1]) == 1.0  # the all-zero block
        assert bool(((scales.log2() % 1) == 0).all()), "scales are powers of two"
        again_codes, again_scales = formats.quantize_fp16(formats.dequantize_fp16(codes, scales))
        assert_bitwise_equal(again_codes, codes, f"{key} codes")
        assert_bitwise_equal(again_scales, scales, f"{key} scales")
        # and the block maxima sit in (16384, 32768], the headroom rule
        nonzero = codes.float().abs().reshape(-1)
        for block in (0, 2, 3):
            amax = float(nonzero[block * QUANT_BLOCK:(block + 1) * QUANT_BLOCK].max())
            assert 16384 < amax <= 32768, (key, block, amax)


@pytest.mark.parametrize("exponent", [-140, -126, -100, -60, -20, 0, 20, 60, 100, 126])
def test_quantize_fp16_round_trips_exactly_at_every_magnitude(exponent):
    gen = torch.Generator().manual_seed(exponent + 1000)
    x = (torch.rand(5000, generator=gen) * 2 - 1).double() * 2.0**exponent
    x = (x * torch.exp2(-16 * torch.rand(5000, generator=gen).double())).float()
    codes, scales = formats.quantize_fp16(x)
    again_codes, again_scales = formats.quantize_fp16(formats.dequantize_fp16(codes, scales))
    assert_bitwise_equal(again_codes, codes, "codes")
    assert_bitwise_equal(again_scales, scales, "scales")
    torch.testing.assert_close(formats.dequantize_fp16(codes, scales), x, rtol=2.0**-11, atol=0)


# ---- validation ----------------------------------------------------------------------------------------------------


def _bad(mutate):
    def make(sd):
        sd = copy.deepcopy(sd)
        mutate(sd)
        return sd
    return make


def _parent(sd, path):
    """The container that holds the entry at path (a sequence of keys) in sd."""
    for key in path[:-1]:
        sd = sd[key]
    return sd


def _set(path, value):
    def mutate(sd):
        _parent(sd, path)[path[-1]] = value
    return mutate


def _delete(path):
    def mutate(sd):
        del _parent(sd, path)[path[-1]]
    return mutate


def _swap(a, b):
    def mutate(sd):
        pa, pb = _parent(sd, a), _parent(sd, b)
        pa[a[-1]], pb[b[-1]] = pb[b[-1]], pa[a[-1]]
    return mutate


def _to_list(path):
    def mutate(sd):
        target = _parent(sd, path)
        value = target[path[-1]]
        target[path[-1]] = list(value.values()) if isinstance(value, dict) else value.tolist()
    return mutate


# (id, mutation of the trained checkpoint, exception, message): the message names the entry, as an expression
BAD_CHECKPOINTS = [
    # the containers
    ("not-a-dict", lambda sd: [sd], TypeError, r"state_dict must be a dict with 'state' and 'param_groups'"),
    ("no-param-groups", _bad(_delete(["param_groups"])), ValueError, r"state_dict\['param_groups'\] is missing"),
    ("no-state", _bad(_delete(["state"])), ValueError, r"state_dict\['state'\] is missing"),
    ("unknown-top-level-key", _bad(_set(["scaler"], {})), ValueError, r"state_dict\['scaler'\]: unknown key"),
    ("an-fp16-optimizer-checkpoint", lambda sd: {"format": "ort_optim.FP16_Optimizer/1", "optimizer": sd,
                                                 "loss_scaler": {}, "master_params": []}, ValueError,
     r"state_dict is an FP16_Optimizer checkpoint .* FP16_Optimizer.load_state_dict, or pass its "
     r"state_dict\['optimizer'\]"),
    ("state-is-a-list", _bad(_to_list(["state"])), TypeError,
     r"state_dict\['state'\] must be a dict from parameter id to state dict, got list"),
    ("param-groups-is-a-dict", _bad(_set(["param_groups"], {0: {}})), TypeError,
     r"state_dict\['param_groups'\] must be a list of dicts"),
    ("group-is-a-list", _bad(_set(["param_groups", 0], [0, 1])), TypeError,
     r"state_dict\['param_groups'\]\[0\] must be a dict, got list"),
    ("extra-group", _bad(lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0]))), ValueError,
     r"state_dict\['param_groups'\] has 2 param groups but this optimizer has 1"),
    ("group-without-params", _bad(_delete(["param_groups", 0, "params"])), ValueError,
     r"state_dict\['param_groups'\]\[0\] has no 'params'"),
    ("group-without-eps", _bad(_delete(["param_groups", 0, "eps"])), ValueError,
     r"state_dict\['param_groups'\]\[0\] has no 'eps'"),
    ("params-not-a-list", _bad(_set(["param_groups", 0, "params"], 0)), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['params'\] must be a list of parameter ids, got int"),
    ("wrong-param-count", _bad(lambda sd: sd["param_groups"][0]["params"].pop()), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['params'\] lists 1 params but this optimizer's param_groups\[0\] has 2"),
    ("duplicate-param-id", _bad(_set(["param_groups", 0, "params", 1], 0)), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['params'\]\[1\]: parameter id 0 is listed twice"),
    ("float-param-id", _bad(_set(["param_groups", 0, "params", 1], 1.0)), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['params'\]\[1\] must be a parameter id"),
    # (torch.optim's load reads True as the id 1, equal to it as a dict key; no state_dict() saves a bool id)
    ("bool-param-id", _bad(_set(["param_groups", 0, "params", 1], True)), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['params'\]\[1\] must be a parameter id \(an int.*got bool True "
     r"\(torch.optim's load_state_dict reads True as the id 1"),
    ("bool-state-key", _bad(lambda sd: sd.update(state={True if pid == 1 else pid: state
                                                         for pid, state in sd["state"].items()})), TypeError,
     r"state_dict\['state'\]\[True\] \(its key\) must be a parameter id \(an int.*got bool True \(torch.optim's "
     r"load_state_dict reads True as the id 1"),
    ("unknown-param-id", _bad(_set(["state", 17], {})), ValueError,
     r"state_dict\['state'\]\[17\]: parameter id 17 is listed in no"),
    ("sgd-group", _bad(_set(["param_groups", 0, "momentum"], 0.9)), ValueError,
     r"state_dict\['param_groups'\]\[0\] has \['momentum'\], options of torch.optim's SGD or RMSprop, not of Adam"),
    # group options, strictly typed (a "False" from a config file is not True)
    ("maximize-string", _bad(_set(["param_groups", 0, "maximize"], "False")), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['maximize'\] must be True or False \(a bool\), got str 'False'"),
    ("amsgrad-string", _bad(_set(["param_groups", 0, "amsgrad"], "no")), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['amsgrad'\] must be True or False"),
    ("maximize-tensor", _bad(_set(["param_groups", 0, "maximize"], torch.tensor([1, 0]))), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['maximize'\] must be True or False \(a bool\), got a torch.int64 tensor"),
    ("bias-correction-int", _bad(_set(["param_groups", 0, "bias_correction"], 1)), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['bias_correction'\] must be True or False"),
    ("lr-string", _bad(_set(["param_groups", 0, "lr"], "1e-3")), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['lr'\] must be a real number, got str"),
    ("lr-nan", _bad(_set(["param_groups", 0, "lr"], float("nan"))), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['lr'\] must be finite"),
    ("lr-negative-tensor", _bad(_set(["param_groups", 0, "lr"], torch.tensor(-1.0))), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['lr'\] must be >= 0"),
    ("lr-two-elements", _bad(_set(["param_groups", 0, "lr"], torch.tensor([1e-3, 1e-3]))), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['lr'\] must hold exactly one number"),
    ("eps-inf", _bad(_set(["param_groups", 0, "eps"], float("inf"))), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['eps'\] must be finite"),
    ("weight-decay-bool", _bad(_set(["param_groups", 0, "weight_decay"], True)), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['weight_decay'\] must be a real number, got bool"),
    ("weight-decay-negative", _bad(_set(["param_groups", 0, "weight_decay"], -0.1)), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['weight_decay'\] must be >= 0"),
    ("betas-out-of-range", _bad(_set(["param_groups", 0, "betas"], (0.9, 1.5))), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['betas'\]\[1\] must be in \[0, 1\)"),
    ("betas-three", _bad(_set(["param_groups", 0, "betas"], (0.9, 0.99, 0.5))), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['betas'\] must be a pair"),
    ("betas-strings", _bad(_set(["param_groups", 0, "betas"], ("0.9", "0.999"))), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['betas'\]\[0\] must be a real number"),
    ("adam-w-mode-5", _bad(_set(["param_groups", 0, "adam_w_mode"], 5)), ValueError,
     r"state_dict\['param_groups'\]\[0\]\['adam_w_mode'\] must be an AdamWMode \(0, 1 or 2\), got 5"),
    ("adam-w-mode-string", _bad(_set(["param_groups", 0, "adam_w_mode"], "ADAMW_TORCH")), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['adam_w_mode'\] must be an AdamWMode or the int 0, 1 or 2"),
    ("group-step-list", _bad(_set(["param_groups", 0, "step"], [3])), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['step'\] must be a real number, got list"),
    # per-parameter states
    ("state-entry-list", _bad(_set(["state", 1], [torch.zeros(6)])), TypeError,
     r"state_dict\['state'\]\[1\] must be a dict of state tensors, got list"),
    ("unknown-key", _bad(_set(["state", 0, "momentum_buffer"], torch.zeros(1))), ValueError,
     r"state_dict\['state'\]\[0\]\['momentum_buffer'\]: unknown key"),
    # (only an empty dict there is the placeholder of torch's unflattening, read as no entry)
    ("scale-key-holding-a-dict", _bad(_set(["state", 0, "exp_avg_scale"], {"scale": torch.ones(1)})), ValueError,
     r"state_dict\['state'\]\[0\]\['exp_avg_scale'\]: unknown key"),
    ("master-param-holding-a-dict", _bad(_set(["state", 0, "master_param"], {"value": torch.ones(1)})), TypeError,
     r"state_dict\['state'\]\[0\]\['master_param'\] must be a tensor, got dict"),
    ("missing-exp-avg-sq", _bad(_delete(["state", 1, "exp_avg_sq"])), ValueError,
     r"state_dict\['state'\]\[1\] has no 'exp_avg_sq'"),
    ("missing-max-exp-avg-sq", _bad(_delete(["state", 0, "max_exp_avg_sq"])), ValueError,
     r"state_dict\['state'\]\[0\] has no 'max_exp_avg_sq', which its group's amsgrad=True needs "
     r"\(state_dict\['param_groups'\]\[0\]\['amsgrad'\]"),
    ("missing-step", _bad(_delete(["state", 1, "step"])), ValueError,
     r"state_dict\['state'\]\[1\] has no 'step' \(nor does its param group, state_dict\['param_groups'\]\[0\]"),
    ("step-list", _bad(_set(["state", 1, "step"], [4.0])), TypeError,
     r"state_dict\['state'\]\[1\]\['step'\] must be a real number, got list"),
    ("step-two-elements", _bad(_set(["state", 1, "step"], torch.tensor([4.0, 4.0]))), ValueError,
     r"state_dict\['state'\]\[1\]\['step'\] must hold exactly one number"),
    ("step-bool-tensor", _bad(_set(["state", 1, "step"], torch.tensor(True))), TypeError,
     r"state_dict\['state'\]\[1\]\['step'\] must be a real number"),
    ("negative-step", _bad(_set(["state", 1, "step"], torch.tensor(-1.0))), ValueError,
     r"state_dict\['state'\]\[1\]\['step'\] must be a whole number in \[0, 2\*\*53\]"),
    ("fractional-step", _bad(_set(["state", 1, "step"], torch.tensor(2.5))), ValueError,
     r"state_dict\['state'\]\[1\]\['step'\] must be a whole number"),
    ("huge-step", _bad(_set(["state", 1, "step"], 1e300)), ValueError,
     r"state_dict\['state'\]\[1\]\['step'\] must be a whole number in \[0, 2\*\*53\]"),
    # (2**53 + 1 is 2**53 as a float: an int or an integer tensor is compared exactly, not accepted as 2**53)
    ("step-int-above-2**53", _bad(_set(["state", 1, "step"], 2**53 + 1)), ValueError,
     r"state_dict\['state'\]\[1\]\['step'\] must be a whole number in \[0, 2\*\*53\], got 9007199254740993"),
    ("step-int64-tensor-above-2**53", _bad(_set(["state", 1, "step"], torch.tensor(2**53 + 1))), ValueError,
     r"state_dict\['state'\]\[1\]\['step'\] must be a whole number in \[0, 2\*\*53\], got 9007199254740993"),
    ("step-int-beyond-float64", _bad(_set(["state", 1, "step"], 10**400)), ValueError,
     r"state_dict\['state'\]\[1\]\['step'\] must be"),
    ("nan-step", _bad(_set(["state", 1, "step"], torch.tensor(float("nan")))), ValueError,
     r"state_dict\['state'\]\[1\]\['step'\] must be finite"),
    ("moment-not-a-tensor", _bad(_set(["state", 1, "exp_avg"], [0.0] * 6)), TypeError,
     r"state_dict\['state'\]\[1\]\['exp_avg'\] must be a tensor, got list"),
    ("ids-swapped", _bad(_swap(["param_groups", 0, "params", 0], ["param_groups", 0, "params", 1])), ValueError,
     r"state_dict\['state'\]\[\d\]\['exp_avg'\] has shape .*, the parameter .* \(the one whose id "
     r"state_dict\['param_groups'\]\[0\]\['params'\]\[\d\] gives\)"),
    ("wrong-shape", _bad(_set(["state", 1, "exp_avg"], torch.zeros(5))), ValueError,
     r"state_dict\['state'\]\[1\]\['exp_avg'\] has shape \(5,\), the parameter \(6,\)"),
    ("integer-moment", _bad(_set(["state", 1, "exp_avg"], torch.zeros(6, dtype=torch.int32))), TypeError,
     r"state_dict\['state'\]\[1\]\['exp_avg'\] must be a floating-point tensor"),
    ("meta-moment", _bad(_set(["state", 1, "exp_avg"], torch.zeros(6, device="meta"))), TypeError,
     r"state_dict\['state'\]\[1\]\['exp_avg'\] must be a dense tensor with data, got .* on meta; a tensor on the "
     r"meta device holds no values \(a checkpoint loaded with map_location='meta'\): load the checkpoint onto the CPU "
     r"or the params' device"),
    ("moment-beyond-float32", _bad(_set(["state", 1, "exp_avg"], torch.full((6,), 1e300, dtype=torch.float64))),
     ValueError, r"state_dict\['state'\]\[1\]\['exp_avg'\] holds inf or NaN once converted to float32"),
    ("negative-second-moment", _bad(_set(["state", 1, "exp_avg_sq"], -torch.ones(6))), ValueError,
     r"state_dict\['state'\]\[1\]\['exp_avg_sq'\] holds negative values"),
    # TransformerEngine's store_param_remainders=True saves the low half of each fp32 master as int16
    ("transformer-engine-param-remainders",
     _bad(_set(["state", 0, "master_param"], torch.zeros(QUANT_BLOCK + 3, dtype=torch.int16))), TypeError,
     r"state_dict\['state'\]\[0\]\['master_param'\] must be a floating-point tensor, got a torch\.int16 tensor .*: "
     r"an int16 master_param is what TransformerEngine's FusedAdam\(store_param_remainders=True\) saves.*delete the "
     r"'master_param' entries"),
    ("master-wrong-shape", _bad(_set(["state", 0, "master_param"], torch.zeros(3))), ValueError,
     r"state_dict\['state'\]\[0\]\['master_param'\] has shape \(3,\)"),
    ("swapped-state-and-groups", _bad(_swap(["state"], ["param_groups"])), TypeError,
     r"state_dict\['param_groups'\] must be a list of dicts, got dict"),
]


@pytest.mark.parametrize("make_bad,error,message", [c[1:] for c in BAD_CHECKPOINTS], ids=[c[0] for c in BAD_CHECKPOINTS])
def test_an_invalid_checkpoint_is_refused_with_an_error_naming_the_entry_and_changes_nothing(make_bad, error, message):
    params, opt = _trained_mixed()
    target_params, target = _fresh_like(params)
    _steps(target, target_params, 0, 2)
    before = optimizer_snapshot(target)
    bad = make_bad(opt.state_dict())
    pristine = copy.deepcopy(bad)
    with pytest.raises(error, match=message):
        target.load_state_dict(bad)
    assert_same_snapshot(before, optimizer_snapshot(target))
    assert_tree_bitwise_equal(bad, pristine, "the given dict")
    _steps(target, target_params, 2, 1)  # and it still steps


@pytest.mark.parametrize("step", [0, 2**53], ids=["zero", "2**53"])
def test_a_step_at_either_end_of_its_range_loads_as_it_is(step):
    """A saved step is a whole number in [0, 2**53]: both ends load (as a number or a tensor, per parameter or as
    ORT's one step per group), and the state holds that step."""
    params, opt = _trained_mixed()
    for place in ("tensor", "number", "group"):
        sd = opt.state_dict()
        if place == "group":
            for state in sd["state"].values():
                del state["step"]
            sd["param_groups"][0]["step"] = step
        else:
            sd["state"][0]["step"] = torch.tensor(float(step), dtype=torch.float64) if place == "tensor" else step
        target_params, target = _fresh_like(params)
        target.load_state_dict(sd)
        p = target.param_groups[0]["params"][0]
        assert float(target.state[p]["step"]) == step, place


def test_masters_that_this_optimizer_does_not_keep_are_dropped_with_a_warning_naming_them():
    """A checkpoint of an optimizer with fp32 masters, loaded into one without (master_weights=False): the run
    continues from the params' own values, and the warning says so; with master_weights=True nothing is said."""
    params, opt = _trained_mixed()
    sd = opt.state_dict()
    masters = [key for key, state in sd["state"].items() if "master_param" in state]
    assert masters, "the trained optimizer keeps masters"
    _, with_masters = _fresh_like(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_masters.load_state_dict(sd)
    twin = _clone_params(params)
    without = FusedAdam(twin, lr=torch.tensor(1e-2), weight_decay=0.1, amsgrad=True, exp_avg_dtype=torch.float16,
                        exp_avg_sq_dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match=rf"state_dict\['state'\]\[{masters[0]}\]\['master_param'\].*"
                                            "keeps no fp32 master weights"):
        without.load_state_dict(sd)
    assert not any("master_param" in state for state in without.state.values())


def test_a_nested_tensor_moment_is_refused_naming_the_entry_and_changes_nothing():
    # (a nested tensor has no shape to read: a plain check of it raised torch's internal error)
    params, opt = _trained_mixed()
    target_params, target = _fresh_like(params)
    _steps(target, target_params, 0, 2)
    before = optimizer_snapshot(target)
    bad = opt.state_dict()
    nested = torch.nested.nested_tensor([torch.zeros(3), torch.ones(3)])
    bad["state"][1]["exp_avg"] = nested
    with pytest.raises(TypeError, match=r"state_dict\['state'\]\[1\]\['exp_avg'\] must be a dense tensor with data, "
                                        r"got a nested torch.float32 tensor"):
        target.load_state_dict(bad)
    assert_same_snapshot(before, optimizer_snapshot(target))
    assert bad["state"][1]["exp_avg"] is nested and torch.equal(nested.unbind()[1], torch.ones(3))


def test_a_value_beyond_bfloat16s_range_is_refused_for_bf16_storage():
    """3.4e38 is a finite float32 that rounds to inf in bfloat16: checked in the storage dtype, not only in float32."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], exp_avg_dtype=torch.bfloat16)
    p.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = torch.full((4,), 3.4e38)
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[0\]\['exp_avg'\] holds values beyond the range of "
                                         r"this optimizer's torch.bfloat16 exp_avg storage"):
        opt.load_state_dict(sd)
    assert_same_snapshot(before, optimizer_snapshot(opt))


@pytest.mark.parametrize("target", [None, torch.float8_e4m3fn, torch.uint8], ids=["fp32", "fp8", "8-bit"])
@pytest.mark.parametrize("saved", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_a_checkpoint_with_its_moments_cast_to_a_narrower_float_loads_as_those_values(saved, target):
    """A torch AdamW checkpoint whose moments were cast to save space (float8 included, which torch's AdamW loads
    too): every value is exact in float32, so it loads as if saved in float32."""
    p = torch.nn.Parameter(torch.randn(300))
    source = torch.optim.AdamW([p])
    for _ in range(3):
        p.grad = torch.randn(300)
        source.step()
    narrow = copy.deepcopy(source.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        narrow["state"][0][key] = narrow["state"][0][key].to(saved)
    wide = copy.deepcopy(narrow)
    for key in ("exp_avg", "exp_avg_sq"):
        wide["state"][0][key] = wide["state"][0][key].float()
    kwargs = {} if target is None else dict(exp_avg_dtype=target, exp_avg_sq_dtype=target)
    optimizers = []
    for sd in (narrow, wide):
        q = torch.nn.Parameter(p.detach().clone())
        optimizers.append(FusedAdam([q], adam_w_mode=AdamWMode.ADAMW_TORCH, **kwargs))
        optimizers[-1].load_state_dict(sd)
    assert_tree_bitwise_equal(optimizers[0].state_dict(), optimizers[1].state_dict())


# Accepted variations of a checkpoint: what torch and ORT write, and JSON-safe spellings of the same values
GOOD_VARIATIONS = {
    "int-step": _set(["state", 1, "step"], 4),
    "float32-step-tensor": _set(["state", 1, "step"], torch.tensor(4.0)),
    "one-element-step": _set(["state", 1, "step"], torch.tensor([4.0])),
    "one-element-2d-step": _set(["state", 1, "step"], torch.tensor([[4.0]])),  # (torch.optim takes any one-element)
    "one-element-2d-lr": _set(["param_groups", 0, "lr"], torch.tensor([[0.01]])),
    "betas-list": _set(["param_groups", 0, "betas"], [0.9, 0.999]),
    "adam-w-mode-enum": _set(["param_groups", 0, "adam_w_mode"], AdamWMode.ADAMW_TRANSFORMERS),
    "extra-group-key": _set(["param_groups", 0, "initial_lr"], 0.01),
    "tuple-params": lambda sd: sd["param_groups"][0].__setitem__("params", tuple(sd["param_groups"][0]["params"])),
}


@pytest.mark.parametrize("variation", GOOD_VARIATIONS, ids=str)
def test_equivalent_spellings_load_and_continue_bit_for_bit(variation):
    params, opt = _trained_mixed()
    sd = opt.state_dict()
    varied = copy.deepcopy(sd)
    GOOD_VARIATIONS[variation](varied)
    a_params, a = _fresh_like(params)
    b_params, b = _fresh_like(params)
    a.load_state_dict(sd)
    b.load_state_dict(varied)
    if variation == "extra-group-key":  # kept, as torch keeps a scheduler's keys
        assert b.param_groups[0].pop("initial_lr") == 0.01
    _steps(a, a_params, 4, 2)
    _steps(b, b_params, 4, 2)
    _assert_same_optimizers(a_params, a, b_params, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_torch_adam_checkpoint_with_l2_decay_is_refused_where_it_can_be_told(backend, monkeypatch):
    """torch.optim.Adam(weight_decay>0) adds wd*p to the gradient (L2) and keeps torch's eps placement: no FusedAdam
    mode computes that, so its moments must not continue silently under AdamW math. torch >= 2.5 saves
    decoupled_weight_decay in each group, which tells; torch 2.4's Adam and AdamW groups have the same keys."""
    select_backend(monkeypatch, backend)
    torch_params = _fp32_params()
    theirs = torch.optim.Adam(torch_params, lr=1e-2, weight_decay=0.1, foreach=False)
    _steps(theirs, torch_params, 0, 3)
    sd = theirs.state_dict()
    params = _clone_params(torch_params)
    ours = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8)
    before = optimizer_snapshot(ours)
    if "decoupled_weight_decay" not in sd["param_groups"][0]:  # torch < 2.5: indistinguishable from AdamW
        ours.load_state_dict(sd)
        assert ours.param_groups[0]["weight_decay"] == 0.1
        return
    with pytest.raises(ValueError, match=r"state_dict\['param_groups'\]\[0\]\['decoupled_weight_decay'\]=False with "
                                         r"weight_decay=0\.1 is torch\.optim\.Adam's L2 decay"):
        ours.load_state_dict(sd)
    assert_same_snapshot(before, optimizer_snapshot(ours))
    # the same checkpoint without decay, or with the mode chosen explicitly, loads
    explicit = copy.deepcopy(sd)
    explicit["param_groups"][0]["adam_w_mode"] = int(AdamWMode.ADAMW_TORCH)
    ours.load_state_dict(explicit)
    assert ours.param_groups[0]["adam_w_mode"] == AdamWMode.ADAMW_TORCH
    no_decay = copy.deepcopy(sd)
    no_decay["param_groups"][0]["weight_decay"] = 0.0
    ours.load_state_dict(no_decay)


# ---- other optimizers' checkpoints ---------------------------------------------------------------------------------

TORCH_VARIANTS = {"plain": {}, "amsgrad": dict(amsgrad=True), "maximize": dict(maximize=True)}
# torch and FusedAdam both run float32 arithmetic but group it differently: an ulp or two per step
TOL = dict(rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", TORCH_VARIANTS, ids=str)
def test_our_checkpoint_loads_into_torch_adamw_which_continues_as_we_do(variant, backend, monkeypatch):
    select_backend(monkeypatch, backend)
    params = _fp32_params()
    kwargs = dict(lr=1e-2, eps=1e-8, weight_decay=1e-2, **TORCH_VARIANTS[variant])
    ours = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, **kwargs)
    _steps(ours, params, 0, 20)
    torch_params = _clone_params(params)
    theirs = torch.optim.AdamW(torch_params, foreach=False, **kwargs)
    theirs.load_state_dict(_roundtrip(ours.state_dict()))
    for p, q in zip(params, torch_params):  # the state arrives exactly
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kwargs.get("amsgrad") else ()):
            assert_bitwise_equal(theirs.state[q][key], ours.state[p][key], key)
        assert float(theirs.state[q]["step"]) == 20
    _steps(ours, params, 20, 30)
    _steps(theirs, torch_params, 20, 30)
    for p, q in zip(params, torch_params):
        torch.testing.assert_close(p, q.detach(), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", TORCH_VARIANTS, ids=str)
def test_a_torch_adamw_checkpoint_loads_into_fused_adam_and_both_stay_equal(variant, backend, monkeypatch):
    select_backend(monkeypatch, backend)
    torch_params = _fp32_params()
    kwargs = dict(lr=1e-2, **TORCH_VARIANTS[variant])
    theirs = torch.optim.AdamW(torch_params, foreach=False, **kwargs)
    _steps(theirs, torch_params, 0, 20)
    params = _clone_params(torch_params)
    ours = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2, **kwargs)
    sd = theirs.state_dict()
    pristine = copy.deepcopy(sd)
    ours.load_state_dict(_roundtrip(sd))
    assert_tree_bitwise_equal(sd, pristine)
    group = ours.param_groups[0]
    assert (group["lr"], group["eps"], group["weight_decay"], group["adam_w_mode"]) == (1e-2, 1e-8, 1e-2, 2)
    assert "foreach" not in group and "fused" not in group, "torch's implementation switches are dropped"
    for p, q in zip(params, torch_params):
        assert float(ours.state[p]["step"]) == 20
        assert_bitwise_equal(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"], "exp_avg_sq")
    _steps(ours, params, 20, 30)
    _steps(theirs, torch_params, 20, 30)
    for p, q in zip(params, torch_params):
        torch.testing.assert_close(p, q.detach(), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("route", ["load_state_dict", "from_optimizer"])
def test_a_torch_checkpoint_with_an_empty_state_for_a_param_that_never_stepped_loads_as_torch_loads_it(
        route, backend, monkeypatch):
    """torch.optim's state is a defaultdict: reading state[p] of a param without a gradient yet (logging its step, say)
    leaves an empty dict, which its state_dict() saves. That param has no state yet: it starts at step 1 when its
    gradient comes, as in torch.optim.AdamW loaded from the same checkpoint."""
    select_backend(monkeypatch, backend)
    torch_params = _fp32_params()
    theirs = torch.optim.AdamW(torch_params, lr=1e-2, foreach=False)
    frozen = torch_params[1]
    for step in range(5):
        _set_grads(torch_params, step)
        frozen.grad = None
        theirs.step()
    assert theirs.state[frozen].get("step") is None  # (the read that leaves the empty dict)
    sd = theirs.state_dict()
    assert sd["state"][1] == {}
    params = _clone_params(torch_params)
    if route == "load_state_dict":
        ours = FusedAdam(params, lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2)
        ours.load_state_dict(sd)
    else:
        source = _torch_adamw_loaded(params, sd)
        assert source.state_dict()["state"][1] == {}
        ours = FusedAdam.from_optimizer(source)
    assert not ours.state.get(params[1]) and float(ours.state[params[0]]["step"]) == 5
    torch_copy = _clone_params(torch_params)
    theirs_copy = _torch_adamw_loaded(torch_copy, sd)
    _steps(ours, params, 5, 10)
    _steps(theirs_copy, torch_copy, 5, 10)
    for p, q in zip(params, torch_copy):
        torch.testing.assert_close(p, q.detach(), **TOL)


def _torch_adamw_loaded(params, sd):
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    opt.load_state_dict(sd)
    return opt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("torch_class", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_from_optimizer_continues_exactly_as_torch_would(torch_class, backend, monkeypatch):
    """Two param groups with their own hyperparameters, amsgrad in one; converted after 15 steps."""
    select_backend(monkeypatch, backend)
    torch_params = _fp32_params()
    decay = 0.05 if torch_class is torch.optim.AdamW else 0.0
    theirs = torch_class([{"params": torch_params[:2], "amsgrad": True},
                          {"params": torch_params[2:], "lr": 3e-3, "maximize": True, "betas": (0.8, 0.99)}],
                         lr=1e-2, weight_decay=decay, foreach=False)
    _steps(theirs, torch_params, 0, 15)
    ours = FusedAdam.from_optimizer(theirs, master_weights=True)
    params = [p for group in ours.param_groups for p in group["params"]]
    assert all(a is b for a, b in zip(params, torch_params)), "the same param objects"
    assert ours.param_groups[1]["betas"] == (0.8, 0.99) and ours.param_groups[1]["maximize"]
    assert all(g["adam_w_mode"] == AdamWMode.ADAMW_TORCH for g in ours.param_groups)
    # torch keeps stepping its own copy of the params from here
    torch_copy = _clone_params(torch_params)
    theirs_copy = torch_class([{"params": torch_copy[:2], "amsgrad": True},
                               {"params": torch_copy[2:], "lr": 3e-3, "maximize": True, "betas": (0.8, 0.99)}],
                              lr=1e-2, weight_decay=decay, foreach=False)
    theirs_copy.load_state_dict(theirs.state_dict())
    _steps(ours, params, 15, 25)
    _steps(theirs_copy, torch_copy, 15, 25)
    for p, q in zip(params, torch_copy):
        torch.testing.assert_close(p, q.detach(), **TOL)
        assert float(ours.state[p]["step"]) == 40


def test_torch_adams_l2_decay_is_refused_in_the_same_words_wherever_it_comes_in():
    """A group with decoupled_weight_decay=False and weight_decay > 0 (torch.optim.Adam's L2 decay): put into a
    FusedAdam group before a step, in a checkpoint without adam_w_mode, or in the torch.optim.Adam that from_optimizer
    converts. One ValueError naming the entry, one explanation, and what to do there."""
    explanation = ("=False with weight_decay=0.1 is torch.optim.Adam's L2 decay with torch's eps placement, which no "
                   "FusedAdam mode reproduces, so its moments would continue under different math. Train on with "
                   "torch.optim.Adam, or choose the mode knowingly: ")
    params = _fp32_params()
    opt = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.1)
    opt.param_groups[0]["decoupled_weight_decay"] = False
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError) as grouped:
        _steps(opt, params, 0, 1)
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, before))
    assert str(grouped.value).startswith("param_groups[0]: decoupled_weight_decay" + explanation + "set the group's")
    saved = torch.optim.AdamW(_fp32_params(), weight_decay=0.1).state_dict()
    saved["param_groups"][0]["decoupled_weight_decay"] = False
    with pytest.raises(ValueError) as loaded:
        FusedAdam(_fp32_params()).load_state_dict(saved)
    assert str(loaded.value).startswith("state_dict['param_groups'][0]['decoupled_weight_decay']" + explanation
                                        + "add 'adam_w_mode'")
    with pytest.raises(ValueError) as converted:
        FusedAdam.from_optimizer(torch.optim.Adam(_fp32_params(), weight_decay=0.1))
    assert str(converted.value).startswith("param_groups[0]: decoupled_weight_decay" + explanation
                                           + "construct FusedAdam with adam_w_mode")


def test_from_optimizer_refuses_adam_with_weight_decay_and_other_optimizers():
    params = _fp32_params()
    with pytest.raises(ValueError, match=r"param_groups\[0\]: decoupled_weight_decay=False with weight_decay=0\.1 is "
                                         r"torch\.optim\.Adam's L2 decay with torch's eps placement, which no FusedAdam "
                                         r"mode reproduces"):
        FusedAdam.from_optimizer(torch.optim.Adam(params, weight_decay=0.1))
    with pytest.raises(TypeError, match=r"converts torch\.optim\.Adam and torch\.optim\.AdamW, got SGD"):
        FusedAdam.from_optimizer(torch.optim.SGD(params, lr=0.1))
    differentiable = torch.optim.AdamW(params, differentiable=True)
    before = copy.deepcopy(differentiable.state_dict())
    with pytest.raises(ValueError, match=r"param_groups\[0\]: differentiable=True is not supported: the step updates "
                                         r"the params in place .* Set it to False"):
        FusedAdam.from_optimizer(differentiable)
    assert differentiable.state_dict() == before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [AdamWMode.ADAM_L2_REGULARIZATION, AdamWMode.ADAMW_TRANSFORMERS], ids=["L2", "HF"])
def test_an_ort_fused_adam_checkpoint_loads(mode, backend, monkeypatch):
    """onnxruntime.training.optim.FusedAdam (1.19.2) saves torch's Optimizer.state_dict() of its own groups:

        {"state": {id: {"exp_avg": T, "exp_avg_sq": T}},           # moments in the param's dtype (fp16 or fp32),
                                                                   # no per-param step, ids of params ever stepped
         "param_groups": [{"lr", "bias_correction", "betas", "eps", "weight_decay",
                           "step": int,                            # ONE step count per group
                           "params": [ids]}]}                      # no adam_w_mode: it lives on the object

    Every param with state gets the group's step; adam_w_mode comes from our constructor; fp16 moments load into
    whatever state dtype this optimizer uses (here fp32 with fp32 masters)."""
    select_backend(monkeypatch, backend)
    g = torch.Generator().manual_seed(41)
    params = [torch.nn.Parameter(torch.randn(6, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g).half()),
              torch.nn.Parameter(torch.randn(3, generator=g))]  # the last one never had a gradient under ORT
    moments = {i: {"exp_avg": 0.01 * torch.randn(p.shape, generator=g).to(p.dtype),
                   "exp_avg_sq": 1e-4 * torch.rand(p.shape, generator=g).to(p.dtype)} for i, p in enumerate(params[:2])}
    ort_checkpoint = {
        "state": moments,
        "param_groups": [{"lr": 2e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-6,
                          "weight_decay": 0.01, "step": 7, "params": [0, 1, 2]}],
    }
    pristine = copy.deepcopy(ort_checkpoint)
    opt = FusedAdam(params, adam_w_mode=mode, master_weights=True)
    opt.load_state_dict(_roundtrip(ort_checkpoint))
    assert_tree_bitwise_equal(ort_checkpoint, pristine)
    group = opt.param_groups[0]
    assert group["lr"] == 2e-3 and group["weight_decay"] == 0.01 and group["adam_w_mode"] == mode
    assert "step" not in group, "the per-group step becomes per-parameter steps"
    assert [float(opt.state[p]["step"]) for p in params[:2]] == [7.0, 7.0]
    assert not opt.state.get(params[2])
    assert opt.state[params[1]]["exp_avg"].dtype == torch.float32
    assert "master_param" not in opt.state[params[1]], "the master is made from the param at its next step"

    # it continues as the float64 reference started from the same moments and step
    reference = ReferenceAdam(params, lr=2e-3, eps=1e-6, weight_decay=0.01, mode=int(mode), master_weights=True)
    for i in range(2):
        reference.states[i] = {"step": 7, "m": moments[i]["exp_avg"].double(), "v": moments[i]["exp_avg_sq"].double(),
                               "vmax": torch.zeros(params[i].shape, dtype=torch.float64)}
    for step in range(5):
        _set_grads(params, step)
        grads = [p.grad for p in params]
        opt.step()
        reference.step(grads)
    for i, p in enumerate(params):
        torch.testing.assert_close(p.double(), reference.param(i), rtol=2.0**-10 if p.dtype == torch.float16 else 1e-6,
                                   atol=1e-7)
    assert [float(opt.state[p]["step"]) for p in params] == [12.0, 12.0, 5.0]


def test_state_dict_ignores_the_empty_entries_that_reading_optimizer_state_creates():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    opt = FusedAdam(params)
    params[0].grad = torch.ones(3)
    opt.step()
    assert opt.state[params[1]] == {}  # a defaultdict read: creates an empty entry
    saved = opt.state_dict()
    assert list(saved["state"]) == [0]
    FusedAdam(params).load_state_dict(saved)


# ---- values training produces load as they are ---------------------------------------------------------------------

# (1 - beta2) * g * g overflows float32 for |g| above about 5.8e20: v = inf for that element, as torch.optim.AdamW keeps
# it (its update is m / inf = 0 from then on); every other element trains on.
OVERFLOWING_GRAD = 6e20
OVERFLOW_STEP = 2


def _overflowing_steps(opt, params, first, count):
    """_steps, with the gradient of params[1][5] set to OVERFLOWING_GRAD at OVERFLOW_STEP."""
    for step in range(first, first + count):
        _set_grads(params, step)
        if step == OVERFLOW_STEP:
            params[1].grad[5] = OVERFLOWING_GRAD
        opt.step()


MOMENT_LAYOUTS = {  # what training with an overflowed second moment leaves in every storage dtype
    "fp32": {},
    "bf16": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    "fp16": {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16},
    "amsgrad": {"amsgrad": True},
    "8-bit": {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8, "amsgrad": True},
    "4-bit": {"exp_avg_dtype": torch.uint4, "exp_avg_sq_dtype": torch.uint4},
    "fp8 e4m3fn": {"exp_avg_dtype": torch.float8_e4m3fn, "exp_avg_sq_dtype": torch.float8_e4m3fn, "amsgrad": True},
    "fp8 e5m2": {"exp_avg_dtype": torch.float8_e5m2, "exp_avg_sq_dtype": torch.float8_e5m2},
}


@pytest.mark.parametrize("layout", MOMENT_LAYOUTS)
def test_a_checkpoint_holding_an_overflowed_second_moment_loads_with_a_warning_and_resumes_bit_for_bit(layout, backend):
    options = dict(lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=1e-2, **MOMENT_LAYOUTS[layout])
    params = _fp32_params()
    opt = FusedAdam(params, **options)
    _overflowing_steps(opt, params, 0, 4)
    saved = _roundtrip(opt.state_dict())
    assert torch.isinf(saved["state"][1]["exp_avg_sq"][5]) and torch.isfinite(saved["state"][1]["exp_avg"]).all()
    assert all(bool(torch.isfinite(p).all()) for p in params)

    resumed_params = _clone_params(params)
    resumed = FusedAdam(resumed_params, **options)
    with pytest.warns(RuntimeWarning, match=r"state_dict\['state'\]\[1\]\['exp_avg_sq'\].* holds? inf or NaN; loaded "):
        resumed.load_state_dict(saved)
    assert_tree_bitwise_equal(resumed.state_dict(), opt.state_dict(), "loaded")
    _overflowing_steps(opt, params, 4, 3)
    _overflowing_steps(resumed, resumed_params, 4, 3)
    for p, q in zip(params, resumed_params):
        assert_bitwise_equal(q.detach(), p.detach(), "resumed param")
    assert_tree_bitwise_equal(resumed.state_dict(), opt.state_dict(), "resumed state")


def test_training_through_an_overflowed_second_moment_equals_torch_adamw_and_their_checkpoints_cross_load():
    params = _fp32_params()
    torch_params = _clone_params(params)
    opt = FusedAdam(params, lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=1e-2)
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-2, weight_decay=1e-2, foreach=False)
    _overflowing_steps(opt, params, 0, 6)
    _overflowing_steps(torch_opt, torch_params, 0, 6)
    for p, q in zip(params, torch_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)
    assert float(params[1][5].detach()) == pytest.approx(float(torch_params[1][5].detach()), rel=1e-6)  # (its updates are 0 after it)
    assert torch.isinf(torch_opt.state_dict()["state"][1]["exp_avg_sq"][5])
    with pytest.warns(RuntimeWarning, match="holds? inf or NaN"):
        FusedAdam(_clone_params(params)).load_state_dict(torch_opt.state_dict())
    torch.optim.AdamW(_clone_params(params)).load_state_dict(opt.state_dict())


def test_a_diverged_runs_checkpoint_with_inf_masters_loads_and_resumes_bit_for_bit(backend):
    """No skip without grad_scale or max_grad_norm: an inf gradient makes the masters (and params) inf or NaN, as it
    makes torch's params; that run's checkpoint still loads and continues exactly."""
    options = dict(master_weights=True, lr=1e-2)
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _fp32_params()]
    opt = FusedAdam(params, **options)
    _steps(opt, params, 0, 2)
    _set_grads(params, 2)
    params[0].grad[0, 0] = float("inf")
    opt.step()
    saved = opt.state_dict()
    assert not torch.isfinite(saved["state"][0]["master_param"]).all()
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = FusedAdam(resumed_params, **options)
    with pytest.warns(RuntimeWarning, match=r"state_dict\['state'\]\[0\]\['exp_avg'\].*\['master_param'\]"):
        resumed.load_state_dict(saved)
    _steps(opt, params, 3, 2)
    _steps(resumed, resumed_params, 3, 2)
    for p, q in zip(params, resumed_params):
        assert_bitwise_equal(q.detach(), p.detach(), "resumed param")
    assert_tree_bitwise_equal(resumed.state_dict(), opt.state_dict(), "resumed state")


def test_a_checkpoint_without_masters_leaves_them_to_the_params_next_step(backend):
    """Loaded into an optimizer with master weights, a checkpoint without masters (torch's AdamW's, or one saved before
    ``master_weights`` was switched on) leaves each master to its param's next step, as a state made before the switch
    does: a model checkpoint loaded after the optimizer's is what the masters start from, and a run resumed right
    after the switch equals the run that did not stop, bit for bit, whatever is written into the params between."""
    def run(resume: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _fp32_params()]
        opt = FusedAdam(params, lr=1e-2)
        _steps(opt, params, 0, 2)
        opt.master_weights = True
        if resume:
            saved = _roundtrip(opt.state_dict())
            params = _clone_params(params)
            opt = FusedAdam(params, lr=1e-2, master_weights=True)
            opt.load_state_dict(saved)
            assert not any("master_param" in opt.state[p] for p in params)
        with torch.no_grad():
            for p in params:  # the model's weights loaded after the optimizer's state
                p.copy_(torch.linspace(-1, 1, p.numel()).view(p.shape))
        _steps(opt, params, 2, 3)
        return [p.detach() for p in params] + [opt.state[p]["master_param"] for p in params]

    for continued, resumed in zip(run(False), run(True)):
        assert_bitwise_equal(resumed, continued, "resumed")
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _fp32_params()]
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    _steps(torch_opt, params, 0, 1)
    opt = FusedAdam(_clone_params(params), lr=1e-2, master_weights=True, adam_w_mode=AdamWMode.ADAMW_TORCH)
    opt.load_state_dict(_roundtrip(torch_opt.state_dict()))
    mine = opt.param_groups[0]["params"]
    with torch.no_grad():
        for p in mine:
            p.fill_(3.0)
    _steps(opt, mine, 1, 1)
    for p in mine:
        assert float((opt.state[p]["master_param"] - 3.0).abs().max()) < 0.1, "the master starts from the new weights"


def _through_torch_adamw(torch_steps: int) -> tuple[list, list, FusedAdam, torch.optim.AdamW, dict]:
    """An fp16 model with FusedAdam's fp32 masters, checkpointed after 2 steps; the checkpoint loaded into
    torch.optim.AdamW, which trains the same model on for torch_steps (fp16 math: the masters ride along untouched)
    and saves. Returns (FusedAdam's params, torch's params, the FusedAdam, the AdamW, AdamW's checkpoint)."""
    kwargs = dict(lr=1e-2, eps=1e-8, weight_decay=1e-2)
    params = [torch.nn.Parameter(p.detach().to(torch.float16)) for p in _fp32_params()]
    opt = FusedAdam(params, master_weights=True, adam_w_mode=AdamWMode.ADAMW_TORCH, **kwargs)
    _steps(opt, params, 0, 2)
    torch_params = _clone_params(params)
    theirs = torch.optim.AdamW(torch_params, foreach=False, **kwargs)
    theirs.load_state_dict(_roundtrip(opt.state_dict()))
    _steps(theirs, torch_params, 2, torch_steps)
    return params, torch_params, opt, theirs, _roundtrip(theirs.state_dict())


def test_masters_that_torch_adamw_carried_while_it_trained_are_left_out_and_the_run_continues_from_its_params():
    """torch.optim.AdamW's load casts FusedAdam's fp32 masters to the params' fp16 and keeps them, never updated: after
    torch trained on, they are the masters of the step before torch's first. Loaded back, a master in its param's own
    dtype is left out (it holds no more than the param), each master then starts from its param, and the run
    continues from the weights torch trained, about as torch.optim.AdamW itself continues (fp32 masters against
    torch's fp16 math), not from the stale masters."""
    _, torch_params, _, theirs, saved = _through_torch_adamw(torch_steps=20)
    assert all(state["master_param"].dtype == torch.float16 for state in saved["state"].values()), "torch carried them"
    mine = _clone_params(torch_params)  # the model's weights as torch left them
    back = FusedAdam(mine, lr=1e-2, eps=1e-8, weight_decay=1e-2, master_weights=True,
                     adam_w_mode=AdamWMode.ADAMW_TORCH)
    back.load_state_dict(saved)
    assert not any("master_param" in back.state[p] for p in mine)
    _steps(back, mine, 22, 3)
    _steps(theirs, torch_params, 22, 3)
    for p, q in zip(mine, torch_params):
        apart = float((p.detach().float() - q.detach().float()).abs().max())
        assert apart <= 4e-3 * max(1.0, float(q.detach().float().abs().max())), apart
    # (the stale masters alone would have pulled the weights back by torch's 20 steps)
    stale = [saved["state"][i]["master_param"] for i in range(len(mine))]
    assert any(float((p.detach().float() - m.float()).abs().max()) > 0.05 for p, m in zip(mine, stale))


def test_a_resume_that_loads_the_optimizer_before_the_model_keeps_its_fp32_masters_bit_for_bit():
    """The masters of FusedAdam's own checkpoint are float32 and always load, whatever the groups hold (keys of
    torch's own, given to FusedAdam's groups, included) and whatever the params hold at the load: the run resumed
    with the optimizer's state loaded first and the model's weights second equals the run that never stopped."""
    def run(resume: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _fp32_params()]
        opt = FusedAdam([{"params": params, "foreach": None}], lr=1e-2, master_weights=True)
        _steps(opt, params, 0, 2)
        if resume:
            saved, weights = _roundtrip(opt.state_dict()), [p.detach().clone() for p in params]
            params = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]  # a fresh model, not loaded yet
            opt = FusedAdam([{"params": params, "foreach": None}], lr=1e-2, master_weights=True)
            opt.load_state_dict(saved)
            with torch.no_grad():
                for p, w in zip(params, weights):
                    p.copy_(w)
        _steps(opt, params, 2, 3)
        return [p.detach() for p in params] + [opt.state[p]["master_param"] for p in params]

    for continued, resumed in zip(run(False), run(True)):
        assert_bitwise_equal(resumed, continued, "resumed")


def test_an_empty_dict_in_place_of_a_master_or_a_block_scale_is_no_entry():
    """torch.distributed.checkpoint's flattened state dict comes back unflattened by the live state's keys, an empty
    dict for each key the checkpoint lacks (block scales, a master the checkpoint does not have): such a master loads
    as no master (taken from the param at the next step), while an empty dict under any other key is refused."""
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _fp32_params()]
    source = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    _steps(source, source.param_groups[0]["params"], 0, 2)
    sd = source.state_dict()
    for state in sd["state"].values():
        state.update(master_param={}, exp_avg_sq_scale={})
    opt = FusedAdam(params, lr=1e-2, master_weights=True, exp_avg_sq_dtype=torch.float16)
    opt.load_state_dict(sd)
    assert not any("master_param" in opt.state[p] for p in params)
    assert all(float(opt.state[p]["step"]) == 2 for p in params)
    sd["state"][0]["exp_avg"] = {}
    before = optimizer_snapshot(opt)
    with pytest.raises(TypeError, match=re.escape("state_dict['state'][0]['exp_avg'] must be a tensor")):
        opt.load_state_dict(sd)
    assert_same_snapshot(before, optimizer_snapshot(opt))


def test_state_entries_the_optimizer_does_not_keep_are_not_saved_and_the_warning_names_them():
    """``optimizer.state[p]['my_ema'] = t``: the step takes it along, but FusedAdam's checkpoint holds the
    optimizer's own state (its load refuses other keys, which is how another optimizer's checkpoint shows), so
    state_dict() leaves it out and says so, and the checkpoint loads back. (torch.optim.AdamW saves it.)"""
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = FusedAdam(params, lr=1e-2, exp_avg_dtype=torch.uint8)
    _steps(opt, params, 0, 1)
    opt.state[params[1]]["my_ema"] = torch.full((5,), 7.0)
    _steps(opt, params, 1, 1)
    with pytest.warns(RuntimeWarning, match=r"state\[1\]\['my_ema'\]: not saved"):
        saved = opt.state_dict()
    assert all(set(state) <= {"step", "exp_avg", "exp_avg_sq"} for state in saved["state"].values())
    del opt.state[params[1]]["my_ema"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_tree_bitwise_equal(opt.state_dict(), saved, "saved without the extra entry")
    FusedAdam(_clone_params(params), lr=1e-2, exp_avg_dtype=torch.uint8).load_state_dict(saved)


BLOCKS = {torch.uint8: 256, torch.uint4: 128, torch.float8_e4m3fn: 256}


@pytest.mark.parametrize("target", list(BLOCKS), ids=str)
@pytest.mark.parametrize("key,value", [("exp_avg", math.nan), ("exp_avg", math.inf), ("exp_avg_sq", math.nan)],
                         ids=["nan-exp_avg", "inf-exp_avg", "nan-exp_avg_sq"])
def test_a_diverged_fp32_checkpoint_loads_into_block_scaled_moments_with_its_block_nan(target, key, value):
    """A float32-moment run that met one inf or NaN gradient element has an inf or NaN in its moments (torch's AdamW
    too). Loaded into 8-bit, 4-bit or fp8 moments, it loads with the RuntimeWarning, as it loads into float moments:
    the element's block reads back as NaN, as the step that meets such a value stores it, and every other block is
    what the same checkpoint without that element gives, bit for bit."""
    p = torch.nn.Parameter(torch.randn(700))
    source = FusedAdam([p], lr=1e-3)
    p.grad = torch.randn(700)
    source.step()
    clean = source.state_dict()
    diverged = copy.deepcopy(clean)
    diverged["state"][0][key][300] = value
    loaded = {}
    for name, sd in (("clean", clean), ("diverged", diverged)):
        opt = FusedAdam([torch.nn.Parameter(p.detach().clone())], lr=1e-3, exp_avg_dtype=target,
                        exp_avg_sq_dtype=target)
        if name == "diverged":
            with pytest.warns(RuntimeWarning, match=re.escape(f"state_dict['state'][0][{key!r}]")):
                opt.load_state_dict(sd)
        else:
            opt.load_state_dict(sd)
        loaded[name] = opt.state_dict()["state"][0]
    block = BLOCKS[target]
    inside = torch.zeros(700, dtype=torch.bool)
    inside[300 // block * block:(300 // block + 1) * block] = True
    assert bool(loaded["diverged"][key][inside].isnan().all()), "the element's block reads back as NaN"
    for moment in ("exp_avg", "exp_avg_sq"):
        assert_bitwise_equal(loaded["diverged"][moment][~inside], loaded["clean"][moment][~inside], moment)


@pytest.mark.parametrize("value", [-1.0, float("-inf")], ids=["negative", "-inf"])
def test_what_training_cannot_produce_stays_refused_a_negative_second_moment(value):
    params = _fp32_params()
    opt = FusedAdam(params)
    _steps(opt, params, 0, 1)
    sd = opt.state_dict()
    sd["state"][1]["exp_avg_sq"][7] = value
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[1\]\['exp_avg_sq'\] holds negative values"):
        opt.load_state_dict(sd)
    assert_same_snapshot(before, optimizer_snapshot(opt))


# ---- any checkpoint, fuzzed: restored exactly or refused naming the entry --------------------------------------------


# Examples per run: 2000 per environment in `make test` (ORT_OPTIM_FUZZ_EXAMPLES replaces it, tests/conftest.py);
# derandomized, so every run tries the same ones and a failure reproduces.
EXAMPLES = fuzz_examples(2000)

# ---- the optimizers under test -------------------------------------------------------------------------------------

# Two param groups over tiny params of every dtype; fp16 (block-scaled) first moments, bf16 second moments, fp32
# masters for the low-precision params: each storage layout is restored. The optimizer that loads also comes with
# 8-bit and 4-bit moments (FUZZ_MOMENTS): the canonical checkpoints are quantised into them, and their own checkpoints
# must restore them bit for bit.
SHAPES = [((4,), torch.float32), ((2, 3), torch.bfloat16), ((), torch.float32), ((3,), torch.float16)]
OPTIONS = dict(lr=1e-2, weight_decay=0.01, master_weights=True, adam_w_mode=AdamWMode.ADAMW_TORCH)
FUZZ_MOMENTS = {"fp16 m, bf16 v": (torch.float16, torch.bfloat16), "8-bit m, 4-bit v": (torch.uint8, torch.uint4),
                "4-bit": (torch.uint4, torch.uint4)}
ORIGINAL_MOMENTS = "fp16 m, bf16 v"


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape, dtype in SHAPES]


def _groups(params):
    return [{"params": params[:3]}, {"params": params[3:], "amsgrad": True, "lr": 3e-3}]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _trained(seed: int, steps: int, layout: str = ORIGINAL_MOMENTS):
    params = _params(seed)
    m_dtype, v_dtype = FUZZ_MOMENTS[layout]
    opt = FusedAdam(_groups(params), **OPTIONS, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype)
    for step in range(steps):
        _grads(params, step)
        opt.step()
    return params, opt


def _foreign(kind: str) -> dict:
    """Another optimizer's checkpoint over params of the same shapes and grouping (fp32 params: torch's
    optimizers need one dtype for their reference paths)."""
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape, _ in SHAPES]
    groups = [{"params": params[:3]}, {"params": params[3:]}]
    if kind == "ort":  # onnxruntime.training.optim.FusedAdam 1.19.2: one step per group, moments in the param dtype
        return {
            "state": {i: {"exp_avg": 0.01 * torch.randn(shape, generator=g).to(dtype),
                          "exp_avg_sq": 1e-4 * torch.rand(shape, generator=g).to(dtype)}
                      for i, (shape, dtype) in enumerate(SHAPES)},
            "param_groups": [{"lr": 2e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-6,
                              "weight_decay": 0.01, "step": 7, "params": [0, 1, 2]},
                             {"lr": 2e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-6,
                              "weight_decay": 0.0, "step": 3, "params": [3]}],
        }
    opt = {
        "sgd": lambda: torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=False),
        "adam": lambda: torch.optim.Adam(groups, lr=1e-2, foreach=False),
        "adam-l2": lambda: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.1, foreach=False),
        "adamw-amsgrad": lambda: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, foreach=False),
    }[kind]()
    for step in range(2):
        _grads(params, step)
        opt.step()
    return copy.deepcopy(opt.state_dict())


SOURCE_PARAMS, SOURCE = _trained(seed=1, steps=3)
ORIGINAL = SOURCE.state_dict()
FOREIGN = {kind: _foreign(kind) for kind in ("sgd", "adam", "adam-l2", "adamw-amsgrad", "ort")}


def _fresh_target(layout: str = ORIGINAL_MOMENTS):
    """The optimizer that loads: trained a step on other params, so a refused load has state to leave alone."""
    return _trained(seed=2, steps=1, layout=layout)


# ---- mutations -----------------------------------------------------------------------------------------------------


def _clone(tree):
    """A copy of a checkpoint tree (tensors cloned, containers rebuilt): copy.deepcopy, several times faster."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: _clone(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(value) for value in tree)
    return tree


def _paths(tree, prefix=()):
    """Every entry's path (keys from the root), containers before their contents."""
    out = []
    if isinstance(tree, dict):
        items = list(tree.items())
    elif isinstance(tree, (list, tuple)):
        items = list(enumerate(tree))
    else:
        return out
    for key, value in items:
        out.append(prefix + (key,))
        out.extend(_paths(value, prefix + (key,)))
    return out


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set_at(tree, path, value):
    """Sets tree[path] = value, rebuilding tuples on the way (they cannot be assigned into)."""
    if not path:
        return value
    parent = _get(tree, path[:-1])
    if isinstance(parent, tuple):
        items = list(parent)
        items[path[-1]] = value
        return _set_at(tree, path[:-1], tuple(items))
    parent[path[-1]] = value
    return tree


NAN, INF = float("nan"), float("inf")
PLAIN_VALUES = [
    None, "False", "True", "no", "", "1e-3", "exp_avg", b"\x00", 0, 1, -1, 2, 3, 7, 2**53, 2**53 + 2, 2**70, 0.0, 0.5,
    -0.5, 0.9, 1.0, 1.5, 1e-8, 1e300, -1e300, NAN, INF, -INF, True, False, [], [0.9, 0.999], (0.9,),
    (0.9, 0.999, 0.5), ("0.9", "0.999"), [0, 1, 2], [0, 0, 1], {}, {"exp_avg": 0}, AdamWMode.ADAMW_TORCH,
    AdamWMode.ADAM_L2_REGULARIZATION,
]
TENSOR_SHAPES = [(), (1,), (2,), (3,), (4,), (2, 3), (3, 2), (5,), (0,), (1, 4)]
TENSOR_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
                 torch.complex64]
TENSOR_FILLS = [0.0, 1.0, -1.0, 0.5, 3.0, 1e-3, NAN, INF, -INF, 1e30, 3.4e38, 1e-40, 1e300, "random"]
NEW_KEYS = ["momentum_buffer", "foo", 99, 1.5, "step", "exp_avg", "exp_avg_scale", "initial_lr",
            "decoupled_weight_decay", "adam_w_mode", "params", "state", "momentum", (0, 1)]


@st.composite
def tensors(draw):
    shape = draw(st.sampled_from(TENSOR_SHAPES))
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    fill = draw(st.sampled_from(TENSOR_FILLS))
    if draw(st.integers(0, 15)) == 0:
        return torch.empty(shape, dtype=dtype, device="meta")
    if fill == "random":
        values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 9))),
                             dtype=torch.float64)
    else:
        values = torch.full(shape, fill, dtype=torch.float64)
    if dtype in (torch.int64, torch.int32, torch.bool):
        values = values.nan_to_num(0.0, 0.0, 0.0).clamp(-1e6, 1e6)
    return values.to(dtype)


# (fresh copies: a later mutation may add a key to a drawn {}, which must not change the pool)
values = st.one_of(st.sampled_from(PLAIN_VALUES).map(lambda v: _clone(v)), tensors())


def _convert(value):
    """The same contents in another container type."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return dict(enumerate(value)) if value else ()
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() < 16 and not value.is_meta else value
    return [value]


def _perturb(value, seed: int):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 0.5 if seed % 2 else value + 1  # (an AdamWMode becomes a plain int)
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.is_meta:
        g = torch.Generator().manual_seed(seed)
        fresh = torch.rand(value.shape, generator=g, dtype=torch.float64) * 2.0**(seed - 5)
        return (fresh.round() if value.dim() == 0 else fresh).to(value.dtype)  # (0-dim: a step, whole)
    return value


@st.composite
def mutated_checkpoints(draw):
    """(checkpoint, paths it was mutated at, a description for failure reports)."""
    base = draw(st.sampled_from(["original"] * 4 + list(FOREIGN)))
    sd = _clone(ORIGINAL if base == "original" else FOREIGN[base])
    touched, steps = [], [base]
    if base != "original":
        touched.append(())
    for _ in range(draw(st.integers(0, 3))):
        paths = _paths(sd)
        kind = draw(st.sampled_from(["replace", "replace", "replace", "perturb", "perturb", "delete", "add",
                                     "convert", "swap"]))
        if not paths:
            kind = "add"
        if kind == "perturb":  # another value of the same kind, usually valid
            path = draw(st.sampled_from(paths))
            sd = _set_at(sd, path, _perturb(_get(sd, path), draw(st.integers(0, 9))))
        elif kind == "replace":
            path = draw(st.sampled_from(paths))
            value = draw(values)
            sd = _set_at(sd, path, value)
        elif kind == "delete":
            path = draw(st.sampled_from(paths))
            parent = _get(sd, path[:-1])
            if isinstance(parent, dict):
                del parent[path[-1]]
            elif isinstance(parent, list):
                parent.pop(path[-1])
            else:
                sd = _set_at(sd, path[:-1], tuple(v for i, v in enumerate(parent) if i != path[-1]))
        elif kind == "add":
            dicts = [()] + [p for p in paths if isinstance(_get(sd, p), dict)]
            where = draw(st.sampled_from(dicts))
            key = draw(st.sampled_from(NEW_KEYS))
            path = where + (key,)
            _get(sd, where)[key] = draw(values)
        elif kind == "convert":
            path = draw(st.sampled_from(paths))
            sd = _set_at(sd, path, _convert(_get(sd, path)))
        else:  # swap two entries, neither inside the other
            a = draw(st.sampled_from(paths))
            others = [p for p in paths if p[:len(a)] != a and a[:len(p)] != p]
            if not others:
                continue
            b = draw(st.sampled_from(others))
            va, vb = _get(sd, a), _get(sd, b)
            sd = _set_at(_set_at(sd, a, vb), b, va)
            touched.append(b)
            path = a
        touched.append(path)
        steps.append(f"{kind} {entry(*path)}")
    return sd, touched, "; ".join(steps)


# ---- the oracle ----------------------------------------------------------------------------------------------------


def _names_a_related_entry(message: str, touched: list[tuple]) -> bool:
    """The message starts with the entry it is about, and that entry is a mutated one, an ancestor of one (a list
    that lost an item, say) or a descendant (a key inside a replaced dict), or a cross-reference: a state whose id
    the mutated group no longer lists."""
    if not message.startswith("state_dict"):
        return False
    if any(path == () for path in touched):  # a whole other checkpoint: any entry of it
        return True
    for path in touched:
        for depth in range(1, len(path) + 1):
            if entry(*path[:depth]) in message:
                return True
    return False


def _step_value(value) -> float:
    return float(value.reshape(()).double()) if isinstance(value, torch.Tensor) else float(value)


def _check_restored(target, params, sd, layout: str) -> None:
    """The loaded optimizer holds what sd says."""
    ids = {}
    for group, saved in zip(target.param_groups, sd["param_groups"]):
        for key, value in saved.items():
            if key in ("params", "step", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"):
                continue
            if key == "betas":
                assert group[key] == tuple(value)
            elif key == "adam_w_mode":
                assert type(group[key]) is int and group[key] == int(value)
            else:  # the options and any other key (a scheduler's, the user's), as saved
                assert_tree_bitwise_equal(group[key], value, key)
        ids.update(zip(saved["params"], zip(group["params"], [saved.get("step")] * len(saved["params"]))))
    for p in params:
        assert bool(target.state.get(p)) == any(ids[i][0] is p for i in sd["state"]), "state only where saved"
    for saved_id, saved in sd["state"].items():
        p, group_step = ids[saved_id]
        state = target.state[p]
        assert float(state["step"]) == _step_value(saved.get("step", group_step))
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state and state[key].dtype == torch.uint8:
                # 8-bit/4-bit codes: exactly the reference quantiser's round trip of the saved values
                # (a 4-bit exp_avg relative to its exp_avg_sq as loaded: ort_optim._spec.EXP_AVG_RELATIVE)
                dtype = FUZZ_MOMENTS[layout][key != "exp_avg"]
                root = None
                if key == "exp_avg" and dtype == torch.uint4:
                    root = formats.state_root(state["exp_avg_sq"], state["exp_avg_sq_scale"], p.shape)
                expected = formats.decode_state(
                    *formats.encode_state(saved[key].float(), dtype, key != "exp_avg", root), key != "exp_avg",
                    p.shape, root)
                assert_bitwise_equal(to_canonical(state, key, p.shape), expected, key)
            elif key in state:
                expected = saved[key].double()
                got = to_canonical(state, key, p.shape).double()
                # within the storage dtype's rounding: bf16 keeps 8 bits, block-scaled fp16 11 bits of the block max
                # (values below float32's normal range may flush or lose bits: 2**-126 absolute)
                tol = 2.0**-8 if state[key].dtype == torch.bfloat16 else 2.0**-10
                bound = tol * (expected.abs() + (expected.abs().max() if state[key].dtype == torch.float16 else 0))
                bound = bound + 2.0**-126
                same = (got - expected).abs() <= bound
                same |= (got == expected) | (got.isnan() & expected.isnan())  # (inf and NaN load as they are)
                assert bool(same.all()), key
        if "master_param" in state and "master_param" in saved:
            assert_bitwise_equal(state["master_param"], saved["master_param"].float(), "master_param")


def _continue_both(a_params, a, b_params, b, steps=2) -> None:
    for step in range(steps):
        _grads(a_params, 50 + step)
        _grads(b_params, 50 + step)
        a.step()
        b.step()
    for p, q in zip(a_params, b_params):  # (NaN moments, from a checkpoint holding them, stay NaN of unspecified bits)
        assert_bitwise_equal_but_nan_bits(p.detach(), q.detach(), "param")
        assert a.state[p].keys() == b.state[q].keys()
        for key in a.state[p]:
            assert_bitwise_equal_but_nan_bits(a.state[p][key], b.state[q][key], key)


def _same_meaning(a: dict, b: dict) -> bool:
    try:
        assert_tree_bitwise_equal(a, b)
        return True
    except AssertionError:
        return False


@pytest.mark.no_interpreter
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=mutated_checkpoints(), layout=st.sampled_from([ORIGINAL_MOMENTS] + list(FUZZ_MOMENTS)))
def test_every_load_restores_exactly_or_refuses_naming_the_entry_and_changes_nothing(case, layout):
    sd, touched, description = case
    pristine = _clone(sd)
    params, target = _fresh_target(layout)
    before = optimizer_snapshot(target)
    try:
        target.load_state_dict(sd)
    except (ValueError, TypeError) as error:
        message = str(error)
        assert _names_a_related_entry(message, touched), f"{description}: {type(error).__name__}: {message}"
        assert_same_snapshot(before, optimizer_snapshot(target))
        assert_tree_bitwise_equal(sd, pristine, "the given dict")
        return
    assert_tree_bitwise_equal(sd, pristine, "the given dict")
    _check_restored(target, params, sd, layout)
    # its own checkpoint restores it exactly: a twin loaded from it continues bit for bit
    saved = target.state_dict()
    twin_params, twin = _fresh_target(layout)
    with torch.no_grad():
        for p, q in zip(params, twin_params):
            q.copy_(p)
    twin.load_state_dict(saved)
    assert_tree_bitwise_equal(twin.state_dict(), saved, "twin")
    if layout == ORIGINAL_MOMENTS and _same_meaning(saved, ORIGINAL):
        # the checkpoint says what the original said: with the original's model params, the load continues exactly
        # like the original optimizer that wrote it
        original_params, original = copy.deepcopy((SOURCE_PARAMS, SOURCE))
        with torch.no_grad():
            for p, q in zip(params, original_params):
                p.copy_(q)
        _continue_both(params, target, original_params, original)
    else:
        _continue_both(params, target, twin_params, twin)


@pytest.mark.no_interpreter
def test_the_fuzzer_reaches_both_outcomes_and_every_kind_of_base():
    """The strategy is not degenerate: unmutated-meaning loads, refused loads and accepted changes all occur."""
    outcomes = {"refused": 0, "accepted": 0}
    bases = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,  # (a check of the strategy itself)
              suppress_health_check=list(HealthCheck))
    @given(case=mutated_checkpoints())
    def probe(case):
        sd, touched, description = case
        bases.add(description.split(";")[0])
        params, target = _fresh_target()
        try:
            target.load_state_dict(sd)
            outcomes["accepted"] += 1
        except (ValueError, TypeError):
            outcomes["refused"] += 1

    probe()
    assert outcomes["refused"] > 50 and outcomes["accepted"] > 30, outcomes
    assert bases == {"original"} | set(FOREIGN), bases


def _configured(config: Configuration, steps: list):
    params = config.params()
    opt = FusedAdam(config.param_groups(params), **config.options)
    for k, grads in enumerate(steps):
        for i, (p, grad) in enumerate(zip(params, grads)):
            p.grad = None if grad is None else gradient(p, grad, 1000 * k + i)
        opt.step()
    return params, opt


# Examples: 150 in each CPU environment; 50 in the Triton suite (ORT_OPTIM_BACKEND=triton), where every step of an
# example runs in Triton's interpreter (the 150 took over a minute there). What a load checks and converts is the
# same code on every backend; the Triton suite's examples are there for the steps before and after it.
CONFIGURATION_EXAMPLES = fuzz_examples(50 if BACKENDS == ("triton",) else 150)


@pytest.mark.filterwarnings("ignore:load_state_dict.*inf or NaN:RuntimeWarning")  # (the steps' inf and NaN gradients)
@settings(max_examples=CONFIGURATION_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_property_a_checkpoint_of_any_configuration_loads_into_any_other_exactly_or_is_refused(data):
    """A checkpoint of a drawn configuration, after 1-2 steps (gradients with inf and NaN elements, missing), saved
    with torch.save and read with torch.load(weights_only=True), loaded into another configuration of the same params
    (other moment formats, master weights, group options): refused with an error naming the entry and nothing changed
    (neither optimizer, nor params, nor the given dict), or loaded; then the loaded optimizer's own checkpoint restores
    a twin exactly, and both continue bit for bit."""
    source = data.draw(configurations(), "source")
    target = data.draw(configurations(), "target")
    master = data.draw(st.booleans(), "target master weights") and source.dtype in (torch.float16, torch.bfloat16)
    target = Configuration(source.dtype, source.sizes, source.layouts, dict(target.options, master_weights=master),
                           target.groups)
    if len(target.groups) != len(source.groups):
        target = Configuration(target.dtype, target.sizes, target.layouts, target.options,
                               (target.groups * 2)[:len(source.groups)])
    steps = [data.draw(gradients(len(source.sizes)), "gradients") for _ in range(data.draw(st.integers(1, 2)))]
    try:
        _, trained = _configured(source, steps)
        params, opt = _configured(target, [])
    except (ValueError, TypeError):
        return  # (a configuration refused at construction or at its first step: test_options and the step tests)
    sd = _roundtrip(trained.state_dict())  # (through torch.save and torch.load(weights_only=True))
    pristine = _clone(sd)
    before = optimizer_snapshot(opt)
    try:
        opt.load_state_dict(sd)
    except (ValueError, TypeError) as error:
        assert str(error).startswith("state_dict"), str(error)
        assert_same_snapshot(before, optimizer_snapshot(opt))
        assert_tree_bitwise_equal(sd, pristine, "the given dict")
        return
    assert_tree_bitwise_equal(sd, pristine, "the given dict")
    saved = opt.state_dict()
    twin_params, twin = _configured(target, [])
    with torch.no_grad():
        for p, q in zip(params, twin_params):
            q.copy_(p)
    twin.load_state_dict(saved)
    assert_tree_bitwise_equal(twin.state_dict(), saved, "twin")
    more = [data.draw(gradients(len(source.sizes), missing=False), "more gradients") for _ in range(2)]
    for k, grads in enumerate(more):
        for i, (p, q, grad) in enumerate(zip(params, twin_params, grads)):
            p.grad = gradient(p, grad, 5000 + 1000 * k + i)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
        assert_same_snapshot_but_nan_bits(optimizer_snapshot(opt), optimizer_snapshot(twin))


def test_a_groups_saved_keys_do_not_depend_on_its_mode_so_a_mode_changed_mid_run_loads_by_key(tmp_path):
    """torch.distributed.checkpoint loads a state_dict into one of the same keys (strictly): a group's mode changed
    between steps must not change what the checkpoint holds. decoupled_weight_decay is saved for every mode (torch >= 2.5
    reads a group without it as False), True but for ADAM_L2_REGULARIZATION."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    keys = {}
    for mode in AdamWMode:
        p = torch.nn.Parameter(torch.ones(3))
        opt = FusedAdam([p], adam_w_mode=mode)
        p.grad = torch.ones(3)
        opt.step()
        saved = opt.state_dict()["param_groups"][0]
        keys[mode] = sorted(saved)
        assert saved["decoupled_weight_decay"] is (mode != AdamWMode.ADAM_L2_REGULARIZATION)
    assert len({tuple(k) for k in keys.values()}) == 1, keys
    # the mode changed mid-run, saved by DCP in one process, loaded into an optimizer made as the first was
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], adam_w_mode=AdamWMode.ADAMW_TORCH)
    for mode in (AdamWMode.ADAMW_TORCH, AdamWMode.ADAM_L2_REGULARIZATION):
        opt.param_groups[0]["adam_w_mode"] = mode
        p.grad = torch.ones(3)
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.distributed is not initialised: one process, as DCP warns)
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path))
        q = torch.nn.Parameter(torch.ones(3))
        fresh = FusedAdam([q], adam_w_mode=AdamWMode.ADAMW_TORCH)
        q.grad = torch.ones(3)
        fresh.step()
        target = {"optim": fresh.state_dict()}
        dcp.load(target, checkpoint_id=str(tmp_path))
    fresh.load_state_dict(target["optim"])
    assert fresh.param_groups[0]["adam_w_mode"] == AdamWMode.ADAM_L2_REGULARIZATION
    assert torch.equal(fresh.state[q]["exp_avg"], opt.state[p]["exp_avg"])


# ---- across the two environments ---------------------------------------------------------------------------------
# The ORTModule stack (torch 2.4.1) and the newest torch each build the native op against their own torch. A run moved
# from one to the other (ORTModule is deprecated upstream: runs move to the newest torch) resumes bit for bit as the run
# that stayed, in both directions. The gradients come from numpy, the same bits under both.

CROSS_CONFIGS = [
    dict(dtype="float32", options=dict(adam_w_mode=2, eps=1e-8, weight_decay=1e-2, amsgrad=True)),
    dict(dtype="bfloat16", options=dict(master_weights=True, exp_avg_dtype="uint8", exp_avg_sq_dtype="uint8",
                                       max_grad_norm=1.0)),
    dict(dtype="float32", options=dict(exp_avg_dtype="uint4", exp_avg_sq_dtype="uint4", maximize=True)),
    dict(dtype="float16", options=dict(master_weights=True, exp_avg_dtype="float8_e4m3fn",
                                       exp_avg_sq_dtype="float8_e4m3fn"), grad_scale=1024.0),
    dict(dtype="bfloat16", options=dict(stochastic_rounding=True, exp_avg_dtype="bfloat16")),
]

# One interpreter does several runs in order, each (start, stop, load, save) over every config afresh: a start of an
# interpreter costs seconds, and the runs share nothing but the imports.
CROSS_RUN = """
import hashlib, json, numpy as np, torch
from ort_optim import FusedAdam

configs, runs = {args}


def run(start, stop, load, save):
    out = []
    for index, config in enumerate(configs):
        dtype = getattr(torch, config["dtype"])
        options = {{k: getattr(torch, v) if k.endswith("_dtype") else v for k, v in config["options"].items()}}
        shapes = [(5,), (33, 17), (1,), (300,), (1031,)]
        rng = np.random.default_rng(7)
        params = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s)).to(dtype)) for s in shapes]
        opt = FusedAdam(params, lr=1e-2, **options)
        if load:
            saved = torch.load(f"{{load}}.{{index}}", weights_only=True)
            with torch.no_grad():
                for p, value in zip(params, saved["params"]):
                    p.copy_(value)
            opt.load_state_dict(saved["optimizer"])
        for step in range(start, stop):
            rng = np.random.default_rng(1000 + step)
            for p in params:
                p.grad = torch.from_numpy(rng.standard_normal(p.shape) * 3).to(dtype)
            if "grad_scale" in config:
                for p in params:
                    p.grad.mul_(config["grad_scale"])
                opt.step(grad_scale=config["grad_scale"])
            else:
                opt.step()
        if save:
            torch.save(dict(params=[p.detach() for p in params], optimizer=opt.state_dict()), f"{{save}}.{{index}}")
        tensors = [p.detach() for p in params] + [t for s in opt.state_dict()["state"].values() for t in s.values()]
        out.append([hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                    for t in tensors])
    return out


print(json.dumps([run(*r) for r in runs]))
"""


def _other_environment():
    """The ORTModule stack's interpreter (this clone's, made by make setup), seen from the newest torch's, or None."""
    other = ROOT / ".venv" / "bin" / "python"
    return other if other.exists() and not torch.__version__.startswith("2.4.") else None


@pytest.mark.slow
@pytest.mark.skipif(_other_environment() is None, reason="runs from the newest torch's environment, both directions, "
                    "where this clone's ORTModule stack environment is set up")
def test_a_checkpoint_moved_between_the_environments_resumes_bit_for_bit_as_the_run_that_stayed(tmp_path):
    here, there = sys.executable, _other_environment()

    def run(python, *runs):
        """Each run (start, stop, load, save), in order in one interpreter: their outputs."""
        runs = [(start, stop, load and str(load), save and str(save)) for start, stop, load, save in runs]
        return run_python(python, CROSS_RUN.format(args=repr((CROSS_CONFIGS, runs))), tmp_path)

    run(there, (0, 4, None, tmp_path / "there"))
    stayed, _, moved_here = run(here, (0, 8, None, None), (0, 4, None, tmp_path / "here"),
                                (4, 8, tmp_path / "there", None))
    assert moved_here == stayed, "saved with torch 2.4.1, resumed here"
    [moved_there] = run(there, (4, 8, tmp_path / "here", None))
    assert moved_there == stayed, "saved here, resumed with torch 2.4.1"


# ---- torch's default device -------------------------------------------------------------------------------------

DEFAULT_DEVICE_MOMENTS = {"fp16": torch.float16, "8-bit": torch.uint8, "4-bit": torch.uint4,
                          "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("moments", DEFAULT_DEVICE_MOMENTS.values(), ids=DEFAULT_DEVICE_MOMENTS.keys())
def test_saving_and_loading_under_another_default_device_keep_the_state_on_the_params_device(moments, backend,
                                                                                            monkeypatch):
    """torch's default device (``with torch.device(...)``, torch.set_default_device) changes where torch's factory
    functions put a tensor; the conversions of a checkpoint work on the params' device whatever it is, as
    torch.optim.AdamW's state_dict() and load_state_dict() do: the same checkpoint and the same state, bit for bit."""
    select_backend(monkeypatch, backend)

    def trained():
        generator = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter(torch.randn(300, generator=generator)),
                  torch.nn.Parameter(torch.randn(5, 6, generator=generator))]
        opt = FusedAdam(params, lr=1e-2, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        opt.step()
        return params, opt

    params, opt = trained()
    expected = opt.state_dict()
    with torch.device("meta"):
        saved = opt.state_dict()
    assert_tree_bitwise_equal(saved, expected, "state_dict")
    fresh_params, fresh = trained()
    twin_params, twin = trained()
    fresh.load_state_dict(copy.deepcopy(saved))
    with torch.device("meta"):
        twin.load_state_dict(copy.deepcopy(saved))
    assert_same_snapshot(optimizer_snapshot(fresh), optimizer_snapshot(twin))


@pytest.mark.parametrize("moments", DEFAULT_DEVICE_MOMENTS.values(), ids=DEFAULT_DEVICE_MOMENTS.keys())
def test_steps_under_another_default_device_are_the_steps_without_it(moments, backend):
    """Nor do the steps depend on torch's default device: under ``with torch.device("meta")``, where a tensor made
    without a device has no values, steps with loss scaling, clipping, amsgrad and stochastically rounded bfloat16
    params update the CPU params and their states as outside it, bit for bit, as torch.optim.AdamW's steps do
    (torch 2.4's make its step count on the default device, and fail there)."""

    def optimizer():
        generator = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(300, generator=generator)),
                  torch.nn.Parameter(torch.randn(5, 6, generator=generator).bfloat16())]
        opt = FusedAdam(params, lr=1e-2, amsgrad=True, max_grad_norm=1.0, stochastic_rounding=True,
                        exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
        return params, opt, generator

    def steps(default_device):
        params, opt, generator = optimizer()
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
            with torch.device(default_device):
                opt.step(grad_scale=4.0)
        return opt

    under_meta = steps("meta")
    assert not any(value.is_meta for state in under_meta.state.values() for value in state.values())
    assert_same_snapshot(optimizer_snapshot(steps("cpu")), optimizer_snapshot(under_meta))


def _a_group_without_gradients():
    taken, idle = torch.nn.Parameter(torch.linspace(-1, 1, 4)), torch.nn.Parameter(torch.ones(4))
    taken.grad = torch.ones(4)
    return FusedAdam([{"params": [taken]}, {"params": [idle]}], lr=0.1)


def _interleaved_views_of_one_buffer():
    base = torch.linspace(-1, 1, 8)
    params = [torch.nn.Parameter(base[::2]), torch.nn.Parameter(base[1::2])]
    for p in params:
        p.grad = torch.ones(4)
    return FusedAdam(params, lr=0.1)


@pytest.mark.parametrize("make", [_a_group_without_gradients, _interleaved_views_of_one_buffer],
                         ids=["a group without gradients", "interleaved views of one buffer"])
def test_steps_that_plan_particular_layouts_under_another_default_device_are_the_steps_without_it(make, backend):
    """Under ``with torch.device("meta")`` a step plans and steps as outside it, as torch.optim.AdamW's steps do:
    a param group whose params have no gradient at this step, next to one that has (the step updates the other
    group's param and leaves this one as it is); params that are interleaved views of one buffer (base[::2],
    base[1::2]: their spans overlap, their elements do not, which the plan tells apart element by element)."""

    def stepped(default_device):
        opt = make()
        with torch.device(default_device):
            opt.step()
        return opt

    under_meta = stepped("meta")
    assert_same_snapshot(optimizer_snapshot(stepped("cpu")), optimizer_snapshot(under_meta))
