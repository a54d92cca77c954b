"""FusedAdam under torch.compile: a compiled step traces to the registered op (one node per bucket), adds no graph
break and no recompile over many steps with schedulers and loss scaling, and computes what the eager step computes;
any drawn configuration (param and moment dtypes, master weights, options, clipping, gradients with inf and NaN)
compiles without a break and steps as eager, bit for bit (a property).

Counts come from torch._dynamo.utils.counters after torch._dynamo.reset(): ``graph_break`` (every break, with its
reason) and ``stats.unique_graphs``. Each count is compared with torch.optim.AdamW's in the same harness: the harness
itself breaks where any optimizer does (``optimizer.step`` is wrapped by torch.optim's hooks, which TorchDynamo
skips, tracing the step's own frame instead). The counts need torch >= 2.13; on older torch step() runs outside the
graph (the docstring of ort_optim.FusedAdam says so), and the last test checks the result on every torch."""

from __future__ import annotations

import re
import weakref

import pytest
import torch
from cases import Configuration, configurations, gradient, gradients
from conftest import (assert_bitwise_equal, assert_same_history, assert_tree_bitwise_equal, fuzz_examples,
                      optimizer_snapshot, select_backend)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ort_optim import AdamWMode, FusedAdam, backends
from ort_optim import fused_adam as fused_adam_module
from ort_optim.fp16_optimizer import FP16_Optimizer

NEWEST = pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                            reason="a FusedAdam step takes its traced route on torch >= 2.13 (best effort before)")
pytestmark = [
    pytest.mark.skipif(not backends.native_available(), reason="the compiled step calls the native library's op"),
]

STEPS = 40

# A compiled-step test traces the step and compiles it with Inductor (2-4 s each): where a test runs over several
# cases, the fast tier runs one or two that between them reach what the test specifies, and the slow tier (which
# `make test` runs) the others, marked LATER.
LATER = pytest.mark.slow


def later(*values) -> list:
    """Cases of a parametrized test for the slow tier only: a tuple is one case's arguments."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=LATER) for v in values]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])


def _groups(model: torch.nn.Module) -> list[dict]:
    """Two groups with their own weight decay (per-group options)."""
    params = list(model.parameters())
    return [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]


def _adamw(model):
    return torch.optim.AdamW(_groups(model), lr=torch.tensor(1e-2))


def _fused(model):
    return FusedAdam(_groups(model), lr=torch.tensor(1e-2), adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8)


def _lambda_lr(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1.0 + 0.1 * i))


def _grads(model: torch.nn.Module, step: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def _eager_then_compiled(make_optimizer):
    """(model, optimizer, step) for the eager step, then for the compiled one, each over a fresh _model() and
    make_optimizer(model), TorchDynamo reset before each."""
    for compiled in (False, True):
        model = _model()
        opt = make_optimizer(model)
        torch._dynamo.reset()
        yield model, opt, (torch.compile(lambda opt=opt: opt.step()) if compiled else (lambda opt=opt: opt.step()))


def _run(make_opt, make_scheduler, compiled: bool, step_kwargs=lambda: {}, grad_scale: float = 1.0,
         wrap=lambda opt: opt, schedule_wrapper: bool = False):
    """STEPS steps of (gradients set eagerly, then the optimizer's step compiled or not, then the scheduler, of the
    optimizer or, with schedule_wrapper, of the wrapper around it); returns the params, (graph breaks, unique
    graphs)."""
    model = _model()
    opt = make_opt(model)
    scheduler = None if schedule_wrapper else make_scheduler(opt)
    stepper = wrap(opt)
    if schedule_wrapper:
        scheduler = make_scheduler(stepper)
    kwargs = step_kwargs()

    def step():
        stepper.step(**kwargs)

    run = torch.compile(step) if compiled else step
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    for i in range(STEPS):
        _grads(model, i, grad_scale)
        run()
        if scheduler is not None:
            scheduler.step()
    counts = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
    return [p.detach().clone() for p in model.parameters()], counts, opt


@pytest.mark.slow
@NEWEST
def test_a_compiled_step_with_a_tensor_lr_scheduler_and_per_group_decay_has_torch_adamws_breaks_and_graphs():
    _, theirs, _ = _run(_adamw, _lambda_lr, compiled=True)
    _, ours, _ = _run(_fused, _lambda_lr, compiled=True)
    assert ours[1] == 1, f"FusedAdam's step compiled to {ours[1]} graphs over {STEPS} steps (recompiles)"
    assert ours[0] <= theirs[0] and ours[1] <= theirs[1], f"FusedAdam {ours} vs torch.optim.AdamW {theirs}"


@NEWEST
def test_a_compiled_step_computes_what_the_eager_step_computes():
    eager, _, _ = _run(_fused, _lambda_lr, compiled=False)
    compiled, _, _ = _run(_fused, _lambda_lr, compiled=True)
    for a, b in zip(compiled, eager):
        assert_bitwise_equal(a, b, "param")


@NEWEST
@pytest.mark.parametrize("shape", [(), pytest.param((1, 1), marks=LATER)], ids=["0-dim", "1x1"])
def test_tensor_betas_and_lr_of_any_one_element_shape_compile_without_breaks_and_step_as_eager(shape):
    # (a tensor beta once was read on the host inside the traced step: a graph break per step)
    def make(model, tensors=True):
        betas = (torch.tensor(0.8).reshape(shape), torch.tensor(0.99).reshape(shape)) if tensors else (0.8, 0.99)
        return FusedAdam(_groups(model), lr=torch.tensor(1e-2).reshape(shape), adam_w_mode=AdamWMode.ADAMW_TORCH,
                         betas=betas)

    eager, _, _ = _run(make, _lambda_lr, compiled=False)
    compiled, counts, _ = _run(make, _lambda_lr, compiled=True)
    _, float_counts, _ = _run(lambda model: make(model, tensors=False), _lambda_lr, compiled=True)
    assert counts == float_counts and counts[1] == 1, (counts, float_counts)  # (the scheduler's own break aside)
    for a, b in zip(compiled, eager):
        assert_bitwise_equal(a, b, "param")


@NEWEST
def test_a_compiled_step_with_a_grad_scale_and_non_contiguous_gradients_matches_eager_without_breaks():
    """channels_last convolutions and transposed weights have gradients with other strides; unscaled in place, they
    are checked for self-overlap first, a host read that a traced step cannot make (it split the graph, and
    TorchDynamo's restarted analysis then raised SpeculationLogDivergence): the check runs in _init_group."""
    runs = []
    for compiled in (False, True):
        model = _model()
        opt = _fused(model)
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        step = torch.compile(lambda: opt.step(grad_scale=torch.tensor(1024.0))) if compiled else (
            lambda: opt.step(grad_scale=torch.tensor(1024.0)))
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            for p in model.parameters():  # (transposed storage: non-contiguous for the 2-d weights)
                p.grad = (torch.randn(tuple(reversed(p.shape)), generator=g) * 1024).t() if p.dim() == 2 else \
                    torch.randn(p.shape, generator=g) * 1024
            step()
        runs.append(([p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()],
                     sum(counters["graph_break"].values())))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert_bitwise_equal(a, b, "param or unscaled gradient")
    assert runs[1][1] == 0, f"{runs[1][1]} graph breaks"


@NEWEST
def test_the_traced_graph_calls_the_registered_op():
    model = _model()
    opt = _fused(model)
    _grads(model, 0)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda: opt.step(), backend=backend)()
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert sum("ort_optim.adam_step_" in t for t in targets) == 2, targets  # one per bucket (two groups)


