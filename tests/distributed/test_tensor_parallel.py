"""FusedAdam under tensor parallelism (``ColwiseParallel``/``RowwiseParallel``) and 2D (FSDP2 x TP), as a
specification.

* Against a shadow FusedAdam over the full tensors (within 1e-6) and one process on the whole batch (within 5e-5),
  on the rows of a 2 x 2 mesh, and 2D with FSDP on "dp" and TP on "tp" (mesh_scenarios).
* Against ``torch.optim.AdamW`` + ``clip_grad_norm_`` under the same TP plan, whose row-wise bias is replicated and
  counted once in the norm (torch_scenarios; fp32 within 1e-6, norms within 1e-5 relative).

These need torch >= 2.6 (DTensor on CPU with gloo) except where a test says otherwise.
"""

from __future__ import annotations

import pytest
import torch
import mesh_scenarios as mesh
import torch_scenarios as against_torch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    """mesh_scenarios on 4 ranks, against a shadow FusedAdam and one process (one spawn per session)."""
    return mesh.results(tmp_path_factory)


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory):
    """torch_scenarios on 2 ranks, against torch.optim.AdamW in the same engine (one spawn per session)."""
    return against_torch.results(tmp_path_factory)


# ---- against a shadow FusedAdam and one process ----------------------------------------------------------------------


@mesh.needs_fsdp2
@pytest.mark.parametrize("case", ["tp", "2d"])
def test_tensor_parallel_and_2d_equal_shadow_and_one_process(mesh_results, case):
    for r in mesh_results:
        mesh.assert_close(r[case]["params"], r[case]["shadow"], 1e-6, f"rank {r['rank']} {case} vs shadow")
        mesh.assert_bitwise(r[case]["params"], mesh_results[0][case]["params"], "ranks agree")
    mesh.assert_close(mesh_results[0][case]["params"], mesh.one_process(), 5e-5, f"{case} vs one process")
    if case == "2d":
        assert any("_StridedShard" in p or "Shard(dim=1)" in p for p in mesh_results[0]["2d"]["placements"])


# ---- against torch.optim.AdamW in the same engine --------------------------------------------------------------------


def test_tensor_parallel_equals_torch_adamw(torch_results):
    for r in torch_results:
        against_torch.assert_like_torch(r["tp"], 1e-6, what=f"rank {r['rank']} TP")
