"""Issue 14 (practical use), items 1, 2 and 4, checked from the outside as a user (and torch's own recipes) would.

1. Setup installs ort_optim editable into each environment, quietly: ``tools/make_env.sh`` prints one line per stage
   with its duration, keeps the tools' output in a log and shows its tail when a stage fails (run here in a sandbox,
   with a stand-in interpreter, so the shared environments are not touched); its last stage is ``pip install -e`` of
   the checkout, and an editable install of this checkout makes ``import ort_optim`` work from any directory (made
   here into a throwaway environment). The wheel (``pip wheel .`` installed elsewhere, native op built and run) is
   tests/test_install.py's. ``python -m ort_optim.build`` (run by every ``make setup``) recompiles nothing once built.
2. ``FusedAdam(step_in_backward=True)`` on real ``torch.nn`` models, as the "optimizer step in backward" recipe
   (``register_post_accumulate_grad_hook``) is used: bit for bit the params and states of ``step()`` after backward
   over many steps (fp32, bf16 with and without master weights, param groups with their own lr and weight decay,
   a tied embedding/head weight, a branch used every other step, frozen layers, both ``zero_grad`` patterns, an
   ``lr_scheduler.StepLR``); each param updated once per backward (a tied weight too), no gradient left;
   ``step()`` after it changes nothing, ``step()`` without backward neither, a closure works; gradient accumulation
   through ``accumulate()`` (the last backward inside or outside it); checkpoints saved and loaded mid-run; what
   needs every gradient (GradScaler's recipes, FP16_Optimizer) refused; under ORTModule bit for bit as step(), with
   accumulation; under DistributedDataParallel (which writes gradients after the hooks) a second update refused;
   torch's recipe (an AdamW per param, stepped in its hook) followed. The hooks go with remove_backward_hooks() or the
   optimizer (then a plain torch optimizer trains the model); a second in-backward optimizer over the same params, or
   a param removed from param_groups, is never updated silently by the wrong one.
4. ``last_grad_norm`` is ``torch.nn.utils.clip_grad_norm_``'s total norm (2-norm, before clipping) of the unscaled
   gradients, a 0-dim float32 tensor on the params' device; with ``max_grad_norm`` the steps follow
   ``clip_grad_norm_`` then ``torch.optim.AdamW``; torch.amp.GradScaler's recipe gives the same norms and skips;
   an inf/NaN gradient sets ``last_found_inf`` to 1 and changes nothing. Both stay None for updates made in backward
   (documented).

Tolerances against torch.optim.AdamW (fp32, ADAMW_TORCH): rtol 1e-5, atol 1e-6 over the run; norms rtol 1e-6.
"""

from __future__ import annotations

import contextlib
import copy
import gc
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_snapshot, optimizer_snapshot

from ort_optim import AdamWMode, FusedAdam

ROOT = Path(__file__).resolve().parent.parent
STEPS = 16
VOCAB, WIDTH = 11, 8


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


# ---- 2. step_in_backward on real models -----------------------------------------------------------------------------

class TinyLM(torch.nn.Module):
    """An embedding tied to the output head (one param, two uses: its hook must fire once, after both gradients are
    accumulated), a hidden layer, a branch the loss uses on even steps only (no gradient on odd ones), a frozen layer
    and a LayerNorm."""

    def __init__(self, dtype: torch.dtype = torch.float32, branch_every: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.branch = torch.nn.Linear(WIDTH, WIDTH)
        self.frozen = torch.nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.branch_every = branch_every
        self.to(dtype)

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(tokens[:, :-1])))
        if step % self.branch_every == 0:
            h = h + self.branch(h)
        h = self.norm(self.frozen(h))
        return F.cross_entropy(self.head(h).float().flatten(0, 1), tokens[:, 1:].flatten())


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(100 + step))


def _decay_groups(model: TinyLM) -> list[dict]:
    """The usual split: no weight decay for biases and norms, their own lr."""
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}]


@dataclass
class Case:
    dtype: torch.dtype = torch.float32
    options: dict = field(default_factory=dict)
    groups: Callable[[TinyLM], list] = lambda model: list(model.parameters())
    zero_grad: str = "after step"  # "after step", "before backward", "set_to_none=False"
    branch_every: int = 2


