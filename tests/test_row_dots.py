"""A convolution's weight gradient with few input channels (a small C over a long k) runs as
row dot products (gemm/row_dots.py): the kernel against float64 sums on odd shapes, special
values and empty dims, and the compiled CNN layer's gradient against the reference
interpreter where the plan picks it."""

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.kernels.gemm.choice import ROW_DOTS, conv_gemm_width
from backplan.codegen.kernels.gemm.isa import vector_width
from backplan.codegen.kernels.gemm.row_dots import row_dots
from backplan.runtime.backend import use_backend


@pytest.mark.parametrize("m,n,k", [(16, 9, 2048), (7, 3, 301), (1, 1, 5), (5, 4, 0), (0, 3, 7)])
def test_row_dots_are_the_sums_of_row_products(m, n, k):
    rng = np.random.default_rng(m * 100 + n + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    row_dots(a, b, out)
    expected = a.astype(np.float64) @ b.T.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).T.astype(np.float64)
    assert np.all(np.abs(out - expected) <= 1e-6 * scale + 1e-30)


def test_row_dots_carry_nan_and_inf_to_their_outputs_only():
    a = np.ones((3, 40), np.float32)
    b = np.ones((2, 40), np.float32)
    a[1, 7], b[1, 39] = np.nan, np.inf
    out = np.zeros((3, 2), np.float32)
    row_dots(a, b, out)
    assert np.isnan(out[1]).all()
    assert out[0, 0] == out[2, 0] == 40.0
    assert np.isposinf(out[0, 1]) and np.isposinf(out[2, 1])


def test_strided_operands_are_read_where_they_lie():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((5, 64)).astype(np.float32)[:, ::2]
    b = rng.standard_normal((6, 32)).astype(np.float32)[::2]
    out = np.empty((5, 3), np.float32)
    row_dots(a, b, out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.T.astype(np.float64), rtol=1e-5)


def test_a_small_weight_gradient_over_a_long_k_is_chosen_for_row_dots():
    """The bench CNN's first layer: 16 filters of 1 x 3 x 3 over 32 images of 8 x 8."""
    assert conv_gemm_width(16, 9, 2048, "f32", trans_b=True) == ROW_DOTS
    assert conv_gemm_width(16, 9, 2048, "f32") == 0  # not A @ B.T: BLAS as before
    assert conv_gemm_width(16, 9, 64, "f32", trans_b=True) == 0  # short k
    assert conv_gemm_width(32, 144, 512, "f32", trans_b=True) == vector_width()  # wide: own


def test_compiled_first_layer_gradient_matches_the_reference_with_nan_in_one_image():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, 1, 8, 8)).astype(np.float32)
    w = (rng.standard_normal((16, 1, 3, 3)) * 0.3).astype(np.float32)
    bad = x.copy()
    bad[5, 0, 2, 3] = np.nan

    def loss(w, x):
        return bp.sum(bp.tanh(bp.conv2d(x, w, padding=1)) ** 2)

    grads = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            step = bp.value_and_grad(loss)
            grads[backend] = [step(w, inputs)[1].numpy() for inputs in (x, bad)]
    (ref, ref_bad), (got, got_bad) = grads["reference"], grads["numba"]
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    assert np.isnan(got_bad).all() and np.isnan(ref_bad).all()  # every tap reads the pixel
