"""Shared fixtures and helpers: backend selection, bit-exact snapshots of an optimizer, tolerance tables."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Optional

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the package under test, whatever the working directory
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/reference.py
# the distributed scenario modules (tests/distributed/), which test modules elsewhere read too (fp16_scenarios.py)
sys.path.append(str(Path(__file__).resolve().parent / "distributed"))

from ort_optim import backends  # noqa: E402
from ort_optim.bench.common import intra_op_threads  # noqa: E402

# One intra-op thread for the FusedAdam specification tests: on the shared 2-core machines a second OpenMP thread that
# has to wait for a busy core makes small tensor ops 20x slower. The kernels' results do not depend on the thread
# count; op/test_op.py checks that explicitly with 1 and 2 threads. (Other test modules keep torch's default.)
SINGLE_THREAD_MODULES = {
    "test_update_rule", "test_mixed_precision", "test_checkpoints", "test_op", "test_low_bit", "test_state_cache",
    "test_migration", "test_drop_in",
}


@pytest.fixture(autouse=True)
def _one_intra_op_thread(request):
    if request.module.__name__ not in SINGLE_THREAD_MODULES:
        yield
        return
    with intra_op_threads(1):
        yield


@pytest.fixture(autouse=True)
def _subnormals_kept():
    """torch 2.4.1's inductor builds its C++ kernels with -ffast-math, and loading one turns on flush-to-zero for the
    thread: a test that compiles a step leaves it off again for the tests after it, which read subnormals (hypothesis
    refuses to draw floats at all under flush-to-zero)."""
    yield
    torch.set_flush_denormal(False)


# Examples per hypothesis property. Each property states the count that `make test` (and CI) runs; the environment
# variable ORT_OPTIM_FUZZ_EXAMPLES replaces every count: `make check` sets a few for its fast tier, and a long fuzzing
# run sets many (ORT_OPTIM_FUZZ_EXAMPLES=100000). The properties are derandomized or seeded per test, so a failure
# reproduces with the same count.
def fuzz_examples(thorough: int) -> int:
    value = os.environ.get("ORT_OPTIM_FUZZ_EXAMPLES")
    return int(value) if value else thorough


# The CPU backends every FusedAdam test runs on: the compiled op (ops/) and the pure-PyTorch fallback
# (ort_optim/backends/reference.py). ORT_OPTIM_BACKEND is read at every step, so monkeypatch.setenv switches per test.
# `make test-triton` runs the suite with ORT_OPTIM_BACKEND=triton (and TRITON_INTERPRET=1): then every
# backend-parametrised test goes through the Triton kernels instead.
BACKENDS = ("triton",) if os.environ.get("ORT_OPTIM_BACKEND") == "triton" else ("native", "torch")
# The backends of a long run (hundreds of steps): on the reference backend it is in the slow tier, whose bits the
# fast tier already pins to the native op's (the bit-for-bit comparisons of the two backends: test_update_rule.py's
# property over any configuration, and test_low_bit.py's; test_op.py compares them within a rounding).
LONG_RUN_BACKENDS = tuple(pytest.param(name, marks=pytest.mark.slow) if name == "torch" else name for name in BACKENDS)


def select_backend(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    if name == "native" and not backends.native_available():
        pytest.skip("the native CPU library could not be built here (test_op.py's build test reports why)")
    monkeypatch.setenv("ORT_OPTIM_BACKEND", name)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    """Runs the test once per CPU backend, with ORT_OPTIM_BACKEND set accordingly."""
    select_backend(monkeypatch, request.param)
    return request.param


@pytest.fixture
def deepspeed_loss_scaler(monkeypatch):
    """DeepSpeed's fp16 loss-scaler module (deepspeed.runtime.fp16.loss_scaler), its scalers usable outside a process
    group (their logging asks torch.distributed for the rank: answered 0); skips where DeepSpeed does not import."""
    module = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler",
                                 reason="DeepSpeed is not importable in this environment")
    monkeypatch.setattr(module, "dist", type("D", (), {"get_rank": staticmethod(lambda: 0)}))
    return module


# ---- bit-exact snapshots -------------------------------------------------------------------------------------------

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (so NaN == NaN and -0.0 != 0.0), contiguous."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.view(_INT_VIEW[t.element_size()])
    return t


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "", nan_mask: Optional[torch.Tensor] = None
                         ) -> None:
    """Bit for bit; the elements where nan_mask is set are left out (assert_bitwise_equal_but_nan_bits)."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    a_bits, b_bits = bits(a), bits(b)
    if nan_mask is not None:
        a_bits, b_bits = (t.masked_fill(nan_mask.contiguous(), 0) for t in (a_bits, b_bits))
    if not torch.equal(a_bits, b_bits):
        diff = (a.double() - b.double()).abs()
        if nan_mask is not None:
            diff = diff.masked_fill(nan_mask, 0.0)
        raise AssertionError(f"{what}: not bit-for-bit equal (max abs diff {float(diff.nan_to_num(1e300).max())})")


