"""A training step compiled with torch.compile: FusedAdam against torch.optim.AdamW in the same compiled step.

Model: 8 x Linear(256, 256), batch 32; the step is forward, backward, ``optimizer.step()`` and ``zero_grad()``, all
inside one ``torch.compile``d function, under two schedules: a tensor lr that ``LambdaLR`` changes at every step
(torch.optim's way to change the lr without recompiling), and ``OneCycleLR(cycle_momentum=True)`` with a float lr
(a new float lr and beta1 at every step). Each step is traced before timing until a step compiles no new graph (at
least 3 steps with LambdaLR and 10 with OneCycleLR, at most MAX_TRACED_STEPS: ``traced_steps``), past TorchDynamo's
recompile limits, so the counts include every recompile and a step that hit a limit is timed as it then runs:
eagerly. Both optimizers use torch AdamW's math (FusedAdam with ``adam_w_mode=ADAMW_TORCH, eps=1e-8,
weight_decay=1e-2``). After tracing, the two compiled steps run interleaved (2 warm-ups); each row gives the median
step time, and FusedAdam's row its ratio to AdamW's (> 1: FusedAdam's step is faster), plus the graph breaks and
graphs TorchDynamo made for each while it was traced (``torch._dynamo.utils.counters``, cleared before each) and
``graphs_while_timed``, those compiled during the warm-ups and timed steps (0 unless a step never settled). One
``torch._dynamo.reset()`` per schedule precedes both tracings, and each step has its own code object, so each keeps
its compiled code through the timing.

    python -m ort_optim.bench --sections compiled      # or alone:
    python -m ort_optim.bench.compiled [--quick] [--width 256 --layers 8]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics


# schedule -> (the lr it needs, its scheduler, steps traced before timing)
SCHEDULES = {
    "LambdaLR, tensor lr": ("tensor", lambda opt, torch: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 1.0 / (1.0 + 1e-3 * i)), 3),
    "OneCycleLR(cycle_momentum=True), float lr": ("float", lambda opt, torch: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1e-3, total_steps=100_000, cycle_momentum=True), 10),
}


def _setup(make_optimizer, make_scheduler, width: int, layers: int, batch: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer, torch)
    x = torch.randn(batch, width)

    def train_step():
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    # TorchDynamo keeps compiled code, and counts recompiles against its limit, per code object: a copy of the code
    # gives each setup its own, so that one optimizer's entries neither evict nor count against the other's.
    train_step.__code__ = train_step.__code__.replace()
    compiled_step = torch.compile(train_step)

    def step():
        compiled_step()
        scheduler.step()

    return step


MAX_TRACED_STEPS = 100


def _trace(step, at_least: int, counters) -> int:
    """Runs ``step`` until a call compiles no new graph, at least ``at_least`` and at most MAX_TRACED_STEPS times;
    returns how many. (A float lr or beta that changes at every step recompiles until TorchDynamo's limit stops it,
    which the limit does per code object: torch 2.13's AdamW settles after 9 steps, torch 2.4's after 33, as the
    frames under its step reach theirs one after another.)"""
    traced = 0
    while traced < MAX_TRACED_STEPS:
        before = counters["stats"]["unique_graphs"]
        step()
        traced += 1
        if traced >= at_least and counters["stats"]["unique_graphs"] == before:
            break
    return traced


@contextlib.contextmanager
def _compiled_from_sources():
    """Compiles from the sources, never from inductor's caches: their keys leave out inputs' storage offsets and
    sizes, so code compiled for states that share one storage (copied around the op at every step) can be served to
    a step whose states do not. (The caches this torch has: torch 2.4 has no autograd cache.)"""
    import torch

    switches = ((torch._inductor.config, "fx_graph_cache"), (torch._functorch.config, "enable_autograd_cache"))
    with contextlib.ExitStack() as stack:
        for config, name in switches:
            if hasattr(config, name):
                stack.enter_context(config.patch(**{name: False}))
        yield


def run(quick: bool, width: int = 256, layers: int = 8) -> list[dict]:
    """Rows for ``python -m ort_optim.bench``: one per schedule and optimizer (the model: layers x Linear(width,
    width))."""
    import torch
    from torch._dynamo.utils import counters

    from ort_optim import AdamWMode, FusedAdam

    from .common import interleaved_samples

    batch = 32
    makers = {
        "torch.optim.AdamW (compiled step)": lambda lr: lambda ps: torch.optim.AdamW(ps, lr=lr),
        "ort_optim FusedAdam (compiled step)": lambda lr: lambda ps: FusedAdam(ps, lr=lr, eps=1e-8, weight_decay=1e-2,
                                                                               adam_w_mode=AdamWMode.ADAMW_TORCH),
    }
    rows = []
    for schedule, (lr_kind, make_scheduler, traced_steps) in SCHEDULES.items():
        steps, counts = {}, {}
        # (a reset drops every compiled code, so there is one per schedule, before either optimizer is traced)
        torch._dynamo.reset()
        for name, make in makers.items():  # traced one after the other, each counted from zero
            counters.clear()
            lr = torch.tensor(1e-3) if lr_kind == "tensor" else 1e-3
            steps[name] = _setup(make(lr), make_scheduler, width, layers, batch)
            with _compiled_from_sources():
                traced = _trace(steps[name], traced_steps, counters)
            counts[name] = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], traced)
        # (both keep their compiled code, and run interleaved from here)
        while_timed = dict.fromkeys(steps, 0)

        def counting(name, step):
            def call():
                before = counters["stats"]["unique_graphs"]
                step()
                while_timed[name] += counters["stats"]["unique_graphs"] - before
            return call

        samples = interleaved_samples({name: counting(name, step) for name, step in steps.items()}, warmup=2,
                                      reps=10 if quick else 60)
        medians = {name: statistics.median(times) for name, times in samples.items()}
        base, ours = list(makers)
        for name in makers:
            row = {"section": "compiled train step", "model": f"{layers} x Linear({width}, {width}), batch {batch}",
                   "schedule": schedule, "impl": name, "median_ms": medians[name] * 1e3,
                   "graph_breaks": counts[name][0], "graphs": counts[name][1], "traced_steps": counts[name][2],
                   "graphs_while_timed": while_timed[name]}
            if name == ours:
                row["ours_speedup"] = medians[base] / medians[ours]
            rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--width", type=int, default=256, help="of each Linear(width, width) layer")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)
    for row in run(args.quick, args.width, args.layers):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
