"""explain's per-category figures add up to the totals it prints beside them: the memory
timeline table's columns to each row's total, and save_trace's counter tracks to each kernel's
bytes held, the previous call's results a loop keeps ("previous outputs") included (they were
left out of both, so the columns summed to less than the printed peak). Nothing compiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

import backplan as bp
from backplan.report.memory import timeline_table
from backplan.runtime.backend import use_backend


def loss(params, x):
    return bp.sum(bp.tanh(x @ params["w"]) ** 2)


def arguments():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    return {"w": bp.tensor(w)}, rng.standard_normal((32, 16)).astype(np.float32)


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_the_timeline_columns_add_up_to_each_total(backend):
    with use_backend(backend):
        report = bp.value_and_grad(loss).explain(*arguments())
    assert report.peak.at_peak().get("previous outputs")  # the loop's kept loss and gradients
    header, *rows = [line.split() for line in timeline_table(report).splitlines()]
    words = " ".join(header)
    assert "previous outputs" in words
    columns = len(header) - 2 - 1  # the kernel label, the line; "previous outputs" is two words
    for row in rows:
        numbers = [int(cell.replace(",", "")) for cell in row[-columns:]]
        assert sum(numbers[:-1]) == numbers[-1], row
    peak_row = next(r for r in rows if "(peak)" in r)
    assert int(peak_row[-1].replace(",", "")) == report.peak_bytes


def test_the_trace_counters_add_up_to_each_kernels_bytes(tmp_path):
    with use_backend("numba"):
        report = bp.value_and_grad(loss).explain(*arguments())
    report.save_trace(tmp_path / "step.json")
    events = json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    kernels = [e for e in events if e["ph"] == "X"]
    counters = [e for e in events if e["ph"] == "C"][: len(kernels)]
    assert len(kernels) == report.n_kernels
    for kernel, counter in zip(kernels, counters, strict=True):
        assert sum(counter["args"].values()) == kernel["args"]["bytes_held"]
    assert max(k["args"]["bytes_held"] for k in kernels) == report.peak_bytes
    assert any(c["args"].get("previous outputs") for c in counters)
