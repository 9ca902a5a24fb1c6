"""A row kernel (consecutive loops over the same rows, one loop over rows) also takes stages
that reduce over the rows: a column sum (a scale's or shift's gradient), a column max, a whole
sum (the loss). ln_gelu's value_and_grad step so runs as one loop over rows, each row read
once, where it ran as three loops. Compiled results must equal the reference interpreter's,
special values included; a stage reading a reduction over rows is never fused after it (its
value is final only after the last row)."""

from __future__ import annotations

import re

import numba
import numpy as np
import pytest

import backplan as bp
from backplan.ir.row_local import CHUNKS
from backplan.runtime.backend import use_backend


def _ln_gelu(x, g, b, up):
    y = bp.gelu(bp.layer_norm(x) * g + b, approximate="tanh") + x
    return bp.sum(y * up)


def _compiled(vg, *args):
    with use_backend("numba"):
        return vg.trace(*args).runner().compiled


def _both(*args):
    """The step on each backend, each from its own trace (a function's plans keep the backend
    they were made for)."""
    out = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            value, grads = bp.value_and_grad(_ln_gelu, argnums=(0, 1, 2))(*args)
            out[backend] = [np.asarray(value.numpy())] + [g.numpy() for g in grads]
    return out["reference"], out["numba"]


@pytest.mark.parametrize("dtype,rows,cols", [("float32", 37, 19), ("float64", 5, 3)])
def test_ln_gelu_step_is_one_row_kernel_equal_to_reference(dtype, rows, cols):
    rng = np.random.default_rng(7)
    args = [
        bp.tensor(rng.standard_normal(s).astype(dtype))
        for s in ((rows, cols), (cols,), (cols,), (rows, cols))
    ]
    vg = bp.value_and_grad(_ln_gelu, argnums=(0, 1, 2))
    compiled = _compiled(vg, *args)
    kernels = [k.source for k in compiled.loop_kernels]
    assert len(kernels) == 1, "statistics, forward + backward and dx in one loop over rows"
    # dx's first term, stored by one stage for the next, is kept one row at a time (where the
    # rows outnumber the rows reserved for it: ir/row_local.py)
    one_row = re.search(r"\bw\d+\[i1\] = t\d+", kernels[0]) is not None
    assert one_row == (rows > CHUNKS)
    ref, got = _both(*args)
    tol = 1e-5 if dtype == "float32" else 1e-12
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)


def test_ln_gelu_row_kernel_gradient_against_finite_differences():
    rng = np.random.default_rng(8)
    x, g, b, up = (rng.standard_normal(s) for s in ((6, 5), (5,), (5,), (6, 5)))
    vg = bp.value_and_grad(_ln_gelu, argnums=(0, 1, 2))
    with use_backend("numba"):
        _, grads = vg(*(bp.tensor(a) for a in (x, g, b, up)))
    params = [x, g, b]
    for i, grad in enumerate(grads):
        v = rng.standard_normal(params[i].shape)

        def f(z, i=i):
            moved = [z if j == i else p for j, p in enumerate(params)]
            with use_backend("numba"):
                return float(_ln_gelu(*(bp.tensor(a) for a in moved), bp.tensor(up)).numpy())

        eps = 1e-6
        numeric = (f(params[i] + eps * v) - f(params[i] - eps * v)) / (2 * eps)
        analytic = float(np.sum(grad.numpy() * v))
        assert abs(analytic - numeric) <= 1e-7 * (np.linalg.norm(grad.numpy()) + 1)


def test_column_max_and_total_after_row_statistics_with_special_values():
    """A layer norm's row statistics, then a column max (NaN wins, infinities kept) and a whole
    sum in the stage after them: one loop over rows."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((9, 4))
    w = rng.standard_normal((9, 4))
    w[2, 0], w[5, 1] = np.nan, np.inf
    w[:, 2] = -np.inf

    def fn(x, w):
        scaled = bp.layer_norm(x) * w
        return bp.max(scaled, axis=0), bp.sum(bp.where(scaled == scaled, scaled, 0.0), axis=0)

    with use_backend("reference"):
        ref = [t.numpy() for t in bp.compile(fn)(bp.tensor(x), bp.tensor(w))]
    with use_backend("numba"):
        got = [t.numpy() for t in bp.compile(fn)(bp.tensor(x), bp.tensor(w))]
    assert np.isnan(ref[0][0]) and np.isinf(ref[0][2]) and np.isfinite(ref[0][3])
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
        np.testing.assert_allclose(g, r, rtol=1e-12)


def test_stage_reading_a_column_sum_is_not_fused_after_it():
    """x * sum(x, axis=0) needs every row's contribution before its first row: fused into the
    same loop over rows it would read a partial sum."""
    x = np.random.default_rng(10).standard_normal((7, 3))

    def fn(x):
        col = bp.sum(x * 3.0, axis=0, keepdims=True)
        return bp.sum(x * col, axis=1)

    with use_backend("reference"):
        ref = bp.compile(fn)(bp.tensor(x)).numpy()
    with use_backend("numba"):
        got = bp.compile(fn)(bp.tensor(x)).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    np.testing.assert_allclose(ref, np.sum(x * np.sum(3 * x, axis=0), axis=1), rtol=1e-12)


def test_parallel_row_kernel_reduces_columns_in_chunks():
    """Big enough for threads: the rows run in chunks, each with its own partial column sums."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread: no loop is parallel")
    rng = np.random.default_rng(11)
    shape = (2048, 1024)  # 2**21 elements: codegen/flags.PARALLEL_MIN_ELEMENTS
    args = [
        bp.tensor(rng.standard_normal(s).astype(np.float32))
        for s in (shape, shape[1:], shape[1:], shape)
    ]
    vg = bp.value_and_grad(_ln_gelu, argnums=(0, 1, 2))
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        compiled = _compiled(vg, *args)
        ref, got = _both(*args)
    finally:
        numba.set_num_threads(previous)
    (source,) = [k.source for k in compiled.loop_kernels]
    assert "for chunk in prange(16)" in source and "for i0 in range(lo, hi)" in source
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
