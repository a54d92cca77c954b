"""The project's two environments (``make setup``, tools/make_env.sh), as a specification.

* Each environment's interpreter imports ort_optim from any directory, without PYTHONPATH.
* ``tools/make_env.sh`` is quiet: it prints one line per stage with its duration, keeps the tools' output in a log and
  shows its tail when a stage fails, marking nothing complete (run here in a sandbox, with a stand-in interpreter, so
  the shared environments are not touched).
* An install of this checkout into an environment makes ``import ort_optim`` work from any directory (made here into
  a throwaway environment).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import venv
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from conftest import ROOT, run_python, site_packages

from ort_optim import backends


def test_the_environment_imports_ort_optim_from_any_directory(tmp_path):
    """An editable install (PEP 660) of a checkout: the import works from a directory with nothing in it and finds
    the checkout's package. In a git worktree the shared environment may point at another checkout, so the test
    asserts the mechanism (an editable install of a checkout that holds the imported package), not the path."""
    found = run_python(sys.executable, """if True:
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


# ---- tools/make_env.sh -----------------------------------------------------------------------------------------------

# A stand-in for python3.11 and pip: creates "virtual environments" (its last argument) as copies of itself, answers
# `-c` (the only question make_env.sh asks: its site-packages) with a folder inside its own environment, prints noise
# like a compiler and pip do, records its arguments, and fails where FAIL_ON (a word of its arguments) says.
_FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_CALLS"
if [ "$1" = "-c" ]; then echo "$(cd "$(dirname "$0")/.." && pwd)/lib/python3.11/site-packages"; exit 0; fi
for i in $(seq 1 50); do echo "noisy tool output line $i"; echo "noisy warning $i" >&2; done
if [ -n "${FAIL_ON:-}" ] && [[ " $* " == *" $FAIL_ON "* ]]; then echo "error: the stage broke here" >&2; exit 3; fi
if [ "$1 $2" = "-m venv" ]; then
  dir="${@: -1}"; mkdir -p "$dir/bin" "$dir/lib/python3.11/site-packages" && cp "$0" "$dir/bin/python"