CASES = {
    "fp32": Case(options=dict(weight_decay=0.01)),
    "fp32 adamw-torch amsgrad, zero_grad before backward": Case(
        options=dict(adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, amsgrad=True), zero_grad="before backward"),
    "bf16 masters": Case(torch.bfloat16, dict(master_weights=True, weight_decay=0.01)),
    "bf16 without masters": Case(torch.bfloat16, dict(weight_decay=0.01)),
    "groups: own lr and weight decay": Case(groups=_decay_groups),
    # set_to_none=False zeroes gradients in place: with every param used at every step, the same as set_to_none
    "zero_grad(set_to_none=False)": Case(zero_grad="set_to_none=False", branch_every=1),
}


def _train(case: Case, step_in_backward: bool, steps: int = STEPS, first_step: int = 0, model=None, opt=None,
           scheduler_cls=None):
    model = model or TinyLM(case.dtype, case.branch_every)
    opt = opt or FusedAdam(case.groups(model), lr=1e-2, step_in_backward=step_in_backward, **case.options)
    scheduler = scheduler_cls(opt) if scheduler_cls else None
    for step in range(first_step, first_step + steps):
        if case.zero_grad == "before backward":
            opt.zero_grad()
        model(_tokens(step), step).backward()
        opt.step()
        if case.zero_grad == "after step":
            opt.zero_grad()
        elif case.zero_grad == "set_to_none=False":
            opt.zero_grad(set_to_none=False)
        if scheduler:
            scheduler.step()
    return model, opt


def _steps_taken(opt: FusedAdam) -> dict[str, int]:
    """Each trainable param's step count (0 when it was never updated)."""
    return {f"{gi}.{pi}": int(opt.state[p]["step"]) if opt.state.get(p) else 0
            for gi, group in enumerate(opt.param_groups) for pi, p in enumerate(group["params"]) if p.requires_grad}


