"""FP16_Optimizer takes the API of DeepSpeed's and apex's FP16_Optimizer, as a specification.

Code written for either (the optimizers ONNX Runtime's FP16_Optimizer wraps) runs after swapping the import: their
constructor arguments map onto the loss scaler's options, ``loss_scale``/``cur_scale`` are settable, ``get_lr()``,
``zero_grad(set_grads_to_None=...)`` and ``load_state_dict(..., load_optimizer_states=False)`` work, and
``clip_master_grads`` is refused pointing to ``max_grad_norm``. Every bad or contradictory argument is refused naming
it (and the argument it contradicts), changing nothing.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import assert_tree_bitwise_equal
from torch import nn

from ort_optim import FusedAdam
from ort_optim.fp16_optimizer import SCALE_RANGE, FP16_Optimizer

pytestmark = pytest.mark.filterwarnings(r"ignore:FP16_Optimizer\.step\(\). no loss was scaled:UserWarning")


def clone_tree(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, clone_tree(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3)).half()


def loss_of(model, step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=g).half(), torch.randn(8, 3, generator=g)
    return torch.nn.functional.mse_loss(model(x).float(), y)


INNER = {
    "FusedAdam": lambda ps, lr=1e-2: FusedAdam(ps, lr=lr),
    "SGD": lambda ps, lr=0.05: torch.optim.SGD(ps, lr=lr, momentum=0.9),
}


def fp16_params():
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(4, 3, generator=g).half()), nn.Parameter(torch.randn(3, generator=g).half())]


def picture(optimizer):
    """Everything construction could change in the wrapped optimizer."""
    return {"groups": [[p.detach().clone() for p in g["params"]] for g in optimizer.param_groups],
            "ids": [[id(p) for p in g["params"]] for g in optimizer.param_groups],
            "options": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "state": clone_tree({id(p): dict(s) for p, s in optimizer.state.items()}),
            "flags": {k: getattr(optimizer, k) for k in ("master_weights", "max_grad_norm") if hasattr(optimizer, k)}}


def wrapper_picture(opt, model):
    return {"scaler": clone_tree(opt.scaler.state_dict()), "model": clone_tree(dict(model.state_dict())),
            "masters": clone_tree(opt.master_params), "inner": clone_tree(opt.optimizer.state_dict()),
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()]}


def train(opt, model, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        opt.backward(loss_of(model, step))
        opt.step()


# ---- constructor arguments ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", list(INNER))
def test_static_loss_scale_gives_a_static_scale_as_in_deepspeed_and_apex(inner):
    model = make_model()
    opt = FP16_Optimizer(INNER[inner](list(model.parameters())), static_loss_scale=128.0)
    assert opt.loss_scale == 128.0 and opt.scaler.dynamic is False
    train(opt, model, 3)
    model[3].weight.grad = None
    opt.backward(loss_of(model, 9))
    model[3].weight.grad[0, 0] = float("inf")
    opt.step()  # an overflow is skipped, and a static scale stays
    assert opt.overflow and opt.loss_scale == 128.0
    # dynamic_loss_scale=False alone: DeepSpeed's and apex's static default, 1.0
    assert FP16_Optimizer(INNER[inner](fp16_params()), dynamic_loss_scale=False).loss_scale == 1.0


@pytest.mark.parametrize("scale", [0.25, 2.0**30])
def test_a_static_scale_outside_our_default_bounds_widens_them(scale):
    opt = FP16_Optimizer(torch.optim.SGD(fp16_params(), lr=0.1), static_loss_scale=scale)
    assert opt.loss_scale == scale and opt.scaler.min_scale <= scale <= opt.scaler.max_scale


DS_ARGS = dict(init_scale=2.0**12, scale_window=100, delayed_shift=2, consecutive_hysteresis=True, min_scale=0.5,
               raise_error_at_min_scale=False)
APEX_ARGS = dict(init_scale=2.0**10, scale_factor=4.0, scale_window=50, min_loss_scale=None, max_loss_scale=2.0**20)


@pytest.mark.parametrize("args, expected", [
    (DS_ARGS, dict(init_scale=2.0**12, growth_interval=100, hysteresis=2, consecutive_hysteresis=True, min_scale=0.5,
                   min_scale_action="clamp", dynamic=True)),
    (APEX_ARGS, dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=50,
                     min_scale=SCALE_RANGE[0], max_scale=2.0**20, dynamic=True)),
    (None, dict(init_scale=2.0**16, growth_interval=2000, hysteresis=1, min_scale=1.0, dynamic=True)),
], ids=["deepspeed", "apex", "no-args"])
def test_dynamic_loss_args_map_onto_the_scalers_options(args, expected):
    # static_loss_scale is not used with a dynamic scale, as in DeepSpeed and apex (DeepSpeed's engine passes 0 there)
    opt = FP16_Optimizer(torch.optim.SGD(fp16_params(), lr=0.1), static_loss_scale=0, dynamic_loss_scale=True,
                         dynamic_loss_args=args, verbose=True)
    for option, value in expected.items():
        assert getattr(opt.scaler, option) == value, option
    assert opt.loss_scale == expected["init_scale"]


def test_deepspeeds_initial_dynamic_scale_above_our_ceiling_raises_the_ceiling():
    opt = FP16_Optimizer(torch.optim.SGD(fp16_params(), lr=0.1), dynamic_loss_scale=True,
                         initial_dynamic_scale=2.0**32)
    assert opt.loss_scale == 2.0**32 and opt.scaler.max_scale == 2.0**32


def test_the_dynamic_scale_follows_deepspeeds_scaler_built_from_the_same_arguments(deepspeed_loss_scaler):
    args = dict(init_scale=2.0**10, scale_window=3, delayed_shift=2, consecutive_hysteresis=False, min_scale=1)
    ds = deepspeed_loss_scaler.DynamicLossScaler(**args)
    opt = FP16_Optimizer(torch.optim.SGD(fp16_params(), lr=0.1), dynamic_loss_scale=True, dynamic_loss_args=args)
    for bad in [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0]:
        ds.update_scale(bool(bad))
        opt.scaler.update(torch.tensor(float(bad)))
        assert opt.loss_scale == float(ds.cur_scale)


def test_megatron_style_dynamic_loss_args_with_a_static_scale_are_checked_and_not_used():
    args = {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2}
    opt = FP16_Optimizer(torch.optim.SGD(fp16_params(), lr=0.1), static_loss_scale=64.0, dynamic_loss_scale=False,
                         dynamic_loss_args=args)
    assert opt.loss_scale == 64.0 and not opt.scaler.dynamic and opt.scaler.hysteresis == 1


@pytest.mark.parametrize("clip_grad, expected", [(1.5, 1.5), (0.0, None)])
def test_clip_grad_sets_max_grad_norm_and_leaves_our_dynamic_default(clip_grad, expected):
    for inner in INNER.values():
        opt = FP16_Optimizer(inner(fp16_params()), clip_grad=clip_grad)
        assert opt.max_grad_norm == expected
        assert opt.scaler.dynamic and opt.loss_scale == 2.0**16  # (no scaling argument given: our defaults)


# (kwargs, exception, fragments of the message); each must change nothing
REFUSED = [
    (dict(static_loss_scale=128.0, init_scale=256.0), ValueError, ["static_loss_scale", "init_scale", "disagree"]),
    (dict(static_loss_scale=128.0, dynamic=True), ValueError, ["static_loss_scale=128.0", "dynamic", "disagree"]),
    (dict(dynamic_loss_scale=True, dynamic=False), ValueError, ["dynamic_loss_scale=True", "dynamic", "disagree"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 10}, growth_interval=20), ValueError,
     ["dynamic_loss_args['scale_window']", "growth_interval", "disagree"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**16}, initial_dynamic_scale=2.0**20),
     ValueError, ["initial_dynamic_scale", "dynamic_loss_args['init_scale']", "disagree"]),
    (dict(clip_grad=1.0, max_grad_norm=2.0), ValueError, ["clip_grad=1.0", "max_grad_norm", "disagree"]),
    (dict(clip_grad=0.0, max_grad_norm=2.0), ValueError, ["clip_grad=0.0", "max_grad_norm", "disagree"]),
    (dict(dynamic_loss_args={"scale_window": 10}), ValueError, ["dynamic_loss_args is given without "
                                                                "dynamic_loss_scale", "dynamic_loss_scale=True"]),
    (dict(initial_dynamic_scale=2.0**10), ValueError, ["initial_dynamic_scale is given without dynamic_loss_scale"]),
    (dict(static_loss_scale=128.0, dynamic_loss_args={"scale_window": 10}), ValueError,
     ["dynamic_loss_args is given without dynamic_loss_scale"]),
    (dict(static_loss_scale=128.0, initial_dynamic_scale=2.0**10), ValueError,
     ["initial_dynamic_scale is given without dynamic_loss_scale"]),
    (dict(static_loss_scale="128"), TypeError, ["static_loss_scale must be a real number, got str '128'"]),
    (dict(static_loss_scale=10**400), ValueError, ["static_loss_scale must be finite, got inf"]),
    (dict(static_loss_scale=0.0), ValueError, ["static_loss_scale must lie in [2**-126, 2**126]"]),
    (dict(static_loss_scale=float("inf")), ValueError, ["static_loss_scale must be finite"]),
    (dict(dynamic_loss_scale="True"), TypeError, ["dynamic_loss_scale must be True or False"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args=[("scale_window", 2)]), TypeError,
     ["dynamic_loss_args must be None or a dict"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"growth_interval": 2}), ValueError,
     ["dynamic_loss_args has unknown keys ['growth_interval']"]),
    (dict(dynamic_loss_scale=False, dynamic_loss_args={"scale_window": 0}), ValueError,
     ["dynamic_loss_args['scale_window'] must be an int in [1, 2147483647]"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"scale_factor": 1.0}), ValueError,
     ["dynamic_loss_args['scale_factor'] must be > 1"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"min_scale": 0}), ValueError,
     ["dynamic_loss_args['min_scale'] must lie in"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"delayed_shift": 0}), ValueError,
     ["dynamic_loss_args['delayed_shift'] must be an int"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"raise_error_at_min_scale": "no"}), TypeError,
     ["dynamic_loss_args['raise_error_at_min_scale'] must be True or False"]),
    (dict(dynamic_loss_scale=True, initial_dynamic_scale=float("nan")), ValueError,
     ["initial_dynamic_scale must be finite"]),
    (dict(clip_grad=-1.0), ValueError, ["clip_grad must be >= 0"]),
    (dict(clip_grad=1e39), ValueError, ["clip_grad=1e+39", "within float32's range"]),
    (dict(clip_grad="1"), TypeError, ["clip_grad must be a real number, got str '1'"]),
    (dict(clip_grad=10**400), ValueError, ["clip_grad must be finite, got inf"]),
    (dict(dynamic_loss_scale=True, initial_dynamic_scale=-10**400), ValueError,
     ["initial_dynamic_scale must be finite, got -inf"]),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"scale_factor": 10**400}), ValueError,
     ["dynamic_loss_args['scale_factor'] must be finite, got inf"]),
    (dict(verbose="yes"), TypeError, ["verbose must be True or False"]),
    (dict(mpu=object()), TypeError, ["['mpu']", "model_parallel_groups=[mpu.get_model_parallel_group()]"]),
    (dict(deepspeed=object()), TypeError, ["['deepspeed']", "deepspeed.initialize"]),
    (dict(timers=None), TypeError, ["['timers']", "leave it out"]),
]


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("kwargs, exc, fragments", REFUSED, ids=[re.sub(r" at 0x[0-9a-f]+", "", repr(c[0]))[:70] for c in REFUSED])
def test_a_bad_or_contradictory_deepspeed_or_apex_argument_is_refused_naming_it_and_changes_nothing(inner, kwargs, exc,
                                                                                         fragments):
    optimizer = INNER[inner](fp16_params())
    before = picture(optimizer)
    with pytest.raises(exc) as info:
        FP16_Optimizer(optimizer, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert_tree_bitwise_equal(before, picture(optimizer))


def test_agreeing_deepspeed_or_apex_and_own_arguments_are_accepted():
    opt = FP16_Optimizer(torch.optim.SGD(fp16_params(), lr=0.1), static_loss_scale=128.0, init_scale=128.0,
                         dynamic=False, clip_grad=1.0, max_grad_norm=1.0)
    assert opt.loss_scale == 128.0 and opt.max_grad_norm == 1.0


# ---- loss_scale and cur_scale ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("name", ["loss_scale", "cur_scale"])
def test_setting_the_loss_scale_in_place_scales_the_next_backward_and_unscales_its_step(inner, name):
    model, ref = make_model(), make_model()
    opt = FP16_Optimizer(INNER[inner](list(model.parameters())), growth_interval=2)
    ref_opt = FP16_Optimizer(INNER[inner](list(ref.parameters())), init_scale=256.0, growth_interval=2)
    tensor = opt.scaler.scale
    setattr(opt, name, 256)
    assert opt.scaler.scale is tensor and float(tensor) == 256.0  # written in place: a compiled step reads it
    assert opt.loss_scale == opt.cur_scale == 256.0
    assert float(opt.scale_loss(torch.tensor(2.0))) == 512.0
    train(opt, model, 3)
    train(ref_opt, ref, 3)  # the same as a wrapper that started at that scale
    assert_tree_bitwise_equal(clone_tree(dict(ref.state_dict())), clone_tree(dict(model.state_dict())))
    assert opt.loss_scale == ref_opt.loss_scale == 512.0  # the dynamic scale goes on from the value set


def test_the_loss_scale_of_a_static_scale_is_settable_too():
    opt = FP16_Optimizer(torch.optim.SGD(fp16_params(), lr=0.1), static_loss_scale=128.0)
    opt.loss_scale = 8.0
    assert opt.loss_scale == 8.0 and not opt.scaler.dynamic


@pytest.mark.parametrize("name", ["loss_scale", "cur_scale"])
@pytest.mark.parametrize("value, exc, fragment", [
    (0.0, ValueError, "must lie in [min_scale, max_scale]"),
    (0.5, ValueError, "must lie in [min_scale, max_scale] = [1.0, 16777216.0]"),
    (2.0**25, ValueError, "must lie in [min_scale, max_scale]"),
    (-4.0, ValueError, "must lie in [min_scale, max_scale]"),
    (float("inf"), ValueError, "must be finite"),
    (float("nan"), ValueError, "must be finite"),
    ("1024", TypeError, "must be a real number"),
    (None, TypeError, "must be a real number"),
    (True, TypeError, "must be a real number"),
])
def test_a_bad_loss_scale_is_refused_naming_it_and_changes_nothing(name, value, exc, fragment):
    model = make_model()
    opt = FP16_Optimizer(torch.optim.SGD(list(model.parameters()), lr=0.1))
    train(opt, model, 1)
    before = wrapper_picture(opt, model)
    with pytest.raises(exc) as info:
        setattr(opt, name, value)
    assert str(info.value).startswith(name) and fragment in str(info.value)
    assert_tree_bitwise_equal(before, wrapper_picture(opt, model))


# ---- get_lr, clip_master_grads, zero_grad ---------------------------------------------------------------------------


@pytest.mark.parametrize("inner", list(INNER))
def test_get_lr_is_the_first_param_groups_lr_as_in_deepspeed(inner):
    model = make_model()
    params = list(model.parameters())
    opt = FP16_Optimizer(INNER[inner]([{"params": params[:2]}, {"params": params[2:], "lr": 7.0}], lr=0.5))
    assert opt.get_lr() == 0.5
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    train(opt, model, 1)
    sched.step()
    assert opt.get_lr() == 0.25 == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("inner", list(INNER))
def test_clip_master_grads_is_refused_pointing_to_max_grad_norm_and_changes_nothing(inner):
    model = make_model()
    opt = FP16_Optimizer(INNER[inner](list(model.parameters())))
    train(opt, model, 1)
    opt.zero_grad()
    opt.backward(loss_of(model, 5))
    before = wrapper_picture(opt, model)
    with pytest.raises(RuntimeError) as info:
        opt.clip_master_grads(1.0)
    assert "clip_master_grads" in str(info.value) and "max_grad_norm" in str(info.value)
    assert_tree_bitwise_equal(before, wrapper_picture(opt, model))


@pytest.mark.parametrize("inner", list(INNER))
def test_zero_grad_takes_apexs_set_grads_to_none(inner):
    model = make_model()
    opt = FP16_Optimizer(INNER[inner](list(model.parameters())))
    opt.backward(loss_of(model, 0))
    grads = [p.grad for p in model.parameters()]
    opt.zero_grad(set_grads_to_None=False)  # apex's default: zeroed in place
    assert all(p.grad is g and not g.any() for p, g in zip(model.parameters(), grads))
    opt.zero_grad(set_grads_to_None=True)
    assert all(p.grad is None for p in model.parameters())
    opt.backward(loss_of(model, 0))
    opt.zero_grad(True, set_grads_to_None=True)  # (the same value twice)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kwargs, exc, fragment", [
    (dict(set_to_none=True, set_grads_to_None=False), ValueError, "set_to_none=True and set_grads_to_None=False"),
    (dict(set_grads_to_None="True"), TypeError, "set_grads_to_None (apex's name for set_to_none) must be True or "),
    (dict(set_grads_to_None=1), TypeError, "set_grads_to_None (apex's name for set_to_none) must be True or "),
])
def test_a_bad_set_grads_to_none_is_refused_naming_it_and_changes_nothing(kwargs, exc, fragment):
    model = make_model()
    opt = FP16_Optimizer(torch.optim.SGD(list(model.parameters()), lr=0.1))
    opt.backward(loss_of(model, 0))
    before = wrapper_picture(opt, model)
    with pytest.raises(exc) as info:
        opt.zero_grad(**kwargs)
    assert fragment in str(info.value)
    assert_tree_bitwise_equal(before, wrapper_picture(opt, model))


# ---- load_state_dict(..., load_optimizer_states=False) ------------------------------------------------------------


def inner_state(opt):
    """The wrapped optimizer's state without the masters, and its group options."""
    state = {i: {k: v.clone() for k, v in s.items() if k != "master_param"}
             for i, s in enumerate(opt.optimizer.state_dict()["state"].values())}
    return state, [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("trained", [True, False], ids=["trained", "fresh"])
def test_loading_without_optimizer_states_loads_the_scaler_and_masters_only(inner, trained):
    saved_model = make_model(seed=1)
    saved = FP16_Optimizer(INNER[inner](list(saved_model.parameters())), init_scale=2.0**10, growth_interval=2)
    train(saved, saved_model, 5)
    checkpoint = saved.state_dict()
    expected_masters = clone_tree(saved.master_params)

    model = make_model(seed=2)
    opt = FP16_Optimizer(INNER[inner](list(model.parameters()), lr=0.125), init_scale=2.0**10, growth_interval=2)
    if trained:
        train(opt, model, 2, start=20)
    before_state, before_groups = inner_state(opt)
    opt.load_state_dict(checkpoint, load_optimizer_states=False)
    assert_tree_bitwise_equal(clone_tree(saved.scaler.state_dict()), clone_tree(opt.scaler.state_dict()))
    assert_tree_bitwise_equal(expected_masters, clone_tree(opt.master_params))
    for p, master in zip([p for p in model.parameters() if p.dtype == torch.float16], opt.master_params):
        assert torch.equal(p, master.half())  # the model's params are the masters, rounded
    after_state, after_groups = inner_state(opt)
    assert after_groups == before_groups and opt.get_lr() == 0.125  # the optimizer's options stay
    if trained:
        assert_tree_bitwise_equal(before_state, after_state)  # its moments and steps stay
    elif inner == "FusedAdam":  # fresh states hold the masters: step 0 and zero moments, as a first step makes them
        assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in after_state.values())
    else:
        assert not after_state
    train(opt, model, 2, start=30)  # and training goes on


