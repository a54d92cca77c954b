"""FusedAdam (and FP16_Optimizer around it) under FSDP2 (``fully_shard``), as a specification.

Against the same FusedAdam unsharded (mesh_scenarios: 4 gloo ranks as a 2 x 2 mesh, two-rank scenarios on its rows):
each step's full gradients also step a FusedAdam over full-size copies in the workers (the shadow: bit for bit without
clipping, since the update is per element; within 1e-6 with clipping, whose norm is summed in another order), and
the parent trains the same model on the whole batch in one process (within 5e-5 after several clipped steps: the
engines average the ranks' gradients instead of one batch's). FSDP2 over all 4 ranks (one rank holds an empty shard),
bf16 params with masters and low-precision moments, 8-bit, 4-bit and fp8 moments against a FusedAdam stepping each
rank's local pieces (they are coded per piece), a DTensor given a new local tensor or reallocated storage, an inf
on one rank skipping the step everywhere (with FP16_Optimizer and torch.amp.GradScaler too), bad input refused
naming the param with nothing changed, and a bitsandbytes checkpoint loaded into DTensor params as into whole ones.

Against ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) in the same engine (torch_scenarios: 2 ranks, 20 steps): fp32
and ``MixedPrecisionPolicy(param_dtype=bf16)``, ``reshard_after_forward`` both ways, uneven shards, a param without a
gradient on odd steps, accumulation through ``set_requires_gradient_sync(False)``, amsgrad/maximize/param groups,
HSDP; ``last_grad_norm`` equal on every rank to clip_grad_norm_'s total norm; FP16_Optimizer on DTensors skipping
together; GradScaler against torch's fused AdamW; unsupported input refused naming the param. Tolerances: fp32
params within 1e-6 and the clipping norm within 1e-5 relative (the same gradients, another order of float32
operations); under bf16 compute 1e-4.

FSDP2 needs torch >= 2.6 on CPU with gloo: in older torch (the .venv environment) these tests skip with the reason.
"""

from __future__ import annotations

import pytest
import torch
import mesh_scenarios as mesh
import torch_scenarios as against_torch

pytestmark = pytest.mark.distributed


# ---- against a shadow FusedAdam and one process ----------------------------------------------------------------------


@mesh.needs_fsdp2
@pytest.mark.parametrize("name", list(mesh.FSDP_CASES) + ["world"])
def test_fsdp2_equals_full_tensor_shadow(mesh_results, name):
    for r in mesh_results:
        out = r[f"fsdp-{name}"]
        if mesh.FSDP_CASES.get(name, ({}, {}))[1].get("clip", mesh.CLIP) is None:
            mesh.assert_bitwise(out["params"], out["shadow"], f"rank {r['rank']} {name}")  # elementwise: exact
        else:
            mesh.assert_close(out["params"], out["shadow"], 1e-6, f"rank {r['rank']} {name}")
        mesh.assert_bitwise(out["params"], mesh_results[r["rank"] % 2][f"fsdp-{name}"]["params"] if name != "world"
                       else mesh_results[0]["fsdp-world"]["params"], "ranks agree")
        assert out["plans"] == 1  # planned at the first step, valid at every later one (FSDP2 keeps its shards)
    if name == "world":
        assert mesh_results[3]["fsdp-world"]["local_shapes"][2] == (0, 16)  # an empty shard took part


@mesh.needs_fsdp2
@pytest.mark.parametrize("dtype", mesh.CODED_MOMENTS, ids=str)
def test_fsdp2_with_coded_moments_equals_fused_adam_stepping_each_ranks_pieces(mesh_results, dtype):
    """8-bit, 4-bit and fp8 moments are coded per local piece (its blocks, its element indices for the stochastic
    rounding): each rank's update is a FusedAdam's over its pieces, bit for bit, not the full tensor's."""
    for r in mesh_results:
        out = r[f"fsdp-coded-{dtype}"]
        mesh.assert_bitwise(out["params"], out["pieces"], f"rank {r['rank']} {dtype}")


@mesh.needs_fsdp2
@pytest.mark.parametrize("name", ["fp32-clip", "fp32-noclip", "mp-bf16-clip", "world"])
def test_fsdp2_equals_one_process(mesh_results, name):
    out = mesh_results[0][f"fsdp-{name}"]
    clip = mesh.FSDP_CASES.get(name, ({}, {}))[1].get("clip", mesh.CLIP)
    # bf16 compute (MixedPrecisionPolicy) vs fp32 in one process: the forward/backward itself differs
    tolerance = 2e-2 if name.startswith("mp") else 5e-5
    mesh.assert_close(out["params"], mesh.one_process(clip=clip), tolerance, name)