@pytest.mark.parametrize("name", CASES)
def test_steps_in_backward_equal_step_after_backward_bit_for_bit_over_many_steps(name):
    case = CASES[name]
    model, stepped = _train(case, step_in_backward=False)
    in_model, in_backward = _train(case, step_in_backward=True)
    if case.zero_grad != "after step":  # step() leaves the last (or zeroed) gradients, the hooks none at all
        stepped.zero_grad(set_to_none=True)
    assert_same_snapshot(optimizer_snapshot(stepped), optimizer_snapshot(in_backward))
    assert all(p.grad is None for p in in_model.parameters())
    assert not in_model.frozen.weight.requires_grad and in_model.frozen.weight not in in_backward.state
    # once per backward: the tied weight too (not twice), the branch on the steps that used it
    counts = {n: int(in_backward.state[p]["step"]) for n, p in in_model.named_parameters() if p.requires_grad}
    used = -(-STEPS // case.branch_every)
    assert counts == {"embed.weight": STEPS, "hidden.weight": STEPS, "hidden.bias": STEPS, "branch.weight": used,
                      "branch.bias": used, "norm.weight": STEPS, "norm.bias": STEPS}


def test_steps_in_backward_follow_torchs_optimizer_in_backward_recipe():
    """torch's recipe ("How to save memory by fusing the optimizer step into the backward pass"): a
    torch.optim.AdamW per param, stepped and zeroed in its post-accumulate-grad hook. FusedAdam in AdamW's mode with
    step_in_backward=True follows it over many steps (fp32: a few ulps per step apart)."""
    ours, theirs = TinyLM(), TinyLM()
    opt = FusedAdam(ours.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH,
                    step_in_backward=True)
    per_param = {p: torch.optim.AdamW([p], lr=1e-2, eps=1e-8, weight_decay=0.01, foreach=False)
                 for p in theirs.parameters() if p.requires_grad}

    def hook(p):
        per_param[p].step()
        per_param[p].zero_grad()

    for p in per_param:
        p.register_post_accumulate_grad_hook(hook)
    for step in range(STEPS):
        ours(_tokens(step), step).backward()
        theirs(_tokens(step), step).backward()
    assert all(p.grad is None for p in list(ours.parameters()) + list(theirs.parameters()))
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
        if p.requires_grad:
            assert int(opt.state[q]["step"]) == int(per_param[p].state[p]["step"]), name


def test_zero_grad_set_to_none_false_with_a_param_unused_in_some_steps_differs_as_documented():
    """step() after zero_grad(set_to_none=False) updates a param the loss did not use with a zero gradient (its
    moments still move it); the hooks freed its gradient at its last update and do not fire without one, so it is
    not updated: the same as torch's optimizer-in-backward recipe, and as zero_grad() (set_to_none) everywhere."""
    case = Case(zero_grad="set_to_none=False")
    _, stepped = _train(case, step_in_backward=False)
    _, in_backward = _train(case, step_in_backward=True)
    assert set(_steps_taken(stepped).values()) == {STEPS}
    assert sorted(_steps_taken(in_backward).values()) == [STEPS // 2] * 2 + [STEPS] * 5  # the branch: half
    reference, _ = _train(Case(), step_in_backward=False)
    in_model = in_backward.param_groups[0]["params"]
    for p, q in zip(reference.parameters(), in_model):
        assert torch.equal(p, q)
    assert "set_to_none=False" in (ROOT / "guides" / "fused-adam.md").read_text()


def test_step_after_backward_changes_nothing_and_step_without_backward_neither():
    model, opt = _train(Case(), step_in_backward=True, steps=3)
    model(_tokens(3), 3).backward()
    after_backward = optimizer_snapshot(opt)
    for _ in range(2):
        opt.step()
        assert_same_snapshot(after_backward, optimizer_snapshot(opt))
    opt.zero_grad()
    assert_same_snapshot(after_backward, optimizer_snapshot(opt))

    fresh_model = TinyLM()
    fresh = FusedAdam(fresh_model.parameters(), step_in_backward=True)
    before = optimizer_snapshot(fresh)
    fresh.step()
    assert not fresh.state
    assert_same_snapshot(before, optimizer_snapshot(fresh))


def test_a_closure_that_runs_backward_steps_once():
    results = []
    for step_in_backward in (False, True):
        model = TinyLM()
        opt = FusedAdam(model.parameters(), lr=1e-2, step_in_backward=step_in_backward)
        for step in range(4):
            def closure(step=step):
                opt.zero_grad()
                loss = model(_tokens(step), step)
                loss.backward()
                return loss
            loss = opt.step(closure)
            assert isinstance(loss, torch.Tensor)
        opt.zero_grad()  # (the closure zeroes before backward: step() after backward leaves the last gradients)
        results.append(optimizer_snapshot(opt))
    assert_same_snapshot(*results)


@pytest.mark.parametrize("last", ["last backward outside accumulate()", "every backward inside, then step()"])
def test_gradient_accumulation_through_accumulate_equals_step_after_the_micro_batches(last):
    micro_batches, steps = 3, 4
    results = []
    for step_in_backward in (False, True):
        model = TinyLM()
        opt = FusedAdam(_decay_groups(model), lr=1e-2, step_in_backward=step_in_backward)
        for step in range(steps):
            for micro in range(micro_batches):
                i = step * micro_batches + micro
                if micro == micro_batches - 1 and last.startswith("last backward outside"):
                    model(_tokens(i), i).backward()
                else:
                    with opt.accumulate():
                        model(_tokens(i), i).backward()
            opt.step()
            opt.zero_grad()
        results.append(optimizer_snapshot(opt))
    assert_same_snapshot(*results)


def test_an_lr_scheduler_reaches_the_updates_made_in_backward():
    def scheduler(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    _, stepped = _train(Case(groups=_decay_groups), step_in_backward=False, steps=10, scheduler_cls=scheduler)
    _, in_backward = _train(Case(groups=_decay_groups), step_in_backward=True, steps=10, scheduler_cls=scheduler)
    assert [g["lr"] for g in in_backward.param_groups] == pytest.approx([1e-2 / 8, 3e-2 / 8])
    assert_same_snapshot(optimizer_snapshot(stepped), optimizer_snapshot(in_backward))


def test_a_checkpoint_saved_and_loaded_mid_run_continues_exactly():
    """Saved after 5 steps and loaded (model and optimizer) into a fresh model and step_in_backward optimizer, or back
    into the running one after 3 more steps (the hooks' cached per-param plans must follow the loaded state): the
    run continues as if uninterrupted."""
    case = Case(groups=_decay_groups)
    straight, straight_opt = _train(case, step_in_backward=False, steps=10)

    model, opt = _train(case, step_in_backward=True, steps=5)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed = TinyLM(seed=1)
    resumed.load_state_dict(saved["model"])
    resumed_opt = FusedAdam(_decay_groups(resumed), lr=1e-2, step_in_backward=True)
    resumed_opt.load_state_dict(saved["opt"])
    _train(case, step_in_backward=True, steps=5, first_step=5, model=resumed, opt=resumed_opt)
    assert_same_snapshot(optimizer_snapshot(straight_opt), optimizer_snapshot(resumed_opt))

    _train(case, step_in_backward=True, steps=3, first_step=5, model=model, opt=opt)  # then roll back
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    _train(case, step_in_backward=True, steps=5, first_step=5, model=model, opt=opt)
    assert_same_snapshot(optimizer_snapshot(straight_opt), optimizer_snapshot(opt))


def _grad_scaler(model, opt):
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(_tokens(0), 0)).backward()
    return scaler


def _unscale_clip_step(model, opt):
    """torch's AMP recipe with clipping: unscale_, clip_grad_norm_, step."""
    scaler = _grad_scaler(model, opt)
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)


@pytest.mark.parametrize("recipe", [lambda model, opt: _grad_scaler(model, opt).step(opt), _unscale_clip_step],
                         ids=["scaler.step", "unscale_-clip-step"])
def test_gradscaler_recipes_are_refused_with_a_clear_error(recipe):
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler is not in this torch")
    model = TinyLM()
    opt = FusedAdam(model.parameters(), step_in_backward=True)
    with pytest.raises(ValueError, match=r"grad_scale/found_inf .*step_in_backward=True"):
        recipe(model, opt)


def test_after_the_optimizer_is_gone_the_model_trains_with_a_plain_torch_optimizer():
    """The hooks hold the optimizer weakly: deleting it (and what refers to it, as a scheduler does) leaves hooks that
    do nothing, and torch.optim.AdamW then trains the model exactly as it trains an untouched copy."""
    model, opt = _train(Case(), step_in_backward=True, steps=2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    del opt, scheduler
    gc.collect()
    twin = copy.deepcopy(model)  # (a copy without hooks: deep-copying a model does not copy param hooks)
    results = []
    for net in (model, twin):
        adamw = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False)
        for step in range(3):
            net(_tokens(step), step).backward()
            assert net.hidden.weight.grad is not None
            adamw.step()
            adamw.zero_grad()
        results.append(optimizer_snapshot(adamw))
    assert_same_snapshot(*results)


def test_remove_backward_hooks_turns_the_optimizer_back_into_a_plain_one():
    """3 iterations stepped in backward, then the hooks removed: backward leaves gradients, step() (loss scaling
    included) updates from them, and the run equals one that never stepped in backward, bit for bit."""
    case = Case(groups=_decay_groups)
    _, straight = _train(case, step_in_backward=False, steps=8)
    model, opt = _train(case, step_in_backward=True, steps=3)
    opt.remove_backward_hooks()
    assert not opt.step_in_backward
    model(_tokens(3), 3).backward()
    assert model.hidden.weight.grad is not None and int(opt.state[model.hidden.weight]["step"]) == 3
    opt.step()
    opt.zero_grad()
    _train(case, step_in_backward=False, steps=4, first_step=4, model=model, opt=opt)
    assert_same_snapshot(optimizer_snapshot(straight), optimizer_snapshot(opt))
    model(_tokens(8), 8).backward()
    opt.step(grad_scale=1.0)  # refused while stepping in backward; a step like any other now
    assert float(opt.last_found_inf) == 0


def test_a_second_optimizer_stepping_in_backward_over_the_same_params_is_an_error_until_the_first_is_removed():
    """The first optimizer's hook (registered first) would update the params and take their gradients; the second
    one's finds none: an error naming the param, instead of silently stepping with the wrong optimizer."""
    model = TinyLM()
    first = FusedAdam(model.parameters(), lr=1e-2, step_in_backward=True)
    scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1)  # (keeps the first alive after `del first`)
    second = FusedAdam(model.parameters(), lr=1e-2, step_in_backward=True)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[\d\] .*another FusedAdam with "
                                         r"step_in_backward=True .*remove_backward_hooks\(\)"):
        model(_tokens(0), 0).backward()
    first.remove_backward_hooks()
    del first, scheduler
    model.zero_grad()
    before = optimizer_snapshot(second)
    model(_tokens(1), 1).backward()
    assert all(p.grad is None for p in model.parameters())
    assert set(_steps_taken(second).values()) == {0, 1}  # (the branch: no gradient at odd steps)
    assert not torch.equal(before["p0.1"], model.hidden.weight)


