"""The native library's cache verifies itself, its build command reports failures in a few lines, and the
environment variables that steer it say what they mean, as a specification.

* A build records the library's size and sha256 in a stamp beside it; a library whose stamp is missing or differs
  (truncated, emptied) is removed and rebuilt, never loaded: loading a truncated shared object kills the process.
* Loading takes the folder's build lock, so no process loads a library that another is linking; on a cache that
  cannot be written, a verified library is loaded without the lock, an unverified one is refused with the reason.
* ``python -m ort_optim.build`` prints what failed, the compiler's last lines and ``--verbose`` for the whole log, and
  exits 1; the fallback warning is one short line.
* ``ORT_OPTIM_CACHE=`` (empty) means the default cache, ``ORT_OPTIM_BACKEND=`` (empty) means auto, and
  ``ORT_OPTIM_BACKEND=native`` without the native library is an error saying why, not a silent fallback.

The build is replaced by a stand-in that writes a file (no compiler runs), except in the no-compiler test, whose
build fails within seconds.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from ort_optim import backends, build as build_command
from ort_optim.backends import native

LIBRARY = b"\x7fELF" + bytes(range(256)) * 64  # (a stand-in: never handed to the dynamic loader here)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A build folder under tmp_path, a stand-in build that writes LIBRARY into it (and records the calls), and a
    stand-in torch.ops.load_library that records what it is given and whether the build lock was held then."""
    folder = tmp_path / "ops" / "torch-x"
    monkeypatch.setattr(native, "build_dir", lambda: folder)
    calls = {"compiled": [], "loaded": []}

    def compile_(where, verbose):
        assert not (where / native.LIBRARY).exists() or native.verified(where / native.LIBRARY), \
            "an unverified library is rebuilt from scratch, not handed to the build as up to date"
        calls["compiled"].append(where)
        (where / native.LIBRARY).write_bytes(LIBRARY)

    def load_library(path):
        calls["loaded"].append((Path(path), Path(path).read_bytes() == LIBRARY, _lock_held(folder)))

    monkeypatch.setattr(native, "_compile", compile_)
    monkeypatch.setattr(native.torch.ops, "load_library", load_library)
    return folder, calls


