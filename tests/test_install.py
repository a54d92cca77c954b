"""ort_optim installs like a package, as a specification.

* The project's environments have ort_optim installed (``make setup`` runs ``pip install -e`` of the checkout into
  both), so their interpreter imports it from any directory, without PYTHONPATH.
* ``pip wheel .`` carries the native sources (ops/*.cpp and ops/*.h as ort_optim/_ops, setup.py), and the wheel installed into
  another environment keeps building, loading and running the native op from those sources.

The wheel test builds a wheel and a virtual environment (about 20 s): marked ``install`` so that CI runs it once per
environment; the suite's runs through other backends (ORT_OPTIM_BACKEND=triton or torch) skip it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch

from ort_optim import AdamWMode, FusedAdam, backends

ROOT = Path(__file__).resolve().parent.parent


def _run_python(python, code: str, cwd: Path) -> dict:
    """Runs code with python in cwd, without PYTHONPATH (so only what is installed is importable); returns the JSON
    the code printed last."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, f"{python} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_environment_imports_ort_optim_from_any_directory(tmp_path):
    """An editable install (PEP 660) of a checkout: the import works from a directory with nothing in it and finds
    the checkout's package. In a helper's worktree the shared environment may point at another checkout, so the test
    asserts the mechanism (an editable install of a checkout that holds the imported package), not the path."""
    found = _run_python(sys.executable, """if True:
        import json, importlib.metadata as metadata
        import ort_optim
        direct_url = metadata.distribution("ort-optim").read_text("direct_url.json")
        print(json.dumps({"file": ort_optim.__file__, "has_fused_adam": hasattr(ort_optim, "FusedAdam"),
                          "direct_url": json.loads(direct_url) if direct_url else None}))
        """, cwd=tmp_path)
    assert found["has_fused_adam"]
    assert found["direct_url"] is not None, "ort-optim is installed, but not from a local checkout (no direct_url.json)"
    assert found["direct_url"].get("dir_info", {}).get("editable") is True, found["direct_url"]
    checkout = Path(unquote(urlparse(found["direct_url"]["url"]).path))
    assert (checkout / "ops" / "schema.cpp").exists(), f"{checkout} is not an ort-optim checkout"
    assert Path(found["file"]).resolve() == (checkout / "ort_optim" / "__init__.py").resolve()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the checkout (setuptools writes build/ and *.egg-info into the tree it builds)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "results",
                                                                "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "--disable-pip-version-check", "-w", str(tmp)], check=True, cwd=tmp)
    (built,) = tmp.glob("*.whl")
    return built


