"""Where FusedAdam's CPU state lives: the moments (and masters) of a bucket's params in one flat buffer per kind, whose
whole 2 MiB pages are advised to be transparent huge pages on Linux before they are first written (ort_optim/_heap.py):
a step streams each of them once, and 4 KiB pages cost a page walk per 4 KiB of each stream. And what it does not keep:
the gradients of a step, which zero_grad(set_to_none=True) frees before the next forward, as with torch's optimizers.
"""

import os
import sys
import weakref

import pytest
import torch

from ort_optim import FusedAdam, _heap


def _vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds address (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                begin, end = (int(x, 16) for x in fields[0].split("-"))
                inside = begin <= address < end
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("numel", [0, 1, 1000, 3 * 2**20 + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_state_buffer_is_zeros_of_its_size_and_dtype(numel, dtype):
    buffer = _heap.zeros(numel, dtype, torch.device("cpu"))
    assert buffer.shape == (numel,) and buffer.dtype == dtype and buffer.device.type == "cpu"
    assert not buffer.any()


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="a Linux kernel with transparent huge pages is needed to take the advice")
def test_the_flat_moment_buffers_are_advised_as_huge_pages():
    params = [torch.nn.Parameter(torch.randn(2**20)) for _ in range(3)]  # 12 MiB per moment buffer
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = FusedAdam(params, lr=1e-3)
    optimizer.step()
    for key in ("exp_avg", "exp_avg_sq"):
        storage = optimizer.state[params[0]][key].untyped_storage()
        assert storage.nbytes() >= 3 * 4 * 2**20  # (one buffer for the three params)
        # the advice is on the buffer's whole 2 MiB pages: one inside it
        inside = -(-storage.data_ptr() // _heap.HUGE_PAGE) * _heap.HUGE_PAGE
        assert "hg" in _vm_flags_of(inside), f"{key}'s buffer was not advised as huge pages"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_huge_pages_do_not_change_the_update():
    torch.manual_seed(0)
    values = [torch.randn(2**20) for _ in range(2)]
    grads = [[torch.randn(2**20) for _ in range(2)] for _ in range(3)]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    optimizers = [FusedAdam(ours, lr=1e-2, adam_w_mode=2, eps=1e-8, weight_decay=1e-2),
                  torch.optim.AdamW(theirs, lr=1e-2, weight_decay=1e-2)]
    for step_grads in grads:
        for params, optimizer in zip((ours, theirs), optimizers):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            optimizer.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # float32: a few ulps over 3 steps


def _state_storage_bytes(opt) -> int:
    """The bytes of every distinct storage that some state tensor of opt is a view of."""
    storages = {}
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("change", ["del state[p]", "a moment replaced"])
def test_the_states_left_in_a_mostly_freed_flat_buffer_move_to_one_of_their_size(change):
    """After del optimizer.state[p] of the largest param (or its moments replaced by tensors of their own), the other
    params' states would keep the whole flat buffer allocated, up to twice the state's memory (torch.optim.AdamW's
    per-param states free it): the next step moves them into a buffer of their own sizes (the same tensors), and
    steps them as an optimizer where nothing changed does, bit for bit."""
    runs = []
    for changed in (False, True):
        gen = torch.Generator().manual_seed(0)
        big = torch.nn.Parameter(torch.randn(1 << 20, generator=gen))
        small = torch.nn.Parameter(torch.randn(1000, generator=gen))
        opt = FusedAdam([big, small], lr=1e-2)
        for p in (big, small):
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        held = opt.state[small]["exp_avg"]
        if changed and change == "del state[p]":
            del opt.state[big]
        elif changed:
            opt.state[big]["exp_avg"] = opt.state[big]["exp_avg"].clone()
            opt.state[big]["exp_avg_sq"] = opt.state[big]["exp_avg_sq"].clone()
        big.grad, small.grad = None, torch.randn(small.shape, generator=gen)
        opt.step()
        assert opt.state[small]["exp_avg"] is held
        runs.append((opt, small))
    (untouched, small_a), (opt, small_b) = runs
    assert opt.state[small_b]["exp_avg"].untyped_storage().nbytes() < 4 * 1000 + 1024
    fresh = FusedAdam([torch.nn.Parameter(torch.zeros(1 << 20)), torch.nn.Parameter(torch.zeros(1000))], lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    assert _state_storage_bytes(opt) <= _state_storage_bytes(fresh) + 1024
    assert torch.equal(small_a, small_b)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(untouched.state[small_a][key], opt.state[small_b][key]), key


@pytest.mark.parametrize("options", [{}, dict(max_grad_norm=1.0), dict(exp_avg_dtype=torch.uint8,
                                                                         exp_avg_sq_dtype=torch.uint8)], ids=str)
def test_after_a_step_zero_grad_frees_the_gradients_as_after_torch_adamws(options, backend):
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 300, 4096)]
    opt = FusedAdam(params, **options)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step(grad_scale=torch.tensor(2.0)) if step else opt.step()
        gradients = [weakref.ref(p.grad) for p in params]
        opt.zero_grad(set_to_none=True)
        assert all(g() is None for g in gradients), f"step {step}: a gradient outlived zero_grad"


@pytest.mark.parametrize("options", [{}, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
                                     dict(step_in_backward=True)], ids=str)
def test_a_deleted_optimizer_frees_its_params_and_states_at_once_as_torch_adamw(options):
    """Without waiting for the garbage collector: optimizer.state holds no reference cycle, so dropping the last
    references to the model and the optimizer frees the params and every state tensor by reference counting, as
    torch.optim.AdamW's (a cycle kept them resident until the collector's next full pass, a model's size per
    optimizer made and dropped)."""
    import gc

    def trained(make):
        model = torch.nn.Linear(8, 4)
        opt = make(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        if not options.get("step_in_backward"):
            opt.step()
        return [weakref.ref(opt), weakref.ref(model.weight)] + [
            weakref.ref(t) for state in opt.state.values() for t in state.values()]

    enabled = gc.isenabled()
    trained(lambda params: FusedAdam(params, **options))  # (first use: imports and caches outside the check)
    gc.collect()
    gc.disable()
    try:
        anchor = trained(lambda params: torch.optim.AdamW(params))
        ours = trained(lambda params: FusedAdam(params, **options))
        assert all(ref() is None for ref in anchor)
        alive = [i for i, ref in enumerate(ours) if ref() is not None]
        assert not alive, f"alive until the garbage collector runs: {alive} (0: the optimizer, 1: a param)"
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("step_in_backward", [False, True], ids=["step()", "step_in_backward"])
@pytest.mark.parametrize("change", ["del state[p]", "a moment replaced", "converted by loading its own checkpoint"])
def test_a_state_the_user_drops_is_freed_at_once_as_torch_adamws(change, step_in_backward, backend):
    """The step's cache holds the state tensors it was built for; a change of optimizer.state releases it, so that
    what the change dropped is freed then, as torch.optim.AdamW's states are, not at the next step (which a frozen
    param, or a frozen model converted to smaller moments, never takes). The next step plans again and trains on."""
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]
    opt = FusedAdam(params, lr=1e-2, step_in_backward=step_in_backward)

    def train_step():
        if step_in_backward:
            sum((p * p).sum() for p in params).backward()
        else:
            for p in params:
                p.grad = torch.randn(p.shape)
            opt.step()

    for _ in range(2):
        train_step()
        opt.zero_grad()
    dropped = [weakref.ref(opt.state[params[0]][key]) for key in ("exp_avg", "exp_avg_sq")]
    if change == "del state[p]":
        del opt.state[params[0]]
        dropped += [weakref.ref(opt.state[params[1]]["exp_avg"])]  # (the flat buffer both shared, views of it)
        opt.state[params[1]]["exp_avg"] = opt.state[params[1]]["exp_avg"].clone()
        opt.state[params[1]]["exp_avg_sq"] = opt.state[params[1]]["exp_avg_sq"].clone()
    elif change == "a moment replaced":
        for p in params:
            opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()
            opt.state[p]["exp_avg_sq"] = opt.state[p]["exp_avg_sq"].clone()
    else:
        opt.exp_avg_dtype = opt.exp_avg_sq_dtype = torch.uint8
        opt.load_state_dict(opt.state_dict())
    assert all(ref() is None for ref in dropped), "a dropped state tensor is still held"
    before = [p.detach().clone() for p in params]
    train_step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