def test_a_param_removed_from_param_groups_is_not_updated_by_its_hook_and_one_moved_follows_its_new_group():
    """As step() after backward: the removed param keeps its gradient and is not updated; the param moved into the
    other group is updated with that group's hyperparameters; bit for bit the same in both modes."""
    results = []
    for step_in_backward in (False, True):
        model = TinyLM()
        opt = FusedAdam(_decay_groups(model), lr=1e-2, step_in_backward=step_in_backward)
        _train(Case(), step_in_backward, steps=2, model=model, opt=opt)
        decay, rest = (group["params"] for group in opt.param_groups)
        position = {id(p): i for i, p in enumerate(decay)}
        moved = decay.pop(position[id(model.branch.weight)])
        removed = decay.pop(position[id(model.hidden.weight)])  # (before the branch: its position still holds)
        rest.insert(0, moved)  # index 0 of group 1: lr 3e-2, no decay
        _train(Case(), step_in_backward, steps=3, first_step=2, model=model, opt=opt)
        assert removed.grad is not None and int(opt.state[removed]["step"]) == 2
        results.append(optimizer_snapshot(opt, extra=[removed]))
    assert_same_snapshot(*results)


def test_max_grad_norm_set_after_construction_is_refused_by_the_first_hook_before_any_update():
    model = TinyLM()
    opt = FusedAdam(model.parameters(), step_in_backward=True)
    opt.max_grad_norm = 1.0
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0 clips by the norm of all gradients.*step_in_backward"):
        model(_tokens(0), 0).backward()
    after = optimizer_snapshot(opt)
    assert_same_snapshot(*({k: v for k, v in snap.items() if not k.endswith(".grad")} for snap in (before, after)))


