"""ort_optim installs like a package, as a specification.

* ``pip wheel .`` carries the native sources (ops/*.cpp and ops/*.h as ort_optim/_ops, setup.py), and the wheel installed into
  another environment keeps building, loading and running the native op from those sources.
* An sdist (``python -m build``, ``pip download``, ``pip install <sdist>``) carries the native sources (ops/*.cpp,
  MANIFEST.in), so the wheel built from it carries them as ort_optim/_ops like ``pip wheel .`` does; a build that
  cannot find them fails loudly instead of producing a wheel that silently falls back to pure PyTorch.
* The native library's cache folder is keyed by everything the library is compiled against: torch's version, location
  and C++ ABI (not the Python ABI: the library uses no Python C API and links no Python library), so two environments
  sharing ``~/.cache/ort-optim`` never load each other's library; building it again (``python -m ort_optim.build``,
  run by every ``make setup``) compiles nothing.

The wheel and sdist tests build a wheel and a virtual environment (about 20 s each): marked ``install``; the suite's
runs through other backends (ORT_OPTIM_BACKEND=triton or torch) skip them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import venv
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_python, site_packages

from ort_optim import AdamWMode, FusedAdam, backends


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

    The wheel and the checkout share the library cache (ORT_OPTIM_CACHE), keyed by the sources' contents: the wheel's
    copy of ops/ lands on the library this checkout built, and loading it there rebuilds nothing (the build compiles
    the folder's own copy of the sources, so the paths torch's build records are the same for both)."""
    if not backends.native_available():
        pytest.fail("the native library cannot be built here: `python -m ort_optim.build --verbose` tells why")
    ours = backends.native.build()
    before = {path.name: path.stat().st_mtime_ns for path in ours.parent.iterdir() if path.is_file()}
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(run_python(python, "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))",
                               cwd=tmp_path))
    # This interpreter's site-packages after the new environment's own: plain paths, so the .pth files there (this
    # environment's editable install of the checkout) are not run, and the only ort_optim importable is the wheel's.
    (purelib / "_parent_environment.pth").write_text("".join(f"{path}\n" for path in site_packages()))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--ignore-installed", "--disable-pip-version-check", "-q", str(wheel)], check=True, cwd=tmp_path)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ran = run_python(python, _STEP_OUTSIDE, cwd=outside)
    installed = purelib / "ort_optim"
    assert Path(ran["file"]) == installed / "__init__.py"
    assert Path(ran["ops_dir"]) == installed / "_ops"
    assert ran["native"] is True
    assert ran["loaded"] == [str(Path(ran["build_dir"]) / "ort_optim_ops.so")]
    assert Path(ran["build_dir"]) == ours.parent  # same sources, same library
    assert {path.name: path.stat().st_mtime_ns for path in ours.parent.iterdir() if path.is_file()} == before

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


# ---- sdists ----------------------------------------------------------------------------------------------------------

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


# ---- the native library's cache key ----------------------------------------------------------------------------------

def test_the_library_cache_is_keyed_by_the_cxx_abi_it_is_compiled_against(monkeypatch):
    """Two environments that share ~/.cache/ort-optim (ORT_OPTIM_CACHE) with the same torch version, one with a torch
    built with the other C++ ABI, get folders of their own: neither loads the other's library (an import error at
    best, a crash at worst)."""
    here = backends.native.build_dir()
    assert here.name.startswith(f"torch-{torch.__version__}-")
    abi = torch.compiled_with_cxx11_abi()
    monkeypatch.setattr(torch, "compiled_with_cxx11_abi", lambda: not abi)
    elsewhere = backends.native.build_dir()
    assert elsewhere.parent == here.parent and elsewhere != here
    monkeypatch.undo()
    assert backends.native.build_dir() == here  # (and the same environment keeps its folder)


def test_the_library_does_not_depend_on_the_python_abi():
    """The library uses torch's C++ API and torch.library registration only, no Python C API: it needs no Python
    library and no symbol of one (nor torch's Python bindings, libtorch_python), so its cache key leaves the Python
    ABI out."""
    if not backends.native_available():
        pytest.skip("the native library could not be built here")
    if shutil.which("readelf") is None or shutil.which("nm") is None:
        pytest.skip("needs binutils' readelf and nm")
    library = str(backends.native.build_dir() / "ort_optim_ops.so")
    needed = [line for line in subprocess.run(["readelf", "-d", library], capture_output=True, text=True,
                                              check=True).stdout.splitlines() if "(NEEDED)" in line]
    assert needed and not [line for line in needed if "python" in line.lower()], needed
    undefined = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True, text=True,
                               check=True).stdout.split()
    assert not [name for name in undefined if name.startswith(("Py", "_Py", "THP"))]


def test_the_library_compiles_in_the_cxx_standard_torchs_headers_need():
    """torch.utils.cpp_extension passes the C++ standard that the installed torch's headers are written in (C++17 for
    torch 2.4, C++20 from 2.13 on; torch 2.14's headers use C++20's <=> and string_view::starts_with); the build adds
    none of its own, which would come after torch's and override it (a library that stops compiling with the next
    torch). Read from the compile command of the library's own build folder."""
    if not backends.native_available():
        pytest.skip("the native library could not be built here")
    ninja = (backends.native.build_dir() / "build.ninja").read_text()
    cflags = next(line for line in ninja.splitlines() if line.startswith("cflags ="))
    standards = re.findall(r"-std=\S+", cflags)
    assert len(standards) == 1, f"the compile command names {len(standards)} C++ standards: {standards}"
    assert not any(flag.startswith("-std=") for flag in backends.native.CFLAGS)