fi
"""


def _sandbox_make_env(tmp_path: Path, fail_on: str = "", cache: str = "", cwd: Path = None,
                      ) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """tools/make_env.sh latest, copied with requirements/ into a sandbox root, with the stand-in interpreter and
    the environment cache under tmp_path (or ``cache``, as given, run from ``cwd``): (the run, the root, the cache)."""
    root = tmp_path / "clone"
    if not (root / "tools").exists():  # (a second run in the same sandbox finds its clone and cache)
        (root / "tools").mkdir(parents=True)
        shutil.copy2(ROOT / "tools" / "make_env.sh", root / "tools" / "make_env.sh")
        shutil.copytree(ROOT / "requirements", root / "requirements")
    fake = tmp_path / "python3.11"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    cwd = cwd or tmp_path
    env = dict(os.environ, ORT_OPTIM_CACHE=cache or str(tmp_path / "cache"), ORT_OPTIM_PYTHON=str(fake),
               FAKE_CALLS=str(tmp_path / "calls"), FAIL_ON=fail_on)
    run = subprocess.run(["bash", str(root / "tools" / "make_env.sh"), "latest"], cwd=cwd, env=env, text=True,
                         capture_output=True, timeout=60)
    return run, root, (cwd / env["ORT_OPTIM_CACHE"]).resolve()


def test_make_env_prints_a_line_per_stage_keeps_the_noise_in_its_log_and_installs_the_checkout_editable(tmp_path):
    run, root, cache = _sandbox_make_env(tmp_path)
    assert run.returncode == 0, run.stderr
    output = run.stdout + run.stderr
    assert "noisy" not in output
    lines = run.stderr.strip().splitlines()
    (log,) = cache.glob("envs/*.log")
    assert lines[0] == f"[make_env] latest: building {log.with_suffix('')} (log: {log})"
    stages = lines[1:]
    assert stages and all(re.fullmatch(r"\[make_env\] latest: .+ \.\.\. \d+ s", line) for line in stages), stages
    assert "noisy tool output line 50" in log.read_text() and "noisy warning 50" in log.read_text()
    # The last stages: the clone's own environment, layered on the shared one, and in it the editable install of the
    # clone the script belongs to (with the clone's interpreter, never the shared one's).
    shared, layer = log.with_suffix(""), root / ".venv-latest"
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[-1].startswith("-m pip install ") and calls[-1].endswith(f" -e {root}"), calls[-1]
    assert stages[-2].startswith(f"[make_env] latest: make .venv-latest, layered on {shared} ... ")
    assert stages[-1].startswith(f"[make_env] latest: install ort_optim from {root} (editable) ... ")
    assert layer.is_dir() and not layer.is_symlink()
    assert (layer / "shared-environment").read_text() == f"{shared}\n"
    pth = layer / "lib" / "python3.11" / "site-packages" / "_ort_optim_shared_env.pth"
    assert pth.read_text() == f"import site; site.addsitedir('{shared}/lib/python3.11/site-packages')\n"
    assert (shared / ".complete").exists()

    # A second run reuses the environment: one line for that, one for the clone's layer, one for the editable
    # install, nothing rebuilt.
    again, _, _ = _sandbox_make_env(tmp_path)
    assert again.returncode == 0 and "noisy" not in again.stdout + again.stderr
    assert len(again.stderr.strip().splitlines()) == 3 and "reusing" in again.stderr


def test_make_env_shows_the_logs_tail_when_a_stage_fails_and_marks_nothing_complete(tmp_path):
    run, root, cache = _sandbox_make_env(tmp_path, fail_on="-r")
    assert run.returncode == 3
    assert re.search(r"install requirements/latest\.txt \.\.\. FAILED after \d+ s \(exit 3\); the last lines of",
                     run.stderr)
    assert "error: the stage broke here" in run.stderr  # the tool's own message, from the log's tail
    assert len(run.stderr.splitlines()) < 80  # the tail, not the whole log
    assert not list(cache.glob("envs/*/.complete")) and not (root / ".venv-latest").exists()


def test_make_env_names_a_relative_cache_by_its_absolute_path_and_replaces_a_link_without_following_it(tmp_path):
    """ORT_OPTIM_CACHE relative to the directory make_env.sh runs from: the clone's environment names the shared one
    by its absolute path, so it works from anywhere. A .venv-latest that is a link (an older setup linked the shared
    environment itself) is replaced by the clone's own environment; the environment it pointed at is left as it was."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    old_target = tmp_path / "older-shared-environment"
    (old_target / "bin").mkdir(parents=True)
    (old_target / "bin" / "python").write_text("kept\n")
    (tmp_path / "clone").mkdir()
    (tmp_path / "clone" / ".venv-latest").symlink_to(old_target)
    run, root, cache = _sandbox_make_env(tmp_path, cache="relative-cache", cwd=elsewhere)
    assert run.returncode == 0, run.stderr
    assert cache == elsewhere / "relative-cache" and cache.is_dir()
    (shared,) = [path for path in cache.glob("envs/*") if path.is_dir()]
    layer = root / ".venv-latest"
    assert layer.is_dir() and not layer.is_symlink()
    assert (layer / "shared-environment").read_text() == f"{shared}\n" and shared.is_absolute()
    assert (old_target / "bin" / "python").read_text() == "kept\n"


def _lock_hash(name: str) -> str:
    """The shared environment's key, as tools/make_env.sh computes it: its lock files and itself."""
    digest = hashlib.sha256()
    for path in (f"requirements/{name}.txt", f"requirements/{name}-nodeps.txt", "tools/make_env.sh"):
        digest.update((ROOT / path).read_bytes())
    return digest.hexdigest()[:16]


