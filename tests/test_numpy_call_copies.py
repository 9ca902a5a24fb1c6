"""Every copy a call makes of a NumPy argument is in explain's peak and in the checked mode's
count (tracer/numpy_args.py call_copies, ir/peak.py "copied out" / "copied in"): an argument an
output reads (x itself, x.T, a reshape of x: the copy is that output, the caller's to keep), an
array in another byte order (its values converted for the call), and on the reference
interpreter an array not in C order that a reshape reads (copied in C order for the call).
Before, each was a copy of x neither explain nor the checked mode saw: the process held
x.nbytes more than printed."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

CALLS = 3
# Python's own objects during a call (on numba up to ~73 KB when a call overlaps the driver's
# background build, which allocates in the same process); a missed copy of x is 524,288
SLACK = 131_072


@pytest.fixture(params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _x(order: str = "C") -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)  # 512 KiB
    return {"C": x, "F": np.asfortranarray(x), ">f4": x.astype(">f4")}[order]


def _held_by_numpy(call) -> int:
    """The most bytes NumPy held during call() (tracemalloc: Python's objects too, a few KB)."""
    tracemalloc.start()
    try:
        result = call()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def _check_calls(backend, f, args, step):
    """Checked mode's count = explain's on calls 1-3, and what NumPy held (compiled: calls 2-3,
    after compiling) within SLACK above it."""
    report = f.explain(*args)
    assert counted_calls(step, CALLS) == printed_calls(report, CALLS)
    for n in range(1, CALLS + 1):
        measured, _ = _held_by_numpy(step)
        printed = report.peak_on_call(n).allocated_peak_bytes
        if backend == "reference":
            assert printed <= measured < printed + SLACK, (n, measured, printed)
        else:  # the compiled plan's own buffers are Numba's: NumPy holds only the copies
            assert measured < printed + SLACK, (n, measured, printed)
    return report


OUTPUTS = {
    "x": lambda x: (x, x.sum()),
    "x.T": lambda x: (x.T, x.sum()),
    "reshape": lambda x: (x.reshape(-1), (x * 2.0).sum()),
}


@pytest.mark.parametrize("name", OUTPUTS)
def test_an_output_reading_a_numpy_argument_counts_its_copy(backend, name):
    x = _x()
    f = bp.compile(OUTPUTS[name])
    report = _check_calls(backend, f, (x,), lambda: f(x))
    assert report.peak_on_call(2).at_peak()["outputs"] >= x.nbytes
    with use_backend("reference"):
        want = [o.numpy().copy() for o in bp.compile(OUTPUTS[name])(bp.tensor(x))]
    got = f(x)
    x += 1.0  # the caller's later writes reach no output
    for o, w in zip(got, want, strict=True):
        np.testing.assert_allclose(o.numpy(), w, rtol=2e-5)  # a sum of 131,072: reassociated


def test_a_value_and_grad_output_reading_a_numpy_argument_counts_its_copy(backend):
    x = _x()
    w = bp.tensor(np.ones((256, 4), np.float32))
    f = bp.value_and_grad(lambda w, x: (bp.tanh(x @ w).sum(), x.T), has_aux=True)
    _check_calls(backend, f, (w, x), lambda: f(w, x))
    (_, aux), grad = f(w, x)
    np.testing.assert_array_equal(aux.numpy(), x.T)


def _loss(w, x):
    return bp.tanh(x @ w).sum()


@pytest.mark.parametrize("kind", ["compile", "vg"])
def test_an_array_in_another_byte_order_counts_its_conversion(backend, kind):
    x = _x(">f4")
    w = bp.tensor(np.ones((256, 4), np.float32) * 0.01, requires_grad=True)
    f = bp.compile(lambda x: (x * 2.0).sum()) if kind == "compile" else bp.value_and_grad(_loss)
    args = (x,) if kind == "compile" else (w, x)
    _check_calls(backend, f, args, lambda: f(*args))
    with use_backend("reference"):
        want = bp.compile(lambda x: (x * 2.0).sum())(bp.tensor(x.astype(np.float32)))
        want_vg = bp.value_and_grad(_loss)(w, bp.tensor(x.astype(np.float32)))
    got = f(*args)
    if kind == "compile":
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)
    else:
        np.testing.assert_allclose(got[1].numpy(), want_vg[1].numpy(), rtol=1e-5, atol=1e-6)


def _reshaping(w, x):
    return bp.sum(bp.tanh(bp.reshape(bp.transpose(x), (-1,)) * 2.0)) + bp.sum(x @ w)


def test_a_reshape_of_an_f_order_argument_counts_the_reference_interpreters_copy(backend):
    """The interpreter's storage model reads a reshaped input as C-contiguous: it gets a C-order
    copy for the call, counted while the call runs; compiled plans read it in place."""
    x = _x("F")
    w = bp.tensor(np.ones((256, 4), np.float32), requires_grad=True)
    f = bp.value_and_grad(_reshaping)
    report = _check_calls(backend, f, (w, x), lambda: f(w, x))
    copies = report.peak_on_call(2).at_peak().get("copies", 0)
    assert copies == (x.nbytes if backend == "reference" else 0)
    with use_backend("reference"):
        want = bp.value_and_grad(_reshaping)(w, bp.tensor(np.ascontiguousarray(x)))
    got = f(w, x)
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got[1].numpy(), want[1].numpy(), rtol=1e-5, atol=1e-5)


def test_a_donated_numpy_argument_counts_the_copy_its_outputs_are_written_into(backend):
    """The caller's array is never written: the call copies it (C order) and, compiled, writes
    the outputs into the copy; the interpreter reads the copy for the call."""
    p, g = _x(), _x() * 0.5
    f = bp.compile(lambda p, g: p - 0.5 * g, donate_argnums=(0,))
    _check_calls(backend, f, (p, g), lambda: f(p, g))
    before = p.copy()
    np.testing.assert_allclose(f(p, g).numpy(), before - 0.5 * g, rtol=1e-6)
    np.testing.assert_array_equal(p, before)