def _lock_held(folder: Path) -> bool:
    """Whether some open file description holds folder's build lock now."""
    try:
        with open(folder / "build.flock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def _built(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / native.LIBRARY
    path.write_bytes(LIBRARY)
    native._record(path)
    return path


@pytest.mark.parametrize("damage", ["truncated", "emptied", "stamp-missing", "stamp-of-another-build"])
def test_a_library_its_stamp_does_not_vouch_for_is_rebuilt_never_loaded(cache, damage):
    folder, calls = cache
    path = _built(folder)
    if damage == "truncated":
        os.truncate(path, 5000)
    elif damage == "emptied":
        os.truncate(path, 0)
    elif damage == "stamp-missing":
        (folder / native.STAMP).unlink()
    else:
        (folder / native.STAMP).write_text("size=1 sha256=00\n")
    assert not native.verified(path)
    native._load_or_build(verbose=False, build_anyway=False)
    assert calls["compiled"] == [folder]
    assert native.verified(path)
    assert calls["loaded"] == []  # (the build loads what it built: cpp_extension.load, replaced here)


def test_the_build_command_rebuilds_a_library_that_does_not_match_its_stamp(cache, capsys):
    folder, calls = cache
    os.truncate(_built(folder), 100)
    assert build_command.main([]) == 0
    assert calls["compiled"] == [folder] and native.verified(folder / native.LIBRARY)
    assert str(folder / native.LIBRARY) in capsys.readouterr().out


def test_a_verified_library_is_loaded_under_the_build_lock_without_building(cache):
    folder, calls = cache
    path = _built(folder)
    native._load_or_build(verbose=False, build_anyway=False)
    assert calls == {"compiled": [], "loaded": [(path, True, True)]}


@pytest.mark.slow
def test_a_load_waits_for_a_build_that_holds_the_folder_and_loads_what_it_built(cache):
    """Another process holds the build lock for a second, then writes the library and its stamp (a build linking
    it): a load started meanwhile waits, then loads the finished library; it neither finds it missing nor builds."""
    folder, calls = cache
    folder.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, time\nfrom ort_optim.backends import native\n"
         f"folder = pathlib.Path({str(folder)!r})\n"
         "with native.build_lock(folder):\n    print('held', flush=True); time.sleep(1.0)\n"
         f"    (folder / native.LIBRARY).write_bytes({LIBRARY!r})\n    native._record(folder / native.LIBRARY)\n"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        held_at = time.monotonic()
        native._load_or_build(verbose=False, build_anyway=False)
        assert time.monotonic() - held_at > 0.8
    finally:
        holder.communicate(timeout=60)
    assert calls == {"compiled": [], "loaded": [(folder / native.LIBRARY, True, True)]}


def _read_only(monkeypatch):
    def refuse(folder, stale_lock_blocks=None):
        raise OSError(errno.EROFS, "Read-only file system", str(folder / "build.flock"))

    monkeypatch.setattr(native, "build_lock", refuse)


def test_on_a_cache_that_cannot_be_written_a_verified_library_loads_without_the_lock(cache, monkeypatch, capsys):
    folder, calls = cache
    path = _built(folder)
    _read_only(monkeypatch)
    assert build_command.main([]) == 0
    assert calls == {"compiled": [], "loaded": [(path, True, False)]}
    assert str(path) in capsys.readouterr().out


def test_on_a_cache_that_cannot_be_written_an_unverified_library_is_refused_with_the_reason(cache, monkeypatch,
                                                                                            capsys):
    folder, calls = cache
    os.truncate(_built(folder), 5000)
    _read_only(monkeypatch)
    with pytest.raises(native.BuildError, match="cannot be written .*set ORT_OPTIM_CACHE to a writable folder"):
        native._load_or_build(verbose=False, build_anyway=False)
    assert build_command.main([]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ORT_OPTIM_CACHE" in err
    assert calls == {"compiled": [], "loaded": []}


def test_the_build_command_reports_a_failure_in_a_few_lines_and_exits_1(monkeypatch, capsys):
    def fail(verbose=False):
        raise native.BuildError("building the native library in /x failed: g++: fatal error", ["g++: fatal error"])

    monkeypatch.setattr(native, "build", fail)
    assert build_command.main([]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == ["ort_optim native ops: building the native library in /x failed: g++: fatal error",
                                    "the compiler's last lines:", "  g++: fatal error",
                                    "Run `python -m ort_optim.build --verbose` for the full log."]


@pytest.mark.slow
def test_without_a_compiler_the_build_command_and_the_fallback_warning_say_so_briefly(tmp_path):
    """PATH with ninja but no compiler: the build fails at its first compile (or, before torch 2.5, when it looks
    for the compiler). The command prints no traceback and no
    ninja transcript, exits 1; the warning of a process that falls back names the missing compiler in one line."""
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    if ninja is None:
        pytest.skip("ninja is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, found in (("ninja", ninja), ("which", shutil.which("which"))):  # (torch < 2.5 asks `which c++`)
        if found:
            (bin_dir / tool).symlink_to(found)
    env = {**os.environ, "PATH": str(bin_dir), "PYTHONPATH": str(ROOT), "ORT_OPTIM_CACHE": str(tmp_path / "cache")}
    env.pop("ORT_OPTIM_NO_NATIVE", None)
    env.pop("ORT_OPTIM_BACKEND", None)
    proc = subprocess.run([sys.executable, "-m", "ort_optim.build"], env=env, text=True, capture_output=True,
                          timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr) < 2000, proc.stderr
    assert "not found" in proc.stderr and "--verbose" in proc.stderr
    code = ("import warnings\nimport ort_optim\nwith warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n    assert not ort_optim.native_available()\n"
            "print('\\n'.join(str(w.message) for w in caught))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not found" in proc.stdout and "python -m ort_optim.build --verbose" in proc.stdout
    assert len(proc.stdout) < 1000, proc.stdout


def test_an_empty_ort_optim_cache_means_the_default_cache(monkeypatch):
    monkeypatch.setenv("ORT_OPTIM_CACHE", "")
    assert native.build_dir().parent == Path.home() / ".cache" / "ort-optim" / "ops"


@pytest.fixture
def fresh_selection(monkeypatch):
    monkeypatch.setattr(backends, "_selected", (None, "auto"))
    yield
    backends._selected = (None, "auto")


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_ort_optim_backend_means_auto(value, monkeypatch, fresh_selection):
    monkeypatch.setenv("ORT_OPTIM_BACKEND", value)
    assert backends.backend() == "auto"


def test_ort_optim_backend_native_without_the_library_is_an_error_saying_why(monkeypatch, fresh_selection):
    monkeypatch.setattr(backends, "_native_loaded", False)
    monkeypatch.setattr(native, "_unavailable_reason", "ORT_OPTIM_NO_NATIVE=1 is set")
    monkeypatch.setenv("ORT_OPTIM_BACKEND", "native")
    with pytest.raises(RuntimeError, match=r"ORT_OPTIM_BACKEND=native, but the native CPU library is unavailable "
                                           r"\(ORT_OPTIM_NO_NATIVE=1 is set\)"):
        backends.backend()
    monkeypatch.setenv("ORT_OPTIM_BACKEND", "torch")
    assert backends.backend() == "torch"
