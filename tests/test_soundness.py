"""FusedAdam's step cache cannot be wrong (issue 11), as a specification.

FusedAdam caches, across steps, its buckets of params and state tensors and, on the native CPU backend, native plans
that hold those tensors (ort_optim/_plan.py). Whatever real training code does between steps, a step either behaves
as ``torch.optim.AdamW`` does, or is refused before anything is written with an error that names
``param_groups[i]['params'][j]``:

1. ``optimizer.state`` mutated: cleared, an entry deleted, new moment or step tensors assigned (the usual moment
   reset), or given new storage through ``.data``, or written in place: honoured as torch honours them; assigned tensors are validated, adopted into the optimizer's layout, or
   refused naming the param and the key.
2. A storage freed and re-allocated in place (``untyped_storage().resize_(0)`` then ``resize_(n)``: CPU offload,
   FSDP): the step writes into the new memory, never the freed one; a storage still freed at step time is refused.
3. A param replaced inside ``param_groups[i]['params']``, or appended: the new param gets fresh state, as in torch.
4. ``torch.utils.swap_tensors`` / swap-on-conversion ``model.to()``: the state follows the Python param (torch's
   rule); a switch to float64 is refused naming the param.
5. Errors of the op name the param, not a bucket position.
6. A param made self-overlapping (``p.data = t.expand(n)``) or sharing memory after the first steps: refused up front,
   nothing half-applied; the overlap check allocates nothing the size of the storage span.
7. The plan is built once and reused; it is rebuilt exactly when something it cached changed.
8. ``last_grad_norm`` is the global gradient norm, unscaled, before clipping (torch's clip_grad_norm_ total norm).

Every test runs through the native op and the pure-PyTorch reference (the ``backend`` fixture), or through the Triton
kernels under Triton's interpreter with ``ORT_OPTIM_BACKEND=triton TRITON_INTERPRET=1``.
Tolerances against torch.optim.AdamW over a handful of fp32 steps: rtol 1e-5, atol 1e-7 (a few ulps per step; the
exact-arithmetic tests elsewhere bound the drift tighter).
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import assert_same_snapshot, optimizer_snapshot, select_backend, state_values

from ort_optim import AdamWMode, FusedAdam, _plan

TOL = dict(rtol=1e-5, atol=1e-7)
SHAPES = [(5,), (3, 4), ()]


def _params(seed: int = 0, shapes=SHAPES, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in shapes]


class Twin:
    """A FusedAdam in torch.optim.AdamW's mode and a torch.optim.AdamW over copies of the same params, stepped with
    the same gradients; mutate() does the same thing to both."""

    def __init__(self, params=None, **options):
        self.ours = params if params is not None else _params()
        self.theirs = [torch.nn.Parameter(p.detach().clone()) for p in self.ours]
        self.opt = FusedAdam(self.ours, lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=1e-2,
                             **options)
        self.ref = torch.optim.AdamW(self.theirs, lr=1e-2, eps=1e-8, weight_decay=1e-2, foreach=False)
        self.g = torch.Generator().manual_seed(1)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for a, b in zip(self.ours, self.theirs):
                a.grad = torch.randn(a.shape, generator=self.g).to(a.dtype)
                b.grad = a.grad.clone().to(b.dtype)
            self.opt.step()
            self.ref.step()

    def mutate(self, change) -> None:
        change(self.opt, self.ours)
        change(self.ref, self.theirs)

    def assert_matches(self) -> None:
        for i, (a, b) in enumerate(zip(self.ours, self.theirs)):
            torch.testing.assert_close(a.detach(), b.detach(), **TOL, msg=lambda m: f"param {i}: {m}")
            theirs = self.ref.state.get(b, {})
            ours = self.opt.state.get(a, {})
            assert bool(ours) == bool(theirs), f"param {i}: state {sorted(ours)} vs torch's {sorted(theirs)}"
            if theirs:
                assert float(ours["step"]) == float(theirs["step"]), f"param {i}: step"
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(ours[key].float(), theirs[key], **TOL, msg=lambda m: f"{i} {key}: {m}")


def _snapshot(opt) -> dict:
    """conftest's optimizer_snapshot, with tensors on the meta device (no data to compare) by their description."""
    return {key: ("meta", value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) and value.is_meta
            else value for key, value in optimizer_snapshot(opt).items()}


