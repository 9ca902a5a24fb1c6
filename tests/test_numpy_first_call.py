"""A NumPy argument is read in place on the first call of a signature as on later ones, on both
backends (tracer/signature.py bind_call wraps it as a read-only view; tracer/numpy_args.py
copies only what outlives the call): what explain prints for a call is what it holds, the first
call and the reference interpreter's calls included. Before, bind_call copied every NumPy
argument for the whole first call and the reference interpreter copied each on every call,
bytes neither explain nor the checked mode saw."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from helpers import numpy_argument_layouts, step_of

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

CALLS = 4
STEPS = ("compile", "vg", "grad")


@pytest.fixture(autouse=True, params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _loss(w, x):
    return bp.tanh(x @ w).sum()


def _make(kind: str, fn=_loss):
    return {"compile": bp.compile, "vg": bp.value_and_grad, "grad": bp.grad}[kind](fn)


def _numpy_blocks(nbytes: int) -> int:
    """NumPy buffers of exactly nbytes allocated since tracemalloc started, alive now."""
    snapshot = tracemalloc.take_snapshot()
    traces = snapshot.filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    return sum(1 for trace in traces.traces if trace.size == nbytes)


@pytest.mark.parametrize("kind", STEPS)
def test_no_copy_of_a_numpy_argument_exists_while_the_first_call_traces(backend, kind):
    x = np.random.default_rng(1).standard_normal((257, 31))  # 63,736 B: no other buffer's size
    w = bp.tensor(np.ones((31, 5)), requires_grad=True)
    seen = []

    def loss(w, x):
        seen.append(_numpy_blocks(257 * 31 * 8))
        return _loss(w, x)

    f = _make(kind, loss)
    tracemalloc.start()
    try:
        step_of(kind, f, w, x)()
    finally:
        tracemalloc.stop()
    assert seen == [0]  # x was allocated before tracing started: a copy of it would show


@pytest.mark.parametrize("order", ["C order", "F order", "sliced"])
@pytest.mark.parametrize("kind", STEPS)
def test_the_reference_interpreter_holds_no_uncounted_copy_on_any_call(backend, kind, order):
    """What NumPy allocates during each call (tracemalloc's peak: Python's objects too, a few
    KB) against explain's allocated peak for that call: a 2 MiB copy of x would show. An
    array not in C order is read in its own layout, as a tensor's array is."""
    if backend != "reference":
        pytest.skip("a compiled first call also compiles: tracemalloc sees that")
    wide = np.random.default_rng(2).standard_normal((4096, 256)).astype(np.float32)
    x = {
        "C order": np.ascontiguousarray(wide[:, :128]),
        "F order": np.asfortranarray(wide[:, :128]),
        "sliced": wide[:, ::2],
    }[order]
    w = bp.tensor(np.ones((128, 8), np.float32), requires_grad=True)
    f = _make(kind)
    report = bp.explain(f, w, x)
    step = step_of(kind, f, w, x)
    for n in range(1, CALLS + 1):
        tracemalloc.start()
        try:
            step()
            measured = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        printed = report.peak_on_call(n).allocated_peak_bytes
        assert printed <= measured < printed + x.nbytes // 8, (n, measured, printed)


@pytest.mark.parametrize("kind", STEPS)
@pytest.mark.parametrize("order", ["C order", "F order", "sliced", "reversed"])
def test_every_call_from_the_first_holds_what_explain_prints(backend, kind, order):
    x = numpy_argument_layouts()[order]
    w = bp.tensor(np.random.default_rng(4).standard_normal((16, 8)).astype(np.float32))
    w.requires_grad = True
    f = _make(kind)
    report = bp.explain(f, w, x)
    counted = counted_calls(step_of(kind, f, w, x), CALLS)
    assert counted == printed_calls(report, CALLS)
    g = _make(kind)  # the same results as with x a tensor, on every call
    for _ in range(2):
        mine, theirs = f(w, x), g(w, bp.tensor(np.ascontiguousarray(x)))
        if kind == "compile":
            np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5)
        else:
            got, want = (mine, theirs) if kind == "grad" else (mine[1], theirs[1])
            # an F-order x reaches BLAS in another order: sums reassociated, a near-zero
            # gradient 1.3e-7 apart with OpenBLAS's AVX-512 kernels
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def _views(x):
    return x.T, x[1:, ::2] * 2.0, x.reshape(-1)


@pytest.mark.parametrize("kind", ["compile", "vg"])
def test_an_output_that_is_a_view_of_a_numpy_argument_does_not_change_with_it(backend, kind):
    """An output reading the argument's buffer (a transpose or a reshape: a view in NumPy and
    in the compiled plan) is a copy, first call and later ones: the caller's later writes to
    its array do not reach it."""
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    if kind == "compile":
        f = bp.compile(_views)
    else:
        f = bp.value_and_grad(lambda w, x: ((w * x).sum(), _views(x)), has_aux=True)
    w = bp.tensor(np.ones((3, 4), np.float32))
    for _ in range(3):
        outputs = f(x) if kind == "compile" else f(w, x)[0][1]
        before = [o.numpy().copy() for o in outputs]
        x += 100.0
        for o, b in zip(outputs, before, strict=True):
            np.testing.assert_array_equal(o.numpy(), b)
        x -= 100.0


def test_a_donated_numpy_argument_is_copied_on_the_first_call_as_on_later_ones(backend):
    """Outputs are written into a donated argument's buffer: never the caller's array."""

    def step(p, g):
        return p - 0.5 * g

    f = bp.compile(step, donate_argnums=(0,))
    p = np.arange(6.0, dtype=np.float32)
    g = np.ones(6, np.float32)
    for _ in range(3):
        out = f(p, g)
        np.testing.assert_array_equal(p, np.arange(6.0, dtype=np.float32))
        np.testing.assert_array_equal(out.numpy(), p - 0.5)


def test_a_big_endian_array_is_read_as_its_values(backend):
    x = np.arange(8.0, dtype=">f4").reshape(2, 4)
    f = bp.compile(lambda x: x * 2.0)
    for _ in range(2):
        np.testing.assert_array_equal(f(x).numpy(), np.arange(8.0).reshape(2, 4) * 2)


def _reshaping(w, x):
    return bp.sum(bp.tanh(bp.reshape(bp.transpose(x), (-1,)) * 2.0)) + bp.sum(x @ w)


@pytest.mark.parametrize("order", ["F order", "sliced", "reversed"])
def test_a_reshape_of_an_argument_not_in_c_order_holds_what_explain_prints(backend, order):
    """The reference interpreter's storage model reads inputs as C-contiguous, so a reshape of
    an argument in another layout gets it in C order (a copy); any other reader reads it in
    its own layout."""
    x = numpy_argument_layouts()[order]
    w = bp.tensor(np.random.default_rng(5).standard_normal((16, 8)).astype(np.float32))
    w.requires_grad = True
    f = bp.value_and_grad(_reshaping)
    report = bp.explain(f, w, x)
    assert counted_calls(lambda: f(w, x), CALLS) == printed_calls(report, CALLS)
    value, grad = f(w, x)
    want_value, want_grad = bp.value_and_grad(_reshaping)(w, bp.tensor(np.ascontiguousarray(x)))
    np.testing.assert_allclose(value.numpy(), want_value.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), want_grad.numpy(), rtol=1e-5)