@mesh.needs_fsdp2
def test_fsdp2_bf16_params_with_masters_and_low_precision_moments_equal_one_process(mesh_results):
    out = mesh_results[0]["fsdp-bf16-masters-lowbit-amsgrad"]
    _, opt_kwargs = mesh.FSDP_CASES["bf16-masters-lowbit-amsgrad"]
    ref = mesh.one_process(dtype=torch.bfloat16, **opt_kwargs)
    mesh.assert_close(out["params"], ref, 2 * 2.0**-8, "bf16 params within two bf16 ulps (of 1)")


@mesh.needs_fsdp2
def test_steps_follow_a_dtensors_new_local_tensor_and_reallocated_storage(mesh_results):
    for r in mesh_results:
        want = {"old-untouched": True, "after-swap": True, "after-realloc": True}
        assert r["local-tensor-changes"] == want, r["rank"]


@mesh.needs_fsdp2
@pytest.mark.parametrize("case", ["fsdp-inf", "fsdp-fp16-optimizer-inf"])
def test_fsdp2_inf_on_one_rank_skips_on_every_rank(mesh_results, case):
    for r in mesh_results:
        assert r[case] == [step == 2 for step in range(mesh.STEPS)], (r["rank"], r[case])
    assert len({r["fsdp-fp16-optimizer-scale"] for r in mesh_results}) == 1


@mesh.needs_fsdp2
def test_fsdp2_with_torch_grad_scaler_skips_together_and_equals_one_process(mesh_results):
    """torch.amp.GradScaler drives FusedAdam through grad_scale/found_inf (fused-optimizer protocol). Its found_inf
    comes from each rank's local shards; FusedAdam's one all-reduce makes the skip global, and the scale is updated
    alike on every rank (one halving for the one poisoned step)."""
    for r in mesh_results:
        skipped = r["fsdp-grad-scaler-inf"]
        assert skipped == [step == 2 for step in range(mesh.STEPS)], (r["rank"], skipped)
        assert r["fsdp-grad-scaler"]["scale"] == mesh.SCALER_INIT / 2
    want = mesh.one_process(grad_scaler=True, inf_step=2)
    mesh.assert_close(mesh_results[0]["fsdp-grad-scaler"]["params"], want, 5e-5, "FSDP2 + GradScaler vs one process")
    mesh.assert_bitwise(mesh_results[1]["fsdp-grad-scaler"]["params"], mesh_results[0]["fsdp-grad-scaler"]["params"],
                        "ranks agree")


@mesh.needs_fsdp2
def test_bad_distributed_input_is_refused_naming_the_param_and_changes_nothing(mesh_results):
    for r in mesh_results:
        out = r["refusals"]
        assert "param_groups[0]['params'][0]" in out["plain-grad"] and "needs a DTensor gradient" in out["plain-grad"]
        assert "param_groups[0]['params'][0]" in out["mesh"] and "on another device mesh" in out["mesh"], out["mesh"]
        assert "state_dict['state'][0]['exp_avg']" in out["bad-shape"] and "(2, 4)" in out["bad-shape"], \
            out["bad-shape"]
        assert out["plain-grad-untouched"] and out["mesh-untouched"] and out["bad-shape-untouched"]
        assert "device meshes over different sets of ranks ([[0, 1], [1, 2]])" in out["meshes-apart"], \
            out["meshes-apart"]
        assert out["meshes-apart-untouched"]
        assert "param_groups[0]['params'][0]" in out["step-in-backward"] and "DTensor" in out["step-in-backward"]
        assert out["appended-dtensor-reduces"]


@mesh.needs_fsdp2
def test_a_bitsandbytes_checkpoint_loads_into_dtensor_params_as_into_whole_ones(mesh_results):
    """Another library's checkpoint (load_state_dict reads its codes as float32 moments) loads into DTensor params
    as into the params whole: each rank's pieces of the moments are those of the whole params' moments, bit for bit
    (fp32 moments: the decoded values themselves)."""
    for r in mesh_results:
        out = r["foreign-checkpoint"]
        for i, (sharded, whole) in enumerate(zip(out["sharded"], out["whole"])):
            assert sorted(sharded) == sorted(whole) == ["exp_avg", "exp_avg_sq", "step"], (r["rank"], i)
            for key in sharded:
                assert torch.equal(sharded[key], whole[key]), (r["rank"], i, key)


