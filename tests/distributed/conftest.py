"""The spawned scenario sets that several modules here read: each runs once per test session."""

from __future__ import annotations

import mesh_scenarios as mesh
import pytest
import torch_scenarios as against_torch


@pytest.fixture(scope="session")
def mesh_results(tmp_path_factory):
    """mesh_scenarios on 4 ranks, against a shadow FusedAdam and one process."""
    return mesh.results(tmp_path_factory)


@pytest.fixture(scope="session")
def torch_results(tmp_path_factory):
    """torch_scenarios on 2 ranks, against torch.optim.AdamW in the same engine."""
    return against_torch.results(tmp_path_factory)
