"""FusedAdam under torch's ZeroRedundancyOptimizer (``optimizer_class=FusedAdam``), as a specification.

ZeroRedundancyOptimizer passes its keyword arguments to FusedAdam and also stores them in every param group it hands
to it, and its load_state_dict copies every key of a checkpoint's groups into FusedAdam's groups (bypassing
FusedAdam.load_state_dict). So:

* FusedAdam's optimizer-wide options (master_weights, exp_avg_dtype, exp_avg_sq_dtype) passed as ZeRO keyword
  arguments work: a group may repeat the optimizer's own value, steps equal a plain FusedAdam's bit for bit, and
  checkpoints save and load (``torch.save``/``torch.load(weights_only=True)``), resuming exactly. A different value in
  a group is refused, naming the group and key, at construction, add_param_group and step, changing nothing.
* A process group in a param group (``pipeline_group=`` as a ZeRO keyword argument) is refused at once, saying to
  pass ``optimizer_class=functools.partial(FusedAdam, pipeline_group=...)``: a group is saved with the checkpoint,
  where a process group cannot be pickled.
* A torch.optim.Adam checkpoint with L2 decay (``decoupled_weight_decay=False``) loaded through ZeRO is refused at
  the step, before anything changes, as FusedAdam.load_state_dict refuses it; so is ``differentiable=True``.
  torch's other group keys (foreach, fused, capturable) change nothing.
* With ``functools.partial(FusedAdam, pipeline_group=dist.group.WORLD)`` clipping and the inf/NaN skip are one
  decision over every rank's shard, as in one process; a resume from a consolidated checkpoint is exact (2 gloo
  ranks, one spawn).

World size 1 (an in-process gloo group) shows the first three; the last spawns 2 ranks.
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks

from ort_optim import AdamWMode, FusedAdam

pytestmark = pytest.mark.distributed

ZeRO = pytest.importorskip("torch.distributed.optim").ZeroRedundancyOptimizer
SHAPES = [(64,), (32,), (16,), (8,)]
TA = dict(lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, without a process group already set up")
    store = tmp_path_factory.mktemp("zero_store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def set_grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = (torch.randn(p.shape, generator=g) * (10.0 if i == 0 else 1.0) * scale).to(p.dtype)


def train(opt, params, steps):
    for step in steps:
        set_grads(params, step)
        opt.step()


def snapshot(opt):
    from conftest import optimizer_snapshot

    return optimizer_snapshot(opt)


def same(a, b):
    from conftest import assert_same_snapshot

    assert_same_snapshot(a, b)


def through_file(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


WIDE = {
    "master_weights": (torch.bfloat16, dict(master_weights=True)),
    "8-bit moments": (torch.float32, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
    "4-bit moments": (torch.float32, dict(exp_avg_dtype=torch.uint4, exp_avg_sq_dtype=torch.uint4)),
}


@pytest.mark.parametrize("case", list(WIDE))
def test_optimizer_wide_options_given_to_zero_step_save_and_resume_as_the_plain_optimizer(case, world_of_one):
    dtype, wide = WIDE[case]
    pz, pr, pc = make_params(dtype), make_params(dtype), make_params(dtype)
    z = ZeRO(pz, optimizer_class=FusedAdam, **TA, **wide)
    r = FusedAdam(pr, **TA, **wide)
    assert all(z.optim.param_groups[0][key] is value for key, value in wide.items())  # (what ZeRO does)
    train(z, pz, range(3))
    train(r, pr, range(3))
    assert all(torch.equal(p, q) for p, q in zip(pz, pr))
    # the local FusedAdam's own checkpoint: the same keys back, through weights_only
    local = through_file(z.optim.state_dict())
    assert local["param_groups"][0].keys() - {"decoupled_weight_decay"} == z.optim.param_groups[0].keys()
    copy.deepcopy(z.optim).load_state_dict(local)
    # ZeRO's consolidated checkpoint resumes exactly
    z.consolidate_state_dict(to=0)
    saved = z.state_dict()
    if not (torch.__version__ < "2.5" and case == "4-bit moments"):  # (torch 2.4 allows no torch.uint4 there)
        saved = through_file(saved)
    with torch.no_grad():
        for p, q in zip(pc, pz):
            p.copy_(q)
    c = ZeRO(pc, optimizer_class=FusedAdam, **TA, **wide)
    c.load_state_dict(saved)
    train(c, pc, range(3, 6))
    train(z, pz, range(3, 6))
    assert all(torch.equal(p, q) for p, q in zip(pc, pz))


def test_a_resume_through_zero_with_another_max_grad_norm_is_refused_then_steps_once_zeros_groups_say_it(
        world_of_one):
    # (ZeRO's load_state_dict puts the checkpoint's max_grad_norm into its groups, which it copies into FusedAdam's at
    # every step: the error says where to write the new value)
    pz, pr, pc = make_params(), make_params(), make_params()
    z = ZeRO(pz, optimizer_class=FusedAdam, **TA, max_grad_norm=1.0)
    r = FusedAdam(pr, **TA, max_grad_norm=1.0)
    train(z, pz, range(3))
    train(r, pr, range(3))
    z.consolidate_state_dict(to=0)
    saved = through_file(z.state_dict())
    with torch.no_grad():
        for p, q in zip(pc, pz):
            p.copy_(q)
    c = ZeRO(pc, optimizer_class=FusedAdam, **TA, max_grad_norm=0.5)
    c.load_state_dict(saved)
    set_grads(pc, 3)
    before = snapshot(c.optim)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: max_grad_norm is set in a param group, .*own value "
                                         r"\(0.5\), not float 1.0: .*set max_grad_norm in each of its param_groups"):
        c.step()
    same(before, snapshot(c.optim))
    for group in c.param_groups:
        group["max_grad_norm"] = 0.5
    r.max_grad_norm = 0.5
    train(c, pc, range(3, 6))
    train(r, pr, range(3, 6))
    assert all(torch.equal(p, q) for p, q in zip(pc, pr))


@pytest.mark.parametrize("key, value", [("master_weights", True), ("exp_avg_dtype", torch.uint8)])
def test_an_optimizer_wide_option_in_a_group_other_than_the_optimizers_is_refused_naming_it(key, value):
    params = make_params()
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {key} is set in a param group, .* may only repeat this "
                                         rf"optimizer's own value \(.*\), not .*: pass {key}= to FusedAdam"):
        FusedAdam([{"params": params[:2], key: value}], **TA)
    opt = FusedAdam([{"params": params[:2]}], **TA)
    train(opt, params[:2], range(1))
    before = snapshot(opt)
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: {key}"):
        opt.add_param_group({"params": params[2:], key: value})
    same(before, snapshot(opt))
    opt.param_groups[0][key] = value  # (written between steps)
    set_grads(params[:2], 1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {key}"):
        opt.step()
    same(before, snapshot(opt))


def test_a_process_group_in_a_param_group_is_refused_at_once(world_of_one):
    params = make_params()
    partial = r"optimizer_class=functools.partial\(FusedAdam, pipeline_group=\.\.\.\)"
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: pipeline_group is .*ProcessGroup.*{partial}"):
        ZeRO(params, optimizer_class=FusedAdam, pipeline_group=dist.group.WORLD, **TA)
    opt = FusedAdam(params[:2], **TA)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: process_group is .*{partial}"):
        opt.add_param_group({"params": params[2:], "process_group": dist.group.WORLD})
    same(before, snapshot(opt))
    z = ZeRO(params, optimizer_class=functools.partial(FusedAdam, pipeline_group=dist.group.WORLD), **TA)
    train(z, params, range(2))
    z.consolidate_state_dict(to=0)
    through_file(z.state_dict())


def torch_checkpoint(cls, **kwargs):
    params = make_params()
    z = ZeRO(params, optimizer_class=cls, lr=1e-2, **kwargs)
    train(z, params, range(3))
    z.consolidate_state_dict(to=0)
    return z.state_dict(), [p.detach().clone() for p in params]


def load_into_zero_fused_adam(saved):
    sd, values = saved
    params = [torch.nn.Parameter(v.clone()) for v in values]
    z = ZeRO(params, optimizer_class=FusedAdam, **TA)
    z.load_state_dict(copy.deepcopy(sd))
    set_grads(params, 3)
    return z


@pytest.mark.skipif(torch.__version__ < "2.5", reason="torch < 2.5 saves no decoupled_weight_decay (indistinguishable)")
def test_a_torch_adam_l2_checkpoint_loaded_through_zero_is_refused_at_the_step_changing_nothing(world_of_one):
    z = load_into_zero_fused_adam(torch_checkpoint(torch.optim.Adam, weight_decay=0.1))
    before = snapshot(z.optim)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: decoupled_weight_decay=False with weight_decay=0.1 is "
                                         r"torch.optim.Adam's L2 decay.*adam_w_mode"):
        z.step()
    same(before, snapshot(z.optim))
    # the mode chosen knowingly: the groups say which decay, and the step goes on
    z.param_groups[0].update(adam_w_mode=int(AdamWMode.ADAM_L2_REGULARIZATION), decoupled_weight_decay=False)
    z.step()
    assert not torch.equal(before["p0.0"], z.optim.param_groups[0]["params"][0])


@pytest.mark.parametrize("cls, kwargs", [(torch.optim.AdamW, dict(weight_decay=0.1)), (torch.optim.Adam, {})],
                         ids=["AdamW", "Adam without decay"])
def test_torch_checkpoints_whose_math_fused_adam_has_continue_through_zero(cls, kwargs, world_of_one):
    saved = torch_checkpoint(cls, **kwargs)
    z = load_into_zero_fused_adam(saved)
    z.step()  # (foreach, fused, capturable, differentiable=False: accepted, nothing else changes)
    r = FusedAdam([torch.nn.Parameter(v.clone()) for v in saved[1]], **TA)
    r.load_state_dict(copy.deepcopy(saved[0]))
    set_grads(r.param_groups[0]["params"], 3)
    r.step()
    assert all(torch.equal(p, q) for p, q in zip(z.optim.param_groups[0]["params"], r.param_groups[0]["params"]))


def test_differentiable_true_in_a_group_is_refused_at_the_step():
    params = make_params()
    opt = FusedAdam(params, **TA)
    opt.param_groups[0].update(foreach=True, fused=False, capturable=False, differentiable=True)
    set_grads(params, 0)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: differentiable=True is not supported"):
        opt.step()
    same(before, snapshot(opt))


# ---- 2 ranks -------------------------------------------------------------------------------------------------------


def two_rank_scenarios(rank: int, world_size: int, tmp_dir: str) -> dict:
    out = {}
    kw = dict(TA, max_grad_norm=1.0)
    for name, cls in [("per shard", functools.partial(FusedAdam, max_grad_norm=1.0)),
                      ("global", functools.partial(FusedAdam, max_grad_norm=1.0, pipeline_group=dist.group.WORLD))]:
        pz, pr = make_params(), make_params()
        z = ZeRO(pz, optimizer_class=cls, **TA)
        r = FusedAdam(pr, **kw)
        train(z, pz, range(3))
        train(r, pr, range(3))
        out[f"{name} clip"] = (float(z.optim.last_grad_norm), float(r.last_grad_norm),
                               max(float((p - q).abs().max()) for p, q in zip(pz, pr)))
        # an inf in one param's gradient, the same on both ranks (as after DDP's all-reduce)
        before = [p.detach().clone() for p in pz]
        set_grads(pz, 3, scale=2.0)
        pz[0].grad[0] = float("inf")
        z.step(grad_scale=2.0)
        out[f"{name} skip"] = (bool(z.optim.last_step_skipped), [torch.equal(a, b) for a, b in zip(before, pz)])
    # resume from the consolidated checkpoint: exact
    cls = functools.partial(FusedAdam, max_grad_norm=1.0, pipeline_group=dist.group.WORLD)
    pz, pc = make_params(), make_params()
    z = ZeRO(pz, optimizer_class=cls, **TA)
    train(z, pz, range(3))
    z.consolidate_state_dict(to=0)
    saved = [z.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    with torch.no_grad():
        for p, q in zip(pc, pz):
            p.copy_(q)
    c = ZeRO(pc, optimizer_class=cls, **TA)
    c.load_state_dict(saved[0])
    train(z, pz, range(3, 6))
    train(c, pc, range(3, 6))
    out["resume exact"] = all(torch.equal(p, q) for p, q in zip(pz, pc))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(two_rank_scenarios, 2, tmp_path_factory.mktemp("zero_two_ranks"))


def test_with_pipeline_group_clipping_and_the_skip_are_one_decision_as_in_one_process(two_ranks):
    for rank, out in enumerate(two_ranks):
        shard_norm, global_norm, diff = out["global clip"]
        assert shard_norm == pytest.approx(global_norm, rel=1e-6) and diff < 1e-6, (rank, out["global clip"])
        assert out["global skip"] == (True, [True] * len(SHAPES)), rank
        assert out["resume exact"], rank


def test_without_pipeline_group_each_rank_decides_over_its_own_shard(two_ranks):
    # (documented in guides/distributed.md: FusedAdam cannot tell that ZeRO partitions its params)
    norms = [out["per shard clip"][0] for out in two_ranks]
    assert all(norm < out["per shard clip"][1] for norm, out in zip(norms, two_ranks))
    assert any(out["per shard clip"][2] > 1e-4 for out in two_ranks)
    assert sorted(out["per shard skip"][0] for out in two_ranks) == [False, True]
