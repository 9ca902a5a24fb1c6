"""A memory budget holds for the kind of array each call passes: a NumPy array its backward
reads is copied at the call (tracer/numpy_args.py), so under max_peak_bytes or
saved_bytes_budget a NumPy argument and a tensor are different signatures, each planned for
what it holds (tracer/signature.py numpy_apart). Before, the plans were chosen for the first
call's kinds: a function first called with tensors, then with NumPy arrays, ran a plan whose
peak left the copy out of the budget. saved_bytes_budget counts the copies too, as explain's
saved bytes do."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend


@pytest.fixture(autouse=True, params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _loss(w1, w2, x):
    """Three plans on its frontier: the budget below is met by recomputing."""
    h = bp.tanh(x @ w1)
    h = bp.tanh((bp.exp(h) * h) @ w2)
    return (bp.exp(h) * h).sum()


def _arrays():
    rng = np.random.default_rng(5)
    w1, w2 = (
        bp.tensor(rng.standard_normal((32, 32)).astype(np.float32) * 0.1, requires_grad=True)
        for _ in range(2)
    )
    return w1, w2, rng.standard_normal((512, 32)).astype(np.float32)


def _step(f, w1, w2, x):
    def step():
        bp.zero_grad([w1, w2])
        f(w1, w2, x).backward()

    return step


def _reference(w1, w2, x):
    bp.zero_grad([w1, w2])
    bp.compile(_loss)(w1, w2, bp.tensor(x)).backward()
    return w1.grad.numpy().copy(), w2.grad.numpy().copy()


def test_max_peak_bytes_holds_for_a_numpy_call_after_a_tensor_call(backend):
    w1, w2, x = _arrays()
    budget = bp.explain(bp.compile(_loss), w1, w2, bp.tensor(x)).peak_bytes  # tensors fit
    assert bp.explain(bp.compile(_loss), w1, w2, x).peak_bytes > budget  # the copy does not
    f = bp.compile(_loss, max_peak_bytes=budget)
    _step(f, w1, w2, bp.tensor(x))()
    report = bp.explain(f, w1, w2, x)  # a plan recomputing more holds the copy within it
    assert report.peak_bytes <= budget < bp.explain(bp.compile(_loss), w1, w2, x).peak_bytes
    counted = counted_calls(_step(f, w1, w2, x), 3)
    assert max(counted) <= budget - report.peak.input_bytes
    assert f.cache_info().traces == 2  # each kind planned on its own
    want = _reference(w1, w2, x)
    _step(f, w1, w2, x)()
    for got, expected in zip((w1.grad.numpy(), w2.grad.numpy()), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)  # another plan


def test_a_switch_of_kind_under_a_budget_says_why_it_retraces(backend):
    w1, w2, x = _arrays()
    f = bp.compile(_loss, max_peak_bytes=1 << 30)
    _step(f, w1, w2, bp.tensor(x))()
    _step(f, w1, w2, x)()
    reason = f.cache_info().last_miss_reason
    assert "x: a tensor -> a NumPy array" in reason and "copy" in reason
    unbudgeted = bp.compile(_loss)
    _step(unbudgeted, w1, w2, bp.tensor(x))()
    _step(unbudgeted, w1, w2, x)()
    assert unbudgeted.cache_info().traces == 1  # without a budget the plans are the same


def test_saved_bytes_budget_counts_the_copy_of_a_numpy_argument(backend):
    w1, w2, x = _arrays()
    as_tensor = bp.explain(bp.compile(_loss), w1, w2, bp.tensor(x))
    budget = as_tensor.saved_bytes - as_tensor.saved_input_bytes  # what tensors keep
    f = bp.compile(_loss, saved_bytes_budget=budget)
    try:
        report = bp.explain(f, w1, w2, x)
    except bp.MemoryBudgetError as exc:
        assert "saved_bytes_budget" in str(exc)
        return
    assert [b.name for b in report.saved_buffers if b.copy_of_argument] == ["x"]
    assert report.saved_bytes - report.saved_input_bytes <= budget  # the copy among them
    _step(f, w1, w2, x)()


@pytest.mark.parametrize("option", ["max_peak_bytes", "saved_bytes_budget"])
def test_a_refusal_says_what_the_numpy_copies_take(backend, option):
    w1, w2, x = _arrays()
    budget = 80_000 if option == "max_peak_bytes" else 1_000  # the arrays passed in fit
    f = bp.compile(_loss, **{option: budget})
    with pytest.raises(bp.MemoryBudgetError) as refused:
        bp.explain(f, w1, w2, x)
    text = str(refused.value)
    assert f"{x.nbytes:,} B" in text or "64.0 KiB" in text
    assert "copies of NumPy arguments the backward reads" in text and "bp.tensor" in text
    with pytest.raises(bp.MemoryBudgetError) as refused:
        bp.explain(bp.compile(_loss, **{option: budget}), w1, w2, bp.tensor(x))
    assert "copies of NumPy arguments" not in str(refused.value)


def test_the_frontier_of_a_later_numpy_call_counts_its_copy(backend):
    """Without a budget the plans do not depend on the kind passed (one trace), but the
    frontier a NumPy call is shown counts its copy, whichever kind came first."""
    w1, w2, x = _arrays()
    f = bp.compile(_loss)
    tensor_rows = f.memory_frontier(w1, w2, bp.tensor(x)).points
    rows = f.memory_frontier(w1, w2, x).points
    assert f.cache_info().traces == 1
    fresh = bp.compile(_loss).memory_frontier(w1, w2, x).points
    assert [r.peak_bytes for r in rows] == [r.peak_bytes for r in fresh]
    assert [r.peak_bytes - t.peak_bytes for r, t in zip(rows, tensor_rows, strict=True)] == [
        x.nbytes
    ] * len(rows)
    assert bp.explain(f, w1, w2, x).frontier.points[0].peak_bytes == rows[0].peak_bytes
