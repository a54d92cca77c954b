"""The benchmark's floor probes (ops/bench_probes.cpp) do the work they are named for.

A floor probe bounds what any step of its kind could reach on the machine (bench sections lowbit_limit and
mixed_limit); a probe that skipped work would make that bound a lie. So each is checked against a float64
reference of exactly what it claims to compute, over several steps.
"""


import pytest
import torch

from ort_optim import FusedAdam
from ort_optim.bench import probes


@pytest.fixture(scope="module")
def library():
    try:
        return probes.library()
    except probes.ProbeUnavailable as reason:
        pytest.skip(f"the probe library cannot be built here: {reason}")


def linear_code_adam_reference(p, grads, bits, steps, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2):
    """float64 Adam (ADAMW_TORCH) whose moments are stored after every step as linear block-absmax codes: exp_avg
    as round(m / max|m| * L) with L = 127 (8-bit) or 7 (4-bit), sqrt(v) as round(u / max u * U), U = 255 or 15."""
    block, levels_m, levels_u = (256, 127, 255) if bits == 8 else (128, 7, 15)
    p = p.double().clone()
    m = torch.zeros_like(p)
    u = torch.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        g = g.double()
        m = m + (1 - beta1) * (g - m)
        v = u * u * beta2 + (1 - beta2) * g * g
        u = v.sqrt()
        p = p * (1 - lr * wd)
        p = p - lr / (1 - beta1 ** step) * m / (u / (1 - beta2 ** step) ** 0.5 + eps)
        for x, levels in ((m, levels_m), (u, levels_u)):  # what the stored codes decode to next step
            blocks = x.view(-1, block)
            scale = blocks.abs().amax(dim=1, keepdim=True)
            blocks.copy_(torch.where(scale > 0, torch.round(blocks / scale * levels) * scale / levels, 0.0))
    return p


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_lowbit_floor_step_is_an_adam_step_with_linear_block_codes(library, bits):
    generator = torch.Generator().manual_seed(bits)
    numel = 4 * (256 if bits == 8 else 128)
    p = torch.randn(numel, generator=generator)
    grads = [torch.randn(numel, generator=generator) * 1e-2 for _ in range(6)]
    expected = linear_code_adam_reference(p, grads, bits, steps=len(grads))

    param = p.clone()
    floor = probes.LowBitFloorStep([param], bits)
    for g in grads:
        param.grad = None
        floor.grads = [g]
        floor()
    # fp32 arithmetic against float64; a code rounding the other way at a tie moves an element by one level's share
    # of one step (lr x a level / max): far below 1e-5 at lr 1e-3.
    torch.testing.assert_close(param.double(), expected, rtol=0, atol=1e-5)
    assert not torch.equal(param, p)


def test_mixed_floor_step_moves_every_array(library):
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator).half() for n in (1, 1024, 70_000)]  # a tensor beyond one work item
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).half()
    for ahead in (0, 2):
        floor = probes.MixedFloorStep([p.clone() for p in params], prefetch_ahead=ahead)
        for q, p in zip(floor.params, params):
            q.grad = p.grad
        floor.grads = [p.grad for p in params]
        masters = [w.clone() for w in floor.masters]
        floor()
        for q, g, w, new_w, m, v in zip(floor.params, floor.grads, masters, floor.masters, floor.exp_avgs,
                                        floor.exp_avg_sqs):
            expected = w * 0.5 + g.float()
            torch.testing.assert_close(new_w, expected, rtol=0, atol=0)
            torch.testing.assert_close(m, g.float(), rtol=0, atol=0)  # from zeros: 0 * 0.5 + g
            torch.testing.assert_close(v, g.float(), rtol=0, atol=0)
            torch.testing.assert_close(q, expected.half(), rtol=0, atol=0)


def test_validation_floor_lists_each_metadata_line_a_check_reads_once_and_loads_it(library):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((3,), (64, 16), (70,))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    opt = FusedAdam(params, lr=1e-3)
    opt.step()
    floor = probes.ValidationFloor([bucket for _, _, bucket in opt._plan.buckets()], ahead=4)
    listed = floor.listed()
    assert len(set(listed)) == len(listed) and all(line % 64 == 0 for line in listed)
    # every TensorImpl the check reads (param, gradient, moments, step tensor) has the lines of its fields listed:
    # its fields span at least 3 lines from its first one
    for p in params:
        state = opt.state[p]
        for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]):
            address = t._cdata
            assert sum(address - address % 64 <= line < address + 256 for line in listed) >= 3
    assert 12 * len(params) <= len(listed) <= 30 * len(params) + 8
    # and each line given is loaded: the sum of one byte per line (its first). On a buffer of known bytes: the listed
    # lines' first bytes may belong to neighbouring heap objects (refcounts) that move while the test reads them
    buffer = torch.randint(-128, 128, (64 * 50,), dtype=torch.int8, generator=generator)
    assert buffer.data_ptr() % 64 == 0  # (torch's CPU allocator aligns to 64 bytes)
    order = torch.randperm(50, generator=generator).tolist()
    lines = torch.tensor([buffer.data_ptr() + 64 * i for i in order], dtype=torch.int64)
    expected = sum(int(buffer[64 * i]) for i in order)
    assert library.touch_lines(lines, len(order), 4) == expected
    assert library.touch_lines(lines, 10, 4) == sum(int(buffer[64 * i]) for i in order[:10])
    assert floor.counts[0] == len(listed)
    # new gradient tensors: their lines are listed again
    old_grad = params[0].grad._cdata
    params[0].grad = params[0].grad.clone()
    floor.list_lines()
    assert any(params[0].grad._cdata - params[0].grad._cdata % 64 <= line < params[0].grad._cdata + 256
               for line in floor.listed()) and params[0].grad._cdata != old_grad
