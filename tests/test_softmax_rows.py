"""The library's softmax rows (codegen/kernels/rows.py), which generated plans and the fused
attention call: equal to the reference interpreter's softmax on masked (-inf), fully masked,
NaN and ordinary rows of every length around the vector width, in both float dtypes, and
compiled with no float64 arithmetic for float32 rows and with vector loops."""

import numpy as np
import pytest
from numba import njit

from backplan.codegen.flags import FASTMATH
from backplan.codegen.kernels import row_math, rows
from backplan.ir.ops.nn import _log_softmax_ref, _softmax_ref

LENGTHS = (1, 3, 15, 16, 17, 64, 127, 128, 1000)


def _rows(dtype, length: int) -> np.ndarray:
    rng = np.random.default_rng(length)
    x = (rng.standard_normal((7, length)) * 4).astype(dtype)
    x[1, ::3] = -np.inf  # a mask
    x[2, :] = -np.inf  # every key masked: NaN, as the reference
    x[3, length // 2] = np.nan
    x[4, -1] = 80.0  # a huge peak next to small values
    x[5, :] = 1.0  # equal values: 1 / length each
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_rows_equal_the_reference(dtype, length, log):
    x = _rows(dtype, length)
    out = np.empty_like(x)
    rows.softmax_rows(x, out, log)
    with np.errstate(invalid="ignore"):  # -inf - -inf in the fully masked row
        expected = (_log_softmax_ref if log else _softmax_ref)(x, 1)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    tolerance = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)
    if not log and length > 1:
        assert np.all(out[1, ::3] == 0.0)  # masked keys get exactly 0


def test_softmax_rows_in_place():
    x = _rows(np.float32, 128)
    with np.errstate(invalid="ignore"):
        expected = _softmax_ref(x, 1)
    rows.softmax_rows(x, x, False)
    np.testing.assert_allclose(x, expected, rtol=2e-6, atol=2e-6)


def test_row_helpers_run_as_python_too():
    """Under BACKPLAN_KERNELS_AS_PYTHON=1 the helpers are these functions: IEEE maxNum."""
    assert row_math.maxnum(np.nan, 2.0) == 2.0 and row_math.maxnum(1.0, np.nan) == 1.0
    assert row_math.maxnum(-np.inf, -3.0) == -3.0
    assert type(row_math.one_like(np.float32(5))) is np.float32
    assert row_math.zero_like(np.float32(5)) == 0


def test_float32_rows_compile_to_float32_vector_loops():
    """A float64 sum or peak (0.0, a Python float) would show as double arithmetic; a called
    exp or a compare-and-select max would keep the loops scalar."""
    softmax_row = njit(fastmath=FASTMATH, error_model="numpy", inline="always")(rows._softmax_row)

    @njit(fastmath=FASTMATH, error_model="numpy")
    def softmax_rows(x, out):
        for r in range(x.shape[0]):
            softmax_row(x[r], out[r], False)

    x = np.zeros((2, 64), np.float32)
    softmax_rows(x, np.empty_like(x))
    llvm = softmax_rows.inspect_llvm(softmax_rows.signatures[0])
    assert "double" not in llvm.split("define", 2)[-1].replace("double*", "")
    assert "x float>" in llvm  # vector loops
    assert "llvm.vector.reduce.fmax" in llvm or "maxnum.v" in llvm  # the peak, vectorised