@NEWEST
def test_a_compiled_step_with_a_grad_scale_tensor_unscales_and_matches_eager():
    kwargs = lambda: {"grad_scale": torch.tensor(1024.0)}  # noqa: E731
    eager, _, eager_opt = _run(_fused, _lambda_lr, compiled=False, step_kwargs=kwargs, grad_scale=1024.0)
    compiled, counts, opt = _run(_fused, _lambda_lr, compiled=True, step_kwargs=kwargs, grad_scale=1024.0)
    _, theirs, _ = _run(_adamw, _lambda_lr, compiled=True)
    assert counts[1] == 1 and counts[0] <= theirs[0], f"FusedAdam {counts} vs torch.optim.AdamW {theirs}"
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(opt.last_grad_norm, eager_opt.last_grad_norm)


@NEWEST
def test_a_float_grad_scale_changed_every_step_compiles_without_breaks_and_steps_as_eager():
    """A float grad_scale goes into the graph as a float64 tensor made there (as a float lr does), so a new value at
    every step is a graph input: no break, at most the one recompile of automatic dynamic; the bits of the eager
    steps. A value the step cannot unscale by is refused by the op, nothing written."""
    def run(compiled):
        model = _model()
        opt = _fused(model)
        step = torch.compile(lambda s: opt.step(grad_scale=s)) if compiled else (lambda s: opt.step(grad_scale=s))
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        for i in range(12):
            scale = 2.0 ** (i % 5) * 3.0  # (not all powers of two: the unscaling's rounding counts)
            _grads(model, i, scale)
            step(scale)
        return model, opt, step, (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])

    eager_model, eager_opt, _, _ = run(compiled=False)
    model, opt, step, (breaks, graphs) = run(compiled=True)
    assert breaks == 0 and graphs <= 2, (breaks, graphs)
    assert_tree_bitwise_equal(optimizer_snapshot(opt, report=True), optimizer_snapshot(eager_opt, report=True),
                              "optimizer")
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), "param")
    _grads(model, 12)
    before = optimizer_snapshot(opt, report=True)
    with pytest.raises(ValueError, match=r"grad_scale must be finite and non-zero, got 0"):
        step(1e-50)  # (0 in float32)
    assert_tree_bitwise_equal(optimizer_snapshot(opt, report=True), before, "optimizer")


@NEWEST
def test_a_compiled_step_with_max_grad_norm_clips_as_eager():
    def make(model):
        return FusedAdam(_groups(model), lr=torch.tensor(1e-2), max_grad_norm=0.5)

    eager, _, _ = _run(make, _lambda_lr, compiled=False)
    compiled, counts, _ = _run(make, _lambda_lr, compiled=True)
    assert counts[1] == 1, counts
    for a, b in zip(compiled, eager):  # (the clip coefficient's square root is correctly rounded in both)
        assert_bitwise_equal(a, b, "param")


def _one_cycle(opt):
    """Changes lr and beta1 at every step: OneCycleLR(cycle_momentum=True) writes a new (float beta1, beta2) tuple
    into each group, and a new lr (a float; a tensor lr is filled in place)."""
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=2 * STEPS, cycle_momentum=True)