def assert_bitwise_equal_but_nan_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Bit for bit, except that a NaN equals any NaN: a NaN's sign and payload are not specified (conversions between
    float widths, torch's included, do not keep them), only that it stays NaN."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    nan = None
    if a.is_floating_point():
        # (through float32 and the raw bits: torch 2.4 has no isnan or fill for the float8 dtypes)
        nan = a.detach().float().isnan()
        assert torch.equal(nan, b.detach().float().isnan()), f"{what}: NaN in different places"
    assert_bitwise_equal(a, b, what, nan_mask=nan)


class LargestTemporary(TorchDispatchMode):
    """Within it, records every storage that an op makes off the meta device (a view of an input makes none); after
    it, :meth:`besides` gives the bytes of the largest one that is not a storage of the given tensors (what the code
    keeps): its largest temporary."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[int, int, str]] = []  # (data_ptr, nbytes, op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in given:
                self.made.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), str(func)))
        return out

    def besides(self, kept: Iterable[torch.Tensor]) -> tuple[int, str]:
        """(bytes, op) of the largest storage made that none of kept uses (0 where there is none)."""
        kept_ptrs = {t.untyped_storage().data_ptr() for t in kept if isinstance(t, torch.Tensor)}
        return max(((nbytes, op) for ptr, nbytes, op in self.made if ptr not in kept_ptrs), default=(0, ""))


class LargestAllocation(LargestTemporary):
    """Within it, records the storages that ops make off the meta device, as LargestTemporary does; ``nbytes`` is the
    largest one's size: what a piece of code allocates at most, whatever it frees later."""

    @property
    def nbytes(self) -> int:
        return max((nbytes for _, nbytes, _ in self.made), default=0)


