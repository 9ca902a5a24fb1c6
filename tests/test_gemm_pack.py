"""The GEMM's panel copies: full panels of untransposed rows go through one vector load and
store per row (codegen/kernels/gemm/pack.py `_copy_by_rows`), edges and strided rows through
the element loop; either way the panel holds exactly the block, and nothing outside it is
written."""

import numpy as np
import pytest

from backplan.codegen.kernels.gemm import pack
from backplan.codegen.kernels.gemm.kernel import TILES

ROW_WIDTHS = sorted({mr for w in TILES.values() for lanes, mr, nv in w.values()} | {
    lanes * nv for w in TILES.values() for lanes, mr, nv in w.values()
})


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cols", ROW_WIDTHS)
def test_full_panel_rows_copied_whole_and_nothing_else(dtype, cols):
    """Source rows inside a wider matrix (row stride > cols, odd offset), destination rows
    inside a wider buffer: the block arrives, the gaps keep their sentinel."""
    rng = np.random.default_rng(cols)
    big = rng.standard_normal((40, cols + 13)).astype(dtype)
    src = big[3:37, 5 : 5 + cols]
    out = np.full((34, cols + 3), -7.0, dtype)
    dst = out[:, 1 : 1 + cols]
    assert pack._copy_by_rows(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert np.all(out[:, 0] == -7) and np.all(out[:, 1 + cols :] == -7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_edges_and_strided_rows_left_to_the_element_loop(dtype):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((20, 70)).astype(dtype)
    dst = np.zeros((10, 32), dtype)
    assert not pack._copy_by_rows(dst[:, :5], big[:10, :5])  # an edge panel's width
    assert not pack._copy_by_rows(dst[:, :32], big[:10, :64:2])  # strided source rows
    assert not pack._copy_by_rows(dst[:, ::2][:, :16], big[:10, :16])  # strided destination
    assert np.all(dst == 0)


@pytest.mark.parametrize("width", sorted(TILES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_whose_panels_are_copied_by_rows(width, dtype):
    """op(A) = A.T (A panels are rows of A) and an untransposed B with more rows of C than one
    row block (B packed), k over several k blocks, edges in every direction, strided rows."""
    from backplan.codegen.kernels import gemm as own
    from backplan.codegen.kernels.gemm.driver import KC, MC

    rng = np.random.default_rng(width)
    m, n, k = MC + 21, 75, KC + 37
    a = rng.standard_normal((k, m + 9)).astype(dtype)[:, 4 : 4 + m]  # op(A) = a.T, strided
    b = rng.standard_normal((k, n + 6)).astype(dtype)[:, 3 : 3 + n]
    c = np.full((m, n), np.nan, dtype)
    own.gemm(width, True, False, 1.0, a, b, 0.0, c)
    expected = a.T.astype(np.float64) @ b.astype(np.float64)
    bound = 4 * (k + 2) * np.finfo(dtype).eps * (np.abs(a.T).astype(np.float64) @ np.abs(b))
    assert np.all(np.abs(c - expected) <= bound)