def _count_builds(monkeypatch) -> list[int]:
    builds = [0]
    build = _plan.build

    def counting(*args):
        builds[0] += 1
        return build(*args)

    monkeypatch.setattr(_plan, "build", counting)
    return builds


# ---- 1. optimizer.state mutations ---------------------------------------------------------------------------------

def _reset_moments(opt, params):
    for p in params:
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)


STATE_MUTATIONS = {
    "state.clear()": lambda opt, params: opt.state.clear(),
    "del state[p]": lambda opt, params: opt.state.__delitem__(params[1]),
    "state[p] = {}": lambda opt, params: opt.state.__setitem__(params[0], {}),
    "new exp_avg and exp_avg_sq tensors": _reset_moments,
    "new exp_avg_sq, scaled": lambda opt, params: opt.state[params[1]].__setitem__(
        "exp_avg_sq", opt.state[params[1]]["exp_avg_sq"] * 4.0),
    "new step tensor": lambda opt, params: opt.state[params[0]].__setitem__("step", torch.tensor(1.0)),
    "state[p].update(step=...)": lambda opt, params: opt.state[params[2]].update(step=torch.tensor(0.0)),
    "state.pop(p)": lambda opt, params: opt.state.pop(params[2]),
    "moment edited in place": lambda opt, params: opt.state[params[0]]["exp_avg"].mul_(0.5),
    # `.data = t` keeps the tensor object in the state and gives it t's storage: the next step uses t's value, as
    # torch's does (the float32 step of torch's AdamW becomes float64 in ours: our steps are float64)
    "step.data = a new tensor": lambda opt, params: setattr(opt.state[params[0]]["step"], "data", torch.tensor(1.0)),
    "every step.data = a new tensor": lambda opt, params: [
        setattr(opt.state[p]["step"], "data", torch.tensor(10.0 + i)) for i, p in enumerate(params)],
    "step.fill_": lambda opt, params: opt.state[params[1]]["step"].fill_(7),
    "step.copy_": lambda opt, params: opt.state[params[2]]["step"].copy_(torch.tensor(1.0)),
    "exp_avg.data = a new tensor": lambda opt, params: setattr(opt.state[params[1]]["exp_avg"], "data",
                                                               torch.full(params[1].shape, 0.5)),
    "exp_avg_sq.data = a new tensor": lambda opt, params: setattr(opt.state[params[0]]["exp_avg_sq"], "data",
                                                                  torch.zeros(params[0].shape)),
}


@pytest.mark.parametrize("mutation", STATE_MUTATIONS)
def test_optimizer_state_mutations_are_honoured_like_torch_adamw(mutation, backend):
    twin = Twin()
    twin.step(3)
    twin.mutate(STATE_MUTATIONS[mutation])
    twin.step(3)
    twin.assert_matches()


def test_a_cleared_state_starts_again_at_step_1_with_fresh_moments(backend):
    twin = Twin()
    twin.step(4)
    twin.mutate(lambda opt, params: opt.state.clear())
    twin.step(1)
    for p in twin.ours:
        assert float(twin.opt.state[p]["step"]) == 1
    twin.assert_matches()


def test_state_dict_shows_what_the_step_updates_after_a_reset(backend):
    """The issue's symptom: after a reset by assignment the cache kept updating the old tensors, and state_dict()
    (which reads optimizer.state) lost the moments."""
    twin = Twin()
    twin.step(3)
    twin.mutate(_reset_moments)
    twin.step(2)
    saved = twin.opt.state_dict()["state"]
    for index, b in enumerate(twin.theirs):
        torch.testing.assert_close(saved[index]["exp_avg"], twin.ref.state[b]["exp_avg"], **TOL)