@pytest.mark.slow
@NEWEST
@pytest.mark.parametrize("lr", ["float-lr", "tensor-lr"])
def test_a_compiled_step_under_one_cycle_lr_with_momentum_compiles_at_most_twice_and_matches_eager(lr):
    """The float lr and beta1 that OneCycleLR changes at every step reach the op as tensors (betas_tensor,
    lr_tensor): TorchDynamo's automatic dynamic makes them graph inputs after their first change, which costs the one
    recompile; then the same graph serves every step. torch.optim.AdamW in the same harness reaches TorchDynamo's
    recompile limit (a graph per value) and steps eagerly after it."""

    def make(cls):
        def opt(model):
            rate = 1e-2 if lr == "float-lr" else torch.tensor(1e-2)
            if cls is FusedAdam:
                return FusedAdam(_groups(model), lr=rate, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8)
            return torch.optim.AdamW(_groups(model), lr=rate)
        return opt

    eager, _, eager_opt = _run(make(FusedAdam), _one_cycle, compiled=False)
    compiled, ours, opt = _run(make(FusedAdam), _one_cycle, compiled=True)
    _, theirs, _ = _run(make(torch.optim.AdamW), _one_cycle, compiled=True)
    assert eager_opt.param_groups[0]["betas"][0] != 0.95, "OneCycleLR changed beta1"
    assert ours[1] <= 2, f"FusedAdam's step compiled to {ours[1]} graphs over {STEPS} steps (recompiles)"
    assert ours[0] <= theirs[0] and ours[1] <= theirs[1], f"FusedAdam {ours} vs torch.optim.AdamW {theirs}"
    for a, b in zip(compiled, eager):
        assert_bitwise_equal(a, b, "param")
    for p, q in zip(opt.state, eager_opt.state):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(opt.state[p][key], eager_opt.state[q][key], key)


@NEWEST
@pytest.mark.parametrize("lr", ["float-lr", pytest.param("tensor-lr", marks=LATER)])
def test_a_compiled_step_after_a_refused_one_steps_and_computes_what_the_eager_steps_compute(lr, monkeypatch):
    """A step refused for an option (a negative lr), then the option set back: the next compiled step steps, and
    every step computes what the eager steps compute. With cold caches, TorchDynamo compiles that step twice over
    (the lr guard failed, then an analysis restarted for the float lr): the plan's version marks must read the same
    both times (ints read as constants, then as symbols, took another path: SpeculationLogDivergence)."""
    monkeypatch.setattr(torch.compiler.config, "force_disable_caches", True)

    def lr_of(value):
        return value if lr == "float-lr" else torch.tensor(value)

    results = []
    for compiled in (False, True):
        model = _model()
        opt = FusedAdam(model.parameters(), lr=lr_of(1e-2))
        step = torch.compile(lambda: opt.step()) if compiled else (lambda: opt.step())
        torch._dynamo.reset()
        opt.param_groups[0]["lr"] = lr_of(-1e-2)
        _grads(model, 0)
        with pytest.raises(ValueError, match=r"param_groups\[0\]: lr must be >= 0"):
            step()
        assert not opt.state
        opt.param_groups[0]["lr"] = lr_of(1e-2)
        for i in range(1, 6):
            _grads(model, i)
            step()
        results.append([p.detach().clone() for p in model.parameters()])
    for compiled_param, eager_param in zip(results[1], results[0]):
        assert_bitwise_equal(compiled_param, eager_param, "param")


@NEWEST
@pytest.mark.parametrize("assignment", ["exp_avg zeroed", *later("step set", "step set to a number",
                                        "step updated to a number", "a state dict with a number step", "update()"),
                                        "a bad shape"])
def test_state_assigned_between_compiled_steps_is_stepped_or_refused_as_eager(assignment):
    """Tensors assigned to optimizer.state[p] between compiled steps become the state from then on (the step traces
    again, as torch.optim.AdamW's does), or are refused with the eager error, nothing written. A step count given as
    a number is held as a float64 tensor (TorchDynamo reads every state's step as a tensor before the step runs)."""

    def assign(state, p):
        if assignment == "exp_avg zeroed":
            state["exp_avg"] = torch.zeros_like(p)
        elif assignment == "step set":
            state["step"] = torch.tensor(10.0)
        elif assignment == "step set to a number":
            state["step"] = 10
        elif assignment == "step updated to a number":
            state.update(step=10)
        elif assignment == "a state dict with a number step":
            opt.state[p] = {**state, "step": 10}
        elif assignment == "update()":
            state.update(exp_avg_sq=torch.ones_like(p))
        else:
            state["exp_avg"] = torch.zeros(3)

    results = []
    for model, opt, step in _eager_then_compiled(lambda model: FusedAdam(model.parameters(), lr=1e-2)):
        outcome = []
        for i in range(4):
            _grads(model, i)
            if i == 2:
                assign(opt.state[next(model.parameters())], next(model.parameters()))
            try:
                step()
            except ValueError as error:
                outcome.append(str(error))
        results.append((optimizer_snapshot(opt), outcome))
    (eager, eager_errors), (compiled, compiled_errors) = results
    assert compiled_errors == eager_errors and bool(eager_errors) == (assignment == "a bad shape")
    assert_tree_bitwise_equal(compiled, eager, "compiled vs eager")


@NEWEST
def test_compiled_graphs_stay_valid_across_options_switched_back():
    """An option switched back to a value already compiled for reuses the graph compiled before, as
    torch.optim.AdamW's compiled step does: no recompile at each switch (until TorchDynamo's limit, after which the
    step would run eagerly), and the eager step's results. (TorchDynamo puts every state's step count back at each
    trace: the same object put back is no mutation of the state.)"""

    def run(compiled):
        model = _model()
        opt = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        for i in range(12):
            _grads(model, i)
            opt.param_groups[0]["eps"] = (1e-8, 1e-6)[i % 2]
            step()
        return optimizer_snapshot(opt), counters["stats"]["unique_graphs"]

    (eager, _), (compiled, graphs) = run(False), run(True)
    assert graphs == 2, f"{graphs} graphs over 12 steps"
    assert_tree_bitwise_equal(compiled, eager, "compiled vs eager")


