"""NumPy arrays as arguments of compiled functions: the fast path reads them in place (a
read-only view, no copy) and copies only what would outlive the call, so changing an array
after a call never changes what the call returned or what a later backward computes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_in_threads

import backplan as bp
from backplan.runtime.backend import current_backend, use_backend


@pytest.fixture(params=["numba", "reference"])
def backend(request):
    """Compiled plans read NumPy arguments in place; the reference interpreter copies them."""
    with use_backend(request.param):
        yield request.param


def _loss(params, x):
    return bp.sum(bp.tanh(x @ params["w"] + params["b"]))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w": rng.standard_normal((3, 2)).astype(np.float32),
        "b": rng.standard_normal(2).astype(np.float32),
    }
    return params, rng.standard_normal((4, 3)).astype(np.float32)


class Recorder:
    """Stands in for a plan's runner and keeps the arrays each call was given."""

    def __init__(self, runner):
        self.runner, self.backend, self.calls = runner, runner.backend, []

    def __call__(self, arrays, *rest, **options):
        self.calls.append(list(arrays))
        return self.runner(arrays, *rest, **options)


def _record_joint(step, args) -> Recorder:
    """Wrap the runner of step's joint plan for these arguments."""
    entry = step.trace(*args)
    recorder = Recorder(entry.runner())
    entry._runners[current_backend()] = recorder
    return recorder


def test_numpy_arguments_are_read_in_place_and_give_the_tensor_results(backend):
    step = bp.value_and_grad(bp.compile(_loss))
    params, x = _data()
    tensor_args = ({k: bp.tensor(v) for k, v in params.items()}, bp.tensor(x))
    want_value, want_grads = step(*tensor_args)
    step(params, x)  # the first NumPy call binds the signature (reading them in place too)
    recorder = _record_joint(step, (params, x))
    value, grads = step(params, x)
    assert step.cache_info().traces == 1  # NumPy or tensor arguments: one signature
    given = recorder.calls[-1]
    assert all(not a.flags.writeable for a in given)  # the plan cannot write into them
    for array in (params["w"], params["b"], x):
        seen = [a for a in given if np.shares_memory(a, array)]
        assert len(seen) == 1  # a view, not a copy, compiled or interpreted
        assert array.flags.writeable  # the caller's array is left as it was
    np.testing.assert_allclose(value.numpy(), want_value.numpy(), rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(grads[k].numpy(), want_grads[k].numpy(), rtol=1e-6)


def test_a_numpy_argument_an_output_keeps_is_copied(backend):
    def loss_and_input(w, y):
        return bp.sum(w * y), y

    step = bp.value_and_grad(bp.compile(loss_and_input), has_aux=True)
    w, y = np.ones(3, np.float32), np.arange(3, dtype=np.float32)
    step(w, y)
    (_, aux), grad = step(w, y)  # the fast path
    assert not np.shares_memory(aux.numpy(), y) and y.flags.writeable
    y[:] = 7.0
    np.testing.assert_array_equal(aux.numpy(), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(grad.numpy(), [0.0, 1.0, 2.0])


def test_changing_a_numpy_argument_after_the_call_changes_no_result(backend):
    @bp.compile
    def forward(w, x):
        return bp.sum(bp.tanh(x @ w)), x.reshape(-1), x * 2.0

    w = bp.tensor(np.full((3, 1), 0.5, np.float32), requires_grad=True)
    x = np.ones((2, 3), np.float32)
    forward(w, x)
    loss, flat, doubled = forward(w, x)  # the fast path
    x[:] = -5.0  # after the call, before backward
    np.testing.assert_array_equal(flat.numpy(), np.ones(6))
    np.testing.assert_array_equal(doubled.numpy(), np.full((2, 3), 2.0))
    loss.backward()  # reads the x saved for backward: the values at call time
    expected = np.ones((2, 3)).T @ (1 - np.tanh(np.full((2, 1), 1.5)) ** 2)
    np.testing.assert_allclose(w.grad.numpy(), expected, rtol=1e-5)
    assert forward.cache_info().traces == 1


def test_the_signature_cache_follows_numpy_structure_shape_and_dtype():
    step = bp.compile(lambda tree: sum(bp.sum(v) for v in tree.values()))
    a, b = np.ones(2, np.float32), np.ones(3, np.float32)
    assert step({"a": a}).item() == 2.0
    assert step({"a": a}).item() == 2.0
    assert step.cache_info().traces == 1
    assert step({"a": a.astype(np.float64)}).item() == 2.0
    assert "['a']: dtype f32 -> f64" in step.cache_info().last_miss_reason
    assert step({"a": a, "b": b}).item() == 5.0  # a new structure: a new trace
    assert "structure" in step.cache_info().last_miss_reason
    assert step({"a": bp.tensor(a)}).item() == 2.0  # a tensor with the first signature
    assert step({"a": a, "b": b}).item() == 5.0
    assert step.cache_info().traces == 3


def test_bad_numpy_arguments_still_raise_after_a_fast_call():
    step = bp.compile(lambda x: bp.sum(x))
    step(np.ones(3, np.float32))
    step(np.ones(3, np.float32))
    with pytest.raises(bp.DtypeError, match="complex"):
        step(np.ones(3, np.complex64))
    with pytest.raises(TypeError):
        step(np.array(["a", "b"]))


def test_a_donated_numpy_argument_keeps_its_values(backend):
    step = bp.compile(lambda p, g: p - 0.5 * g, donate_argnums=0)
    p, g = np.ones(4, np.float32), np.ones(4, np.float32)
    step(p, g)
    out = step(p, g)  # the fast path
    np.testing.assert_array_equal(p, np.ones(4))
    assert p.flags.writeable
    p[:] = 3.0
    np.testing.assert_array_equal(out.numpy(), np.full(4, 0.5))


def test_two_threads_calling_with_numpy_arguments_get_their_own_results():
    step = bp.value_and_grad(bp.compile(_loss))
    data = [_data(seed) for seed in (1, 2)]
    want = [step({k: bp.tensor(v) for k, v in p.items()}, bp.tensor(x)) for p, x in data]
    failures = []

    def worker(k):
        params, x = data[k]
        for _ in range(50):
            value, grads = step(params, x)
            if not np.allclose(value.numpy(), want[k][0].numpy(), rtol=1e-5):
                failures.append((k, value.item()))

    with use_backend("numba"):
        run_in_threads(worker, (0, 1))
    assert not failures