@pytest.mark.parametrize("moments", [torch.float16, torch.bfloat16], ids=["fp16-moments", "bf16-moments"])
def test_assigned_moments_are_adopted_into_the_optimizers_layout(moments, backend):
    """A float32 tensor assigned to a bf16 or block-scaled fp16 moment is taken as values and converted (quantised
    with fresh block scales for fp16); a moment already in the layout is used as is (the same tensor)."""
    params = _params()
    opt = FusedAdam(params, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    p = params[1]
    values = torch.full(p.shape, 0.25)
    opt.state[p]["exp_avg"] = values
    kept = opt.state[p]["exp_avg_sq"]
    for q in params:
        q.grad = torch.ones_like(q)
    opt.step()
    state = opt.state[p]
    assert state["exp_avg"].dtype == moments and state["exp_avg_sq"] is kept
    assert ("exp_avg_scale" in state) == (moments == torch.float16)
    # the step applied beta1 * 0.25 + (1 - beta1) * 1 to the adopted values (within the moments' rounding)
    torch.testing.assert_close(state_values(opt, p, "exp_avg").float(), torch.full(p.shape, 0.9 * 0.25 + 0.1),
                               rtol=2.0**-7, atol=0)


def _bad_state(key, value):
    def damage(opt, params):
        opt.state[params[1]][key] = value(params[1]) if callable(value) else value
    return damage


STATE_REFUSALS = [
    ("exp_avg-wrong-shape", _bad_state("exp_avg", lambda p: torch.zeros(p.numel() + 1)), ValueError,
     r"\['exp_avg'\] has shape \(13,\)"),
    ("exp_avg-integer", _bad_state("exp_avg", lambda p: torch.zeros(p.shape, dtype=torch.int32)), TypeError,
     r"\['exp_avg'\] must be a dense floating-point tensor"),
    ("exp_avg-not-a-tensor", _bad_state("exp_avg", 0.0), TypeError, r"\['exp_avg'\] must be a dense floating"),
    ("exp_avg_sq-other-device", _bad_state("exp_avg_sq", lambda p: torch.zeros(p.shape, device="meta")), ValueError,
     r"\['exp_avg_sq'\] is on meta"),
    ("exp_avg_sq-float64", _bad_state("exp_avg_sq", lambda p: torch.zeros(p.shape, dtype=torch.float64)), ValueError,
     r"\['exp_avg_sq'\] is torch.float64 but the parameter is torch.float32"),
    ("step-negative", _bad_state("step", torch.tensor(-1.0)), ValueError, r"\['step'\] must be a whole number"),
    ("step-two-elements", _bad_state("step", torch.zeros(2)), ValueError, r"\['step'\] must be a one-element"),
    ("step-a-string", _bad_state("step", "3"), TypeError, r"\['step'\] must be a one-element tensor or a number"),
    ("exp_avg-deleted", lambda opt, params: opt.state[params[1]].__delitem__("exp_avg"), ValueError,
     r"its optimizer state has no 'exp_avg'"),
    ("state-not-a-dict", lambda opt, params: opt.state.__setitem__(params[1], 3), TypeError,
     r"optimizer.state\[p\] must be a dict"),
]


@pytest.mark.parametrize("damage,error,message", [c[1:] for c in STATE_REFUSALS], ids=[c[0] for c in STATE_REFUSALS])
def test_a_state_that_cannot_be_honoured_is_refused_naming_the_param_and_key(damage, error, message, backend):
    twin = Twin()
    twin.step(2)
    for p in twin.ours:
        p.grad = torch.ones_like(p)
    try:
        damage(twin.opt, twin.ours)
    except error as exc:  # refused at the assignment itself
        assert re.search(message, str(exc)), str(exc)
        return
    before = _snapshot(twin.opt)
    with pytest.raises(error, match=re.escape("param_groups[0]['params'][1] (shape (3, 4)") + ".*" + message):
        twin.opt.step()
    assert_same_snapshot(before, _snapshot(twin.opt))


# ---- 2. storages freed and re-allocated in place --------------------------------------------------------------------

def _offload_and_restore(tensor_of):
    """CPU offload / FSDP style: copy the data away, free the storage in place, re-allocate it, copy the data back.
    Between the free and the re-allocation another tensor is allocated, which may take the freed block."""

    def change(opt, params):
        t = tensor_of(opt, params)
        storage = t.untyped_storage()
        saved, nbytes = torch.empty(0, dtype=torch.uint8).set_(storage.clone()), storage.nbytes()
        storage.resize_(0)
        decoy = torch.full((nbytes // 4 + 1,), 7.0)
        storage.resize_(nbytes)
        torch.empty(0, dtype=torch.uint8).set_(storage).copy_(saved)
        change.decoys.append(decoy)

    change.decoys = []
    return change


OFFLOADED = {
    "exp_avg": lambda opt, params: opt.state[params[1]]["exp_avg"],  # (its flat buffer: every param's exp_avg)
    "exp_avg_sq": lambda opt, params: opt.state[params[0]]["exp_avg_sq"],
    "param": lambda opt, params: params[1],
}


@pytest.mark.parametrize("which", OFFLOADED)
def test_a_storage_reallocated_in_place_is_written_where_it_now_is(which, backend, monkeypatch):
    twin = Twin()
    twin.step(3)
    builds = _count_builds(monkeypatch)
    change = _offload_and_restore(OFFLOADED[which])
    change(twin.opt, twin.ours)
    twin.step(1)
    twin.assert_matches()
    for decoy in change.decoys:
        assert bool((decoy == 7.0).all()), "a step wrote into freed memory"
    if backend == "native":  # followed in C++: the same storage, re-resolved, not planned again
        assert builds[0] == 0


def test_master_weights_reallocated_in_place_are_followed(backend):
    params = _params(dtype=torch.bfloat16)
    reference_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [FusedAdam(ps, lr=1e-2, master_weights=True) for ps in (params, reference_params)]
    g = torch.Generator().manual_seed(5)
    change = _offload_and_restore(lambda opt, ps: opt.state[ps[0]]["master_param"])
    for step in range(4):
        if step == 2:
            change(opts[0], params)
        for a, b in zip(params, reference_params):
            a.grad = torch.randn(a.shape, generator=g).bfloat16()
            b.grad = a.grad.clone()
        for opt in opts:
            opt.step()
    for a, b in zip(params, reference_params):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(opts[0].state[a]["master_param"], opts[1].state[b]["master_param"])


@pytest.mark.parametrize("key", ["master_param", "step", "exp_avg"])
def test_data_assigned_to_a_state_tensor_equals_assigning_the_tensor(key, backend):
    """`state[p][key].data = t` (the tensor object kept, its storage replaced) steps exactly as `state[p][key] = t`
    (the known-honoured assignment), bit for bit, for a master weight of a bf16 param too."""
    runs = []
    for by_data in (True, False):
        params = _params(dtype=torch.bfloat16)
        opt = FusedAdam(params, lr=1e-2, master_weights=True)
        g = torch.Generator().manual_seed(7)
        for step in range(5):
            if step == 2:
                p = params[1]
                fresh = torch.tensor(1.0, dtype=torch.float64) if key == "step" else torch.full(p.shape, 0.25)
                if by_data:
                    opt.state[p][key].data = fresh
                else:
                    opt.state[p][key] = fresh
            for q in params:
                q.grad = torch.randn(q.shape, generator=g).bfloat16()
            opt.step()
        runs.append((params, opt))
    (ours, opt), (theirs, ref) = runs
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        for name in ("master_param", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][name], ref.state[b][name]), name


FREED = {
    "exp_avg": ("exp_avg", lambda opt, p: opt.state[p]["exp_avg"]),
    "exp_avg_sq": ("exp_avg_sq", lambda opt, p: opt.state[p]["exp_avg_sq"]),
    "param": ("it", lambda opt, p: p),
    "grad": ("its gradient", lambda opt, p: p.grad),
}


@pytest.mark.parametrize("which", FREED)
def test_a_storage_still_freed_at_step_time_is_refused_naming_the_param_and_key(which, backend):
    twin = Twin()
    twin.step(2)
    for p in twin.ours:
        p.grad = torch.ones_like(p)
    victim = twin.ours[0]  # (states of params planned together share one flat buffer: the first is named)
    name, tensor_of = FREED[which]
    storage = tensor_of(twin.opt, victim).untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    try:
        key = {"exp_avg": r"\['exp_avg'\] ", "exp_avg_sq": r"\['exp_avg_sq'\] "}.get(which, "")
        with pytest.raises(ValueError, match=re.escape("param_groups[0]['params'][0] (shape (5,)") + ".*" + key
                           + ".*has a storage of 0 bytes"):
            twin.opt.step()
    finally:
        storage.resize_(nbytes)
    for p in twin.ours:  # nothing was written: every param still has its step count
        assert float(twin.opt.state[p]["step"]) == 2


# ---- 3. params replaced or appended in a group's list ---------------------------------------------------------------

def _replace_param(opt, params):
    fresh = torch.nn.Parameter(torch.full(params[1].shape, 0.5))
    opt.param_groups[0]["params"][1] = fresh
    params[1] = fresh


def _append_param(opt, params):
    late = torch.nn.Parameter(torch.full((7,), -0.5))
    opt.param_groups[0]["params"].append(late)
    params.append(late)


def _new_list(opt, params):
    late = torch.nn.Parameter(torch.full((2,), 2.0))
    opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"]) + [late]
    params.append(late)


PARAM_LIST_CHANGES = {"replaced-in-place": _replace_param, "appended": _append_param, "list-reassigned": _new_list}


@pytest.mark.parametrize("change", PARAM_LIST_CHANGES)
def test_a_param_replaced_or_appended_in_a_group_gets_fresh_state_like_torch(change, backend):
    twin = Twin()
    twin.step(3)
    old = twin.ours[1]
    old_value = old.detach().clone()
    twin.mutate(PARAM_LIST_CHANGES[change])
    twin.step(2)
    twin.assert_matches()
    if change == "replaced-in-place":
        assert torch.equal(old.detach(), old_value), "the replaced param must not move"
        assert float(twin.opt.state[twin.ours[1]]["step"]) == 2


# ---- 4. swap_tensors and model.to() with swap-on-conversion ---------------------------------------------------------

def _swap(opt, params):
    other = torch.nn.Parameter(torch.full(params[0].shape, 3.0))
    torch.utils.swap_tensors(params[0], other)


def test_swap_tensors_on_a_param_follows_the_python_param_like_torch(backend):
    """swap_tensors keeps the Python param and gives it another TensorImpl: a plan that held the old one would update
    a tensor nobody uses with stale gradients. torch's state follows the Python param: so does ours."""
    twin = Twin()
    twin.step(3)
    twin.mutate(_swap)
    twin.step(2)
    twin.assert_matches()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["to-float64", "to-bfloat16"])
def test_model_to_with_swap_on_conversion(dtype, backend):
    """With swap_module_params_on_conversion, model.to(dtype) swaps new tensors into the same Parameter objects. A
    switch to float64 is refused naming the param (its states are float32); to bfloat16 the state follows the param,
    converted into the layout this optimizer keeps for bfloat16 params (bfloat16 moments, no masters here)."""
    model = torch.nn.Linear(4, 3)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        ids = [id(p) for p in model.parameters()]
        model.to(dtype)
        assert [id(p) for p in model.parameters()] == ids  # the same Python params
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    model(x.to(dtype)).square().sum().backward()
    if dtype == torch.float64:
        before = optimizer_snapshot(opt)
        with pytest.raises(ValueError, match=re.escape("param_groups[0]['params'][0] (shape (3, 4), torch.float64)")
                           + ".*cannot switch to or from float64"):
            opt.step()
        assert_same_snapshot(before, optimizer_snapshot(opt))
        return
    weight_before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.weight.detach(), weight_before)
    assert opt.state[model.weight]["exp_avg"].dtype == torch.bfloat16
    assert float(opt.state[model.weight]["step"]) == 3


