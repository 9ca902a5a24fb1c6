"""Compiled vs reference on special values: inf, -inf, nan, huge, tiny and empty axes. Every
op below runs in one compiled function (one compile), once per row of special inputs, and must
agree with the reference interpreter (NumPy and PyTorch semantics: logsumexp([inf, 1, 2]) is
inf; softmax over an empty axis is empty)."""

import warnings

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

INF, NAN = np.inf, np.nan
HUGE, TINY = 3e38, 1e-45  # near float32's largest finite value and smallest subnormal
ROWS = {
    "inf": [INF, 1.0, 2.0, -1.0],
    "-inf": [-INF, 1.0, 2.0, -1.0],
    "all -inf": [-INF, -INF, -INF, -INF],
    "inf and -inf": [INF, -INF, 0.5, 1.0],
    "nan": [NAN, 1.0, 2.0, -1.0],
    "huge": [HUGE, HUGE, -HUGE, 1.0],
    "tiny": [TINY, -TINY, 0.0, -0.0],
}


def ops(x, empty):
    """x: f32[4]; empty: f32[3, 0]. Elementwise, reductions, row composites, empty axes."""
    row = bp.reshape(x, (1, 4))
    return {
        "exp": bp.exp(x),
        "log": bp.log(bp.abs(x)),
        "tanh": bp.tanh(x),
        "sigmoid": bp.sigmoid(x),
        "sqrt": bp.sqrt(bp.abs(x)),
        "rsqrt": 1.0 / bp.sqrt(bp.abs(x)),  # with arcp, LLVM's estimate gave nan at 0 and inf
        "relu": bp.relu(x),
        "maximum": bp.maximum(x, 0.0),
        "div_by_zero": x / 0.0,
        "sum": bp.sum(x),
        "max": bp.max(x),
        "mean": bp.mean(x),
        "logsumexp": bp.logsumexp(x, axis=0),
        "logsumexp_rows": bp.logsumexp(row, axis=1),
        "softmax": bp.softmax(row, axis=-1),
        "log_softmax": bp.log_softmax(row, axis=-1),
        "cross_entropy": bp.cross_entropy(row, bp.tensor(np.array([1]))),
        "softmax_empty": bp.softmax(empty, axis=1),
        "log_softmax_empty": bp.log_softmax(empty, axis=1),
        "logsumexp_empty": bp.logsumexp(empty, axis=1),
        "sum_empty": bp.sum(empty, axis=1),
    }


@pytest.fixture(scope="module")
def compiled():
    return bp.compile(ops)


@pytest.mark.parametrize("name", list(ROWS))
def test_special_values_agree_with_the_reference(compiled, name):
    x = bp.tensor(np.array(ROWS[name], np.float32))
    empty = bp.tensor(np.zeros((3, 0), np.float32))
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend), np.errstate(all="ignore"):
            results[backend] = {k: v.numpy() for k, v in compiled(x, empty).items()}
    wrong = []
    for op, expected in results["reference"].items():
        got = results["numba"][op]
        if got.shape != expected.shape or not np.allclose(
            got, expected, rtol=2e-6, atol=0, equal_nan=True
        ):
            wrong.append(f"{op}: compiled {got} reference {expected}")
    assert not wrong, "\n".join(wrong)


def test_logsumexp_of_inf_is_inf_as_in_numpy(compiled):
    x = bp.tensor(np.array([INF, 1.0, 2.0, 0.0], np.float32))
    with use_backend("numba"):
        out = compiled(x, bp.tensor(np.zeros((3, 0), np.float32)))
    assert out["logsumexp"].item() == INF and out["logsumexp_rows"].numpy()[0] == INF
    assert out["softmax_empty"].shape == (3, 0) and np.all(out["logsumexp_empty"].numpy() == -INF)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_gradient_of_sqrt_at_zero_inf_and_subnormals_agrees_with_the_reference(dtype):
    """d sqrt(x) = 0.5 / sqrt(x) in one loop: a reciprocal estimate made it nan at 0 and inf."""
    x = np.array([0.0, INF, 4.0, TINY, 2.0], dtype)
    grads = {}
    for backend in ("reference", "numba"):
        with use_backend(backend), np.errstate(all="ignore"):
            _, g = bp.value_and_grad(lambda x: bp.sqrt(x).sum())(bp.tensor(x))
        grads[backend] = g.numpy()
    with np.errstate(all="ignore"):
        exact = 0.5 / np.sqrt(x)
    np.testing.assert_allclose(grads["numba"], grads["reference"], rtol=2e-6)
    np.testing.assert_allclose(grads["numba"], exact, rtol=2e-6)


@pytest.mark.reference
@pytest.mark.parametrize("requires_grad", [False, True])
def test_eager_ops_give_ieee_results_without_numpy_warnings_as_compiled_ones_do(requires_grad):
    """1 / sqrt(0) and log(0) are inf and -inf on every path, with no RuntimeWarning from inside
    backplan on one path and silence on the others (torch and JAX are silent too)."""
    x = bp.tensor(np.zeros(3, np.float32), requires_grad=requires_grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eager = [(1.0 / bp.sqrt(x)).numpy(), bp.log(x).numpy()]
    compiled = bp.compile(lambda x: (1.0 / bp.sqrt(x), bp.log(x)))(x)
    for got, want in zip(eager, compiled, strict=True):
        np.testing.assert_array_equal(got, want.numpy())
    assert np.isposinf(eager[0]).all() and np.isneginf(eager[1]).all()