@NEWEST
def test_eager_steps_between_compiled_steps_keep_the_compiled_graph_valid():
    """An eager step() between compiled steps steps through the plan the compiled step made (the op, as the graph
    calls it), so the next compiled step reuses its graph: alternating the two traces once, as a compiled step alone
    does (a plan made again for the eager step would fail the graph's guards: a recompile at every switch, up to the
    limit), with the eager step's results, bit for bit."""

    def run(mode):
        model = _model()
        opt = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.01)
        compiled = torch.compile(opt.step, backend="aot_eager")
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        for i in range(12):
            _grads(model, i)
            (opt.step if mode == "eager" or (mode == "alternating" and i % 2) else compiled)()
        return optimizer_snapshot(opt), counters["stats"]["unique_graphs"]

    (eager, _), (alternating, graphs), (_, compiled_graphs) = run("eager"), run("alternating"), run("compiled")
    assert graphs == compiled_graphs == 1, f"{graphs} graphs alternating, {compiled_graphs} compiled alone"
    assert_tree_bitwise_equal(alternating, eager, "alternating vs eager")


@NEWEST
def test_eager_steps_after_compiled_ones_plan_natively_again_from_the_fourth_in_a_row():
    """Eager steps with no compiled step between them go back to native plans (which read the gradients in C++ and
    report a plain step's norm) from the fourth in a row on; the three before step through the compiled step's plan
    (the op: a plain step's last_grad_norm None, as a compiled step's)."""
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    compiled = torch.compile(opt.step, backend="aot_eager")
    torch._dynamo.reset()
    _grads(model, 0)
    compiled()
    norms = []
    for i in range(1, 6):
        _grads(model, i)
        opt.step()
        norms.append(opt.last_grad_norm is not None)
    assert norms == [False, False, False, True, True]
    assert opt._plan.native


@NEWEST
@pytest.mark.parametrize("case", ["expanded gradient, grad_scale tensor", *later("capturable, grad_scale number")])
def test_a_first_compiled_step_refused_as_eager_creates_no_state(case):
    """A first step refused by a check that depends on step()'s arguments: the eager ValueError, and no state created
    (the traced step's planning runs before the graph, so these checks run before it plans)."""
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2, capturable=case.startswith("capturable"))
    step = torch.compile(lambda scale: opt.step(grad_scale=scale))
    torch._dynamo.reset()
    _grads(model, 0)
    if case.startswith("expanded"):
        first = next(model.parameters())
        first.grad = torch.ones(1).expand(first.shape)
        scale, message = torch.tensor(4.0), r"'s grad overlaps itself \(an expand\(\)ed tensor\)"
    else:
        scale, message = 4.0, r"capturable=True: pass grad_scale as a tensor"
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=message):
        step(scale)
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")
    assert not opt.state


@NEWEST
def test_a_compiled_train_step_lets_its_model_and_states_go_when_they_are_deleted():
    """The compiled graph holds the optimizer's static tensors (states, params) as attributes, and the calling module's
    globals hold the graph for the rest of the process: deleting the model and the optimizer frees them all the same,
    as for torch.optim.AdamW (each traced graph drops them when the optimizer dies)."""
    import gc
    import weakref

    def one_run():
        model = _model()
        opt = FusedAdam(model.parameters(), lr=1e-2)
        x = torch.randn(3, 16)

        def train_step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        step = torch.compile(train_step)
        for _ in range(2):
            step()
        first = next(model.parameters())
        return weakref.ref(first), weakref.ref(opt.state[first]["exp_avg"]), weakref.ref(opt)

    torch._dynamo.reset()
    refs = one_run()
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True], "param, exp_avg, optimizer still alive"


def _numpy_lr(kind):
    import numpy as np

    return lambda group, i: group.update(lr=getattr(np, kind)(1e-3 * (i + 1)))


def _fraction(option):
    from fractions import Fraction

    if option == "lr":
        return lambda group, i: group.update(lr=Fraction(1, 100 + i))
    return lambda group, i: group.update(betas=(Fraction(90 - i, 100), 0.999))


# A number the options take, written into the group at every step: a schedule computed in numpy writes numpy
# scalars; any real number (numbers.Real: fractions.Fraction too) is taken, which a tensor does not add itself.
REAL_NUMBERS_CHANGED_EVERY_STEP = {"numpy float32 lr": _numpy_lr("float32"), "numpy float64 lr": _numpy_lr("float64"),
                                   "Fraction lr": _fraction("lr"), "Fraction beta1": _fraction("beta1")}


@NEWEST
@pytest.mark.parametrize("case", ["numpy float32 lr", *later("numpy float64 lr", "Fraction lr"), "Fraction beta1"])
def test_a_real_number_changed_every_step_compiles_without_breaks_and_steps_as_eager(case):
    """Numpy scalars and other real numbers (a Fraction) reach the traced step as the float the eager step reads from
    them (no host read of a tensor's value), without a break, and a value changed at every step costs at most the one
    recompile of a float, as for a Python float; the compiled step computes what the eager step computes."""
    write = REAL_NUMBERS_CHANGED_EVERY_STEP[case]
    results, counts = [], []
    for model, opt, step in _eager_then_compiled(lambda model: FusedAdam(model.parameters(), lr=1e-2)):
        torch._dynamo.utils.counters.clear()
        for i in range(8):
            _grads(model, i)
            write(opt.param_groups[0], i)
            step()
        counts.append((sum(torch._dynamo.utils.counters["graph_break"].values()),
                       torch._dynamo.utils.counters["stats"]["unique_graphs"]))
        results.append([p.detach().clone() for p in model.parameters()])
    assert counts[1][0] == 0 and counts[1][1] <= 2, counts[1]
    for compiled_param, eager_param in zip(results[1], results[0]):
        assert_bitwise_equal(compiled_param, eager_param, "param")


