"""A GEMM's epilogue holding a column sum (ir/epilogue.py, codegen/render/epilogue.py): the loop
after a 2-D matmul that also sums down the columns (the bias gradient of a layer the backward
recomputes) runs inside the own GEMM on each finished block of rows, its sum taking each row,
with the reference interpreter's values, on odd shapes, several row blocks, inf and NaN."""

import numpy as np
import pytest
from test_gemm_epilogue import SHAPES, assert_blocked_close, fused_kernels, own_gemm  # noqa: F401

import backplan as bp
from backplan.bench.memory_budget import plan_outputs
from backplan.runtime.backend import use_backend

pytestmark = pytest.mark.usefixtures("own_gemm")  # BACKPLAN_GEMM=own in every test


def column_sums(w, b, c, x):
    return bp.sum(bp.tanh(x @ w + b) * c, axis=0)


def layer_arrays(rng, m, k, n, dtype):
    x = rng.standard_normal((m, k)).astype(dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    return w, rng.standard_normal(n).astype(dtype), rng.standard_normal((m, n)).astype(dtype), x


def forward(fn, arrays, backend):
    with use_backend(backend):
        return bp.compile(fn)(*map(bp.tensor, arrays)).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_sum_runs_in_the_epilogue_with_the_reference_values(dtype):
    fn = column_sums
    rng = np.random.default_rng(5)
    for m, k, n in SHAPES:
        arrays = layer_arrays(rng, m, k, n, dtype)
        plan = bp.compile(fn).trace(*map(bp.tensor, arrays)).program.plans.forward
        (kernel,) = fused_kernels(plan)
        assert kernel.nodes[0].op == "matmul" and kernel.epilogue.reductions
        ref, got = forward(fn, arrays, "reference"), forward(fn, arrays, "numba")
        assert got.dtype == dtype
        assert_blocked_close(got, ref, dtype, 2 * m + k)


def test_inf_and_nan_reach_the_sums_of_their_columns():
    rng = np.random.default_rng(6)
    w, b, c, x = layer_arrays(rng, 200, 9, 40, np.float32)
    x[3, :], c[150, 7], b[11] = np.nan, np.inf, -np.inf
    ref = forward(column_sums, (w, b, c, x), "reference")
    got = forward(column_sums, (w, b, c, x), "numba")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    assert np.isnan(got).all()  # row 3 is NaN in every column
    w, b, c, x = layer_arrays(rng, 200, 9, 40, np.float32)
    c[150, 7], b[11] = np.inf, -np.inf
    ref = forward(column_sums, (w, b, c, x), "reference")
    got = forward(column_sums, (w, b, c, x), "numba")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(got[np.isinf(ref)], ref[np.isinf(ref)])
    finite = np.isfinite(ref)
    assert_blocked_close(got[finite], ref[finite], np.float32, 2 * 200 + 9)


def deep_tanh(params, x):
    h = x
    for w, b in params:
        h = bp.tanh(h @ w + b)
    return bp.sum(h * h)


def test_a_layer_recomputed_for_the_backward_takes_its_bias_gradient_into_the_epilogue():
    """A plan holding 1/5 of the saved bytes recomputes layers in the backward; each recomputed
    x @ w + b, tanh, tanh' and the bias gradient's column sum run as one GEMM kernel (before:
    the GEMM bare, its result read back by the gradient loop), with the reference values."""
    rng = np.random.default_rng(8)
    params = [
        ((rng.standard_normal((24, 24)) * 0.3).astype(np.float32), rng.standard_normal(24) * 0.1)
        for _ in range(6)
    ]
    params = [(w, b.astype(np.float32)) for w, b in params]
    x = rng.standard_normal((150, 24)).astype(np.float32)
    planner = bp.value_and_grad(deep_tanh).trace(params, x).planner
    default = planner.points("saved")[0]
    plan = planner.cheapest_saved(default.held_bytes // 5).plans.plan
    kernels = fused_kernels(plan)
    axes = [r.attrs["axes"] for k in kernels for r in k.epilogue.reductions]
    assert axes and set(axes) == {(0,)}, axes  # recomputed layers' bias gradients
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            _, (outputs,), _ = plan_outputs([plan], [params, x])
        results[backend] = outputs
    assert len(results["numba"]) == 1 + 2 * len(params)
    for got, ref in zip(results["numba"], results["reference"], strict=True):
        assert_blocked_close(got, ref, np.float32, 3 * 150 + 24)
