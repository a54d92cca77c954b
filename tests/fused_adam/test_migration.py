"""Runs trained with torchao's and bitsandbytes' low-bit Adam optimizers continue on FusedAdam (load_state_dict).

The specification, as tests:

* Layouts, in every environment: state_dicts built here in the exact layouts of torchao 0.18 (``OptimState8bit``,
  ``OptimState4bit`` with two codes per byte, the first in the high nibble, ``OptimStateFp8``) and bitsandbytes 0.50
  (``state1``/``state2`` codes with ``qmap``/``absmax``, nested under ``__bnb_optimizer_quant_state__``) load with
  every moment equal, bit for bit, to its float64 definition qmap[code] * scale[block] rounded to float32 (exact:
  the product of two float32s fits in a float64). Stand-ins carry the attributes as plain tensors; where torchao is
  installed its own subclasses are used as well.
* The values are stored through the same conversion as any checkpoint: for every moment dtype FusedAdam offers,
  loading the foreign dict gives the same state bits as loading the canonical dict of the decoded values.
* Hyperparameters and steps are mapped (torch's AdamW update: ADAMW_TORCH, no maximize); bitsandbytes' extra options
  load at their neutral values, each of the type bitsandbytes stores, and are refused, by name, at any other value
  or type (a bool where an int belongs, an int where a bool does); an unknown layout is refused naming what it
  is, and neither the optimizer (params, state, groups) nor the given dict changes.
* With the libraries (.venv-latest): a model trained N steps by the source optimizer, saved with torch.save and
  loaded with weights_only=True, continues on FusedAdam: the first step equals the source's to float32 rounding
  (its moments are decoded exactly, its hyperparameters mapped), and the loss over M more steps stays close to the
  source's own continuation, far closer than a restart with fresh moments.
"""

from __future__ import annotations

import copy
import io
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import (LargestAllocation, LargestTemporary, assert_bitwise_equal, assert_same_snapshot,
                      assert_tree_bitwise_equal, fuzz_examples, optimizer_snapshot)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ort_optim import AdamWMode, FusedAdam
from ort_optim._spec import STATE_DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "guides" / "examples"))
import migrate_lowbit as example  # noqa: E402  (the guide's run of a migration, which a test here continues)

try:
    import torchao.optim as torchao_optim
    from torchao.optim.subclass_4bit import OptimState4bit as TorchaoState4bit
    from torchao.optim.subclass_8bit import OptimState8bit as TorchaoState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8 as TorchaoStateFp8
except Exception as error:  # absent (the torch 2.4.1 environment), or unusable with this torch
    torchao_optim, TORCHAO_MISSING = None, f"torchao is not usable here ({type(error).__name__}: {error})"
else:
    TORCHAO_MISSING = None
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes as bnb
except Exception as error:
    bnb, BNB_MISSING = None, f"bitsandbytes is not usable here ({type(error).__name__}: {error})"
else:
    BNB_MISSING = None

BNB_KEY = "__bnb_optimizer_quant_state__"


# ---- the layouts, built from plain tensors -----------------------------------------------------------------------


class _Standin:
    """An object with a torchao state class's name, module and attributes, holding plain tensors."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def standin(name: str, module: str = "torchao.optim.subclass_8bit") -> type:
    return type(name, (_Standin,), {"__module__": module})


def dynamic_map(signed: bool, levels: int = 256, seed: int = 0) -> torch.Tensor:
    """A sorted float32 code map in [-1, 1] (signed) or [0, 1], with 0 and 1 among its values, as the libraries'."""
    g = torch.Generator().manual_seed(seed)
    inner = torch.rand(levels - 2, generator=g, dtype=torch.float64) ** 3 * (2 if signed else 1) - (1 if signed else 0)
    return torch.cat([inner, torch.tensor([0.0, 1.0], dtype=torch.float64)]).sort().values.float()


