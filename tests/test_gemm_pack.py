"""The GEMM's panel copies: full panels of untransposed rows go through one vector load and
store per row (codegen/kernels/gemm/pack.py `_copy_by_rows`), edges and strided rows through
the element loop; either way the panel holds exactly the block, and nothing outside it is
written."""

import numpy as np
import pytest

from backplan.codegen.kernels.gemm import pack
from backplan.codegen.kernels.gemm.kernel import TILES

ROW_WIDTHS = sorted(
    {mr for w in TILES.values() for lanes, mr, nv in w.values()}
    | {lanes * nv for w in TILES.values() for lanes, mr, nv in w.values()}
)


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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transposing_pack_of_eight_rows_in_blocks_and_tail(dtype):
    """transpose_pack_8 moves 8 panel rows at a time through an in-register 8 x 8 transpose
    and the rest (kc % 8) one by one: for kc around multiples of 8, source rows inside a
    wider matrix and panel rows inside wider ones (an NT product's 32-wide B panel), dst is
    src transposed and nothing past the 8 columns or kc rows is written. NaN and inf move
    like any value."""
    from numba import njit

    from backplan.codegen.kernels.gemm.transpose_pack import transpose_pack_8

    @njit
    def transpose(src, kc, dst, dst_ld, out):
        ld = src.strides[0] // src.itemsize
        transpose_pack_8(src.ctypes.data, ld, kc, dst.ctypes.data, dst_ld, out, src)

    rng = np.random.default_rng(6)
    for kc in (0, 1, 7, 8, 9, 16, 23, 64, 70):
        big = rng.standard_normal((11, kc + 12)).astype(dtype)
        big[3, 2], big[5, 9 % (kc + 12)] = np.nan, np.inf
        src = big[1:9, 2 : 2 + kc]
        for dst_ld in (8, 32):
            out = np.full((kc + 1) * dst_ld + 3, -7.0, dtype)
            transpose(src, kc, out[1:], dst_ld, out)
            panel = out[1 : 1 + kc * dst_ld].reshape(kc, dst_ld) if kc else out[1:1]
            if kc:
                np.testing.assert_array_equal(panel[:, :8], src.T)
                assert np.all(panel[:, 8:] == -7)
            assert out[0] == -7 and np.all(out[1 + kc * dst_ld :] == -7)
