"""FusedAdam's steps with other Python threads running, as a specification.

Torch runs the methods of the native step cache (``backends.TensorWatch`` and ``backends.AdamPlan``, ops/README.md)
with the GIL released, so another Python thread runs while they check and step: a DataLoader's pin-memory thread, a
logger, or any thread of a free-threaded CPython. The step cache holds no Python object and reads nothing that it does
not hold or that the step's caller does not vouch for (each param's TensorImpl, read under the GIL at every check),
so memory that another thread frees and allocates again cannot pass for what the cache planned.

The specification: steps taken while another thread allocates and frees tensors in a loop, replaces the gradients of
other tensors and gives other tensors new memory (``.data =``) give, bit for bit, what the same steps give without
that thread, and the params torch.optim.AdamW gives for the same steps. Between steps the training thread itself does
what forces the cache to notice freed or moved objects: new gradient tensors at every step (the old ones freed), a param
given new memory (``.data =``, its old storage freed), a param swapped for another tensor (``torch.utils.swap_tensors``)
with the TensorImpl it had freed right after, a param swapped with the TensorImpl it had kept alive, gradient and all,
by the other tensor (a cache that kept reading that TensorImpl would step the other tensor instead of the param), a
moment given new memory. Every backend (the native CPU plans, the pure-PyTorch reference,
and with ``ORT_OPTIM_BACKEND=triton`` the Triton kernels, whose buckets the native watch checks where the library is
loaded), the reference backend's in the fast tier too: its buckets are the ones here that the native watch
(``TensorWatch``, the cache of every step off the native CPU plans, CUDA's included) checks.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

import pytest
import torch
from conftest import assert_tree_bitwise_equal, run_python

from ort_optim import AdamWMode, FusedAdam, backends

STEPS = 12
SHAPES = [(64,), (16, 8), (3,), (128,)] * 24  # many small params: a check long enough for the other thread to run


def _grads(seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(STEPS)]


def _churn(stop: threading.Event, others: list[torch.Tensor]) -> None:
    """Another thread's work: tensors allocated and freed (TensorImpls, storages and Python objects of the sizes the
    training thread frees), gradients of other tensors replaced, other tensors given new memory."""
    while not stop.is_set():
        for k, other in enumerate(others):
            scratch = [torch.empty(shape) for shape in SHAPES[k % 4::4][:8]]
            other.grad = torch.full_like(other, float(k))
            other.data = torch.zeros_like(other)
            del scratch


def _train(optimizer_class, grads: list[list[torch.Tensor]], with_thread: bool) -> dict:
    """STEPS steps over fresh params, with the training thread's own changes between them (module docstring);
    returns the params and the optimizer's state."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    opt = optimizer_class(params, lr=1e-2, weight_decay=1e-2)
    stop = threading.Event()
    others = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES[:16]]
    thread = threading.Thread(target=_churn, args=(stop, others), daemon=True)
    kept = []  # the tensors that hold what swapped params had
    interval = sys.getswitchinterval()
    if with_thread:
        sys.setswitchinterval(1e-5)  # (hand the GIL over often: the threads interleave within a step)
        thread.start()
    try:
        for step in range(STEPS):
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()  # (a new tensor at every step: the last one's memory is freed)
            if step % 4 == 1:
                p = params[step]
                p.data = p.detach().clone()  # new memory; the old storage is freed
            if step % 4 == 2:
                p = params[step]
                replacement = torch.nn.Parameter(p.detach() * 1.0)
                torch.utils.swap_tensors(p, replacement)  # p gets another TensorImpl ...
                del replacement  # ... and the one it had is freed
                p.grad = grads[step][step].clone()
            if step % 4 == 0 and step > 0:
                p = params[step]
                replacement = torch.nn.Parameter(p.detach() * 1.0)
                torch.utils.swap_tensors(p, replacement)  # p gets another TensorImpl; the one it had, with its
                kept.append(replacement)  # gradient, lives on in the replacement
                p.grad = grads[step][step].clone()
            if step % 4 == 3 and isinstance(opt, FusedAdam):
                state = opt.state[params[step]]
                state["exp_avg"].data = state["exp_avg"].clone()  # a moment given new memory
            opt.step()
    finally:
        stop.set()
        if with_thread:
            thread.join()
        sys.setswitchinterval(interval)
    return {"params": [p.detach().clone() for p in params],
            "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in params]}


def _fused_adam(params, **options) -> FusedAdam:
    return FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, **options)  # (torch's AdamW)


def _assert_torch_adamw_steps(run: dict, grads: list[list[torch.Tensor]]) -> None:
    reference = _train(torch.optim.AdamW, grads, with_thread=False)
    for i, (p, expected) in enumerate(zip(run["params"], reference["params"])):
        # (float32 rounding: the update's operations in another order than torch's)
        torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"params[{i}] vs AdamW: {m}")


