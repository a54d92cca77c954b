"""``python -m ort_optim.bench`` checks its arguments before any timing, as a specification: an unknown section, a
``--out`` that names a directory or a file the tables or the chart would overwrite, and a ``--reps`` below 1 are
refused at once with what to pass instead (a mistake found after minutes of timing, or never, costs the run). What
is optional is skipped with the reason, not a crash at the end of the run: the chart where matplotlib is not
installed, the floor probes' rows where their library's cache cannot be written."""

from __future__ import annotations

import json
import sys

import pytest

from ort_optim.bench import __main__ as bench, probes


class Timed(Exception):
    """Raised by the stand-in for the first timing: the arguments were accepted."""


@pytest.fixture
def no_timing(monkeypatch):
    def measure_bandwidth(quick):
        raise Timed

    monkeypatch.setattr(bench, "measure_bandwidth", measure_bandwidth)


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("sections", ["nonexistent", "fp32,nonexistent", ","])
def test_unknown_sections_are_refused_before_timing_with_the_valid_names(sections, no_timing, tmp_path, capsys):
    err = _refused(["--quick", "--sections", sections, "--out", str(tmp_path / "b.json")], capsys)
    assert "valid sections: fp32, mixed, states, fp16_optimizer, overhead" in err and "mixed_limit" in err
    if "nonexistent" in sections:
        assert "unknown section nonexistent" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("sections", ["fp32, mixed", " mixed_limit ", "fp32,mixed,"])
def test_section_names_may_have_spaces_around_them(sections, no_timing, tmp_path):
    with pytest.raises(Timed):
        bench.main(["--quick", "--sections", sections, "--out", str(tmp_path / "b.json")])


@pytest.mark.parametrize("kind", ["existing-directory", "trailing-slash"])
def test_an_out_that_names_a_directory_is_refused_before_timing(kind, no_timing, tmp_path, capsys):
    out = str(tmp_path) if kind == "existing-directory" else str(tmp_path / "new") + "/"
    err = _refused(["--quick", "--sections", "fp32", "--out", out], capsys)
    assert "--out takes a file path" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["bench.md", "bench.png", "BENCH.MD"])
def test_an_out_that_the_tables_or_the_chart_would_overwrite_is_refused_before_timing(name, no_timing, tmp_path,
                                                                                        capsys):
    err = _refused(["--quick", "--sections", "fp32", "--out", str(tmp_path / name)], capsys)
    assert "--out names the JSON" in err and "name a .json file" in err
    assert not list(tmp_path.iterdir())


def test_without_matplotlib_the_run_writes_its_json_and_tables_and_says_there_is_no_chart(tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (as where it is not installed)
    monkeypatch.setattr(bench, "measure_bandwidth", lambda quick: dict(
        inplace_GBps=1.0, copy_GBps=1.0, triad_GBps=1.0, read_GBps=1.0, peak_GBps=1.0))
    monkeypatch.setattr(bench, "bench_op_overhead", lambda reps: [
        {"section": "op overhead", "workload": "2x1", "call": "op", "caches": "warm", "tensors": 2, "median_ms": 0.5}])
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--sections", "overhead", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["op_overhead_rows"][0]["median_ms"] == 0.5
    assert out.with_suffix(".md").exists() and not out.with_suffix(".png").exists()
    assert "no chart: matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("reps", ["0", "-2"])
def test_reps_below_one_are_refused(reps, no_timing, capsys):
    assert "--reps must be at least 1" in _refused(["--quick", "--reps", reps], capsys)


def test_a_cache_that_cannot_be_written_makes_the_probes_unavailable_not_a_crash(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # (a folder under a file cannot be made, even by root, unlike a read-only mode)
    monkeypatch.setattr(probes.native, "cache_root", lambda: blocker)
    with pytest.raises(probes.ProbeUnavailable, match="failed: NotADirectoryError"):
        probes.library.__wrapped__()  # (not the cached library other tests use)