def blockwise(codes: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The float64 definition: table[code] * scale[element // block], rounded once to float32."""
    flat = codes.reshape(-1).long()
    blocks = torch.arange(flat.numel()) // block
    return (table.double()[flat] * scale.double()[blocks]).float().reshape(codes.shape)


def torchao_8bit(shape, signed: bool, seed: int, real: bool):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    scale = torch.rand(math.prod(shape) // 256, generator=g) * 2.0 ** torch.randint(-20, 4, (1,), generator=g).item()
    qmap = dynamic_map(signed, 256, seed)
    expected = blockwise(codes, qmap, scale, 256)
    if real:
        return TorchaoState8bit(codes, scale, qmap, signed), expected
    return standin("OptimState8bit")(codes=codes, scale=scale, qmap=qmap, signed=signed, block_size=256), expected


def torchao_4bit(shape, signed: bool, seed: int, real: bool):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    elements = torch.randint(0, 16, (n,), generator=g, dtype=torch.uint8)  # one code per element, in order
    packed = (elements[::2] << 4) | elements[1::2]  # torchao's packing (torchao.optim.subclass_4bit, its aten.copy_)
    scale = torch.rand(n // 128, generator=g) + 0.5
    qmap = dynamic_map(signed, 16, seed) if signed else torch.linspace(0, 1, 17)[1:]
    expected = blockwise(elements.view(shape), qmap, scale, 128)
    if real:
        return TorchaoState4bit(packed, scale, qmap, signed, tuple(shape)), expected
    state = standin("OptimState4bit", "torchao.optim.subclass_4bit")(codes=packed, scale=scale, qmap=qmap,
                                                                     signed=signed, _shape=tuple(shape), block_size=128)
    return state, expected


def torchao_fp8(shape, signed: bool, seed: int, real: bool):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(shape, generator=g) * 300).clamp(-448, 448)  # e4m3fn: 448 is its largest
    codes = (values.abs() if not signed else values).to(torch.float8_e4m3fn)
    scale = torch.rand(math.prod(shape) // 256, generator=g) / 448
    expected = (codes.double().reshape(-1, 256) * scale.double()[:, None]).float().reshape(shape)
    if real:
        return TorchaoStateFp8(codes, scale), expected
    return standin("OptimStateFp8", "torchao.optim.subclass_fp8")(codes=codes, scale=scale, block_size=256), expected


TORCHAO_KINDS = {"8bit": torchao_8bit, "4bit": torchao_4bit, "fp8": torchao_fp8}
SHAPES = [(64, 128), (32, 8, 16)]  # what torchao quantises: >= 4096 elements, a multiple of the block
SMALL = (10, 64)  # under 4096 elements: plain float32 moments in both libraries


def make_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES + [SMALL]]


def torchao_state_dict(kind: str, real: bool, amsgrad: bool = False, step: float = 37.0):
    state = {}
    for i, shape in enumerate(SHAPES):
        s = {"step": torch.tensor(step)}
        expected = {}
        for j, key in enumerate(("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())):
            s[key], expected[key] = TORCHAO_KINDS[kind](shape, key == "exp_avg", 10 * i + j, real)
        state[i] = (s, expected)
    g = torch.Generator().manual_seed(99)
    small = {"step": torch.tensor(step), "exp_avg": torch.randn(SMALL, generator=g),
             "exp_avg_sq": torch.rand(SMALL, generator=g)}
    if amsgrad:
        small["max_exp_avg_sq"] = small["exp_avg_sq"] + 0.5
    state[len(SHAPES)] = (small, {k: v for k, v in small.items() if k != "step"})
    groups = [{"lr": torch.tensor(3e-3), "betas": (0.85, 0.99), "eps": 1e-7, "weight_decay": 0.05,
               "amsgrad": amsgrad, "params": list(range(len(SHAPES) + 1))}]
    return ({"state": {i: s for i, (s, _) in state.items()}, "param_groups": groups},
            {i: e for i, (_, e) in state.items()})


def bnb_moment(shape, i: int, seed: int, block: int = 256):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    absmax = torch.rand(-(-n // block), generator=g) * 0.1
    qmap = dynamic_map(i == 1, 256, seed)
    return {f"state{i}": codes, f"qmap{i}": qmap, f"absmax{i}": absmax}, blockwise(codes, qmap, absmax, block)


BNB_SHAPES = [(41, 100), (64, 128)]  # 4100 elements: a partial last block of 256


def bnb_state_dict(block: int = 256, step: int = 37, **group_options):
    state, expected = {}, {}
    for i, shape in enumerate(BNB_SHAPES):
        m, em = bnb_moment(shape, 1, 10 * i, block)
        v, ev = bnb_moment(shape, 2, 10 * i + 1, block)
        state[i] = {"step": step, BNB_KEY: {**m, **v}}
        expected[i] = {"exp_avg": em, "exp_avg_sq": ev}
    g = torch.Generator().manual_seed(7)
    small = {"state1": torch.randn(SMALL, generator=g), "state2": torch.rand(SMALL, generator=g)}
    state[len(BNB_SHAPES)] = {"step": step, BNB_KEY: small}
    expected[len(BNB_SHAPES)] = {"exp_avg": small["state1"], "exp_avg_sq": small["state2"]}
    group = {"lr": 2e-3, "betas": (0.9, 0.995), "eps": 1e-8, "weight_decay": 0.01, "alpha": 0.0, "t_alpha": None,
             "t_beta3": None, **group_options, "params": list(range(len(BNB_SHAPES) + 1))}
    return {"state": state, "param_groups": [group]}, expected


def bnb_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in BNB_SHAPES + [SMALL]]


def real_kinds():
    return [pytest.param(False, id="standin"),
            pytest.param(True, id="torchao", marks=pytest.mark.skipif(TORCHAO_MISSING is not None,
                                                                      reason=TORCHAO_MISSING or ""))]


def tree_bits(tree):
    """A comparable copy of a nested dict/list of tensors and plain values (tensors by their bits)."""
    if isinstance(tree, dict):
        return {k: tree_bits(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [tree_bits(v) for v in tree]
    if isinstance(tree, torch.Tensor) and tree.is_meta:  # (no data: by its description)
        return ("meta tensor", type(tree), tree.dtype, tuple(tree.shape))
    if isinstance(tree, torch.Tensor):
        return ("tensor", type(tree), tree.dtype, tuple(tree.shape), tree.detach().as_subclass(torch.Tensor).clone())
    if isinstance(tree, _Standin):
        return {"class": type(tree).__name__, **tree_bits(dict(vars(tree)))}
    return tree


def assert_tree_same(a, b, where="state_dict"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_tree_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_same(x, y, f"{where}[{i}]")
    elif isinstance(a, tuple) and a and a[0] == "tensor":
        assert a[:4] == b[:4], where
        assert_bitwise_equal(a[4], b[4], where)
    elif isinstance(a, float) and a != a:  # NaN is NaN
        assert isinstance(b, float) and b != b, where
    else:
        assert a == b, where


# ---- decoding: exact values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("real", real_kinds())
@pytest.mark.parametrize("kind", TORCHAO_KINDS)
def test_torchao_moments_load_as_their_exact_values(kind, real):
    sd, expected = torchao_state_dict(kind, real, amsgrad=True)
    params = make_params()
    opt = FusedAdam(params, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, amsgrad=True)
    opt.load_state_dict(sd)
    for i, p in enumerate(params):
        for key, value in expected[i].items():
            assert_bitwise_equal(opt.state[p][key], value, f"param {i} {key}")
        assert float(opt.state[p]["step"]) == 37.0


@pytest.mark.skipif(TORCHAO_MISSING is not None, reason=TORCHAO_MISSING or "")
@pytest.mark.parametrize("kind", TORCHAO_KINDS)
def test_torchao_decoding_equals_torchaos_own_dequantize(kind):
    """torchao's dequantize() (its own reference), against the values FusedAdam loads."""
    sd, _ = torchao_state_dict(kind, real=True)
    params = make_params()
    opt = FusedAdam(params)
    opt.load_state_dict(sd)
    for i in range(len(SHAPES)):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(opt.state[params[i]][key], sd["state"][i][key].dequantize(), f"{i} {key}")


def test_4bit_codes_are_unpacked_high_nibble_first():
    """One byte 0x1F in a block of scale 1: element 0 reads qmap[1], element 1 qmap[15]."""
    qmap = torch.linspace(0, 1, 17)[1:]
    n = 4096
    codes = torch.zeros(n // 2, dtype=torch.uint8)
    codes[0] = 0x1F
    state = standin("OptimState4bit", "torchao.optim.subclass_4bit")(
        codes=codes, scale=torch.ones(n // 128), qmap=qmap, signed=False, _shape=(n,), block_size=128)
    p = torch.nn.Parameter(torch.zeros(n))
    opt = FusedAdam([p])
    opt.load_state_dict({"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(n), "exp_avg_sq": state}},
                         "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                           "amsgrad": False, "params": [0]}]})
    v = opt.state[p]["exp_avg_sq"]
    assert v[0].item() == qmap[1].item() and v[1].item() == qmap[15].item() and v[2].item() == qmap[0].item()


def _assert_loads_as(sd: dict, expected: list[dict]) -> tuple[FusedAdam, list[torch.nn.Parameter]]:
    """Loads sd into a FusedAdam over bnb_params(); its state then holds each expected value bit for bit."""
    params = bnb_params()
    opt = FusedAdam(params)
    opt.load_state_dict(sd)
    for i, p in enumerate(params):
        for key, value in expected[i].items():
            assert_bitwise_equal(opt.state[p][key], value, f"param {i} {key}")
    return opt, params


@pytest.mark.parametrize("block", [256, 2048])
def test_bitsandbytes_moments_load_as_their_exact_values(block):
    """Blocks of 256 (bitsandbytes >= 0.45) or 2048 (earlier 8-bit optimizers), told apart by the absmax count; the
    last block partial; params under min_8bit_size with plain float32 states."""
    sd, expected = bnb_state_dict(block)
    opt, params = _assert_loads_as(sd, expected)
    assert all(float(opt.state[p]["step"]) == 37.0 for p in params)


def test_bitsandbytes_unnested_states_load_too():
    """The state as bitsandbytes holds it in memory (and as versions before the nesting saved it)."""
    sd, expected = bnb_state_dict()
    flat = {"state": {i: {"step": s["step"], **s[BNB_KEY]} for i, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}
    _assert_loads_as(flat, expected)


@pytest.mark.skipif(BNB_MISSING is not None, reason=BNB_MISSING or "")
def test_bitsandbytes_decoding_equals_bitsandbytes_own_dequantize():
    sd, _ = bnb_state_dict()
    params = bnb_params()
    opt = FusedAdam(params)
    opt.load_state_dict(sd)
    for i in range(len(BNB_SHAPES)):
        q = sd["state"][i][BNB_KEY]
        for key, n in (("exp_avg", 1), ("exp_avg_sq", 2)):
            theirs = bnb.functional.dequantize_blockwise(q[f"state{n}"], absmax=q[f"absmax{n}"], code=q[f"qmap{n}"],
                                                         blocksize=256)
            assert_bitwise_equal(opt.state[params[i]][key], theirs, f"{i} {key}")


# ---- re-encoding: the one conversion every checkpoint takes ------------------------------------------------------


# (a 4-bit exp_avg only beside a 4-bit exp_avg_sq, relative to which it is stored)
MOMENT_PAIRS = [(m, v) for m in STATE_DTYPES for v in STATE_DTYPES if m != torch.uint4 or v == torch.uint4]


@pytest.mark.parametrize("m_dtype,v_dtype", MOMENT_PAIRS, ids=[f"{m}-{v}" for m, v in MOMENT_PAIRS])
@pytest.mark.parametrize("source", ["torchao-8bit", "torchao-4bit", "torchao-fp8", "bitsandbytes"])
def test_foreign_moments_are_stored_as_any_checkpoint_in_every_moment_dtype(source, m_dtype, v_dtype):
    """For every storage FusedAdam offers (STATE_DTYPES: a new format is covered here when it is added there)."""
    if source == "bitsandbytes":
        sd, expected = bnb_state_dict()
        make = bnb_params
    else:
        sd, expected = torchao_state_dict(source.split("-")[1], real=False)
        make = make_params
    canonical = {"state": {i: {"step": torch.tensor(37.0, dtype=torch.float64), **e} for i, e in expected.items()},
                 "param_groups": [{**sd["param_groups"][0], "lr": float(sd["param_groups"][0]["lr"]),
                                   "adam_w_mode": AdamWMode.ADAMW_TORCH, "maximize": False, "bias_correction": True,
                                   "amsgrad": False}]}
    for key in ("alpha", "t_alpha", "t_beta3"):
        canonical["param_groups"][0].pop(key, None)
    opts = []
    for checkpoint in (sd, canonical):
        opt = FusedAdam(make(), exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype)
        opt.load_state_dict(checkpoint)
        opts.append(opt)
    for p, q in zip(opts[0].param_groups[0]["params"], opts[1].param_groups[0]["params"]):
        assert opts[0].state[p].keys() == opts[1].state[q].keys()
        for key in opts[0].state[p]:
            assert_bitwise_equal(opts[0].state[p][key], opts[1].state[q][key], key)
    assert opts[0].param_groups[0] | {"params": None} == opts[1].param_groups[0] | {"params": None}


# ---- hyperparameters and steps -----------------------------------------------------------------------------------


def test_torchao_groups_map_to_torchs_adamw_update():
    sd, _ = torchao_state_dict("8bit", real=False, amsgrad=True)
    opt = FusedAdam(make_params(), maximize=True, eps=1e-3, bias_correction=False)
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    assert group["lr"] == float(torch.tensor(3e-3)) and isinstance(group["lr"], float)
    assert group["betas"] == (0.85, 0.99) and group["eps"] == 1e-7 and group["weight_decay"] == 0.05
    assert group["amsgrad"] is True and group["maximize"] is False and group["bias_correction"] is True
    assert group["adam_w_mode"] == AdamWMode.ADAMW_TORCH


def test_bitsandbytes_groups_map_to_torchs_adamw_update():
    sd, _ = bnb_state_dict(step=12)
    opt = FusedAdam(bnb_params(), maximize=True, amsgrad=True)
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    assert group["lr"] == 2e-3 and group["betas"] == (0.9, 0.995) and group["eps"] == 1e-8
    assert group["weight_decay"] == 0.01 and group["amsgrad"] is False and group["maximize"] is False
    assert group["adam_w_mode"] == AdamWMode.ADAMW_TORCH
    assert not {"alpha", "t_alpha", "t_beta3"} & set(group)
    assert all(float(s["step"]) == 12.0 for s in opt.state.values())


def test_a_bitsandbytes_state_dict_with_an_empty_state_for_a_param_that_never_stepped_loads_as_torch_loads_it():
    """bitsandbytes' optimizers keep torch.optim's defaultdict state: reading the state of a param without a gradient
    so far leaves an empty dict, which its state_dict() saves. That param has no state yet, as bitsandbytes and
    torch.optim load it; the others load as usual."""
    sd, expected = bnb_state_dict()
    sd["state"][len(BNB_SHAPES)] = {}
    params = [torch.nn.Parameter(torch.randn(s)) for s in BNB_SHAPES + [SMALL]]
    opt = FusedAdam(params)
    opt.load_state_dict(sd)
    assert opt.state[params[-1]] == {} or params[-1] not in opt.state
    for i in range(len(BNB_SHAPES)):
        assert_bitwise_equal(opt.state[params[i]]["exp_avg"], expected[i]["exp_avg"].float(), "exp_avg")


def test_a_bitsandbytes_state_dict_saved_before_its_first_step_loads_its_groups():
    """No state yet: AdEMAMix's keys in the groups still tell bitsandbytes' layout (they would read as RMSprop's
    alpha otherwise)."""
    sd, _ = bnb_state_dict()
    sd["state"] = {}
    opt = FusedAdam(bnb_params())
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["adam_w_mode"] == AdamWMode.ADAMW_TORCH and opt.param_groups[0]["lr"] == 2e-3
    assert not any(opt.state.values())


@pytest.mark.parametrize("params", ["before the first step", "all under 4096 elements", "with a scheduler's keys"])
def test_a_torchao_state_dict_without_torchao_states_is_told_by_its_groups(params):
    """No torchao state: its groups (torchao's keys, lr a tensor, none of the keys torch's or ORT's Adam save) tell
    its layout, so its options map as in every torchao load (ADAMW_TORCH, lr a float); the small params' plain
    moments load as they are. Keys an LR scheduler adds (initial_lr) are kept, as torch keeps them."""
    sd, _ = torchao_state_dict("8bit", real=False)
    if params == "with a scheduler's keys":
        sd["param_groups"][0].update(initial_lr=3e-3, max_lr=3e-3)
        params = "before the first step"
    small = torch.nn.Parameter(torch.randn(SMALL))
    if params == "before the first step":
        sd["state"] = {}
    else:
        sd["state"] = {0: {"step": torch.tensor(5.0), "exp_avg": torch.full(SMALL, 0.25),
                           "exp_avg_sq": torch.full(SMALL, 0.5)}}
        sd["param_groups"][0]["params"] = [0]
    opt = FusedAdam(make_params() if params == "before the first step" else [small])
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    assert group["adam_w_mode"] == AdamWMode.ADAMW_TORCH and isinstance(group["lr"], float), group
    assert group["lr"] == float(torch.tensor(3e-3))
    if params == "all under 4096 elements":
        assert float(opt.state[small]["step"]) == 5.0
        assert torch.equal(opt.state[small]["exp_avg"], torch.full(SMALL, 0.25))


NEUTRAL = {"alpha": 0.0, "t_alpha": None, "t_beta3": None, "max_unorm": 0.0, "percentile_clipping": 100,
           "skip_zeros": False, "block_wise": True, "optim_bits": 8, "min_8bit_size": 4096, "is_paged": True}
NOT_NEUTRAL = {"alpha": 5.0, "t_alpha": 1000, "t_beta3": 1000, "max_unorm": 1.0, "percentile_clipping": 5,
               "skip_zeros": True, "block_wise": False, "optim_bits": 4, "min_8bit_size": "4096", "is_paged": 1}
# Each option has the type bitsandbytes stores (alpha and max_unorm floats, t_alpha and t_beta3 None or an int,
# percentile_clipping, optim_bits and min_8bit_size ints, skip_zeros, block_wise and is_paged bools): a value of
# another type is refused even where it equals (==) a neutral value, a bool for a number included.
WRONG_TYPE = {"alpha": (False, "a number"), "t_alpha": (False, "None or an int"), "t_beta3": (0.0, "None or an int"),
              "max_unorm": (False, "a number"), "percentile_clipping": (100.0, "an int"),
              "skip_zeros": (0, "True or False"), "block_wise": (1, "True or False"), "optim_bits": (8.0, "an int"),
              "min_8bit_size": (True, "an int"), "is_paged": (0, "True or False")}


def test_bitsandbytes_extra_options_load_at_their_neutral_values():
    sd, expected = bnb_state_dict(**NEUTRAL)
    params = bnb_params()
    opt = FusedAdam(params)
    opt.load_state_dict(sd)
    assert not set(NEUTRAL) & set(opt.param_groups[0])
    assert_bitwise_equal(opt.state[params[0]]["exp_avg"], expected[0]["exp_avg"])


# ---- refusals: named, and nothing changes ------------------------------------------------------------------------


def _bnb_with(change):
    sd, _ = bnb_state_dict()
    change(sd)
    return sd, bnb_params


def _torchao_with(change, kind="8bit"):
    sd, _ = torchao_state_dict(kind, real=False)
    change(sd)
    return sd, make_params


def _torch_optimizer_state(kind):
    """A stepped torch optimizer's state_dict over make_params(): a layout of another update rule."""
    params = make_params()
    opt = kind(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt.state_dict(), make_params


def _transposed(make, index):
    """make's params, the one at index (a matrix) transposed: as many elements, another shape."""
    def params(seed: int = 0):
        made = make(seed)
        made[index] = torch.nn.Parameter(made[index].detach().t().contiguous())
        return made
    return params


def _plain_with(change):
    """A torch.optim.AdamW checkpoint of make_params() with one state changed."""
    params = make_params()
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    change(sd)
    return sd


def _drop(obj, name):
    delattr(obj, name)


class Wrapped(torch.Tensor):  # a traceable wrapper subclass of some other library
    def __tensor_flatten__(self):
        return [], None


def _unknown_subclass(sd):
    sd["state"][0]["exp_avg"] = torch.Tensor._make_subclass(Wrapped, torch.zeros(SHAPES[0]))


def _bnb_one_state_before_its_first_step(eps, betas):
    """The state_dict of bitsandbytes' Lion8bit / SGD8bit / RMSprop8bit before their first step: groups of exactly
    these keys, no state (after a step, their 'state1' without a 'state2' tells them)."""
    group = {"params": [0, 1, 2], "lr": 1e-4, "betas": betas, "eps": eps, "weight_decay": 0}
    return {"state": {}, "param_groups": [group]}, make_params


REFUSALS = {
    "bnb-lion-before-its-first-step": (lambda: _bnb_one_state_before_its_first_step(0.0, (0.9, 0.99)),
                                       "a bitsandbytes one-state optimizer's group"),
    "bnb-sgd-before-its-first-step": (lambda: _bnb_one_state_before_its_first_step(0.0, (0.9, 0)),
                                      "a bitsandbytes one-state optimizer's group"),
    "bnb-rmsprop-before-its-first-step": (lambda: _bnb_one_state_before_its_first_step(1e-8, (0.99, 0)),
                                          "a bitsandbytes one-state optimizer's group"),
    "bnb-one-state-group-with-scalar-betas": (lambda: _bnb_one_state_before_its_first_step(0.0, 0.9),
                                              "a bitsandbytes one-state optimizer's group (eps 0.0, betas 0.9"),
    **{f"{library}-{key}": (lambda library=library, key=key, value=value: (
        _bnb_with if library == "bnb" else _torchao_with)(lambda sd: sd["param_groups"][0].update({key: value})),
        f"['param_groups'][0]['{key}'] is {value!r}, which changes the update")
       for library in ("bnb", "torchao")
       for key, value in (("maximize", True), ("adam_w_mode", 0), ("bias_correction", False))},
    **{f"bnb-{key}": (lambda key=key: _bnb_with(lambda sd: sd["param_groups"][0].update({key: NOT_NEUTRAL[key]})),
                      f"['param_groups'][0]['{key}']") for key in NOT_NEUTRAL},
    **{f"bnb-{key}-of-another-type": (lambda key=key: _bnb_with(lambda sd: sd["param_groups"][0].update(
        {key: WRONG_TYPE[key][0]})), f"['param_groups'][0]['{key}'] must be {WRONG_TYPE[key][1]}")
       for key in WRONG_TYPE},
    "bnb-ademamix-betas": (lambda: _bnb_with(lambda sd: sd["param_groups"][0].update(betas=(0.9, 0.999, 0.9999))),
                           "three betas"),
    "bnb-amsgrad": (lambda: _bnb_with(lambda sd: sd["param_groups"][0].update(amsgrad=True)), "'amsgrad'"),
    "bnb-missing-qmap": (lambda: _bnb_with(lambda sd: sd["state"][1][BNB_KEY].pop("qmap2")), "'qmap2'"),
    "bnb-missing-absmax": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].pop("absmax1")), "'absmax1'"),
    "bnb-non-blockwise": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(max1=torch.zeros(1))),
                          "'max1'"),
    "bnb-unorm": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(unorm_vec=torch.zeros(1))),
                  "'unorm_vec'"),
    "bnb-other-key": (lambda: _bnb_with(lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(1))),
                      "'momentum_buffer'"),
    "bnb-absmax-count": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(absmax1=torch.ones(5))),
                         "5 block scales"),
    "bnb-absmax-blocks-disagree": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(
        absmax2=sd["state"][0][BNB_KEY]["absmax2"][:-(-math.prod(BNB_SHAPES[0]) // 2048)].clone())),
        "'absmax1' gives blocks of 256 elements but 'absmax2' blocks of 2048"),
    "bnb-absmax-blocks-differ-between-params": (lambda: _bnb_with(lambda sd: sd["state"][1][BNB_KEY].update(
        absmax1=sd["state"][1][BNB_KEY]["absmax1"][:-(-math.prod(BNB_SHAPES[1]) // 2048)].clone(),
        absmax2=sd["state"][1][BNB_KEY]["absmax2"][:-(-math.prod(BNB_SHAPES[1]) // 2048)].clone())),
        "state_dict['state'][1]: its 'absmax' counts give blocks of 2048 elements but state_dict['state'][0]'s give "
        "256"),
    "bnb-subclass-codes": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(
        state1=torch.Tensor._make_subclass(Wrapped, sd["state"][0][BNB_KEY]["state1"]))),
        "Wrapped, a tensor subclass)"),
    "bnb-qmap-size": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(qmap1=torch.zeros(16))),
                      "16 values"),
    "bnb-negative-v": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(qmap2=-dynamic_map(False))),
                       "negative"),
    # (refused by the checks of the Adam checkpoint it is read as: the error says which of its entries that is)
    "bnb-negative-absmax2": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(
        absmax2=-sd["state"][0][BNB_KEY]["absmax2"])), "holds negative values; a second moment is a mean of squares "
        "(in the Adam checkpoint read from this bitsandbytes state_dict: its 'exp_avg' is state1 and its "
        "'exp_avg_sq' state2"),
    "bnb-lion": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].pop("state2")),
                 "has 'state1' but no 'state2': one moment, the state of bitsandbytes' Lion"),
    "torch-sgd": (lambda: _torch_optimizer_state(lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)),
                  "options of torch.optim's SGD, not of Adam"),
    "torch-adagrad": (lambda: _torch_optimizer_state(torch.optim.Adagrad), "options of torch.optim's Adagrad"),
    "torch-rmsprop": (lambda: _torch_optimizer_state(torch.optim.RMSprop),
                      "options of torch.optim's RMSprop, not of Adam"),
    "torch-adamax": (lambda: _torch_optimizer_state(torch.optim.Adamax), "Adamax"),
    "torchao-other-class": (lambda: _torchao_with(lambda sd: sd["state"][0].update(
        exp_avg=standin("OptimStateFp8WithDynamicRangeExpansion")(codes=torch.zeros(1), scale=torch.ones(1)))),
        "OptimStateFp8WithDynamicRangeExpansion"),
    "torchao-mixed-classes": (lambda: _torchao_with(lambda sd: sd["state"][1].update(
        exp_avg_sq=torchao_state_dict("4bit", real=False)[0]["state"][1]["exp_avg_sq"])),
        "is a torchao OptimState4bit but state_dict['state'][0]['exp_avg'] is a torchao OptimState8bit"),
    "torchao-key-of-another-layout": (lambda: _torchao_with(lambda sd: sd["state"][0].update(
        master_param=sd["state"][0]["exp_avg"])), "['master_param']: a key a torchao Adam state does not have"),
    "torchao-missing-qmap": (lambda: _torchao_with(lambda sd: _drop(sd["state"][1]["exp_avg_sq"], "qmap")),
                             "without 'qmap'"),
    "torchao-4bit-missing-shape": (lambda: _torchao_with(lambda sd: _drop(sd["state"][0]["exp_avg"], "_shape"),
                                                         "4bit"), "'_shape'"),
    "torchao-qmap-size": (lambda: _torchao_with(lambda sd: setattr(sd["state"][0]["exp_avg"], "qmap",
                                                                   torch.zeros(16))), "16 values"),
    "torchao-codes-dtype": (lambda: _torchao_with(lambda sd: setattr(sd["state"][0]["exp_avg"], "codes",
                                                                     torch.zeros(SHAPES[0], dtype=torch.int8))),
                            "torch.uint8"),
    "torchao-meta-scale": (lambda: _torchao_with(lambda sd: setattr(sd["state"][0]["exp_avg"], "scale",
                                                                    torch.zeros(2, device="meta")), "4bit"),
                           "OptimState4bit.scale must be a dense tensor with data"),
    # (torch.load(..., map_location="meta"): the lr tensor of torchao's groups holds no value either)
    "torchao-meta-lr": (lambda: _torchao_with(lambda sd: sd["param_groups"][0].update(
        lr=torch.tensor(3e-3, device="meta"))), "['param_groups'][0]['lr'] is a tensor on the meta device"),
    "torchao-meta-lr-before-its-first-step": (lambda: _torchao_with(lambda sd: (sd["state"].clear(), sd[
        "param_groups"][0].update(lr=torch.tensor(3e-3, device="meta")))),
        "['param_groups'][0]['lr'] is a tensor on the meta device"),
    "bnb-meta-absmax": (lambda: _bnb_with(lambda sd: sd["state"][0][BNB_KEY].update(
        absmax1=torch.zeros(17, device="meta"))), "['absmax1'] must be a dense tensor with data"),
    "unknown-subclass": (lambda: _torchao_with(_unknown_subclass, "fp8"), "Wrapped"),
    "unknown-subclass-in-a-plain-checkpoint": (lambda: (_plain_with(_unknown_subclass), make_params), "Wrapped"),
    # (a moment of as many elements as its param, in another shape: decoded moments are checked as any entry is)
    "bnb-transposed-moment": (lambda: (bnb_state_dict()[0], _transposed(bnb_params, 1)),
                              "['state'][1]['exp_avg'] has shape (64, 128), the parameter (128, 64)"),
    "torchao-transposed-moment": (lambda: (torchao_state_dict("8bit", real=False)[0], _transposed(make_params, 0)),
                                  "['state'][0]['exp_avg'] has shape (64, 128), the parameter (128, 64)"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_unknown_layouts_are_refused_by_name_and_change_nothing(case):
    build, message = REFUSALS[case]
    sd, make = build()
    params = make(seed=3)
    opt = FusedAdam(params, lr=5e-4, exp_avg_dtype=torch.uint8)
    for p in params:  # a state to keep
        p.grad = torch.ones_like(p)
    opt.step()
    before, given = optimizer_snapshot(opt), tree_bits(sd)
    with pytest.raises((ValueError, TypeError)) as info:
        opt.load_state_dict(sd)
    assert message in str(info.value), str(info.value)
    assert str(info.value).startswith("state_dict["), str(info.value)
    assert_same_snapshot(before, optimizer_snapshot(opt))
    assert_tree_same(given, tree_bits(sd))


def _on_meta(make):
    """make's params, on the meta device (a model built there for deferred initialisation)."""
    return lambda seed=0: [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in make(seed)]


@pytest.mark.parametrize("source", ["bitsandbytes", "torchao 8bit", "torchao 4bit", "torchao fp8"])
def test_a_foreign_checkpoint_loads_into_meta_params_decoded_piece_by_piece(source, monkeypatch):
    """Into params on the meta device a foreign checkpoint loads as any does: states on the meta device, without
    values. Its moments are decoded CHECK_CHUNK elements at a time and checked as they would be for params with
    data, never decoded whole."""
    from ort_optim import _checkpoint, _migration
    monkeypatch.setattr(_checkpoint, "CHECK_CHUNK", 101)  # (pieces that start mid-block, and mid-byte of 4-bit codes)
    sd, make = FOREIGN_SOURCES[source]()
    params = _on_meta(make)()
    opt = FusedAdam(params, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    with LargestAllocation() as largest:
        opt.load_state_dict(sd)
    assert all(value.is_meta for p in params for value in opt.state[p].values())
    assert all(sorted(opt.state[p]) == ["exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "step"]
               for p in params)
    smallest_moment = min(p.numel() for p in params if p.numel() >= 4096)
    assert 0 < largest.nbytes <= 101 * 8 < smallest_moment, largest.nbytes  # (int64 indices of a piece at most)


@pytest.mark.parametrize("source", ["bitsandbytes", "torchao 8bit", "torchao 4bit", "torchao fp8"])
@pytest.mark.parametrize("moments", [torch.float32, torch.uint8, torch.uint4], ids=str)
def test_a_foreign_checkpoint_loads_into_params_with_data_decoded_piece_by_piece(source, moments, monkeypatch):
    """Into params with data a foreign checkpoint's moments are decoded where the load checks and stores them, a
    piece at a time (CHECK_CHUNK elements; writes rounded up to whole blocks): besides the state it fills, the load
    makes no temporary bigger than an int64 tensor of one piece, never a decoded copy of a whole moment. Decoded
    whole and then quantised whole, a load peaked at about 35 times its 8-bit state. The pieces hold the bits of a
    load in one piece: each piece's elements decoded with their own blocks' scales."""
    from ort_optim import _checkpoint, formats
    monkeypatch.setattr(_checkpoint, "CHECK_CHUNK", 101)  # (pieces that start mid-block, and mid-byte of 4-bit codes)
    sd, make = FOREIGN_SOURCES[source]()
    params = make()
    opt = FusedAdam(params, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    with LargestTemporary() as allocations:
        opt.load_state_dict(sd)
    nbytes, op = allocations.besides(value for p in params for value in opt.state[p].values())
    smallest_moment = min(p.numel() for p in params if p.numel() >= 4096)
    assert 0 < nbytes <= 8 * formats.BLOCK_MULTIPLE < 4 * smallest_moment, (nbytes, op)
    monkeypatch.setattr(_checkpoint, "CHECK_CHUNK", 1 << 30)
    whole = FusedAdam(make(), exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    whole.load_state_dict(sd)
    assert_tree_bitwise_equal(whole.state_dict()["state"], opt.state_dict()["state"])


@pytest.mark.parametrize("case", [case for case in REFUSALS if "negative" in case or "meta" in case])
def test_a_foreign_checkpoint_is_refused_into_meta_params_as_into_params_with_data(case, monkeypatch):
    """The values of moments decoded for params on the meta device are checked by the rules that check them for
    params with data: the same refusal, by the same words, and nothing changes."""
    from ort_optim import _checkpoint
    monkeypatch.setattr(_checkpoint, "CHECK_CHUNK", 101)
    build, message = REFUSALS[case]
    sd, make = build()
    opt = FusedAdam(_on_meta(make)(seed=3), lr=5e-4, exp_avg_dtype=torch.uint8)
    groups, given = copy.deepcopy(opt.param_groups), tree_bits(sd)
    with pytest.raises((ValueError, TypeError)) as info:
        opt.load_state_dict(sd)
    assert message in str(info.value), str(info.value)
    assert str(info.value).startswith("state_dict["), str(info.value)
    assert not opt.state and tree_bits(opt.param_groups) == tree_bits(groups)
    assert_tree_same(given, tree_bits(sd))


# Any change to a foreign checkpoint's entries, the library objects' attributes included: it loads (and the optimizer
# steps), or it is refused with an error that starts with the entry's name, and nothing changes.
FOREIGN_SOURCES = {
    "bitsandbytes": lambda: (bnb_state_dict()[0], bnb_params),
    **{f"torchao {kind}": (lambda kind=kind: (torchao_state_dict(kind, real=False)[0], make_params))
       for kind in TORCHAO_KINDS},
}
ODD_VALUES = [None, 0, -1, 1.5, float("nan"), "x", True, [], {}, torch.tensor(float("nan")), torch.zeros(0),
              torch.zeros(3), torch.ones(7, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64),
              torch.full((4,), -1.0), torch.zeros(2, device="meta"), torch.zeros(64, 128, dtype=torch.float16),
              torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8), torch.ones(16),
              torch.ones(32)]


def _foreign_paths(tree, prefix=()):
    """Every entry of a checkpoint tree (dict keys, list items, a library object's attributes), containers first."""
    out = []
    children = (vars(tree) if isinstance(tree, _Standin) else tree if isinstance(tree, dict)
                else dict(enumerate(tree)) if isinstance(tree, list) else {})
    for key, value in children.items():
        out.append(prefix + (key,))
        out += _foreign_paths(value, prefix + (key,))
    return out


def _foreign_set(tree, path, value, delete=False):
    parent = tree
    for key in path[:-1]:
        parent = vars(parent)[key] if isinstance(parent, _Standin) else parent[key]
    container = vars(parent) if isinstance(parent, _Standin) else parent
    if delete:
        del container[path[-1]]
    else:
        container[path[-1]] = value


@settings(max_examples=fuzz_examples(200), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(source=st.sampled_from(sorted(FOREIGN_SOURCES)), moments=st.sampled_from([torch.uint8, torch.float32]),
       data=st.data())
def test_property_a_changed_foreign_checkpoint_loads_and_steps_or_is_refused_by_name(source, moments, data):
    sd, make = FOREIGN_SOURCES[source]()
    for k in range(data.draw(st.integers(1, 3), label="changes")):
        paths = [p for p in _foreign_paths(sd) if p[-1] != "params"]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label=f"path {k}")
        if data.draw(st.booleans(), label=f"delete {k}"):
            _foreign_set(sd, path, None, delete=True)
        else:
            _foreign_set(sd, path, copy.deepcopy(data.draw(st.sampled_from(ODD_VALUES), label=f"value {k}")))
    params = make(seed=3)
    opt = FusedAdam(params, lr=5e-4, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before, given = optimizer_snapshot(opt), tree_bits(sd)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (inf/NaN moments load, with a warning)
            opt.load_state_dict(sd)
    except (ValueError, TypeError) as error:
        assert str(error).startswith("state_dict"), str(error)
        assert_same_snapshot(before, optimizer_snapshot(opt))
        assert_tree_same(given, tree_bits(sd))
        return
    assert_tree_same(given, tree_bits(sd))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.skipif(TORCHAO_MISSING is not None, reason=TORCHAO_MISSING or "")
def test_torchao_states_of_sharded_params_are_refused_by_name(tmp_path):
    """torchao's states of FSDP2 params are DTensors around its subclasses: not read (gather them first), and said
    so (one process, gloo, a one-rank mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, without a process group already set up")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sd, _ = torchao_state_dict("8bit", real=True)
        for state in sd["state"].values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = DTensor.from_local(state[key], mesh, [Replicate()], run_check=False)
        params = make_params(seed=3)
        opt = FusedAdam(params)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        before = optimizer_snapshot(opt)
        with pytest.raises(TypeError, match=r"^state_dict\['state'\]\[0\]\['exp_avg'\] is a DTensor whose local "
                                            r"tensor is a torchao\.optim\.subclass_8bit\.OptimState8bit"):
            opt.load_state_dict(sd)
        assert_same_snapshot(before, optimizer_snapshot(opt))
    finally:
        dist.destroy_process_group()


def test_a_nonfinite_foreign_moment_loads_with_a_warning_that_says_what_its_entry_is_in_the_given_dict():
    # (a run that had diverged: its block scale is NaN; the warning names the canonical entry and what it was read
    # from, as the errors of the same load do)
    sd, _ = bnb_state_dict()
    sd["state"][0][BNB_KEY]["absmax1"][0] = float("nan")
    with pytest.warns(RuntimeWarning) as record:
        FusedAdam(bnb_params()).load_state_dict(sd)
    message = str(record[0].message)
    assert message.startswith("load_state_dict: state_dict['state'][0]['exp_avg'] (in the Adam checkpoint read from "
                              "this bitsandbytes state_dict: its 'exp_avg' is state1"), message
    assert "holds inf or NaN" in message, message


def test_loading_leaves_the_given_state_dict_as_it_was():
    for sd, make in ((bnb_state_dict()[0], bnb_params), (torchao_state_dict("4bit", real=False)[0], make_params)):
        given = tree_bits(sd)
        FusedAdam(make(), exp_avg_dtype=torch.uint4, exp_avg_sq_dtype=torch.uint4).load_state_dict(sd)
        assert_tree_same(given, tree_bits(sd))


# ---- with the libraries: a run continues --------------------------------------------------------------------------

# The run of guides/examples/migrate_lowbit.py (``example``), the guide's demonstration of this migration: its task (an
# MLP whose 4096- and 8192-element weights get quantised moments), training loop and hyperparameters.


def _sources():
    out = []
    for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
        out.append(pytest.param("torchao", name, id=f"torchao-{name}",
                                marks=pytest.mark.skipif(TORCHAO_MISSING is not None, reason=TORCHAO_MISSING or "")))
    for name in ("Adam8bit", "AdamW8bit", "PagedAdamW8bit", "AdamW32bit"):  # (32-bit: plain state1/state2)
        out.append(pytest.param("bitsandbytes", name, id=f"bitsandbytes-{name}",
                                marks=pytest.mark.skipif(BNB_MISSING is not None, reason=BNB_MISSING or "")))
    return out


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")  # (bitsandbytes: it runs unpaged)
@pytest.mark.parametrize("library,name", _sources())
def test_a_run_continues_on_fusedadam_as_with_its_source_optimizer(library, name):
    cls = getattr(torchao_optim if library == "torchao" else bnb.optim, name)
    model, batches = example.task()
    source = cls(model.parameters(), **example.HYPER)
    example.train(model, source, batches[:example.BEFORE])
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    at_save = copy.deepcopy(model)
    theirs = example.train(model, source, batches[example.BEFORE:])

    def continued(moments: dict, load: bool):
        m = copy.deepcopy(at_save)
        opt = FusedAdam(m.parameters(), adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, **example.HYPER, **moments)
        if load:
            opt.load_state_dict(checkpoint)
        return m, opt

    # one step: the source's own update of the decoded moments, to float32 rounding
    m1, opt1 = continued({}, load=True)
    example.train(m1, opt1, batches[example.BEFORE:example.BEFORE + 1])
    s1 = copy.deepcopy(at_save)
    src1 = cls(s1.parameters(), **example.HYPER)
    src1.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    example.train(s1, src1, batches[example.BEFORE:example.BEFORE + 1])
    for a, b in zip(m1.parameters(), s1.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    # M steps: close to the source's continuation, far closer than fresh moments
    def distance(losses):
        return sum(abs(a - b) for a, b in zip(losses, theirs)) / len(theirs)

    restart = distance(example.train(*continued({}, load=False), batches[example.BEFORE:]))
    for dtype in example.TARGETS.values():  # fp32, 8-bit, 4-bit and fp8 moments
        moments = {"exp_avg_dtype": dtype, "exp_avg_sq_dtype": dtype}
        ours = distance(example.train(*continued(moments, load=True), batches[example.BEFORE:]))
        assert ours < 0.2 * restart, (moments, ours, restart)


@pytest.mark.parametrize("module,name", [("torchao.optim.adam", "AdamW8bit"), ("bitsandbytes.optim.adamw", "AdamW8bit")])
def test_from_optimizer_refuses_a_torchao_or_bitsandbytes_optimizer_naming_load_state_dict(module, name):
    params = make_params()
    optimizer = type(name, (torch.optim.Optimizer,), {"__module__": module})(params, {"lr": 1e-3})
    with pytest.raises(TypeError, match=rf"got {name}; .*{module.split('.')[0]} optimizer's run continues through "
                                        r"its state_dict: .*load_state_dict\(optimizer.state_dict\(\)\)"):
        FusedAdam.from_optimizer(optimizer)


@pytest.mark.parametrize("module,name", [("bitsandbytes.optim.lion", "Lion8bit"), ("bitsandbytes.optim.sgd", "SGD8bit"),
                                         ("bitsandbytes.optim.ademamix", "AdEMAMix8bit"),
                                         ("torchao.optim.cpu_offload", "CPUOffloadOptimizer")])
def test_from_optimizer_names_load_state_dict_only_for_the_adam_optimizers_whose_state_dict_it_reads(module, name):
    """Their other optimizers (Lion, SGD, AdEMAMix, ...) keep states of other update rules, which load_state_dict
    refuses: the error does not send their runs there."""
    params = make_params()
    optimizer = type(name, (torch.optim.Optimizer,), {"__module__": module})(params, {"lr": 1e-3})
    with pytest.raises(TypeError, match=rf"converts torch.optim.Adam and torch.optim.AdamW, got {name}$"):
        FusedAdam.from_optimizer(optimizer)