def test_steps_over_params_given_new_memory_or_swapped_are_torch_adamw_steps(backend):
    grads = _grads(seed=1)
    _assert_torch_adamw_steps(_train(_fused_adam, grads, with_thread=False), grads)


def test_steps_with_another_thread_freeing_and_allocating_tensors_are_bit_for_bit_the_steps_without(backend):
    grads = _grads(seed=1)
    alone = _train(_fused_adam, grads, with_thread=False)
    _assert_torch_adamw_steps(alone, grads)  # (so that "the same" cannot mean "equally wrong")
    for _ in range(3):  # (the interleaving differs from run to run: several chances to read what was freed)
        assert_tree_bitwise_equal(_train(_fused_adam, grads, with_thread=True), alone, "with another thread")


FIRST_STEPS_IN_THREADS = """
import json, sys, threading, time, warnings
import torch
from ort_optim import FusedAdam, backends
from ort_optim.backends import native

load = native._load_or_build
native._load_or_build = lambda *args, **kwargs: (time.sleep(0.2), load(*args, **kwargs))[1]  # (the loads overlap)

warnings.simplefilter("always")
barrier, planned = threading.Barrier(8), []
with warnings.catch_warnings(record=True) as caught:
    def first_step():
        p = torch.nn.Parameter(torch.randn(100))
        opt = FusedAdam([p], lr=1e-2)
        p.grad = torch.ones(100)
        barrier.wait()
        opt.step()
        planned.append(opt._plan.groups[0].buckets[0].native is not None)
    threads = [threading.Thread(target=first_step) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(json.dumps(dict(native=backends.native_available(), planned=planned,
                      warnings=[str(w.message) for w in caught])))
"""


@pytest.mark.skipif(not backends.native_available(), reason="the native library is not loaded in this environment")
def test_first_steps_taken_in_several_threads_at_once_load_the_native_library_once(tmp_path):
    """The first step loads the library and registers its ops' fake and CUDA kernels; two threads doing that at once
    registered twice, which raised, and the library then counted as unavailable for the whole process. (In a fresh
    process, the library's loading slowed down so that the threads' first steps overlap.)"""
    result = run_python(sys.executable, FIRST_STEPS_IN_THREADS, tmp_path)
    assert result == dict(native=True, planned=[True] * 8, warnings=[]), result


# ---- other threads that touch the params being stepped ----------------------------------------------------------------
# A step holds the params and gradients it checked until its kernel is done: a gradient another thread replaces stays
# alive until the step no longer reads it. Nothing is held between steps. The scenario races for a second in a process
# of its own (a use after free would crash it, or corrupt the other thread's fresh tensors). Not specified: another
# thread's torch.utils.swap_tensors of a param being stepped (its check of the param's holders and its swap are not
# one atomic action, so a step can take the param in between: a race that torch does not guard either).

RACE = """
import faulthandler, json, sys, threading, time
faulthandler.enable()
sys.setswitchinterval(1e-5)
import torch
from ort_optim import FusedAdam
torch.set_num_threads(1)
N = 16384
params = [torch.nn.Parameter(torch.randn(N)) for _ in range(16)]
opt = FusedAdam(params, lr=1e-3)
for p in params:
    p.grad = torch.ones(N)
stop, counts = threading.Event(), dict(steps=0, changes=0, canaries_overwritten=0)

def stepper():
    while not stop.is_set():
        opt.step(grad_scale=torch.tensor(8.0))  # (unscaled gradients are written back: a freed one would be written)
        counts["steps"] += 1

def replacer():
    canaries = []
    while not stop.is_set():
        for p in params:
            p.grad = torch.ones(N)  # (the old gradient released here)
            canaries.append(torch.full((N,), 3.0))  # (fresh tensors, likely where a freed gradient was)
            counts["changes"] += 1
        if len(canaries) > 256:
            counts["canaries_overwritten"] += sum(int(not bool((c == 3.0).all())) for c in canaries)
            canaries.clear()

threads = [threading.Thread(target=stepper), threading.Thread(target=replacer)]
for t in threads:
    t.start()
time.sleep(1.0)
stop.set()
for t in threads:
    t.join()
counts["finite"] = all(bool(p.isfinite().all()) for p in params)
print(json.dumps(counts))
"""


@pytest.mark.slow
def test_another_thread_replacing_gradients_during_steps_frees_nothing_a_step_reads(tmp_path):
    result = run_python(sys.executable, RACE, tmp_path)
    assert result["steps"] > 0 and result["changes"] > 0, result
    assert result["canaries_overwritten"] == 0 and result["finite"], result