def test_the_library_cache_is_keyed_by_the_sources_not_where_they_are(tmp_path, monkeypatch):
    """A checkout, another clone and an installed wheel (its copy of ops/ in ort_optim/_ops) with the same sources share
    one folder; changed sources get another. (The build compiles the copy inside the folder: the wheel test below
    checks that switching between them rebuilds nothing.)"""
    here = backends.native.build_dir()
    copy = tmp_path / "_ops"
    shutil.copytree(backends.native.OPS_DIR, copy)
    monkeypatch.setattr(backends.native, "OPS_DIR", copy)
    assert backends.native.build_dir() == here
    (copy / backends.native.SOURCES[-1]).write_bytes((copy / backends.native.SOURCES[-1]).read_bytes() + b"\n")
    changed = backends.native.build_dir()
    assert changed.parent == here.parent and changed != here


# ---- building again --------------------------------------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("ORT_OPTIM_BACKEND", "auto") not in ("auto", "native"),
                    reason="the native library's build: once per environment, not again for every backend")
def test_building_the_native_library_again_compiles_nothing():
    """`python -m ort_optim.build` runs at every `make setup` (so before every `make test`, `demo` and `bench`): with
    the library built, it finds every object up to date instead of recompiling the kernels (25-50 s on 2 cores)."""
    from ort_optim import backends

    if not backends.native_available():
        pytest.fail("the native library cannot be built here: `python -m ort_optim.build --verbose` tells why")
    folder = backends.native.build().parent  # (up to date first: an older checkout may have touched the header)
    built = {path.name: path.stat().st_mtime_ns for path in folder.iterdir() if path.suffix in (".o", ".so", ".h")}
    assert "ort_optim_ops.so" in built
    backends.native.build()
    assert {name: (folder / name).stat().st_mtime_ns for name in built} == built


@pytest.mark.skipif(os.environ.get("ORT_OPTIM_BACKEND", "auto") not in ("auto", "native"),
                    reason="the native library's build: once per environment, not again for every backend")
def test_a_build_killed_midway_does_not_block_the_next_one():
    """torch.utils.cpp_extension before torch 2.14 marks a build in progress with a `lock` file in the build folder
    and waits, forever and silently, while one exists; a build killed midway leaves it. The next build removes it,
    says so, and finishes. From torch 2.14 on, its lock is an flock on that file, which stays after every build and
    blocks nothing: the next build leaves it and says nothing (a warning at every build would be a false alarm).
    Here in a subprocess with a time limit, so a hang fails instead of stopping the suite."""
    from ort_optim import backends

    if not backends.native_available():
        pytest.fail("the native library cannot be built here: `python -m ort_optim.build --verbose` tells why")
    folder = backends.native.build().parent
    (folder / "lock").touch()
    code = ("import warnings, json\nfrom ort_optim.backends import native\n"
            "with warnings.catch_warnings(record=True) as caught:\n    warnings.simplefilter('always')\n"
            "    native.build()\nprint(json.dumps([str(w.message) for w in caught]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages = json.loads(proc.stdout.strip().splitlines()[-1])
    if backends.native._baton_lock():
        assert any("left by a build that was killed" in m and str(folder / "lock") in m for m in messages), messages
        assert not (folder / "lock").exists()
    else:
        assert not any("left by a build that was killed" in m for m in messages), messages


@pytest.mark.slow
def test_builds_into_one_folder_run_one_at_a_time(tmp_path):
    """native.build_lock holds an fcntl lock on the folder while a build runs: a second build waits for the first
    (here another process holding the folder 1 s), and only a `lock` file that no live build holds is removed; where
    such a file blocks nothing (torch >= 2.14's cpp_extension locks with an flock on it), it is left alone."""
    from ort_optim.backends import native

    (tmp_path / "lock").touch()  # (a live build's cpp_extension lock: it must survive while that build runs)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom ort_optim.backends import native\n"
         f"with native.build_lock(__import__('pathlib').Path({str(tmp_path)!r}), stale_lock_blocks=True):\n"
         "    print('held', flush=True); time.sleep(1.0)"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        held_at = time.monotonic()
        (tmp_path / "lock").touch()  # (the holder removed the first one as stale: its own build's lock now)
        with pytest.warns(RuntimeWarning, match="left by a build that was killed"):
            with native.build_lock(tmp_path, stale_lock_blocks=True):
                assert time.monotonic() - held_at > 0.8  # (entered only once the holder had let go)
    finally:
        holder.communicate(timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with native.build_lock(tmp_path, stale_lock_blocks=True):  # no lock file: no warning
            pass
        (tmp_path / "lock").touch()
        with native.build_lock(tmp_path, stale_lock_blocks=False):  # a file that blocks nothing: left, no warning
            pass
        assert (tmp_path / "lock").exists()


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
