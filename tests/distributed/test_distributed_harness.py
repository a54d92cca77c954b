"""The multi-process harness itself (tests/distributed_harness.py): a failing or hanging rank fails the test with
the reason, instead of passing, vanishing or holding CI until its time limit."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

import distributed_harness
from distributed_harness import run_ranks

pytestmark = pytest.mark.distributed


def _rank_one_raises(rank, world_size, tmp_dir):
    if rank == 1:
        raise ValueError("scenario failed on rank 1")
    return {}


def _rank_zero_never_joins_the_barrier(rank, world_size, tmp_dir):
    if rank == 0:
        time.sleep(3600)
    dist.barrier()
    return {}


def test_a_raising_rank_fails_the_run_with_its_traceback(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:\n.*ValueError: scenario failed on rank 1"):
        run_ranks(_rank_one_raises, 2, tmp_path)


def test_a_hang_is_killed_and_fails_naming_the_ranks_still_running(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed_harness, "TIMEOUT_S", 8)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 still running"):
        run_ranks(_rank_zero_never_joins_the_barrier, 2, tmp_path)
    assert time.monotonic() - start < 60