def test_fp16_optimizer_refuses_a_fused_adam_that_steps_in_backward():
    from ort_optim.fp16_optimizer import FP16_Optimizer

    model = TinyLM(torch.float16)
    opt = FusedAdam(model.parameters(), master_weights=True, step_in_backward=True)
    with pytest.raises(ValueError, match="FP16_Optimizer: this FusedAdam has step_in_backward=True"):
        FP16_Optimizer(opt)


@pytest.mark.parametrize("order", ["DDP made first", "optimizer made first"])
def test_under_distributed_data_parallel_the_first_backward_is_refused_before_any_update(order, tmp_path):
    """DDP writes the averaged gradient into p.grad after autograd's accumulation, i.e. after a hook would have
    updated the param with this rank's own gradient. The first backward refuses before the first gradient is even
    accumulated (the optimizer's setup check, whichever was made first), naming the param and DDP; so do step() and
    every later backward, while nothing is updated (one process, gloo: the mechanism is the same as on many ranks,
    which tests/test_distributed_audit.py runs)."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, without a process group already set up")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = TinyLM(branch_every=1)
        ddp = torch.nn.parallel.DistributedDataParallel(model) if order == "DDP made first" else None
        opt = FusedAdam(model.parameters(), lr=1e-2, step_in_backward=True)
        ddp = ddp or torch.nn.parallel.DistributedDataParallel(model)
        before = optimizer_snapshot(opt)
        refused = r"param_groups\[0\]\['params'\]\[\d\] .* is reduced by DistributedDataParallel .*Nothing was " \
                  r"updated .*Use step_in_backward=False with DistributedDataParallel"
        with pytest.raises(ValueError, match=refused):
            ddp(_tokens(0), 0).backward()
        assert_same_snapshot(before, optimizer_snapshot(opt))
        with pytest.raises(ValueError, match=refused):
            opt.step()
        opt.zero_grad()
        with pytest.raises(ValueError, match=refused):
            model(_tokens(1), 0).backward()  # (the module itself too: its params are DDP's)
        assert set(_steps_taken(opt).values()) == {0}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pattern", ["step() after backward", "zero_grad() before backward", "backward only"])
def test_under_distributed_data_parallel_made_after_the_first_backward_a_second_update_is_refused(pattern, tmp_path):
    """The setup check runs at the first backward; a DDP made after it is caught by the end-of-backward check (the
    backstop): step() would update every param twice per iteration, and a loop of backward calls alone would update
    with DDP's gradient accumulated into the next one's. The end of the first backward under DDP raises instead,
    naming the param and DDP, whatever the loop calls next."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, without a process group already set up")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = TinyLM(branch_every=1)
        opt = FusedAdam(model.parameters(), lr=1e-2, step_in_backward=True)
        model(_tokens(5), 0).backward()  # (no DDP yet: the setup check passes)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        refused = r"param_groups\[0\]\['params'\]\[\d\] .* was updated in backward .*has a gradient again.*" \
                  r"DistributedDataParallel"
        with pytest.raises(ValueError, match=refused):
            ddp(_tokens(0), 0).backward()
        assert set(_steps_taken(opt).values()) == {2}
        with pytest.raises(ValueError, match=refused):  # and whatever comes next, until the hooks are removed
            if pattern == "backward only":
                ddp(_tokens(1), 0).backward()
            else:
                opt.step() if pattern.startswith("step()") else opt.zero_grad()
        assert set(_steps_taken(opt).values()) == {2}  # once per backward, never twice
    finally:
        dist.destroy_process_group()


