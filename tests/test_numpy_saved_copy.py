"""A NumPy array a compiled loss's backward reads is copied at the call (tracer/numpy_args.py),
so changing the array after the call cannot change the gradients (torch.from_numpy shares the
array, and a NumPy write after the forward silently changes torch's gradients). The copy is
backplan's buffer: explain lists it as a copy, not as your input held by reference, counts it
in the saved bytes and in the peak; live_saved_bytes counts it as allocated; the checked mode
counts it, on every call and both backends."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

CALLS = 5


@pytest.fixture(autouse=True, params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _loss(w, x):
    return bp.tanh(x @ w).sum()


def _arrays(rows=32):
    rng = np.random.default_rng(0)
    w = bp.tensor(rng.standard_normal((16, 8)).astype(np.float32), requires_grad=True)
    return w, rng.standard_normal((rows, 16)).astype(np.float32)


def _step(f, w, x):
    def step():
        bp.zero_grad(w)
        f(w, x).backward()

    return step


def test_explain_lists_a_saved_numpy_argument_as_a_copy_in_the_saved_bytes_and_the_peak(backend):
    w, x = _arrays()
    f = bp.compile(_loss)
    as_tensor = bp.explain(f, w, bp.tensor(x))
    report = bp.explain(f, w, x)
    (copy,) = [b for b in report.saved_buffers if b.name == "x"]
    assert copy.copy_of_argument and not copy.is_region_input
    assert report.saved_input_bytes == 0  # none of the saved bytes are your arrays
    assert (
        report.saved_bytes
        == as_tensor.saved_bytes
        == as_tensor.saved_input_bytes + (report.saved_bytes - x.nbytes)
    )
    text = str(report)
    assert "x (copy)" in text and "copy of x taken at the call" in text
    assert "held by reference" not in text.split("3. Saved buffers")[1].split("4. Memory")[0]
    # the copy is held beside your array on every call: the peak grows by its bytes
    for n in range(1, CALLS + 1):
        mine, theirs = report.peak_on_call(n), as_tensor.peak_on_call(n)
        assert mine.peak_bytes == theirs.peak_bytes + x.nbytes
        assert mine.input_bytes == theirs.input_bytes  # your array, counted once as an input
    assert report.peak_bytes == as_tensor.peak_bytes + x.nbytes


def test_the_checked_mode_counts_the_copy_on_every_call_as_explain_prints(backend):
    w, x = _arrays()
    f = bp.compile(_loss)
    report = bp.explain(f, w, x)
    with_copy = counted_calls(_step(f, w, x), CALLS)
    assert with_copy == printed_calls(report, CALLS)
    g = bp.compile(_loss)
    tensor_x = bp.tensor(x)
    without = counted_calls(_step(g, w, tensor_x), CALLS)
    assert without == printed_calls(bp.explain(g, w, tensor_x), CALLS)
    assert [a - b for a, b in zip(with_copy, without, strict=True)] == [x.nbytes] * CALLS


def _live_per_call(f, w, x, calls=3) -> list[tuple[int, int]]:
    """(allocated, yours) live saved bytes after each call's forward, the caller's x changed
    before each backward(), whose gradient must be the one of x as it was at the call."""
    live = []
    for _ in range(calls):  # the first call, the fast path, and the joint plan from call 3
        bp.zero_grad(w)
        loss = f(w, x)
        live.append((bp.live_saved_bytes(), bp.live_saved_bytes(yours=True)))
        if isinstance(x, np.ndarray):
            before = x.copy()
            x[:] = 0.0  # the owner changes its array before backward()
        loss.backward()
        if isinstance(x, np.ndarray):
            x[:] = before
        got = w.grad.numpy().copy()
        bp.zero_grad(w)
        bp.compile(_loss)(w, bp.tensor(np.array(x))).backward()
        np.testing.assert_allclose(got, w.grad.numpy(), rtol=1e-6)
    return live


def test_live_saved_bytes_and_the_graph_count_the_copy_as_backplans(backend):
    w, x = _arrays()
    f = bp.compile(_loss)
    loss = f(w, x)
    names = {b.name: b for b in loss.grad_fn.saved_buffers}
    assert names["x"].copy_of_argument and not names["x"].is_region_input
    assert "x (copy)" in str(loss.grad_fn) and "x *" not in str(loss.grad_fn)
    del loss
    mine = _live_per_call(bp.compile(_loss), w, x)
    theirs = _live_per_call(bp.compile(_loss), w, bp.tensor(x))
    for (allocated, yours), (their_allocated, their_yours) in zip(mine, theirs, strict=True):
        assert allocated == their_allocated + x.nbytes  # the copy: backplan's
        assert yours == their_yours - x.nbytes  # a tensor x is yours, held by reference


def test_each_size_of_a_dynamic_axis_counts_its_copy(backend):
    w, _ = _arrays()
    f = bp.compile(_loss, dynamic={"x": {0: "batch"}})
    for rows in (32, 24):
        x = _arrays(rows)[1]
        report = bp.explain(f, w, x)
        assert [b.name for b in report.saved_buffers if b.copy_of_argument] == ["x"]
        assert counted_calls(_step(f, w, x), 2) == printed_calls(report, 2)


def test_the_frontier_and_a_budget_count_the_copy(backend):
    w, x = _arrays()
    report = bp.explain(bp.compile(_loss), w, x)
    rows = bp.compile(_loss).memory_frontier(w, x).points
    tensor_rows = bp.compile(_loss).memory_frontier(w, bp.tensor(x)).points
    assert rows[0].peak_bytes == report.call_peak.peak_bytes
    assert rows[0].saved_bytes == report.saved_bytes - report.saved_input_bytes
    assert [r.peak_bytes - t.peak_bytes for r, t in zip(rows, tensor_rows, strict=True)] == [
        x.nbytes
    ] * len(rows)  # every plan here reads x in its backward: each holds the copy
    budget = tensor_rows[0].peak_bytes  # the default plan fits it with a tensor x only
    try:
        f = bp.compile(_loss, max_peak_bytes=budget)
        chosen = bp.explain(f, w, x)
    except bp.MemoryBudgetError:
        assert all(r.peak_bytes > budget for r in rows)
        return
    assert chosen.peak_bytes <= budget
    counted = counted_calls(_step(f, w, x), 2)
    assert max(counted) <= budget - chosen.peak.input_bytes


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_a_bench_model_called_with_numpy_batches_holds_what_explain_prints(backend, name):
    """The copies are freed where the backward last reads them on the reference interpreter
    (its region lets each saved buffer go), held to the step's end by the compiled plans."""
    from backplan.bench.memory_calls import model_arrays
    from backplan.bench.models import MODELS
    from backplan.bench.peers.backplan_peer import bench_function

    params, batch = model_arrays(name, requires_grad=True)
    arrays = [t.numpy().copy() for t in batch]
    f = bp.compile(bench_function(MODELS[name]))
    report = bp.explain(f, params, *arrays)
    assert sum(b.nbytes for b in report.saved_buffers if b.copy_of_argument) > 0

    def step():
        bp.zero_grad(params)
        f(params, *arrays).backward()

    assert counted_calls(step, CALLS) == printed_calls(report, CALLS)
