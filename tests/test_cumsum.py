"""cumsum, an opaque op added in four source files (ir/ops/reductions.py, tracer/ops.py,
tracer/tensor_methods.py, codegen/kernels/scan.py): the compiled kernel against NumPy on
special values, empty axes and odd shapes, forward and reverse, and its gradient (the reverse
scan) compiled against the reference interpreter. One compiled plan covers each group."""

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

INF, NAN = np.inf, np.nan


def np_cumsum(x, axis, reverse=False):
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis), axis)
    return np.cumsum(x, axis)


CASES = [  # (array, axis, reverse)
    (np.array([1.0, NAN, 2.0, 3.0], np.float32), 0, False),  # NaN carries to the end
    (np.array([1.0, NAN, 2.0, 3.0], np.float32), 0, True),  # ... and to the start, reversed
    (np.array([INF, 1.0, -INF, 2.0], np.float32), 0, False),  # inf, then inf - inf = nan
    (np.array([[INF, -INF], [INF, INF]], np.float32), 1, True),
    (np.array([1e30, 1e30, -1e30], np.float32), 0, False),
    (np.zeros((0, 3), np.float32), 0, False),  # an empty axis
    (np.zeros((3, 0), np.float32), 1, True),
    (np.zeros((2, 0, 4), np.float32), 2, False),  # empty elsewhere
    (np.arange(7, dtype=np.float32).reshape(1, 7, 1), 1, True),  # size-1 axes around
    (np.array([5.0], np.float32), 0, False),
    (np.random.default_rng(0).standard_normal((13, 17)).astype(np.float32), 0, True),
    (np.random.default_rng(1).standard_normal((3, 5, 7)).astype(np.float32), 2, False),
    (np.random.default_rng(2).standard_normal((3, 5, 7)).astype(np.float32), 1, True),
]


def _all_cumsums(*arrays):
    return [
        bp.cumsum(a, axis, reverse=rev) for a, (_, axis, rev) in zip(arrays, CASES, strict=True)
    ]


@pytest.mark.filterwarnings("ignore:invalid value encountered in accumulate")  # inf - inf
@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_compiled_cumsum_matches_numpy_on_special_values_and_odd_shapes(backend):
    with use_backend(backend):
        outs = bp.compile(_all_cumsums)(*(bp.tensor(a) for a, _, _ in CASES))
    for out, (array, axis, reverse) in zip(outs, CASES, strict=True):
        want = np_cumsum(array, axis, reverse)
        assert out.shape == want.shape and out.dtype == np.float32
        np.testing.assert_array_equal(out.numpy(), want)  # NaNs in the same places


def test_integers_and_bools_sum_in_int64_compiled():
    ints = np.array([[2**40, 1, -3], [4, 5, 6]], np.int64)
    bools = np.array([True, False, True, True])

    def f(i, b):
        return bp.cumsum(i, 1, reverse=True), bp.cumsum(b), bp.cumsum(i)

    with use_backend("numba"):
        rev, counted, flat = bp.compile(f)(ints, bools)
    np.testing.assert_array_equal(rev.numpy(), np_cumsum(ints, 1, True))
    np.testing.assert_array_equal(counted.numpy(), np.cumsum(bools))
    assert counted.dtype == np.int64 and flat.shape == (6,)
    np.testing.assert_array_equal(flat.numpy(), np.cumsum(ints))


def _loss(x, w):
    return (bp.cumsum(x, 1) * w).sum() + (x.cumsum(dim=0, reverse=True) ** 2).mean()


def test_gradient_is_the_reverse_scan_compiled_and_reference():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    grads = {}
    for backend in ("numba", "reference"):
        with use_backend(backend):
            _, grads[backend] = bp.value_and_grad(_loss)(x, w)
    g = grads["numba"].numpy()
    np.testing.assert_allclose(g, grads["reference"].numpy(), rtol=1e-12)
    rev = np_cumsum(x, 0, True)
    expected = np_cumsum(w, 1, True) + np.cumsum(2 * rev / rev.size, 0)
    np.testing.assert_allclose(g, expected, rtol=1e-12)
    explained = bp.value_and_grad(_loss).explain(x, w)
    reasons = [s.reason for s in explained.saved_buffers]
    assert reasons and not [r for r in reasons if "cumsum" in r]  # its rule saves nothing


def test_bad_axes_and_dtypes_say_the_op_the_shape_and_the_line():
    x = bp.tensor(np.ones((2, 3), np.float32))
    with pytest.raises(bp.ShapeError, match=r"axis.*2.*test_cumsum.py"):
        bp.cumsum(x, axis=2)
    with pytest.raises(bp.ShapeError, match=r"cumsum.*test_cumsum.py"):
        bp.cumsum(bp.tensor(np.float32(1.0)), axis=0)