# ---- 5. op errors name the param ------------------------------------------------------------------------------------

def test_an_op_error_is_reported_with_the_params_name(monkeypatch):
    """The op only knows list positions; FusedAdam maps them through the bucket to param_groups[i]['params'][j]."""
    from ort_optim import backends

    select_backend(monkeypatch, "native")
    params = _params(shapes=[(2,), (3,)])
    bucket = _plan.Bucket(indices=[4, 7], params=params, exp_avgs=[torch.zeros(2), torch.zeros(3, dtype=torch.int32)],
                          exp_avg_sqs=[torch.zeros(2), torch.zeros(3)], steps=torch.zeros(2, dtype=torch.float64),
                          grads=[torch.zeros(2), torch.zeros(3)])
    with pytest.raises(RuntimeError) as raised:
        backends.adam_step_(*bucket.op_lists(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            adam_w_mode=2, bias_correction=True, maximize=False)
    named = str(_plan.name_op_error(raised.value, 1, bucket))
    assert "param_groups[1]['params'][7] (shape (3,), torch.float32)'s exp_avg" in named, named


# ---- 6. params made to overlap after the first steps ----------------------------------------------------------------

def _expand(opt, params):
    params[0].data = torch.ones(1).expand(5)


def _share(opt, params):
    params[0].data = params[1].data.view(-1)[:5]


OVERLAPS = [("expanded", _expand, r"param_groups\[0\]\['params'\]\[0\] .*its elements overlap in memory"),
            ("shared", _share, r"param_groups\[0\]\['params'\]\[0\] .* and param_groups\[0\]\['params'\]\[1\] .*share "
                               r"memory")]


@pytest.mark.parametrize("damage,message", [c[1:] for c in OVERLAPS], ids=[c[0] for c in OVERLAPS])
def test_a_param_made_to_overlap_after_the_first_steps_is_refused_before_any_write(damage, message, backend):
    twin = Twin()
    twin.step(2)
    damage(twin.opt, twin.ours)
    for p in twin.ours:
        p.grad = torch.ones_like(p)
    before = optimizer_snapshot(twin.opt)
    with pytest.raises(ValueError, match=message):
        twin.opt.step()
    assert_same_snapshot(before, optimizer_snapshot(twin.opt))
    assert all(float(twin.opt.state[p]["step"]) == 2 for p in twin.ours[1:])


def test_the_overlap_check_allocates_nothing_the_size_of_the_storage_span(monkeypatch):
    """Interleaved strided views far apart in a large storage: the element-wise check looks at their elements only."""
    base = torch.zeros(1 << 22)
    a, b = base[0::1 << 20], base[1::1 << 20]  # 4 elements each, spans of 3 * 2**20 + 1 elements
    sizes = []
    arange = torch.arange

    def recording(*args, **kwargs):
        sizes.append(args[0] if len(args) == 1 else args[1] - args[0])
        return arange(*args, **kwargs)

    monkeypatch.setattr(torch, "arange", recording)
    _plan._check_overlap([(0, 0, a), (0, 1, b)])  # disjoint: accepted
    assert max(sizes) <= 4
    with pytest.raises(ValueError, match="share memory"):
        _plan._check_overlap([(0, 0, a), (0, 1, base[0::1 << 21])])


# ---- 7. the plan is built once, and again exactly when something it cached changed ----------------------------------

REBUILDS = {
    "nothing": (lambda opt, params: None, 0),
    "moment edited in place": (lambda opt, params: opt.state[params[0]]["exp_avg"].zero_(), 0),
    "hyperparameter changed": (lambda opt, params: opt.param_groups[0].__setitem__("lr", 0.5), 0),
    "state reassigned": (lambda opt, params: opt.state[params[0]].__setitem__("exp_avg", torch.zeros(5)), 1),
    "amsgrad switched off": (lambda opt, params: opt.param_groups[0].__setitem__("amsgrad", False), 1),
    "param list appended": (lambda opt, params: opt.param_groups[0]["params"].append(torch.nn.Parameter(
        torch.ones(2))), 1),
    "param given new memory": (lambda opt, params: setattr(params[1], "data", params[1].data.clone()), 1),
    "step given new memory": (lambda opt, params: setattr(opt.state[params[2]]["step"], "data", torch.tensor(4.0)),
                              1),
    "step edited in place": (lambda opt, params: opt.state[params[2]]["step"].fill_(4), 0),
    "max_exp_avg_sq given new memory": (lambda opt, params: setattr(
        opt.state[params[0]]["max_exp_avg_sq"], "data", torch.zeros(5)), 1),
    "master_weights turned on": (lambda opt, params: setattr(opt, "master_weights", True), 1),
}


@pytest.mark.parametrize("change", REBUILDS)
def test_the_plan_is_rebuilt_exactly_when_something_it_cached_changed(change, backend, monkeypatch):
    params = _params()
    opt = FusedAdam(params, amsgrad=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    builds = _count_builds(monkeypatch)
    mutate, expected = REBUILDS[change]
    mutate(opt, params)
    for _ in range(3):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()
    assert builds[0] == expected


# ---- 8. last_grad_norm ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,step_kwargs", [
    (dict(max_grad_norm=0.1), {}), (dict(), dict(grad_scale=1024.0)), (dict(max_grad_norm=1e3), dict(grad_scale=8.0)),
], ids=["clipped", "scaled", "scaled-and-clipped"])
def test_last_grad_norm_is_torchs_total_norm_of_the_unscaled_gradients(options, step_kwargs, backend):
    params = _params(shapes=[(5,), (3, 4), (), (70,)]) + _params(seed=3, shapes=[(6,)], dtype=torch.bfloat16)
    opt = FusedAdam([{"params": params[:3]}, {"params": params[3:], "lr": 1e-2}], master_weights=True, **options)
    g = torch.Generator().manual_seed(9)
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
    scale = step_kwargs.get("grad_scale", 1.0)
    for p, grad in zip(params, grads):
        p.grad = grad * scale
    opt.step(**step_kwargs)
    copies = [torch.nn.Parameter(torch.zeros(p.shape, dtype=torch.float32)) for p in params]
    for c, grad in zip(copies, grads):
        c.grad = grad.float()
    expected = torch.nn.utils.clip_grad_norm_(copies, max_norm=1.0)
    assert opt.last_grad_norm is not None and opt.last_grad_norm.shape == ()
    torch.testing.assert_close(opt.last_grad_norm, expected, rtol=1e-6, atol=0)


