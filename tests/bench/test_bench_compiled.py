"""The ``compiled`` section times compiled steps: each optimizer's train step is traced (and its graphs counted)
before the timing, and keeps its compiled code through it, under every schedule and with either torch. A step that
compiled again while timed would charge compilation to one optimizer and make its row's ratio meaningless."""

from __future__ import annotations

import pytest

from ort_optim.bench import common, compiled


@pytest.mark.slow
def test_no_step_is_compiled_while_timed_and_the_counts_are_of_the_tracing(monkeypatch):
    from torch._dynamo.utils import counters

    compiled_while_timed = {}
    timed = common.interleaved_samples

    def counting(steps, warmup, reps, **kwargs):
        def counted(name, step):
            def call():
                before = counters["stats"]["unique_graphs"]
                step()
                compiled_while_timed[name] += counters["stats"]["unique_graphs"] - before
            return call

        compiled_while_timed.clear()
        compiled_while_timed.update(dict.fromkeys(steps, 0))
        samples = timed({name: counted(name, step) for name, step in steps.items()}, warmup, reps, **kwargs)
        assert compiled_while_timed == dict.fromkeys(steps, 0)
        return samples

    monkeypatch.setattr(common, "interleaved_samples", counting)
    rows = compiled.run(True, width=8, layers=1)
    assert [(row["schedule"], row["impl"]) for row in rows] == [
        (schedule, impl) for schedule in compiled.SCHEDULES for impl in
        ("torch.optim.AdamW (compiled step)", "ort_optim FusedAdam (compiled step)")]
    for row in rows:
        assert row["graphs"] >= 1 and row["graph_breaks"] >= 0 and row["graphs_while_timed"] == 0
        assert 3 <= row["traced_steps"] < compiled.MAX_TRACED_STEPS
    for base, ours in zip(rows[::2], rows[1::2]):
        assert ours["ours_speedup"] == pytest.approx(base["median_ms"] / ours["median_ms"])
