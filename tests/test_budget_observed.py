"""Budgets (max_peak_bytes), memory_frontier and bp.max_batch bound the peak explain prints,
every result counted as kept until the next call returns. Once a second call has shown what a
loop does with the results (tracer/loop_watch.py), explain says which figure the budget was
judged against and what this loop holds, with both numbers."""

from __future__ import annotations

import numpy as np

import backplan as bp


def _f(x):
    return bp.tanh(x * 1.5) + 0.5


def _x():
    return bp.tensor(np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64))


def _words(report) -> str:
    return " ".join(str(report).split())


def test_a_budget_says_it_was_judged_against_the_every_result_kept_peak():
    x = _x()
    peak = bp.compile(_f).explain(x).peak_bytes
    budget = peak + 100
    step = bp.compile(_f, max_peak_bytes=budget)
    before = step.explain(x)
    assert before.max_peak_bytes == budget and before.peak_bytes == peak
    said = f"max_peak_bytes={budget:,} was judged against this peak, every result counted as kept"
    assert said in _words(before) and "not against the" not in _words(before)
    for _ in range(3):  # x = f(x): each result goes back in as the next argument
        x = step(x)
    after = step.explain(x)
    observed = after.observed_peak_bytes
    assert observed == peak - x.numpy().nbytes
    assert f"{said} (100 B to spare), not against the {observed:,} B" in _words(after)


def test_the_frontier_says_its_peaks_count_every_result_kept_once_a_loop_held_less():
    x = _x()
    step = bp.compile(_f)
    note = "These peaks, like max_peak_bytes, bp.max_batch and fits(), count every result"
    assert note not in _words(step.explain(x))
    assert step.explain(x).max_peak_bytes is None
    for _ in range(3):
        x = step(x)
    report = step.explain(x)
    less = report.peak_bytes - report.observed_peak_bytes
    assert less == x.numpy().nbytes
    words = _words(report)
    assert note in words
    assert f"this loop was seen to hold {report.observed_peak_bytes:,} B" in words
    assert f"{less:,} B" in words.split(note)[1]


def test_a_loop_that_keeps_its_results_gets_no_note():
    x = _x()
    step = bp.compile(_f)
    kept = [step(x) for _ in range(3)]  # every result stays bound: the printed peak is exact
    report = step.explain(x)
    assert report.observed_peak_bytes == report.peak_bytes
    assert "These peaks, like max_peak_bytes" not in _words(report)
    assert len(kept) == 3