def optimizer_snapshot(opt: torch.optim.Optimizer, extra: Iterable[torch.Tensor] = (), report: bool = False) -> dict:
    """Copies of everything an optimizer step may touch: params, grads, every state tensor (keys included),
    param group hyperparameters, plus any extra tensors; with report, a FusedAdam's report of its last step too
    (last_grad_norm and last_found_inf: what a refused step keeps, and what a plain step leaves None on some paths)."""
    snap = {}
    for name in ("last_grad_norm", "last_found_inf") if report else ():
        if isinstance(getattr(type(opt), name, None), property):
            value = getattr(opt, name)
            snap[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    for gi, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if k != "params":
                if isinstance(v, torch.Tensor):  # (a tensor without data, meta or fake, by its description)
                    no_data = v.is_meta or isinstance(v, FakeTensor)
                    v = ("no data", str(v.device), v.dtype, tuple(v.shape)) if no_data else v.detach().clone()
                snap[f"group{gi}.{k}"] = v
        for pi, p in enumerate(group["params"]):
            snap[f"p{gi}.{pi}"] = p.detach().clone()
            snap[f"p{gi}.{pi}.grad"] = None if p.grad is None else p.grad.detach().clone()
            state = opt.state.get(p, {})
            snap[f"p{gi}.{pi}.state_keys"] = tuple(sorted(state))
            for key, value in state.items():
                snap[f"p{gi}.{pi}.{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    for i, t in enumerate(extra):
        snap[f"extra{i}"] = t.detach().clone()
    return snap


def assert_tree_bitwise_equal(a, b, where: str = "state") -> None:
    """Nested dicts/lists/tuples of tensors and plain values: same types and keys everywhere, tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor) and (a.is_meta or b.is_meta):  # no data to compare
        assert (a.device, a.dtype, a.shape) == (b.device, b.dtype, b.shape), f"{where}: {a} vs {b}"
    elif isinstance(a, torch.Tensor):
        assert_bitwise_equal(a, b, where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_tree_bitwise_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_bitwise_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, (float, complex)) and a != a:
        assert b != b, f"{where}: {a!r} != {b!r}"  # NaN is NaN
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_snapshot(a: dict, b: dict, nan_bits: bool = True) -> None:
    """Two optimizer_snapshot()s: the same entries, tensors bit for bit; nan_bits=False: a NaN equals any NaN
    (assert_bitwise_equal_but_nan_bits)."""
    assert a.keys() == b.keys(), f"different entries: {sorted(set(a) ^ set(b))}"
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), f"{key}: {x!r} vs {y!r}"
            (assert_bitwise_equal if nan_bits else assert_bitwise_equal_but_nan_bits)(x, y, key)
        else:
            assert x == y or (not nan_bits and x != x and y != y), f"{key}: {x!r} != {y!r}"


def assert_same_snapshot_but_nan_bits(a: dict, b: dict) -> None:
    assert_same_snapshot(a, b, nan_bits=False)


def assert_same_history(first: list, second: list) -> None:
    """Two runs' histories, one entry per step: a snapshot (assert_same_snapshot_but_nan_bits), or a refusal (a
    tuple, such as ("refused", type, message)) that must be the same, ending the run."""
    assert len(first) == len(second), (first[-1:], second[-1:])
    for a, b in zip(first, second):
        if isinstance(a, tuple) or isinstance(b, tuple):
            assert a == b
        else:
            assert_same_snapshot_but_nan_bits(a, b)


def state_values(opt: torch.optim.Optimizer, p: torch.Tensor, key: str) -> Optional[torch.Tensor]:
    """A moment's float32/float64 values, decoding fp16 and low-bit states stored with block scales."""
    state = opt.state[p]
    if key not in state:
        return None
    value = state[key]
    if key + "_scale" in state:  # fp16 codes (sqrt(v) for second moments) or low-bit codes (ops/README.md)
        from ort_optim import formats

        root = None  # a 4-bit exp_avg is decoded through its exp_avg_sq (ort_optim._spec.EXP_AVG_RELATIVE)
        if key == "exp_avg" and formats.is_relative(value, state[key + "_scale"]):
            root = formats.state_root(state["exp_avg_sq"], state["exp_avg_sq_scale"], p.shape)
        return formats.decode_state(value, state[key + "_scale"], key != "exp_avg", p.shape, root)
    return value


def site_packages() -> list[str]:
    """This interpreter's site-packages folders, in order: its own and those its .pth files add (a clone's .venv is
    layered on the shared environment that way, tools/make_env.sh). For environments made in tests that must see
    this one's packages (torch, pip, setuptools) as plain paths, whose .pth files do not run."""
    folders = site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    folders += [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages")]
    return list(dict.fromkeys(folders))


def run_python(python, code: str, cwd: Path) -> dict:
    """Runs code with python in cwd, without PYTHONPATH (so only what is installed is importable); returns the JSON
    the code printed last."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, f"{python} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the spawned scenario sets that several test modules read ------------------------------------------------------
# (Here, not in a tests/distributed/conftest.py: the modules import this one by name, and a second conftest module
# would take its place in sys.modules.) Each set spawns once per session (distributed_harness.run_once); the scenario
# modules are imported when a test asks for their results: they live in tests/distributed/, on sys.path (above).


@pytest.fixture(scope="session")
def mesh_results(tmp_path_factory):
    """mesh_scenarios on 4 ranks, against a shadow FusedAdam and one process."""
    import mesh_scenarios

    return mesh_scenarios.results(tmp_path_factory)


@pytest.fixture(scope="session")
def torch_results(tmp_path_factory):
    """torch_scenarios on 2 ranks, against torch.optim.AdamW in the same engine."""
    import torch_scenarios

    return torch_scenarios.results(tmp_path_factory)


def pytest_report_header(config):
    native = backends.native_available() if os.environ.get("ORT_OPTIM_NO_NATIVE") != "1" else False
    return f"torch {torch.__version__}; ort_optim native CPU library: {'loaded' if native else 'NOT available'}"