def test_under_ortmodule_a_tied_weight_is_updated_once_per_iteration_with_and_without_accumulation():
    """Two ORTModules over the same init: step() after backward, and step_in_backward (the first of two micro-batches
    inside accumulate()): every hook fires once per iteration (the tied weight's too), and the params are equal bit
    for bit."""
    ortmodule = pytest.importorskip("onnxruntime.training.ortmodule",
                                    reason="onnxruntime-training's ORTModule is not installed here")
    if not torch.__version__.startswith("2.4."):
        pytest.skip(f"ORTModule needs torch 2.4.x; this environment has torch {torch.__version__}")

    class Wrapped(TinyLM):  # ORTModule exports forward(tokens): the branch always on
        def forward(self, tokens):
            return super().forward(tokens, 0)

    stepped, in_backward = Wrapped(), Wrapped()
    opts = [FusedAdam(m.parameters(), lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, step_in_backward=m is in_backward)
            for m in (stepped, in_backward)]
    wrapped = [ortmodule.ORTModule(m) for m in (stepped, in_backward)]
    for step in range(4):
        micro_batches = 2 if step % 2 else 1
        for model, opt, ort in zip((stepped, in_backward), opts, wrapped):
            for micro in range(micro_batches):
                with opt.accumulate() if micro < micro_batches - 1 else contextlib.nullcontext():
                    ort(_tokens(10 * step + micro)).backward()
            if opt.step_in_backward:
                assert all(p.grad is None for p in model.parameters()), "a hook did not fire under ORTModule"
            opt.step()
            opt.zero_grad()
    assert set(_steps_taken(opts[1]).values()) == {4}  # every trainable param once per iteration (the tied one too)
    assert_same_snapshot(optimizer_snapshot(opts[0]), optimizer_snapshot(opts[1]))


# ---- 4. last_grad_norm and last_found_inf ---------------------------------------------------------------------------

def _torch_twin(model: TinyLM):
    twin = copy.deepcopy(model)
    return twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, foreach=False)