# ---- against torch.optim.AdamW in the same engine --------------------------------------------------------------------


@against_torch.needs_fsdp2
@pytest.mark.parametrize("name", list(against_torch.FSDP_CASES))
def test_fsdp2_equals_torch_adamw_under_fsdp2(torch_results, name):
    tol = 1e-4 if name.startswith("mp") else 1e-6
    for r in torch_results:
        against_torch.assert_like_torch(r[f"fsdp-{name}"], tol, what=f"rank {r['rank']} {name}")
    if name == "hsdp":  # replicated over the 2 ranks: each replica's sum of squares counted once
        assert torch_results[0]["fsdp-hsdp"]["fused"]["placements"] == {"(Replicate(), Shard(dim=0))"}
    else:
        assert torch_results[1][f"fsdp-{name}"]["fused"]["local"][2] == (0, 5)  # rank 1's head shard is empty


@pytest.mark.parametrize("engine", [pytest.param("fsdp2", marks=against_torch.needs_fsdp2), "tp"])
def test_fp16_optimizer_on_dtensors_skips_together_and_agrees_around_torch_adamw_and_fused_adam(torch_results, engine):
    """Regression: around torch.optim.AdamW on DTensor fp16 params (FSDP2, TP), FP16_Optimizer's step raised
    NotImplementedError (DTensor has no sharding rule for _foreach_copy_, used to copy gradients into the fp32
    masters' buffers and masters back into the params); its last_grad_norm was a DTensor, and master_params were
    DTensors around torch's optimizer but FusedAdam's local pieces around FusedAdam."""
    inf_steps = against_torch.INF_STEPS
    want = [(step in inf_steps, against_torch.LOSS_SCALE / 2 ** sum(s <= step for s in inf_steps)) for step in range(8)]
    first = torch_results[0][f"fp16-optimizer-{engine}"]
    for r in torch_results:
        out = r[f"fp16-optimizer-{engine}"]
        for kind in ("fused", "torch", "torch-fp32"):
            assert out[kind]["record"] == want, (r["rank"], kind, out[kind]["record"])  # one decision, one scale
            assert out[kind]["norm_types"] == ["Tensor"], (kind, out[kind]["norm_types"])  # a plain tensor
            for a, b in zip(out[kind]["masters"] + out[kind]["params"], first[kind]["masters"] + first[kind]["params"]):
                assert torch.equal(a, b)  # ranks agree bit for bit
        # fp16 params: the same global norm (FusedAdam's one all-reduce; DTensor's norm on the masters' path) and the
        # same training, up to fp16 roundings in the forward that the small differences of the updates flip
        for step, (a, b) in enumerate(zip(out["fused"]["norms"], out["torch"]["norms"])):
            assert a == b == float("inf") if step in against_torch.INF_STEPS else abs(a - b) <= 1e-3 * b, (step, a, b)
        assert against_torch.max_diff(out["fused"]["masters"], out["torch"]["masters"]) <= 2e-3
        # fp32 params (torch AdamW inside): torch's own recipe on the same model, clip_grad_norm_ included
        reference = out["reference-fp32"]
        for step, (a, b) in enumerate(zip(out["torch-fp32"]["norms"], reference["norms"])):
            assert a == b == float("inf") if step in against_torch.INF_STEPS else abs(a - b) <= 1e-6 * b, (step, a, b)
        assert against_torch.max_diff(out["torch-fp32"]["params"], reference["params"]) <= 1e-6


@against_torch.needs_fsdp2
def test_grad_scaler_under_fsdp2_matches_torch_fused_adamw(torch_results):
    want = [against_torch.LOSS_SCALE / 2 ** sum(s <= step for s in against_torch.INF_STEPS) for step in range(8)]
    for r in torch_results:
        out = r["grad-scaler"]
        for recipe in ("", "-unscale-clip"):
            fused_, torch_ = out["fused" + recipe], out["torch-fused" + recipe]
            assert fused_["scales"] == torch_["scales"] == want, (r["rank"], recipe)
            assert against_torch.max_diff(fused_["params"], torch_["params"]) <= 1e-6, recipe


def test_unsupported_distributed_input_is_refused_naming_the_param(torch_results):
    for r in torch_results:
        out = r["refusals"]
        assert "param_groups[0]['params'][1]" in out["partial-param"] and "partial sum" in out["partial-param"], \
            out["partial-param"]
        assert "param_groups[0]['params'][0]" in out["fp16-layout"] and "laid out alike" in out["fp16-layout"], \
            out["fp16-layout"]
        assert out["fp16-layout-untouched"]