@pytest.mark.install
def test_a_wheel_carries_every_module_and_the_native_sources(wheel):
    """The wheel ships every module of the package (subpackages included) and ops/*.cpp and ops/*.h as ort_optim/_ops, where
    backends/native.py looks outside a checkout (setup.py)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "ort_optim").rglob("*.py")}
    assert modules - names == set()
    for source in backends.native.SOURCES:
        assert f"ort_optim/_ops/{source}" in names


# A FusedAdam step outside any checkout; prints what it imported and loaded, and the stepped param.
_STEP_OUTSIDE = """if True:
    import json, torch, ort_optim
    from ort_optim.backends import native
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3000))
    p.grad = torch.randn(3000)
    opt = ort_optim.FusedAdam([p], lr=1e-2, eps=1e-8, weight_decay=0.1, adam_w_mode=ort_optim.AdamWMode.ADAMW_TORCH)
    for _ in range(3):
        opt.step()
    maps = open("/proc/self/maps").read().split()
    print(json.dumps({"file": ort_optim.__file__, "ops_dir": str(native.OPS_DIR), "native": ort_optim.native_available(),
                      "build_dir": str(native.build_dir()), "loaded": sorted({m for m in maps if m.endswith(".so")
                                                                              and "ort_optim_ops" in m}),
                      "param": p.detach().tolist()}))
    """


@pytest.mark.install
@pytest.mark.skipif(os.environ.get("ORT_OPTIM_BACKEND", "auto") not in ("auto", "native"),
                    reason="installs the wheel: once per environment, not again for every backend")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps to see the loaded library")
def test_the_wheel_installed_elsewhere_builds_and_runs_the_native_op_from_its_own_sources(wheel, tmp_path):
    """A fresh virtual environment that sees this one's packages (torch) the way --system-site-packages would see the
    system's, with the wheel installed into it and run from a directory outside the checkout: it imports its own copy,
    finds the native sources in that copy, loads the library built from them and steps like the checkout does.

    The library cache (ORT_OPTIM_CACHE) is keyed by a hash of the sources, so the wheel's copy of ops/ lands on the
    library this checkout already built (no minutes-long compile in the suite); a wheel whose sources differed would
    get a folder of its own, built from them."""
    if not backends.native_available():
        pytest.fail("the native library cannot be built here: `python -m ort_optim.build --verbose` tells why")
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(_run_python(python, "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))",
                               cwd=tmp_path))
    # This interpreter's site-packages after the new environment's own: plain paths, so the .pth files there (this
    # environment's editable install of the checkout) are not run, and the only ort_optim importable is the wheel's.
    ours = dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (purelib / "_parent_environment.pth").write_text("".join(f"{path}\n" for path in ours))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--ignore-installed", "--disable-pip-version-check", "-q", str(wheel)], check=True, cwd=tmp_path)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ran = _run_python(python, _STEP_OUTSIDE, cwd=outside)
    installed = purelib / "ort_optim"
    assert Path(ran["file"]) == installed / "__init__.py"
    assert Path(ran["ops_dir"]) == installed / "_ops"
    assert ran["native"] is True
    assert ran["loaded"] == [str(Path(ran["build_dir"]) / "ort_optim_ops.so")]
    assert Path(ran["build_dir"]).name == backends.native.build_dir().name  # same sources, same library

    # The same three steps here, from the checkout: bit for bit, and close to torch.optim.AdamW's.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3000))
    p.grad = torch.randn(3000)
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    opt = FusedAdam([p], lr=1e-2, eps=1e-8, weight_decay=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH)
    reference = torch.optim.AdamW([q], lr=1e-2, eps=1e-8, weight_decay=0.1, foreach=False)
    for _ in range(3):
        opt.step()
        reference.step()
    assert ran["param"] == p.detach().tolist()
    torch.testing.assert_close(torch.tensor(ran["param"]), q.detach(), rtol=1e-6, atol=1e-6)


def test_the_library_is_built_from_every_native_source_and_its_cache_key_covers_each(tmp_path, monkeypatch):
    """backends.native.SOURCES names every file of ops/ that goes into the library (the .cpp files it compiles and
    the headers they include; ops/bench_probes.cpp is the benchmark's, built apart), so that the build, the cache key
    and the wheel (setup.py reads the same list) all see them; and editing any one of them changes the build folder,
    so an edited header never gets a library built from the old one."""
    native = backends.native
    in_ops = {p.name for p in (ROOT / "ops").iterdir() if p.suffix in (".cpp", ".h")} - {"bench_probes.cpp"}
    assert set(native.SOURCES) == in_ops
    included = set()
    for name in native.SOURCES:
        included |= set(re.findall(r'#include "([^"]+)"', (ROOT / "ops" / name).read_text()))
    assert included - {"ort_optim_spec.h"} <= set(native.SOURCES)  # (the spec header is generated into the key)
    shutil.copytree(ROOT / "ops", tmp_path / "ops")
    monkeypatch.setattr(native, "OPS_DIR", tmp_path / "ops")
    unchanged = native.build_dir()
    for name in native.SOURCES:
        source = tmp_path / "ops" / name
        text = source.read_bytes()
        source.write_bytes(text + b"\n// edited\n")
        assert native.build_dir() != unchanged, f"editing ops/{name} leaves the library's cache key as it was"
        source.write_bytes(text)
    assert native.build_dir() == unchanged
