"""A function bp.load returns reads a NumPy argument in place, as the compiled function it was
exported from does (artifacts/call.py wraps each array as a read-only view; the call copies only
what outlives it: tracer/numpy_args.py): what its explain prints for a call is what the call
holds. Before, every NumPy argument was copied on every call of a loaded function, bytes
neither explain nor the checked mode saw (a 16.8 MB batch held 16.8 MB more than printed)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from helpers import numpy_argument_layouts, step_of

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

CALLS = 3


@pytest.fixture(params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _loss(w, x):
    return bp.tanh(x @ w).sum()


def _loaded(kind: str, tmp_path, w, x, fn=_loss):
    compiled = bp.compile(fn)
    exported = compiled if kind == "compile" else bp.value_and_grad(compiled)
    return bp.load(bp.export(exported, w, x, path=tmp_path / f"{kind}.bpz"))


def _weights():
    w = bp.tensor(np.random.default_rng(4).standard_normal((16, 8)).astype(np.float32))
    w.requires_grad = True
    return w


def test_a_loaded_value_and_grad_holds_no_copy_of_a_numpy_argument(tmp_path):
    """What NumPy allocates during each call (tracemalloc: Python's objects too, a few KB)
    against explain's allocated peak: the 4 MiB copy each call made before would show."""
    x = np.random.default_rng(2).standard_normal((4096, 256)).astype(np.float32)
    w = bp.tensor(np.ones((256, 8), np.float32), requires_grad=True)
    f = _loaded("vg", tmp_path, w, x)
    report = f.explain(w, x)
    for n in range(1, CALLS + 1):
        tracemalloc.start()
        try:
            f(w, x)
            measured = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        printed = report.peak_on_call(n).allocated_peak_bytes
        assert printed <= measured < printed + x.nbytes // 8, (n, measured, printed)


@pytest.mark.parametrize("kind", ["compile", "vg"])
@pytest.mark.parametrize("order", ["C order", "F order", "sliced", "reversed"])
def test_every_call_of_a_loaded_function_holds_what_explain_prints(tmp_path, backend, kind, order):
    x = numpy_argument_layouts()[order]
    w = _weights()
    f = _loaded(kind, tmp_path, w, np.ascontiguousarray(x))
    report = f.explain(w, x)
    assert counted_calls(step_of(kind, f, w, x), CALLS) == printed_calls(report, CALLS)
    with use_backend("reference"):  # the interpreter's results: the oracle
        want = bp.value_and_grad(_loss)(w, bp.tensor(np.ascontiguousarray(x)))
    for _ in range(2):
        bp.zero_grad(w)
        if kind == "compile":
            value = f(w, x)
            value.backward()
            grad = w.grad
        else:
            value, grad = f(w, x)
        np.testing.assert_allclose(value.numpy(), want[0].numpy(), rtol=1e-5)
        np.testing.assert_allclose(grad.numpy(), want[1].numpy(), rtol=1e-5, atol=1e-6)


def _views(x):
    return x.T, x[1:, ::2] * 2.0, x.reshape(-1)


def test_an_output_of_a_loaded_function_that_views_a_numpy_argument_does_not_change_with_it(
    tmp_path, backend
):
    """An output reading the argument's buffer (a transpose, a reshape) is a copy: the caller's
    later writes to its array do not reach it."""
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    f = bp.load(bp.export(bp.compile(_views), x, path=tmp_path / "views.bpz"))
    report = f.explain(x)  # the copy an output reads is counted: as an output
    assert counted_calls(lambda: f(x), CALLS) == printed_calls(report, CALLS)
    assert report.peak_on_call(1).at_peak()["outputs"] >= x.nbytes
    for _ in range(3):
        outputs = f(x)
        before = [o.numpy().copy() for o in outputs]
        x += 100.0
        for o, b in zip(outputs, before, strict=True):
            np.testing.assert_array_equal(o.numpy(), b)
        x -= 100.0


def test_a_numpy_argument_exported_with_a_gradient_is_copied_once(tmp_path):
    """x exported requiring grad, passed as a NumPy array: its stand-in leaf (which takes the
    gradient nobody asked for) is the copy the backward saves, not a second one, and the step
    holds what explain prints (before: two copies of x from the forward on)."""
    x = np.random.default_rng(5).standard_normal((4096, 64)).astype(np.float32)
    w = bp.tensor(np.ones((64, 8), np.float32), requires_grad=True)
    f = _loaded("compile", tmp_path, w, bp.tensor(x, requires_grad=True))
    report = f.explain(w, x)
    for n in range(1, CALLS + 1):
        bp.zero_grad(w)
        tracemalloc.start()
        try:
            loss = f(w, x)
            forward = tracemalloc.get_traced_memory()[1]
            loss.backward()
            step = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        printed = report.peak_on_call(n).allocated_peak_bytes
        assert x.nbytes <= forward < x.nbytes * 3 // 2, (n, forward)  # one copy, not two
        assert printed <= step < printed + x.nbytes // 8, (n, step, printed)
        bp.zero_grad(w)
        _loss(w, bp.tensor(x)).backward()
        want = w.grad.numpy().copy()
        bp.zero_grad(w)
        f(w, x).backward()
        np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5)


def test_a_loaded_function_refuses_a_dtype_it_cannot_read(tmp_path):
    x = np.ones((48, 16), np.float32)
    f = _loaded("compile", tmp_path, _weights(), x)
    with pytest.raises(bp.DtypeError, match="complex"):
        f(_weights(), x.astype(np.complex64))
    with pytest.raises(bp.ExportError, match="f64"):
        f(_weights(), x.astype(np.float64))
