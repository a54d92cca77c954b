"""FP16_Optimizer around FusedAdam: what it refuses at construction leaves the FusedAdam as the user built it."""

import copy

import pytest
import torch

from ort_optim import FusedAdam
from ort_optim.fp16_optimizer import FP16_Optimizer


def _bf16_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g).bfloat16()),
            torch.nn.Parameter(torch.randn(3, generator=g).bfloat16())]


def _step(params, opt):
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    opt.step()


def _snapshot(params, opt):
    groups = [({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]]) for g in opt.param_groups]
    return (copy.deepcopy(opt.defaults), copy.deepcopy(groups), copy.deepcopy(opt.state_dict()),
            opt.master_weights, opt.max_grad_norm, [p.detach().clone() for p in params])


@pytest.mark.parametrize("stepped_before", [False, True])
def test_stochastic_rounding_is_refused_up_front_and_the_fused_adam_is_left_as_it_was(stepped_before):
    params = _bf16_params()
    opt = FusedAdam(params, lr=1e-2, stochastic_rounding=True)
    if stepped_before:
        _step(params, opt)
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\] of this FusedAdam has stochastic_rounding=True.*"
                                         r"was not changed"):
        FP16_Optimizer(opt, init_scale=1024.0, max_grad_norm=1.0)
    after = _snapshot(params, opt)
    assert after[:2] == before[:2] and after[3:5] == before[3:5]
    torch.testing.assert_close(after[2], before[2], rtol=0, atol=0)
    torch.testing.assert_close(after[5], before[5], rtol=0, atol=0)
    # The FusedAdam still steps alone, bit for bit as an identical one that was never offered to FP16_Optimizer.
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = FusedAdam(twin_params, lr=1e-2, stochastic_rounding=True)
    twin.load_state_dict(before[2])
    _step(params, opt)
    _step(twin_params, twin)
    torch.testing.assert_close([p.detach() for p in params], [p.detach() for p in twin_params], rtol=0, atol=0)


def test_stochastic_rounding_in_a_later_group_is_refused_naming_it():
    params = _bf16_params()
    opt = FusedAdam([{"params": params[:1]}, {"params": params[1:], "stochastic_rounding": True}], lr=1e-2)
    with pytest.raises(ValueError, match=r"param_groups\[1\] of this FusedAdam has stochastic_rounding=True"):
        FP16_Optimizer(opt)
    assert opt.master_weights is False
    fp16 = FP16_Optimizer(FusedAdam(params[:1], lr=1e-2))  # wrapped: a group added later with it is refused
    with pytest.raises(ValueError, match="stochastic_rounding"):
        fp16.add_param_group({"params": params[1:], "stochastic_rounding": True})
    assert len(fp16.param_groups) == 1
