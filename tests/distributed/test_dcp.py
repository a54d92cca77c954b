"""FusedAdam and FP16_Optimizer checkpoints through ``torch.distributed.checkpoint``, as a specification.

* Resume is bit for bit on 2 ranks; a two-rank checkpoint loads into four ranks and into one process
  (mesh_scenarios).
* FusedAdam's checkpoint loads into torch.optim.AdamW and torch's into FusedAdam, then both continue alike; the
  full-state-dict path (broadcast from rank 0) and the flattened optimizer state dict (torchtitan's default) resume
  bit for bit; a one-process checkpoint loads into 2 ranks; FP16_Optimizer(FusedAdam) resumes through the guide's
  recipe bit for bit (torch_scenarios).
* A checkpoint without masters loaded that way into FusedAdam(master_weights=True), the template's masters dropped
  as the guide says, gives each master its loaded param at the next step, not the weights the new model started with
  (torch_scenarios).

torch.distributed.checkpoint with FSDP2 needs torch >= 2.6 on CPU with gloo; elsewhere these skip with the reason.
"""

from __future__ import annotations

import pytest
import torch
import mesh_scenarios as mesh
import torch_scenarios as against_torch

pytestmark = pytest.mark.distributed


# ---- against a shadow FusedAdam and one process ----------------------------------------------------------------------


@mesh.needs_fsdp2
def test_dcp_resume_is_bit_for_bit(mesh_results):
    for r in mesh_results:
        out = r["checkpoint"]
        mesh.assert_bitwise(out["resumed"], out["uninterrupted"], f"rank {r['rank']}")
        for fqn, state in out["saved"].items():
            for key, value in state.items():
                assert torch.equal(out["loaded"][fqn][key], value), (fqn, key)


@mesh.needs_fsdp2
def test_two_rank_checkpoint_loads_into_four_ranks(mesh_results):
    saved = mesh_results[0]["checkpoint"]["saved"]
    for r in mesh_results:
        loaded = r["reshard-2-to-4"]
        assert loaded.keys() == saved.keys()
        for fqn in saved:
            for key, value in saved[fqn].items():
                assert torch.equal(loaded[fqn][key], value), (r["rank"], fqn, key)


@mesh.needs_fsdp2
def test_two_rank_checkpoint_loads_into_one_process(mesh_results):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = mesh.make_model(torch.bfloat16)
    opt = mesh.make_optimizer(model.parameters(), master_weights=True, exp_avg_sq_dtype=torch.float16)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=mesh_results[0]["checkpoint"]["path"], no_dist=True)
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = get_optimizer_state_dict(model, opt)["state"]
    saved = mesh_results[0]["checkpoint"]["saved"]
    assert loaded.keys() == saved.keys()
    for fqn in saved:
        for key, value in saved[fqn].items():
            assert torch.equal(loaded[fqn][key], value), (fqn, key)


# ---- against torch.optim.AdamW in the same engine --------------------------------------------------------------------


@against_torch.needs_fsdp2
@pytest.mark.parametrize("direction", ["fused-to-torch", "torch-to-fused"])
def test_dcp_checkpoint_moves_between_fused_adam_and_torch_adamw(torch_results, direction):
    for r in torch_results:
        out = r["dcp-cross"]
        # the strict load names the option torch's or FusedAdam's groups lack (the guide gives the recipe)
        assert "Missing key in checkpoint state_dict" in out[f"{direction}-strict"], out[f"{direction}-strict"]
        diff = against_torch.max_diff(out[direction]["resumed"], out[direction]["uninterrupted"])
        assert diff <= 1e-6, (r["rank"], direction, diff)


@against_torch.needs_fsdp2
@pytest.mark.parametrize("source", ["torch", "fused", "torch-flattened"])
def test_a_checkpoint_without_masters_loads_into_master_weights_from_the_loaded_params(torch_results, source):
    """torch.optim.AdamW's checkpoint, or FusedAdam's without master_weights, loaded through dcp.load(...,
    allow_partial_load=True) into FusedAdam(master_weights=True), the template's masters dropped before
    set_state_dict (guides/distributed.md): the masters come from the loaded params (as when the optimizer's
    state_dict() is loaded directly), not from the weights the new model started with."""
    for r in torch_results:
        out = r["dcp-into-master-weights"][source]
        assert out["masters_after_load"] == 0, r["rank"]
        assert out["first_step"] <= 2 * against_torch.LR, (r["rank"], out["first_step"])
        for a, b in zip(out["resumed"], out["direct"]):
            assert torch.equal(a, b), r["rank"]


@against_torch.needs_fsdp2
def test_full_state_dict_broadcast_from_rank0_resumes_bit_for_bit(torch_results):
    assert torch_results[0]["full-state-dict"]["gathered"]
    against_torch.assert_resumed_bit_for_bit(torch_results, "full-state-dict")


@against_torch.needs_fsdp2
def test_flattened_optimizer_state_dict_resumes_bit_for_bit(torch_results):
    assert all(r["flattened-dcp"]["flat"] for r in torch_results)
    against_torch.assert_resumed_bit_for_bit(torch_results, "flattened-dcp")


@against_torch.needs_fsdp2
def test_one_process_checkpoint_loads_into_two_ranks(torch_results):
    for r in torch_results:
        out = r["one-to-two"]
        assert out["loaded"].keys() == out["saved"].keys()
        for i in out["saved"]:
            for key, value in out["saved"][i].items():
                assert torch.equal(out["loaded"][i][key], value), (r["rank"], i, key)
        assert against_torch.max_diff(out["params"], out["single"]) <= 1e-5


@against_torch.needs_fsdp2
def test_fp16_optimizer_with_fused_adam_resumes_through_dcp_and_its_own_state_dict_bit_for_bit(torch_results):
    for r in torch_results:
        out = r["fp16-optimizer-dcp"]
        assert out["saved_scale"] == out["loaded_scale"] == against_torch.LOSS_SCALE / 2
        for a, b in zip(out["resumed"], out["uninterrupted"]):
            assert torch.equal(a, b), r["rank"]
        for a, b in zip(out["resumed_in_process"], out["uninterrupted"]):  # (the wrapper's own state_dict)
            assert torch.equal(a, b), r["rank"]


@against_torch.needs_fsdp2
def test_a_checkpoint_one_rank_refuses_for_its_pieces_is_refused_by_every_rank(torch_results):
    """Each rank checks its own pieces of a full checkpoint, so one rank can refuse what another accepts; the ranks
    agree before anything changes, so that all load or none."""
    rank0, rank1 = (r["one-rank-refuses"] for r in torch_results)
    assert "holds negative values" in rank1["error"]
    assert "another rank refused this checkpoint" in rank0["error"]
    assert rank0["unchanged"] and rank1["unchanged"]