@pytest.mark.install
def test_two_clones_sharing_an_environment_each_import_their_own_ort_optim(tmp_path):
    """Two clones set up one after the other against one shared environment (a small real one standing in for the
    torch environment, marked complete so that make_env.sh reuses it): each clone's .venv-latest imports that clone's
    ort_optim from any directory, and the shared environment none. The cache is given relative to the directory
    make_env.sh runs from."""
    cache = tmp_path / "cache"
    shared = cache / "envs" / f"latest-{_lock_hash('latest')}"
    venv.EnvBuilder(with_pip=False).create(shared)
    shared_python = shared / "bin" / "python"
    ask = "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))"
    purelib = Path(_python_json(shared_python, ask, tmp_path))
    # (this environment's packages as plain paths: pip and setuptools for the editable installs, torch to import)
    (purelib / "_parent_environment.pth").write_text("".join(f"{path}\n" for path in site_packages()))
    (shared / ".complete").touch()
    clones = [tmp_path / "a" / "ort-optim", tmp_path / "b" / "ort-optim"]
    for clone in clones:
        shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "*.egg-info", "results", "__pycache__", ".pytest_cache", "tests", "guides"))
        run = subprocess.run(["bash", str(clone / "tools" / "make_env.sh"), "latest"], cwd=tmp_path, text=True,
                             capture_output=True, timeout=600,
                             env=dict(os.environ, ORT_OPTIM_CACHE="cache", ORT_OPTIM_PYTHON="/nonexistent/python"))
        assert run.returncode == 0, run.stderr
        assert f"reusing {shared}" in run.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = "import importlib.util, json; spec = importlib.util.find_spec('ort_optim'); " \
            "print(json.dumps(spec and spec.origin))"
    for clone in clones:  # the first clone's too, after the second one's setup
        found = _python_json(clone / ".venv-latest" / "bin" / "python", where, elsewhere)
        assert found == str(clone / "ort_optim" / "__init__.py")
    assert _python_json(shared_python, where, elsewhere) is None


def _python_json(python, code: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.install
def test_an_editable_install_of_the_checkout_imports_and_steps_from_any_directory(tmp_path):
    """What make_env.sh's last stage does, into a throwaway environment that sees this one's packages (torch,
    setuptools) as plain paths: `pip show` names the checkout, and from an empty directory without PYTHONPATH the
    package imported is the checkout's and its native op steps (the library this environment built: same sources)."""
    if not backends.native_available():
        pytest.fail("the native library cannot be built here: `python -m ort_optim.build --verbose` tells why")
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(_python_json(python, "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))",
                                tmp_path))
    (purelib / "_parent_environment.pth").write_text("".join(f"{path}\n" for path in site_packages()))
    # (a copy of the checkout: the editable build writes ort_optim.egg-info into the tree it installs)
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "results",
                                                                  "__pycache__", ".pytest_cache", "tests", "guides"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "-q", "-e", str(checkout)], check=True,
                   cwd=tmp_path, capture_output=True, timeout=120)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = subprocess.run([str(python), "-m", "pip", "show", "ort-optim"], cwd=elsewhere, text=True,
                           capture_output=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert shown.returncode == 0, shown.stderr
    assert f"Editable project location: {checkout}" in shown.stdout, shown.stdout
    ran = _python_json(python, """if True:
        import json, torch, ort_optim
        p = torch.nn.Parameter(torch.ones(100)); p.grad = torch.ones(100)
        ort_optim.FusedAdam([p], lr=0.5).step()
        print(json.dumps({"file": ort_optim.__file__, "native": ort_optim.native_available(), "p": p[0].item()}))
        """, elsewhere)
    assert Path(ran["file"]) == checkout / "ort_optim" / "__init__.py"
    # ADAMW_TRANSFORMERS, eps=1e-6: the first update is lr * sqrt(1 - beta2) / (1 - beta1) * m / (sqrt(v) + eps),
    # with m = 0.1 and v = 1e-3 for a gradient of ones
    first_update = 0.5 * 0.001 ** 0.5 / 0.1 * 0.1 / (0.001 ** 0.5 + 1e-6)
    assert ran["native"] is True and ran["p"] == pytest.approx(1 - first_update, rel=1e-6)
