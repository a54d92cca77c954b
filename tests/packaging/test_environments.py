"""The project's two environments (``make setup``, tools/make_env.sh), as a specification.

* Each environment's interpreter imports ort_optim from any directory, without PYTHONPATH.
* ``tools/make_env.sh`` is quiet: it prints one line per stage with its duration, keeps the tools' output in a log and
  shows its tail when a stage fails, marking nothing complete (run here in a sandbox, with a stand-in interpreter, so
  the shared environments are not touched).
* An install of this checkout into an environment makes ``import ort_optim`` work from any directory (made here into
  a throwaway environment).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import stat
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from conftest import ROOT


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


# ---- tools/make_env.sh -----------------------------------------------------------------------------------------------




# ---- 1. installs like a package -------------------------------------------------------------------------------------

# A stand-in for python3.11 and pip: creates "virtual environments" as copies of itself, prints noise like a compiler
# and pip do, records its arguments, and fails where FAIL_ON (a word of its arguments) says.
_FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_CALLS"
for i in $(seq 1 50); do echo "noisy tool output line $i"; echo "noisy warning $i" >&2; done
if [ -n "${FAIL_ON:-}" ] && [[ " $* " == *" $FAIL_ON "* ]]; then echo "error: the stage broke here" >&2; exit 3; fi
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
"""


def _sandbox_make_env(tmp_path: Path, fail_on: str = "") -> tuple[subprocess.CompletedProcess, Path, Path]:
    """tools/make_env.sh latest, copied with requirements/ into a sandbox root, with the stand-in interpreter and
    the environment cache under tmp_path: (the run, the sandbox root, the cache)."""
    root = tmp_path / "clone"
    if not root.exists():  # (a second run in the same sandbox finds its clone and cache)
        (root / "tools").mkdir(parents=True)
        shutil.copy2(ROOT / "tools" / "make_env.sh", root / "tools" / "make_env.sh")
        shutil.copytree(ROOT / "requirements", root / "requirements")
    fake = tmp_path / "python3.11"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    cache = tmp_path / "cache"
    env = dict(os.environ, ORT_OPTIM_CACHE=str(cache), ORT_OPTIM_PYTHON=str(fake), FAKE_CALLS=str(tmp_path / "calls"),
               FAIL_ON=fail_on)
    run = subprocess.run(["bash", str(root / "tools" / "make_env.sh"), "latest"], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=60)
    return run, root, cache


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
    # The last stage: the editable install of the clone the script belongs to, into the environment it built.
    calls = (tmp_path / "calls").read_text().splitlines()
    assert re.search(r"-m pip install .*-e " + re.escape(str(root)) + "$", calls[-1]), calls[-1]
    assert stages[-1].startswith(f"[make_env] latest: install ort_optim from {root} (editable) ... ")
    assert (root / ".venv-latest").resolve() == log.with_suffix("").resolve()
    assert (log.with_suffix("") / ".complete").exists()

    # A second run reuses the environment: one line for that, one for the editable install, nothing rebuilt.
    again, _, _ = _sandbox_make_env(tmp_path)
    assert again.returncode == 0 and "noisy" not in again.stdout + again.stderr
    assert len(again.stderr.strip().splitlines()) == 2 and "reusing" in again.stderr


def test_make_env_shows_the_logs_tail_when_a_stage_fails_and_marks_nothing_complete(tmp_path):
    run, root, cache = _sandbox_make_env(tmp_path, fail_on="-r")
    assert run.returncode == 3
    assert re.search(r"install requirements/latest\.txt \.\.\. FAILED after \d+ s \(exit 3\); the last lines of",
                     run.stderr)
    assert "error: the stage broke here" in run.stderr  # the tool's own message, from the log's tail
    assert len(run.stderr.splitlines()) < 80  # the tail, not the whole log
    assert not list(cache.glob("envs/*/.complete")) and not (root / ".venv-latest").exists()


def _python_json(python, code: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.install
def test_an_editable_install_of_the_checkout_imports_and_steps_from_any_directory(tmp_path):
    """What make_env.sh's last stage does, into a throwaway environment that sees this one's packages (torch,
    setuptools) as plain paths: `pip show` names the checkout, and from an empty directory without PYTHONPATH the
    package imported is the checkout's and its native op steps."""
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(_python_json(python, "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))",
                                tmp_path))
    ours = dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (purelib / "_parent_environment.pth").write_text("".join(f"{path}\n" for path in ours))
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