@NEWEST
def test_a_scheduled_float_lr_that_turns_negative_is_refused_by_a_compiled_step_before_it_writes():
    """A float lr that a scheduler changes is an input of the compiled graph (TorchDynamo's automatic dynamic), so
    the check that step() makes before tracing does not see its later values: the op checks the values it reads
    (the native CPU op; not the Triton kernels) and refuses a negative lr before writing anything."""
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.3 * i)  # 1, 0.7, 0.4, 0.1, -0.2
    step = torch.compile(lambda: opt.step())
    torch._dynamo.reset()
    for i in range(4):
        _grads(model, i)
        step()
        scheduler.step()
    _grads(model, 4)
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=r"lr must be finite and >= 0, got -0\.002"):
        step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


@NEWEST
@pytest.mark.parametrize("bad", ["lr", *later("beta1")])
def test_a_graph_input_out_of_range_in_a_later_group_refuses_the_whole_compiled_step(bad):
    """With several groups the compiled step calls the op once per group; the first call checks every group's lr and
    betas (the op's group_hyperparameters) before anything is written, so a value out of range in the second group
    leaves the first group unstepped too, and the error names the group."""
    model = _model()
    opt = FusedAdam(_groups(model), lr=1e-2)
    step = torch.compile(lambda: opt.step())
    torch._dynamo.reset()
    values = [0.9, 0.6, 0.3, -0.2] if bad == "lr" else [0.8, 0.85, 0.95, 1.0]
    for i, value in enumerate(values):
        _grads(model, i)
        if bad == "lr":
            opt.param_groups[1]["lr"] = 1e-2 * value
        else:
            opt.param_groups[1]["betas"] = (value, 0.999)
        if i < len(values) - 1:
            step()
    before = optimizer_snapshot(opt)
    message = (r"param_groups\[1\]: lr must be finite and >= 0, got -0\.002" if bad == "lr"
               else r"param_groups\[1\]: betas\[0\] must be in \[0, 1\), got 1")
    with pytest.raises(ValueError, match=message):
        step()
    assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "optimizer")


