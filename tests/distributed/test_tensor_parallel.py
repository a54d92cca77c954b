"""FusedAdam under tensor parallelism (``ColwiseParallel``/``RowwiseParallel``) and 2D (FSDP2 x TP), as a
specification.

* Against a shadow FusedAdam over the full tensors (within 1e-6) and one process on the whole batch (within 5e-5),
  on the rows of a 2 x 2 mesh, and 2D with FSDP on "dp" and TP on "tp" (mesh_scenarios).
* Against ``torch.optim.AdamW`` + ``clip_grad_norm_`` under the same TP plan, whose row-wise bias is replicated and
  counted once in the norm (torch_scenarios; fp32 within 1e-6, norms within 1e-5 relative).

* On the transformer of torch's own TP training test, with and without sequence parallelism (tp_transformer):
  gradients laid out unlike their params (a ``Replicate`` gradient of a ``Shard(0)`` embedding, ``Partial`` ones of
  ``Replicate`` norm weights) are brought to the param's layout, and training equals ``torch.optim.AdamW`` on the
  same mesh and the one-process model, with clipping (each element counted once in the norm) and a global skip.

These need torch >= 2.6 (DTensor on CPU with gloo) except where a test says otherwise.
"""

from __future__ import annotations

import pytest
import torch
import mesh_scenarios as mesh
import torch_scenarios as against_torch
import tp_transformer as transformer

pytestmark = pytest.mark.distributed


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


# ---- torch's TP transformer training: gradients laid out unlike their params (tp_transformer) -----------------------


@pytest.fixture(scope="module")
def transformer_results(tmp_path_factory):
    """tp_transformer's scenarios on 2 ranks: FusedAdam, torch.optim.AdamW on the same mesh, and one process."""
    return transformer.results(tmp_path_factory)


CASES = [(sp, case) for sp in (False, True) for case in ("plain", "clip", "skip")]
IDS = [f"{'sequence-parallel' if sp else 'tp'}-{case}" for sp, case in CASES]


def _assert_close(got: dict, want: dict, tol: float, what: str) -> None:
    assert got.keys() == want.keys()
    for name in got:
        diff = float((got[name].double() - want[name].double()).abs().max())
        assert diff <= tol, f"{what}: {name} differs by {diff} (tolerance {tol})"


@transformer.needs_tp
@pytest.mark.parametrize("key", CASES, ids=IDS)
def test_fused_adam_trains_torchs_tp_transformer_as_torch_adamw_does(transformer_results, key):
    for r in transformer_results:
        out = r[key]
        for ref in ("torch-tp", "one-process"):
            _assert_close(out["ours"]["params"], out[ref]["params"], transformer.TOL, f"rank {r['rank']} vs {ref}")
        for name, p in out["ours"]["params"].items():
            assert torch.equal(p, transformer_results[0][key]["ours"]["params"][name]), f"ranks disagree on {name}"
            assert bool(torch.isfinite(p).all()), name


@transformer.needs_tp
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sequence-parallel"])
def test_the_gradients_laid_out_unlike_their_params_are_the_ones_torch_redistributes(transformer_results,
                                                                                      sequence_parallel):
    """The model's TP run has gradients laid out unlike their params (a ``Replicate`` gradient of the ``Shard(0)``
    position embedding; with sequence parallelism, ``Partial`` gradients of ``Replicate`` norm weights): the
    transformer tests here step with those."""
    layouts = transformer_results[0][(sequence_parallel, "plain")]["layouts"]
    assert layouts["pos_embeddings.weight"] == ("(Shard(dim=0),)", "(Replicate(),)")
    if sequence_parallel:
        assert layouts["norm.weight"] == ("(Replicate(),)", "(Partial(sum),)")


@transformer.needs_tp
def test_a_replicated_gradient_is_sliced_locally_without_communication(transformer_results):
    """Without sequence parallelism the only mismatch is Replicate -> Shard(0): the step's one collective is the
    all-reduce of the [sum of squares, inf flag] pair (with clipping), and none without."""
    for r in transformer_results:
        assert all(not comms for comms in r[(False, "plain")]["comms"]), r[(False, "plain")]["comms"]
        for comms in r[(False, "clip")]["comms"]:
            assert sum(comms.values()) == 1 and any("all_reduce" in op or "allreduce" in op for op in comms), comms


@transformer.needs_tp
def test_the_clipping_norm_counts_each_gradient_element_once(transformer_results):
    want = transformer.grad_norms()
    for r in transformer_results:
        got = r[(False, "clip")]["norms"]
        assert got == pytest.approx(want, rel=1e-5), (r["rank"], got, want)
        got = r[(True, "clip")]["norms"]
        assert got == pytest.approx(want, rel=1e-5), (r["rank"], got, want)


@transformer.needs_tp
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sequence-parallel"])
def test_an_inf_in_the_slice_another_rank_steps_skips_the_step_on_every_rank(transformer_results, sequence_parallel):
    for r in transformer_results:
        want = [step == transformer.SKIP_STEP for step in range(transformer.STEPS)]
        assert r[(sequence_parallel, "skip")]["ours"]["skipped"] == want
