"""report.save_trace: Chrome trace / Perfetto JSON of a step's kernels and bytes held."""

from __future__ import annotations

import json

import numpy as np
import pytest

import backplan as bp


def _report():
    w = bp.tensor(np.ones((8, 4), np.float32), requires_grad=True)
    x = bp.tensor(np.ones((16, 8), np.float32))
    return bp.explain(lambda x, w: bp.tanh(x @ w).sum(), x, w)


def test_the_trace_has_a_kernel_event_per_step_and_counters_that_reach_the_peak(tmp_path):
    report = _report()
    path = tmp_path / "step.json"
    report.save_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert all({"ph", "pid", "name"} <= set(e) for e in events)
    kernels = [e for e in events if e["ph"] == "X"]
    counters = [e for e in events if e["ph"] == "C"]
    assert [k["name"] for k in kernels] == [s.what for s in report.peak.steps]
    assert all(k["dur"] > 0 and isinstance(k["ts"], float) for k in kernels)
    assert [k["ts"] for k in kernels] == sorted(k["ts"] for k in kernels)
    totals = [sum(c["args"].values()) for c in counters]
    assert max(totals) == report.peak_bytes and totals[-1] == 0
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {"forward kernels", "backward kernels"}


def test_measured_times_set_each_kernels_length(tmp_path):
    report = _report()
    times = [0.001 * (i + 1) for i in range(len(report.peak.steps))]
    report.save_trace(tmp_path / "step.json", times=times)
    events = json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    assert [e["dur"] for e in events if e["ph"] == "X"] == pytest.approx([t * 1e6 for t in times])
    with pytest.raises(ValueError, match="one per kernel"):
        report.save_trace(tmp_path / "bad.json", times=times[1:])


def test_times_that_are_not_seconds_are_refused_and_write_no_file(tmp_path):
    report = _report()
    n = len(report.peak.steps)
    path = tmp_path / "bad.json"
    for times, error, words in (
        ([-1.0] * n, ValueError, r"times\[0\] is -1.0"),
        ([0.001] * (n - 1) + [float("nan")], ValueError, rf"times\[{n - 1}\] is nan"),
        ([0.001] * (n - 1) + ["fast"], ValueError, rf"times\[{n - 1}\] is 'fast'"),
        ("a" * n, TypeError, "got str"),
    ):
        with pytest.raises(error, match=words):
            report.save_trace(path, times=times)
        assert not path.exists()