def test_steps_of_one_optimizer_called_from_two_threads_run_one_after_the_other():
    """The steps of one optimizer from several threads at once are those steps taken one after the other (the
    gradients do not change, so any order gives the same params)."""
    def run(threads: int, steps: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        opt = FusedAdam(params, lr=1e-2, weight_decay=1e-2, max_grad_norm=1.0)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        try:
            workers = [threading.Thread(target=lambda: [opt.step() for _ in range(steps)]) for _ in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            sys.setswitchinterval(switch)
        return [p.detach().clone() for p in params] + [opt.state[params[0]]["step"].clone()]

    assert_tree_bitwise_equal(run(threads=2, steps=25), run(threads=1, steps=50), "two threads against one")


@pytest.mark.parametrize("when", ["after a partial check", "in the kernel"])
def test_a_step_that_raises_holds_no_param_or_gradient_afterwards(when, backend):
    """What a step's checks hold is given back on every way out: the refused step's params can be swapped and their
    gradients freed, as after a step that succeeded."""
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = FusedAdam([{"params": [a]}, {"params": [b]}], lr=1e-3)
    for p in (a, b):
        p.grad = torch.ones(8)
    opt.step(grad_scale=torch.tensor(2.0))
    if when == "after a partial check":
        b.data = torch.randn(8)  # (the first group's check passes, the second's fails: then the scale is refused)
    with pytest.raises(ValueError, match="grad_scale"):
        opt.step(grad_scale=torch.tensor(0.0))
    gradient = weakref.ref(a.grad)
    opt.zero_grad(set_to_none=True)
    assert gradient() is None
    torch.utils.swap_tensors(a, torch.nn.Parameter(torch.randn(8)))


FORK_DURING_A_STEP = """
import json, os, signal, threading, time
import torch
from ort_optim import FusedAdam
torch.set_num_threads(1)
params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(4)]
opt = FusedAdam(params, lr=1e-3)
for p in params:
    p.grad = torch.ones_like(p)
stop, taken = threading.Event(), []
def stepper():
    while not stop.is_set():
        opt.step()
        taken.append(1)
thread = threading.Thread(target=stepper)
thread.start()
while len(taken) < 2:
    time.sleep(0.01)
statuses = []
for _ in range(4):  # (forks at different points of the other thread's steps, most of them inside one)
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # (a child whose step never returns ends here)
        opt.step()
        os._exit(0)
    statuses.append(os.waitpid(pid, 0)[1])
    time.sleep(0.003)
stop.set()
thread.join()
print(json.dumps(dict(statuses=statuses)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is not available on this platform")
def test_a_child_forked_while_another_thread_steps_takes_steps_of_its_own(tmp_path):
    """os.fork (multiprocessing's "fork" start method) copies the optimizer into the child as it is, a step of
    another thread included, which never ends there: the child's own steps run, as torch.optim.AdamW's do, instead
    of waiting forever for that step."""
    assert run_python(sys.executable, FORK_DURING_A_STEP, tmp_path) == dict(statuses=[0] * 4)


FORK_WHILE_ANOTHER_THREAD_HOLDS_THE_MODULE_LOCKS = """
import json, os, signal, threading
import torch
import ort_optim
from ort_optim import FusedAdam, backends
from ort_optim.backends import triton as triton_backend
torch.set_num_threads(1)
unloaded = backends._native_loaded is None  # (so the child's first step loads the library, under the lock)
held, release = threading.Event(), threading.Event()
def first_use():  # (as a thread that loads the native library and fills the Triton caches, stopped at the fork)
    with backends._native_loading, triton_backend._lock:
        held.set()
        release.wait()
thread = threading.Thread(target=first_use)
thread.start()
held.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # (a child that waits for a lock held by a thread it does not have ends here)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    FusedAdam([p]).step()
    ort_optim.native_available()
    triton_backend.clear_caches()
    os._exit(0 if p[0] < 1 else 1)
status = os.waitpid(pid, 0)[1]
release.set()
thread.join()
print(json.dumps(dict(unloaded=unloaded, status=status)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is not available on this platform")
def test_a_child_forked_while_another_thread_holds_the_backends_locks_loads_and_steps(tmp_path):
    """The backends' own locks (the native library's first load, the Triton backend's caches) are made anew in a
    forked child too: held by another thread of the parent at the fork, they do not keep the child's first step,
    its load of the library or its Triton caches waiting forever."""
    assert run_python(sys.executable, FORK_WHILE_ANOTHER_THREAD_HOLDS_THE_MODULE_LOCKS, tmp_path) == dict(
        unloaded=True, status=0)
