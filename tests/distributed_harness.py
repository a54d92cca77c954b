"""Multi-process tests in one spawn: every scenario of a set runs inside the same worker processes.

``run_ranks(scenarios, world_size, tmp_dir)`` starts ``world_size`` processes with ``torch.multiprocessing.spawn``;
each joins a gloo process group through a ``torch.distributed.FileStore`` in ``tmp_dir`` (no ports, so no port races
between concurrent test runs), calls ``scenarios(rank, world_size, tmp_dir)`` and saves the dict it returns. The parent
gets one such dict per rank and does the assertions. Starting processes costs seconds (each imports torch), so a
set of scenarios spawns once and its scenarios share the processes; a scenario that raises fails the whole spawn with
the worker's traceback. ``run_once`` spawns a set once per test session for the several test modules that read it
(tests/distributed/: mesh_scenarios.py and torch_scenarios.py).

Workers run with one intra-op thread and see the same ``sys.path`` as the parent (spawn copies it), so ``scenarios``
must be a module-level function of an importable module (a test module is).

Workers end with ``os._exit`` and never tear their process groups down. With torch 2.4.1,
``dist.destroy_process_group()`` can deadlock. The destructor of ProcessGroupGloo runs with the GIL held and joins
its worker threads. One of those threads may still be dropping the last reference to a finished broadcast's
tensors (DDP's initial broadcast), which needs the GIL to free their Python objects. gdb showed exactly that on a
4-rank spawn on 2 cores: `make test` hung forever. Instead, every rank records in the FileStore that it has
returned from its last collective and waits for all the others, then exits without running any destructor. A
scenario that raises writes its traceback to ``error<rank>.txt`` and exits with status 1. mp.spawn then stops the
other ranks, and run_ranks raises with that traceback. A spawn still running after TIMEOUT_S is killed and raises
TimeoutError naming the ranks still alive, so a hang fails one test instead of holding CI until its time limit.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

Scenarios = Callable[[int, int, str], dict]
# A spawn that runs longer is a hang: it is killed and fails (the slowest module takes about 60 s on 2 cores),
# instead of holding CI until its 90-minute limit.
TIMEOUT_S = 600
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def torch_too_old(version: tuple[int, int], what: str) -> str | None:
    """Why scenarios that need ``what`` skip in this torch, or None from torch ``version`` on."""
    if TORCH_VERSION >= version:
        return None
    return f"{what}: needs torch >= {version[0]}.{version[1]}; this environment has torch {torch.__version__}"


def _entry(rank: int, scenarios: Scenarios, world_size: int, tmp_dir: str, env: dict) -> None:
    import torch.distributed as dist

    # torchrun-style variables, for libraries that read them (DeepSpeed); the rendezvous itself is the FileStore
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size), **env)
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(tmp_dir) / "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = scenarios(rank, world_size, tmp_dir)
        torch.save(result, Path(tmp_dir) / f"result{rank}.pt")
    except BaseException:
        (Path(tmp_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        _exit(1)
    # (see the module docstring: no teardown) The FileStore is a file, so this wait involves no socket
    store.set(f"harness/done{rank}", "1")
    store.wait([f"harness/done{r}" for r in range(world_size)])
    _exit(0)


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_ranks(scenarios: Scenarios, world_size: int, tmp_dir, env: dict | None = None) -> list[dict]:
    """Runs scenarios on world_size gloo ranks (see the module docstring); returns each rank's dict, by rank."""
    import torch.multiprocessing as mp

    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    context = mp.spawn(_entry, args=(scenarios, world_size, str(tmp_dir), dict(env or {})), nprocs=world_size,
                       join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                alive = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"ranks {alive} of {world_size} still running after {TIMEOUT_S} s (killed): a hang "
                                   "(a collective some rank never joined, or a teardown deadlock)")
    except mp.ProcessExitedException as exc:
        errors = [f"rank {rank}:\n{path.read_text()}" for rank in range(world_size)
                  if (path := tmp_dir / f"error{rank}.txt").exists()]
        if errors:
            raise RuntimeError("a distributed scenario raised\n\n" + "\n".join(errors)) from exc
        raise
    return [torch.load(tmp_dir / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


_SESSION_RUNS: dict = {}


def run_once(scenarios: Scenarios, world_size: int, tmp_path_factory, env: dict | None = None) -> list[dict]:
    """run_ranks, once per test session for these scenarios: several test modules read one spawn's results (a spawn
    costs seconds; the scenarios of one set share their processes). A spawn that failed fails every reader alike
    without starting again."""
    key = (scenarios.__module__, scenarios.__qualname__, world_size)
    if key not in _SESSION_RUNS:
        try:
            _SESSION_RUNS[key] = run_ranks(scenarios, world_size, tmp_path_factory.mktemp(scenarios.__module__), env)
        except Exception as exc:
            _SESSION_RUNS[key] = exc
    outcome = _SESSION_RUNS[key]
    if isinstance(outcome, Exception):
        raise RuntimeError(f"the spawn of {scenarios.__module__}.{scenarios.__qualname__} failed") from outcome
    return outcome


def tree_max_abs_diff(a: Any, b: Any) -> float:
    """Largest |a - b| over matching tensors of two nested dicts/lists (same structure required)."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape, (a.shape, b.shape)
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max((tree_max_abs_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max((tree_max_abs_diff(x, y) for x, y in zip(a, b)), default=0.0)
    assert a == b, (a, b)
    return 0.0