@NEWEST
def test_a_compiled_fp16_optimizer_step_that_the_op_refuses_leaves_the_loss_scaler_as_it_was():
    """FP16_Optimizer(FusedAdam) compiled: the scaler's update reads the step's skip flag, which the traced step makes
    depend on the op having run, so a step the op refuses (a scheduled lr gone negative in the second group, on a
    step whose gradients overflow) changes neither the params and states nor the scale, its counters and flags."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).half()
    params = list(model.parameters())
    inner = FusedAdam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)
    opt = FP16_Optimizer(inner, init_scale=2.0**10)
    step = torch.compile(lambda: opt.step())
    torch._dynamo.reset()
    for i, lr in enumerate([1e-3, 2e-3, 3e-3, -1e-3]):
        g = torch.Generator().manual_seed(i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).half()
        inner.param_groups[1]["lr"] = lr
        if lr > 0:
            step()
    params[0].grad[0, 0] = float("inf")
    scaler = opt.scaler
    names = ("scale", "skipped_steps", "growth_tracker", "hysteresis_left", "found_inf", "underflow")
    before = ({name: getattr(scaler, name).clone() for name in names}, optimizer_snapshot(inner),
              [p.detach().clone() for p in params])
    assert int(before[0]["growth_tracker"]) == 3
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr must be finite and >= 0"):
        step()
    assert_tree_bitwise_equal(({name: getattr(scaler, name) for name in names}, optimizer_snapshot(inner),
                               [p.detach() for p in params]), before, "FP16_Optimizer")


@pytest.mark.slow
@NEWEST
def test_a_change_the_step_must_see_retraces_and_is_validated():
    """Guards stand in for the per-step validity check: a param that gets a gradient late, a state reset, a bad
    option written into a group are each seen by the next compiled step."""
    model = _model()
    opt = _fused(model)
    params = list(model.parameters())
    step = torch.compile(lambda: opt.step())
    torch._dynamo.reset()
    _grads(model, 0)
    params[0].grad = None
    step()
    assert not opt.state.get(params[0])
    _grads(model, 1)
    step()  # params[0] has a gradient now: planned and stepped
    assert float(opt.state[params[0]]["step"]) == 1 and float(opt.state[params[1]]["step"]) == 2
    opt.state.clear()
    _grads(model, 2)
    step()
    assert float(opt.state[params[1]]["step"]) == 1
    opt.param_groups[0]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: betas\[1\] must be in \[0, 1\)"):
        step()


def _step_or_refusal(opt, step, errors: list) -> None:
    """step(), or its ValueError appended to errors, the optimizer then as it was before the call."""
    before = optimizer_snapshot(opt)
    try:
        step()
    except ValueError as error:
        errors.append(str(error))
        assert_tree_bitwise_equal(optimizer_snapshot(opt), before, "after a refused step")


@NEWEST
@pytest.mark.parametrize("entry, value", [
    ("differentiable", True), *later(("decoupled_weight_decay", False), ("decoupled_weight_decay", True),
                                     ("master_weights", True)),
    ("exp_avg_dtype", torch.bfloat16), *later(("process_group", object()))])
def test_a_group_entry_written_between_compiled_steps_is_validated_as_the_eager_step_validates_it(entry, value):
    """The entries of a param group that only validation reads (an optimizer-wide option a group may repeat, a process
    group, torch's differentiable and decoupled_weight_decay), written between compiled steps: the compiled step sees
    them as the eager step does, and refuses them with its error, nothing written (torch.optim.AdamW's compiled step
    likewise sees a new decoupled_weight_decay, which its step reads), or steps as eager where they are accepted
    (decoupled_weight_decay=True with a decoupled mode)."""
    results = []
    for model, opt, step in _eager_then_compiled(_fused):  # (ADAMW_TORCH, weight decay 0.1 in its first group)
        outcome = []
        for i in range(4):
            _grads(model, i)
            if i == 2:
                opt.param_groups[0][entry] = value
            _step_or_refusal(opt, step, outcome)
        results.append((optimizer_snapshot(opt), outcome))
    (eager, eager_errors), (compiled, compiled_errors) = results
    assert compiled_errors == eager_errors and len(eager_errors) == (0 if value is True and entry.startswith(
        "decoupled") else 2)
    assert_tree_bitwise_equal(compiled, eager, "compiled vs eager")


@NEWEST
@pytest.mark.parametrize("key", ["eps", *later("weight_decay")])
def test_a_tensor_eps_or_weight_decay_changed_between_compiled_steps_is_validated_and_used_as_eager(key):
    """A tensor eps or weight_decay (read on the host: the update runs outside the graph) changed in place between
    compiled steps: a negative value is refused with the eager error, the whole step unwritten (the group holding it
    is the second: the first is not stepped either); a value written back in place, and a float put in the tensor's
    place, are stepped with, every step what the eager step computes."""
    def make(model):
        params = list(model.parameters())
        return FusedAdam([{"params": params[::2]}, {"params": params[1::2], key: torch.tensor(0.1)}], lr=1e-2,
                         adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8, weight_decay=0.01)

    results = []
    for model, opt, step in _eager_then_compiled(make):
        errors = []
        for i in range(6):
            _grads(model, i)
            if i == 2:
                opt.param_groups[1][key].fill_(-1.0)
            if i == 3:
                opt.param_groups[1][key].fill_(0.05)
            if i == 4:
                opt.param_groups[1][key] = 0.2
            _step_or_refusal(opt, step, errors)
        results.append((optimizer_snapshot(opt), errors))
    (eager, eager_errors), (compiled, compiled_errors) = results
    assert eager_errors == [f"param_groups[1]: {key} must be >= 0, got -1.0"], eager_errors
    assert compiled_errors == eager_errors
    assert_tree_bitwise_equal(compiled, eager, "compiled vs eager")


@pytest.mark.slow
@NEWEST
@pytest.mark.parametrize("scheduled", ["FP16_Optimizer", "FusedAdam"])
@pytest.mark.parametrize("schedule", ["lambda-lr", "one-cycle-lr"])
def test_fp16_optimizer_around_fused_adam_compiles_without_recompiles_and_matches_eager(schedule, scheduled):
    """FP16_Optimizer(FusedAdam).step() with fp16 params and masters: the wrapper's logic is traced with the step,
    with no graph break of its own (no host read: the loss scaler updates on the device and its min-scale flag is not
    read inside a traced step) and the same graphs at every step after the second (no recompile; under OneCycleLR,
    the second step's is the one of its changed float beta1, see
    test_a_compiled_step_under_one_cycle_lr_with_momentum_compiles_at_most_twice_and_matches_eager), and the eager
    result. A scheduler of the FP16_Optimizer: one graph (two under OneCycleLR). A scheduler of the FusedAdam inside:
    its wrapper of FusedAdam.step is a function TorchDynamo skips, so each graph is cut in two there (every break is
    that one)."""
    make_scheduler = _lambda_lr if schedule == "lambda-lr" else _one_cycle

    def make(model):
        model.half()
        return FusedAdam(model.parameters(), lr=torch.tensor(1e-2), master_weights=True)

    wrap = lambda opt: FP16_Optimizer(opt)  # noqa: E731
    on_wrapper = scheduled == "FP16_Optimizer"
    eager, _, _ = _run(make, make_scheduler, compiled=False, wrap=wrap, schedule_wrapper=on_wrapper)
    graphs_after = {}

    def counting_scheduler(opt):
        scheduler = make_scheduler(opt)
        original = scheduler.step

        def step():
            original()
            graphs_after[scheduler.last_epoch] = torch._dynamo.utils.counters["stats"]["unique_graphs"]

        scheduler.step = step
        return scheduler

    compiled, counts, _ = _run(make, counting_scheduler, compiled=True, wrap=wrap, schedule_wrapper=on_wrapper)
    assert graphs_after[2] == graphs_after[STEPS] == counts[1], graphs_after
    reasons = list(torch._dynamo.utils.counters["graph_break"])
    assert all("lr_scheduler" in reason for reason in reasons), reasons
    # (a step cut in two by the inner scheduler's wrapper: each of its graphs in two pieces)
    assert counts[1] == (1 if schedule == "lambda-lr" else 2) * (1 if on_wrapper else 2), counts
    assert not any("item()" in reason or "Tensor.item" in reason for reason in reasons), reasons
    for a, b in zip(compiled, eager):
        assert_bitwise_equal(a, b, "param")


@NEWEST
@pytest.mark.parametrize("moments", [
    {}, *later({"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8}),
    {"exp_avg_dtype": torch.uint4, "exp_avg_sq_dtype": torch.uint4},
    *later({"exp_avg_dtype": torch.float8_e4m3fn, "exp_avg_sq_dtype": torch.float8_e5m2, "amsgrad": True},
           {"stochastic_rounding": True})], ids=["fp32", "8-bit", "4-bit", "fp8-amsgrad", "bf16-stochastic-rounding"])
def test_a_step_that_is_not_traced_updates_eagerly_outside_the_graph(moments, monkeypatch):
    """The reference backend (as DTensor params, process groups and step_in_backward): the update runs eagerly, one
    graph break, and computes the eager results bit for bit; no graph holds any of its ops (traced piecewise, its bit
    arithmetic for low-bit states failed inductor's C++ code generation)."""
    select_backend(monkeypatch, "torch")
    runs = []
    for compiled in (False, True):
        model = _model()
        if moments.get("stochastic_rounding"):
            model.bfloat16()
        opt = FusedAdam(model.parameters(), lr=1e-2, **moments)
        run = torch.compile(lambda: opt.step()) if compiled else opt.step
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for i in range(6):
            _grads(model, i)
            run()
        if compiled:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise_equal(a, b, "param")


@pytest.mark.parametrize("route", ["this torch's", "outside the graph"])
def test_a_compiled_step_on_any_torch_computes_what_the_eager_step_computes_and_traces_once(route, monkeypatch):
    """On every torch: the traced route (newest) or the step run outside the graph (older torch; forced here on any),
    10 steps, bit for bit. Nothing is traced again after the second step (a step run outside the graph is one
    function that TorchDynamo skips, not a new one per call)."""
    if route == "outside the graph":
        monkeypatch.setattr(fused_adam_module, "_TRACED_STEP", False)
    steps = 10
    runs = []
    for compiled in (False, True):
        model = _model()
        opt = _fused(model)
        scheduler = _lambda_lr(opt)
        run = torch.compile(lambda: opt.step()) if compiled else opt.step
        torch._dynamo.reset()
        for i in range(steps):
            _grads(model, i)
            run()
            scheduler.step()
            if i == 1:
                frames = torch._dynamo.utils.counters["frames"]["total"]
        assert torch._dynamo.utils.counters["frames"]["total"] == frames, "a compiled step traced again"
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise_equal(a, b, "param")


@pytest.mark.parametrize("options", [
    {"lr": torch.tensor(1e-2)},
    *later({"lr": torch.tensor(1e-2), "max_grad_norm": 1.0, "exp_avg_dtype": torch.uint8},
           {"lr": 1e-2, "betas": (torch.tensor(0.9), torch.tensor(0.99)), "weight_decay": 0.1})],
    ids=["tensor lr", "tensor lr, clipping, 8-bit", "tensor betas"])
def test_an_optimizer_made_inside_a_compiled_function_is_made_whole_and_steps_as_eager(options):
    """Made inside a compiled function, as torch.optim.AdamW may be: the constructor runs eagerly (a graph break, as
    torch.optim's add_param_group), so every option it was given is there (an option tensor read on the host once
    split it, and the attributes its checked setters wrote before that break were lost: an AttributeError), and the
    optimizer steps, inside the function and after it, bit for bit as one made and stepped eagerly."""
    runs = []
    for compiled in (False, True):
        model = _model()

        def make_and_step():
            opt = FusedAdam(_groups(model), adam_w_mode=AdamWMode.ADAMW_TORCH, **options)
            opt.step()
            return opt

        torch._dynamo.reset()
        _grads(model, 0)
        opt = (torch.compile(make_and_step) if compiled else make_and_step)()
        assert (opt.max_grad_norm, opt.exp_avg_dtype) == (options.get("max_grad_norm"), options.get("exp_avg_dtype"))
        for i in range(1, 4):
            _grads(model, i)
            opt.step()
        runs.append(optimizer_snapshot(opt))
    assert_tree_bitwise_equal(*runs)


@NEWEST
@pytest.mark.parametrize("change", ["another shape", *later("another dtype", "freed storage")])
def test_a_state_changed_in_place_between_compiled_steps_is_refused_and_nothing_is_written(change):
    """The optimizer's own tensors are guarded by identity in a traced step (as torch.optim's states are: guards on
    their metadata cost more than a small model's step). A state whose metadata is changed in place between
    compiled steps (`.data =` another shape or dtype, its storage freed) is refused before anything is written: by
    the compiled graph's input check or the op's own; its values are another matter (the same shape: see eager)."""
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    opt = FusedAdam(params, lr=1e-2)
    step = torch.compile(opt.step)
    torch._dynamo.reset()
    for i in range(2):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (i + 1))
        step()
    state = opt.state[params[1]]["exp_avg"]
    if change == "another shape":
        state.data = torch.zeros(4)
    elif change == "another dtype":
        state.data = torch.zeros(8, 8, dtype=torch.float64)
    else:
        state.untyped_storage().resize_(0)
    before = [p.detach().clone() for p in params] + [opt.state[p]["exp_avg_sq"].clone() for p in params]
    with pytest.raises((AssertionError, RuntimeError, ValueError)):
        step()
    after = [p.detach().clone() for p in params] + [opt.state[p]["exp_avg_sq"].clone() for p in params]
    for a, b in zip(before, after):
        assert_bitwise_equal(a, b, "tensor")


def test_a_compiled_step_after_a_compiled_step_in_backward_run_computes_what_the_eager_step_computes():
    """A compiled train step of a step_in_backward optimizer first (its update runs outside the graph), then another
    FusedAdam's compiled step in the same process: bit for bit the eager step's. On torch 2.4.1 TorchDynamo then ran
    step()'s frame eagerly but compiled the frames it calls, and its inductor refused the op ("alias annotations")."""
    w = torch.nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
    first = FusedAdam([w], lr=1e-2, step_in_backward=True)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def train(inputs):
        (inputs @ w).square().mean().backward()
        first.step()
        first.zero_grad()

    torch._dynamo.reset()
    compiled_train = torch.compile(train)
    try:
        for _ in range(3):
            compiled_train(x)
    finally:
        # (torch 2.4.1's inductor builds its C++ kernels with -ffast-math, and loading them turns on flush-to-zero
        # for the thread: off again, or later tests in this process see subnormals read as 0)
        torch.set_flush_denormal(False)
    runs = []
    for compiled in (True, False):
        q = torch.nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(2)))
        opt = FusedAdam([q], lr=1e-2)
        run = torch.compile(opt.step) if compiled else opt.step
        for i in range(3):
            q.grad = torch.randn(16, 16, generator=torch.Generator().manual_seed(3 + i))
            run()
        runs.append(q.detach().clone())
    assert_bitwise_equal(runs[1], runs[0], "param")