def test_a_plain_step_reports_the_norm_from_its_own_update_pass_on_the_native_path(backend):
    """Without grad_scale or max_grad_norm there is no statistics pass: the native plan (and the Triton kernels, under
    `make test-triton`) sum the squares as the update loads each gradient (every bucket, here fp32 and bf16 params in
    two groups); the pure-PyTorch backend reports None."""
    params = _params(shapes=[(5,), (3, 4), (), (2000,)]) + _params(seed=3, shapes=[(6,)], dtype=torch.bfloat16)
    opt = FusedAdam([{"params": params[:3]}, {"params": params[3:], "lr": 1e-2}])
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.step()
        if backend == "torch":
            assert opt.last_grad_norm is None and opt.last_found_inf is None
            continue
        copies = [torch.nn.Parameter(torch.zeros(p.shape)) for p in params]
        for c, grad in zip(copies, grads):
            c.grad = grad.float()
        expected = torch.nn.utils.clip_grad_norm_(copies, max_norm=1.0)
        assert opt.last_grad_norm.shape == () and opt.last_found_inf is None
        torch.testing.assert_close(opt.last_grad_norm, expected, rtol=1e-6, atol=0)


def test_a_plain_step_with_found_inf_or_an_inf_gradient_reports_what_it_read(backend):
    """found_inf without grad_scale skips the step before any pass reads the gradients: no norm (NaN from the update
    pass that skipped, None where plain steps report none). An inf gradient in a plain step is not skipped
    (torch.optim.AdamW does not check either), and the norm says inf."""
    params = _params()
    opt = FusedAdam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step(found_inf=torch.ones(1))
    assert opt.last_grad_norm is None if backend == "torch" else torch.isnan(opt.last_grad_norm)
    params[0].grad[0] = float("inf")
    opt.step()
    if backend != "torch":
        assert opt.last_grad_norm == float("inf")


# ---- 9. step_in_backward's per-param plans ----------------------------------------------------------------------------

@pytest.mark.parametrize("mutation", ["step.data = a new tensor", "step.fill_", "exp_avg.data = a new tensor"])
def test_state_changes_are_honoured_by_the_updates_inside_backward(mutation, backend):
    """step_in_backward=True updates each param from its own cached plan (ort_optim/_backward_step.py): the same rule
    holds there."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    twin = Twin(list(model.parameters()), step_in_backward=True)
    theirs = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for a, b in zip(theirs.parameters(), twin.theirs):
            a.copy_(b)
    twin.ref = torch.optim.AdamW(list(theirs.parameters()), lr=1e-2, eps=1e-8, weight_decay=1e-2, foreach=False)
    twin.theirs = list(theirs.parameters())
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    for step in range(6):
        if step == 3:
            twin.mutate(STATE_MUTATIONS[mutation])
        model(x * (step + 1)).square().sum().backward()  # (the hooks update each param)
        twin.opt.step()
        theirs(x * (step + 1)).square().sum().backward()
        twin.ref.step()
        twin.ref.zero_grad()
    twin.assert_matches()