def test_max_grad_norm_steps_follow_clip_grad_norm_then_adamw_and_last_grad_norm_is_its_total_norm():
    model = TinyLM()
    twin, adamw = _torch_twin(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH,
                    max_grad_norm=7.0)
    clipped, norms, totals = 0, [], []
    for step in range(STEPS):  # (the branch has no gradient on odd steps: norms over the gradients that exist)
        model(_tokens(step), step).backward()
        twin(_tokens(step), step).backward()
        total = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm=7.0)
        clipped += bool(total > 7.0)
        opt.step()
        adamw.step()
        norm = opt.last_grad_norm
        assert norm.shape == () and norm.dtype == torch.float32 and norm.device == model.hidden.weight.device
        norms.append(norm)  # (logged as is: a later step must not overwrite it)
        totals.append(total)
        assert float(opt.last_found_inf) == 0 and not opt.last_step_skipped
        opt.zero_grad()
        adamw.zero_grad()
    torch.testing.assert_close(torch.stack(norms), torch.stack(totals), rtol=1e-6, atol=0)
    assert 0 < clipped < STEPS  # both regimes were exercised
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_with_torch_amp_gradscaler_the_norm_is_of_the_unscaled_gradients_and_an_overflow_skips():
    """torch's recipe (scale, backward, unscale_, clip_grad_norm_, step, update) against FusedAdam(max_grad_norm)
    stepped by the same GradScaler protocol: the same norms, the same skipped iteration (an inf injected into one
    gradient), the same scale afterwards, and the same params."""
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler is not in this torch")
    model = TinyLM()
    twin, adamw = _torch_twin(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH,
                    max_grad_norm=1.0)
    ours, theirs = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3) for _ in range(2))
    for step in range(8):
        ours.scale(model(_tokens(step), step)).backward()
        theirs.scale(twin(_tokens(step), step)).backward()
        if step == 4:
            model.hidden.weight.grad[0, 0] = float("inf")
            twin.hidden.weight.grad[0, 0] = float("inf")
        before = optimizer_snapshot(opt)
        theirs.unscale_(adamw)
        total = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm=1.0)
        ours.step(opt)
        theirs.step(adamw)
        if step == 4:
            assert float(opt.last_found_inf) == 1 and opt.last_step_skipped and not torch.isfinite(opt.last_grad_norm)
            after = optimizer_snapshot(opt)
            for key in before:
                if not key.endswith(".grad"):
                    assert_same_snapshot({key: before[key]}, {key: after[key]})
        else:
            assert float(opt.last_found_inf) == 0
            torch.testing.assert_close(opt.last_grad_norm, total, rtol=1e-6, atol=0)
        ours.update()
        theirs.update()
        assert ours.get_scale() == theirs.get_scale()
        opt.zero_grad()
        adamw.zero_grad()
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("how", ["max_grad_norm", "grad_scale"])
def test_an_inf_or_nan_gradient_sets_last_found_inf_and_changes_nothing(bad, how):
    model = TinyLM(torch.bfloat16)
    opt = FusedAdam(_decay_groups(model), lr=1e-2, master_weights=True,
                    max_grad_norm=1.0 if how == "max_grad_norm" else None)
    kwargs = dict(grad_scale=4.0) if how == "grad_scale" else {}
    for step in range(3):
        model(_tokens(step), step).backward()
        opt.step(**kwargs)
        assert float(opt.last_found_inf) == 0
        opt.zero_grad()
    model(_tokens(3), 3).backward()
    model.norm.bias.grad[1] = bad
    before = optimizer_snapshot(opt)
    opt.step(**kwargs)
    assert opt.last_found_inf.shape == (1,) and float(opt.last_found_inf) == 1 and opt.last_step_skipped
    assert not torch.isfinite(opt.last_grad_norm)
    assert_same_snapshot(before, optimizer_snapshot(opt))  # params, masters, moments, steps and gradients


def test_updates_made_in_backward_leave_the_telemetry_none_as_documented():
    """No pass reads every gradient when each param is updated from its own hook: last_grad_norm and last_found_inf
    stay None (guides/fused-adam.md says so), rather than describing a step() that updated nothing."""
    _, opt = _train(Case(), step_in_backward=True, steps=2)
    assert opt.last_grad_norm is None and opt.last_found_inf is None
    guide = " ".join((ROOT / "guides" / "fused-adam.md").read_text().split())
    assert "`last_grad_norm` and `last_found_inf` stay None for updates made in backward" in guide