@pytest.mark.slow
@NEWEST
def test_a_compiled_step_after_eager_steps_writes_the_states_in_place():
    """Eager steps lay states out as views of flat buffers; a traced step gives them storages of their own, since
    mutated graph inputs sharing a storage would be copied whole around the op at every step. The generated code
    then calls the op on the optimizer's own tensors, with no copy kernel, and computes what eager steps compute."""
    from torch._inductor.utils import run_and_get_code

    runs = []
    for compiled in (False, True):
        model = _model()
        opt = _fused(model)
        _grads(model, 0)
        opt.step()  # eager: the flat layout
        step = torch.compile(lambda: opt.step()) if compiled else opt.step
        torch._dynamo.reset()
        for i in range(1, 4):
            _grads(model, i)
            if compiled and i == 1:
                # (compiled from the sources: inductor's cache keys leave out inputs' storage offsets and sizes, so
                # code compiled earlier for view states, copies included, would be served here)
                with torch._inductor.config.patch(fx_graph_cache=False), \
                        torch._functorch.config.patch(enable_autograd_cache=False):
                    _, code = run_and_get_code(step)
                # (kernel names, e.g. cpp_fused__to_copy_cat_stack_view_0 of the step's hyperparameter table, left out)
                source = re.sub(r"cpp_fused_\w+", "", "\n".join(code))
                assert "ort_optim.adam_step_" in source
                assert not any(word in source for word in ("clone", "copy_", "as_strided")), source
            else:
                step()
        for state in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                t = state[key]
                assert (t.untyped_storage().nbytes() == t.numel() * t.element_size()) == compiled, key
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise_equal(a, b, "param")


