"""Issue 14 (practical use), items 1, 2 and 4, audited from the outside: what tests/test_practical_acceptance.py and
tests/test_install.py leave out, as a user of torch's and apex's recipes, or a packager, would run into it.

1. Packaging. An sdist (``python -m build``, ``pip download``, ``pip install <sdist>``) carries the native sources
   (ops/*.cpp, MANIFEST.in), so the wheel built from it carries them as ort_optim/_ops like ``pip wheel .`` does; a
   build that cannot find them fails loudly instead of producing a wheel that silently falls back to pure PyTorch.
   The native library's cache folder is keyed by everything the library is compiled against: torch's version and
   C++ ABI, and the Python ABI (ops/adam_plan.cpp unpacks Python tensors through the Python C API), so two
   environments sharing ``~/.cache/ort-optim`` with the same torch version on another Python never load each
   other's library.
2. ``step_in_backward`` under TorchDynamo: ``torch.compile`` of a function that calls ``backward()`` makes the
   engine call the hooks from inside a compiled frame; they run eagerly, not traced, and update bit for bit as
   ``step()``. Compiled autograd, which replaces autograd's engine, is refused by the first hook before any update.
4. Telemetry with a caller's ``found_inf`` and no ``grad_scale`` (torch.amp.GradScaler after
   ``scaler.unscale_(optimizer)``: torch's recipe for clipping under AMP; apex-style overflow buffers):
   ``last_found_inf`` is a float32 [1] of the optimizer's own, 1.0/0.0, on the params' device (not the caller's
   buffer, which it may zero for the next iteration), and ``last_grad_norm`` the norm of the gradients the update
   pass read (NaN for a step that found_inf skipped: that pass reads nothing). With ``step_in_backward``, a step()
   after backward calls that all ran inside ``accumulate()`` is a normal step and reports the norm; one that
   finishes updates made in backward reports None (never a stale or partial norm). A step without any gradient
   reports 0.0, as ``clip_grad_norm_`` does for no gradients.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import assert_same_snapshot, optimizer_snapshot

from ort_optim import AdamWMode, FusedAdam, backends

ROOT = Path(__file__).resolve().parent.parent


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _loss(model, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return model(torch.randn(5, 6, generator=g)).square().mean() * 50


# ---- 1. packaging ---------------------------------------------------------------------------------------------------

def _copy_checkout(tmp_path: Path, without: tuple = ()) -> Path:
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "results", "__pycache__", ".pytest_cache", "guides", *without))
    return source


def _build(kind: str, source: Path, out: Path) -> subprocess.CompletedProcess:
    """setuptools' PEP 517 backend, as pip and `python -m build` call it (with this environment's setuptools: no
    isolation, nothing downloaded)."""
    out.mkdir(parents=True, exist_ok=True)
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}({str(out)!r}))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=source, env=env, text=True, capture_output=True,
                          timeout=180)


@pytest.mark.install
def test_an_sdist_carries_the_native_sources_and_the_wheel_built_from_it_does_too(tmp_path):
    """`python -m build` (and `pip install` of an sdist) builds the wheel from the sdist, not from the checkout: the
    sdist must carry ops/*.cpp for that wheel to hold ort_optim/_ops, where an installed ort_optim finds them."""
    sdist_run = _build("sdist", _copy_checkout(tmp_path), tmp_path / "dist")
    assert sdist_run.returncode == 0, sdist_run.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        archive.extractall(tmp_path / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    for source in backends.native.SOURCES:
        assert f"ops/{source}" in names, sorted(names)
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheel_run = _build("wheel", unpacked, tmp_path / "wheel")
    assert wheel_run.returncode == 0, wheel_run.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    carried = set(zipfile.ZipFile(wheel).namelist())
    for source in backends.native.SOURCES:
        assert f"ort_optim/_ops/{source}" in carried
        assert zipfile.ZipFile(wheel).read(f"ort_optim/_ops/{source}") == (ROOT / "ops" / source).read_bytes()


@pytest.mark.install
def test_a_wheel_build_without_the_native_sources_fails_naming_them(tmp_path):
    """Rather than a wheel that installs fine and then runs the pure-PyTorch fallback everywhere."""
    run = _build("wheel", _copy_checkout(tmp_path, without=("ops",)), tmp_path / "wheel")
    assert run.returncode != 0
    assert "schema.cpp" in run.stderr and "adam_kernel.cpp" in run.stderr
    assert not list((tmp_path / "wheel").glob("*.whl"))


# ---- 4. found_inf without grad_scale ----------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="torch.amp.GradScaler is not in this torch")
def test_gradscaler_with_unscale_reports_the_norm_the_step_read_and_nan_for_a_skipped_step(backend):
    """torch's AMP clipping recipe: scale, backward, ``scaler.unscale_(opt)``, ``clip_grad_norm_``, ``scaler.step``.
    GradScaler then hands the step found_inf alone (the gradients are unscaled already). The update pass reads them:
    last_grad_norm is their norm (clip_grad_norm_'s total where it did not clip, max_norm where it did),
    last_found_inf 0.0; an overflow skips the step with last_found_inf 1.0, last_grad_norm NaN and nothing changed.
    The pure-PyTorch backend reports no plain-step norm (None), as for any plain step."""
    model = Tiny()
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    max_norms = [1e9, 1e9, 0.5, 1e9, 0.5]
    for step, max_norm in enumerate(max_norms):
        scaler.scale(_loss(model, step)).backward()
        if step == 3:
            model.a.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        before = optimizer_snapshot(opt)
        scaler.step(opt)
        scaler.update()
        flag = opt.last_found_inf
        assert flag is not None and flag.shape == (1,) and flag.dtype == torch.float32
        if step == 3:
            assert float(flag) == 1 and opt.last_step_skipped
            assert_same_snapshot(before, optimizer_snapshot(opt))
            assert backend == "torch" or torch.isnan(opt.last_grad_norm)
        else:
            assert float(flag) == 0 and not opt.last_step_skipped
            if backend == "torch":
                assert opt.last_grad_norm is None
            else:
                norm = opt.last_grad_norm
                assert norm.shape == () and norm.dtype == torch.float32
                torch.testing.assert_close(norm, torch.clamp(total, max=max_norm), rtol=1e-5, atol=0)
        opt.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool], ids=str)
def test_last_found_inf_is_a_float32_flag_of_its_own_not_the_callers_found_inf(dtype, backend):
    """apex's pattern: one overflow buffer, written by the overflow check, read by the step, zeroed before the next
    iteration. last_found_inf is this step's verdict as the docstring says (float32, shape [1], params' device),
    and keeps it after the caller zeroes or reuses the buffer."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = FusedAdam([p], lr=0.1)
    overflow = torch.zeros((), dtype=dtype)
    verdicts = []
    for step, value in enumerate([1, 0, 1, 0]):
        p.grad = torch.full_like(p, 0.5)
        overflow.fill_(value)
        opt.step(found_inf=overflow)
        flag = opt.last_found_inf
        assert flag is not overflow and flag.dtype == torch.float32 and flag.shape == (1,) and flag.device == p.device
        assert opt.last_step_skipped == bool(value)
        verdicts.append(flag)
        overflow.zero_()  # (the next iteration's buffer)
        assert float(flag) == value, step
    assert [float(f) for f in verdicts] == [1.0, 0.0, 1.0, 0.0]
    assert int(opt.state[p]["step"]) == 2


# ---- 1. the native library's cache key --------------------------------------------------------------------------------

@pytest.mark.parametrize("other", ["python", "torch_cxx11_abi"])
def test_the_library_cache_is_keyed_by_the_python_and_cxx_abis_it_is_compiled_against(other, monkeypatch):
    """Two environments that share ~/.cache/ort-optim (ORT_OPTIM_CACHE) with the same torch version, one on another
    Python (the library calls the Python C API: ops/adam_plan.cpp) or with a torch built with the other C++ ABI, get
    folders of their own: neither loads the other's library (an import error at best, a crash at worst)."""
    here = backends.native.build_dir()
    assert here.name.startswith(f"torch-{torch.__version__}-")
    if other == "python":
        real = backends.native.sysconfig.get_config_var
        monkeypatch.setattr(backends.native.sysconfig, "get_config_var", lambda name: (
            ".cpython-399-x86_64-linux-gnu.so" if name == "EXT_SUFFIX" else real(name)))
    else:
        abi = torch.compiled_with_cxx11_abi()
        monkeypatch.setattr(torch, "compiled_with_cxx11_abi", lambda: not abi)
    elsewhere = backends.native.build_dir()
    assert elsewhere.parent == here.parent and elsewhere != here
    monkeypatch.undo()
    assert backends.native.build_dir() == here  # (and the same environment keeps its folder)


# ---- 4. last_grad_norm with step_in_backward ------------------------------------------------------------------------

def test_with_step_in_backward_a_step_after_accumulate_reports_the_norm_and_one_after_updates_in_backward_none(
        backend):
    """Every micro-batch's backward inside accumulate(): step() is a normal step over every gradient (bit for bit the
    optimizer without step_in_backward's), and reports the same last_grad_norm (clip_grad_norm_'s total). An
    iteration whose last backward updates the params in backward leaves it None again: never the previous
    iteration's norm, never the norm of the few params step() finished."""
    models = [Tiny(), Tiny()]
    opts = [FusedAdam(m.parameters(), lr=1e-2, step_in_backward=in_backward) for m, in_backward in
            zip(models, (False, True))]
    for iteration in range(4):
        accumulate_all = iteration % 2 == 0
        for micro in range(2):
            for model, opt in zip(models, opts):
                outside = micro == 1 and not accumulate_all
                with opt.accumulate() if not outside else contextlib.nullcontext():
                    _loss(model, 2 * iteration + micro).backward()
        total = (torch.nn.utils.get_total_norm if hasattr(torch.nn.utils, "get_total_norm") else
                 lambda grads: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))(
            [p.grad for p in models[0].parameters()])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_same_snapshot(optimizer_snapshot(opts[0]), optimizer_snapshot(opts[1]))
        reference, in_backward = (opt.last_grad_norm for opt in opts)
        if backend == "torch":
            assert reference is None and in_backward is None
        elif accumulate_all:
            assert torch.equal(in_backward, reference), iteration
            torch.testing.assert_close(in_backward, total, rtol=1e-6, atol=0)
        else:
            assert in_backward is None, iteration


# ---- 2. step_in_backward under TorchDynamo ---------------------------------------------------------------------------

def _train_step(model, opt, compile_step: bool):
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        return loss
    # (backend="eager": what matters is TorchDynamo's tracing of the Python code, not inductor's kernels)
    return torch.compile(step, backend="eager") if compile_step else step


def test_torch_compile_of_a_function_that_calls_backward_updates_in_backward_bit_for_bit(backend):
    """torch.compile of a whole training step: TorchDynamo breaks the graph at backward(), which autograd's engine
    then runs, calling the hooks from inside the compiled function. The hooks run eagerly, not traced: each param
    updated once per backward, bit for bit as step() after the same compiled step without step_in_backward."""
    torch._dynamo.reset()
    try:
        models = [Tiny(), Tiny()]
        opts = [FusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1, step_in_backward=in_backward)
                for m, in_backward in zip(models, (False, True))]
        steps = [_train_step(m, opt, compile_step=True) for m, opt in zip(models, opts)]
        for i in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
            for model, opt, step in zip(models, opts, steps):
                step(x)
                if opt.step_in_backward:
                    assert all(p.grad is None for p in model.parameters())
                opt.step()
                opt.zero_grad()
        assert {int(s["step"]) for s in opts[1].state.values()} == {3}
        assert_same_snapshot(optimizer_snapshot(opts[0]), optimizer_snapshot(opts[1]))
    finally:
        torch._dynamo.reset()


def test_a_backward_run_by_compiled_autograd_is_refused_by_the_first_hook_with_nothing_updated():
    """Compiled autograd replaces autograd's engine by a traced graph (whose hooks' order and end-of-backward
    callbacks the updates in backward cannot rely on): the first hook raises a ValueError naming it, before any
    update; no param, state or step count changes."""
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    torch._dynamo.reset()
    try:
        model = Tiny()
        opt = FusedAdam(model.parameters(), lr=1e-2, step_in_backward=True)
        before = [p.detach().clone() for p in model.parameters()]
        loss = _loss(model, 0)
        with pytest.raises(ValueError, match="compiled autograd"):
            with enable(torch.compile(backend="eager")):
                loss.backward()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert not opt.state or all("step" not in s for s in opt.state.values())
    finally:
        torch._dynamo.reset()


# ---- 4. last_grad_norm of a step without gradients -------------------------------------------------------------------

@pytest.mark.parametrize("how", ["plain", "max_grad_norm", "grad_scale"])
def test_a_step_without_any_gradient_reports_a_zero_norm_as_clip_grad_norm_does(how, backend):
    """Every param without a gradient (a frozen phase, an empty param group beside them): nothing is updated or
    checked, and the norm is clip_grad_norm_'s for no gradients, 0.0 (float32, params' device), not None and not
    the previous step's; last_found_inf None. (A plain step on the pure-PyTorch backend reports no norm at all.)"""
    params = [torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]
    opt = FusedAdam([{"params": params}, {"params": []}], lr=1e-2, master_weights=True,
                    max_grad_norm=1.0 if how == "max_grad_norm" else None)
    kwargs = dict(grad_scale=8.0) if how == "grad_scale" else {}
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step(**kwargs)
    for p in params:
        p.grad = None
    before = optimizer_snapshot(opt)
    opt.step(**kwargs)
    assert_same_snapshot(before, optimizer_snapshot(opt))
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    if backend == "torch" and how == "plain":
        assert opt.last_grad_norm is None
    else:
        norm = opt.last_grad_norm
        assert norm.shape == () and norm.dtype == torch.float32 and norm.device == params[0].device
        assert float(norm) == float(expected) == 0.0
    assert opt.last_found_inf is None