def test_a_fresh_fused_adam_state_that_holds_a_loaded_master_steps_as_a_full_load_with_zero_moments():
    saved_model = make_model(seed=1)
    saved = FP16_Optimizer(FusedAdam(list(saved_model.parameters()), lr=1e-2))
    train(saved, saved_model, 3)
    checkpoint = saved.state_dict()
    zeroed = clone_tree(checkpoint)
    for s in zeroed["optimizer"]["state"].values():
        s["step"].zero_()
        for key in ("exp_avg", "exp_avg_sq"):
            s[key].zero_()
    models, opts = [make_model(seed=2), make_model(seed=2)], []
    for model in models:
        opts.append(FP16_Optimizer(FusedAdam(list(model.parameters()), lr=1e-2)))
    opts[0].load_state_dict(checkpoint, load_optimizer_states=False)
    opts[1].load_state_dict(zeroed)
    for opt, model in zip(opts, models):
        train(opt, model, 2, start=10)
    assert_tree_bitwise_equal(clone_tree(dict(models[1].state_dict())), clone_tree(dict(models[0].state_dict())))
    assert_tree_bitwise_equal(clone_tree(opts[1].master_params), clone_tree(opts[0].master_params))


def test_masters_load_into_a_fresh_fused_adam_under_another_default_device_as_without_it():
    """torch's default device (``with torch.device(...)``) does not change the fresh states that hold the loaded
    masters: under the meta device, where a tensor made without a device has no values, the load gives the state and
    the model it gives outside it, bit for bit."""
    saved_model = make_model(seed=1)
    saved = FP16_Optimizer(FusedAdam(list(saved_model.parameters()), lr=1e-2))
    train(saved, saved_model, 3)
    checkpoint = saved.state_dict()
    models, opts = [make_model(seed=2), make_model(seed=2)], []
    for model, device in zip(models, ("cpu", "meta")):
        opts.append(FP16_Optimizer(FusedAdam(list(model.parameters()), lr=1e-2)))
        with torch.device(device):
            opts[-1].load_state_dict(clone_tree(checkpoint), load_optimizer_states=False)
    assert_tree_bitwise_equal(clone_tree(opts[0].optimizer.state_dict()), clone_tree(opts[1].optimizer.state_dict()))
    assert_tree_bitwise_equal(clone_tree(dict(models[0].state_dict())), clone_tree(dict(models[1].state_dict())))


@pytest.mark.parametrize("inner", list(INNER))
def test_loading_without_optimizer_states_validates_first_and_changes_nothing(inner):
    saved_model = make_model(seed=1)
    saved = FP16_Optimizer(INNER[inner](list(saved_model.parameters())))
    train(saved, saved_model, 2)
    model = make_model(seed=2)
    opt = FP16_Optimizer(INNER[inner](list(model.parameters())))
    train(opt, model, 1)
    before = wrapper_picture(opt, model)
    broken = clone_tree(saved.state_dict())
    if inner == "FusedAdam":
        broken["optimizer"]["state"][0]["master_param"] = torch.zeros(2, 2)
        where = "state_dict['optimizer']['state'][0]['master_param']"
    else:
        broken["master_params"][0] = torch.zeros(2, 2)
        where = "state_dict['master_params'][0]"
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(broken, load_optimizer_states=False)
    assert where in str(info.value)
    with pytest.raises(TypeError, match="load_optimizer_states must be True or False"):
        opt.load_state_dict(saved.state_dict(), load_optimizer_states="False")
    assert_tree_bitwise_equal(before, wrapper_picture(opt, model))