def _drawn_steps(config, steps, compiled: bool) -> tuple[list, int]:
    """The drawn configuration stepped (compiled or not) with each drawn gradient list and grad_scale: a snapshot per
    step, or ("refused", type, message) where a step raises; and the graph breaks."""
    params = config.params()
    opt = FusedAdam(config.param_groups(params), **config.options)
    run = torch.compile(lambda **kwargs: opt.step(**kwargs)) if compiled else opt.step
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    history = []
    for k, (grads, grad_scale) in enumerate(steps):
        for i, (p, grad) in enumerate(zip(params, grads)):
            p.grad = None if grad is None else gradient(p, grad, 1000 * k + i)
        try:
            run(**({} if grad_scale is None else {"grad_scale": torch.tensor(grad_scale)}))
        except Exception as error:  # (under torch.compile a refusal may come wrapped: compared by its message)
            history.append(("refused", str(error).split("\n")[0]))
            break
        history.append(optimizer_snapshot(opt))
    return history, sum(torch._dynamo.utils.counters["graph_break"].values())


@NEWEST
def test_a_strided_params_master_made_in_a_compiled_step_is_contiguous_and_steps_as_eager():
    """A param whose state is made inside a compiled step (its first gradient comes after the first step) gets an
    fp32 master as the op takes every state tensor, contiguous, whatever the param's strides (a transposed fp16
    param's master was a transposed copy: refused by the op)."""
    group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=AdamWMode.ADAM_L2_REGULARIZATION,
                 bias_correction=True, amsgrad=True, maximize=False, stochastic_rounding=False)
    config = Configuration(torch.float16, (0, 0, 1023, 1024), ("flat", "flat", "transposed", "flat"),
                           dict(master_weights=True, exp_avg_dtype=None, exp_avg_sq_dtype=None, max_grad_norm=None),
                           (group,))
    assert not config.params()[2].is_contiguous()
    ones = (1.0, [])
    steps = [([ones, ones, None, ones], None), ([ones] * 4, None), ([ones] * 4, None)]
    (eager, _), (compiled, breaks) = (_drawn_steps(config, steps, flag) for flag in (False, True))
    assert not any(isinstance(entry, tuple) for entry in eager + compiled), (eager[-1:], compiled[-1:])
    assert_same_history(eager, compiled)
    assert breaks == 0


@pytest.mark.slow
@NEWEST
@settings(max_examples=fuzz_examples(30), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_property_any_configuration_compiles_without_breaks_and_steps_as_eager(data):
    """Any drawn configuration (param sizes, layouts and dtypes, master weights, moment formats, per-group options,
    clipping) and gradients (with inf and NaN elements, missing), with or without a grad_scale tensor: the compiled
    step adds no graph break and leaves every param, gradient and state as the eager step does, bit for bit, after
    each of 1-3 steps; or both refuse the same step with the same message."""
    config = data.draw(configurations(), "configuration")
    grad_scale = data.draw(st.sampled_from((None, 1024.0)), "grad_scale")
    steps = [(data.draw(gradients(len(config.sizes)), "gradients"), grad_scale)
             for _ in range(data.draw(st.integers(1, 3), "steps"))]
    try:
        FusedAdam(config.param_groups(config.params()), **config.options)
    except (ValueError, TypeError):
        return  # (refused at construction: nothing to compile; test_options covers those refusals)
    (eager, _), (compiled, breaks) = (_drawn_steps(config, steps, flag) for flag in (False, True))
    assert_same_history(eager, compiled)
    if not isinstance(compiled[-1], tuple):
        assert breaks == 0, f"{breaks} graph breaks"


@NEWEST
def test_after_compiled_steps_zero_grad_frees_the_gradients_but_the_tracing_steps():
    """As after eager steps, the plan keeps no step's gradients; TorchDynamo's record of the trace keeps those of the
    step that traced (one set, for the compiled graph's life)."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = FusedAdam(model.parameters(), lr=1e-3)
    step = torch.compile(opt.step)
    alive = []
    for _ in range(4):
        model(torch.randn(8, 16)).sum().backward()
        step()
        gradients = [weakref.ref(p.grad) for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        alive.append(sum(g() is not None for g in gradients))
    assert alive[1:] == [0, 0, 0], alive
