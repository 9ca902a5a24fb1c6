"""The NT product computed as its transpose (gemm/symbols.py _transpose_nt) and the
micro-kernel that stores its tile transposed (gemm/kernel.py store_tile_transposed): float64
references over odd shapes and edge tiles, one and several k blocks, beta over NaN and
beta != 0, C inside a larger array (nothing outside it written), a column-major C given
directly, NaN and infinity, and bit-for-bit equality with the product left as it was."""

import numpy as np
import pytest
from helpers import two_layer_step_source

from backplan.codegen.kernels import gemm as own
from backplan.codegen.kernels.gemm import choice, isa
from backplan.codegen.kernels.gemm.driver import KC
from backplan.codegen.kernels.gemm.symbols import _transpose_nt

NR = 32  # the 512-bit float32 tile's width


def _reference(a, b, alpha=1.0, beta=0.0, c0=None):
    """alpha * A @ B.T + beta * C0 in float64 and its rounding bound (k * eps)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want, scale = alpha * (a64 @ b64.T), abs(alpha) * (np.abs(a64) @ np.abs(b64).T)
    if beta != 0:
        want, scale = want + beta * c0, scale + abs(beta * c0)
    bound = 4 * (a.shape[1] + 2) * np.finfo(np.float32).eps * scale + 1e-30
    return want, bound


def _as_before(a, b, alpha=1.0, beta=0.0, c0=None):
    """The same product not transposed: C a view with a column stride of two elements, which
    _transpose_nt refuses (the tiles then go through the edge tile, as before)."""
    m, n = a.shape[0], b.shape[0]
    wide = np.full((m, 2 * n), np.nan, np.float32)
    c = wide[:, ::2]
    if c0 is not None:
        c[...] = c0
    own.gemm(512, False, True, alpha, a, b, beta, c)
    return c


SHAPES = [  # (m, n, k): taken (k (n - m) >= m n per k block) unless marked
    (128, 512, 512),  # the mlp's input gradient, two k blocks
    (32, 144, 512),  # a convolution's weight gradient
    (33, 100, 77),  # edge rows (100 = 12 * 8 + 4) and edge columns (33 = 32 + 1)
    (47, 203, KC + 1),  # a one-column second k block
    (40, 41, 3),  # not taken: k too short
    (32, 64, 1),  # not taken
]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_nt_products_match_float64_and_the_untransposed_product_bit_for_bit(m, n, k):
    rng = np.random.default_rng(m * n + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    c = np.full((m, n), np.nan, np.float32)  # beta 0: C is not read
    own.gemm(512, False, True, 1.0, a, b, 0.0, c)
    want, bound = _reference(a, b)
    assert np.all(np.abs(c - want) <= bound)
    np.testing.assert_array_equal(c, _as_before(a, b))
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    c = c0.copy()
    own.gemm(512, False, True, -2.0, a, b, 0.5, c)
    want, bound = _reference(a, b, -2.0, 0.5, c0.astype(np.float64))
    assert np.all(np.abs(c - want) <= bound)
    np.testing.assert_array_equal(c, _as_before(a, b, -2.0, 0.5, c0))


def test_transposed_c_inside_a_larger_array_writes_only_c():
    rng = np.random.default_rng(3)
    m, n, k = 64, 260, 300
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    big = np.full((m + 3, n + 9), 5.0, np.float32)
    view = big[2 : 2 + m, 4 : 4 + n]
    view[...] = np.nan
    own.gemm(512, False, True, 1.0, a, b, 0.0, view)
    want, bound = _reference(a, b)
    assert np.all(np.abs(view - want) <= bound)
    view[...] = 0
    assert np.all(big == np.where(np.pad(np.ones((m, n)), ((2, 1), (4, 5))) == 1, 0, 5))


@pytest.mark.parametrize("m,n,k", [(200, 96, 50), (45, 70, 400), (8, 32, 9)])
def test_a_column_major_c_is_stored_by_the_transposing_kernel(m, n, k):
    """C given as the transpose of a row-major array (no swap in the symbol): its full tiles
    over A's rows are stored transposed, edge tiles element by element."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = np.full((n, m), np.nan, np.float32).T
    own.gemm(512, False, False, 1.0, a, b, 0.0, c)
    want, bound = _reference(a, np.ascontiguousarray(b.T))
    assert np.all(np.abs(c - want) <= bound)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    c[...] = c0
    own.gemm(512, False, False, 3.0, a, b, -1.0, c)
    want, bound = _reference(a, np.ascontiguousarray(b.T), 3.0, -1.0, c0.astype(np.float64))
    assert np.all(np.abs(c - want) <= bound)


def test_nan_and_infinity_reach_exactly_the_results_they_reach_in_float64():
    rng = np.random.default_rng(9)
    m, n, k = 40, 300, 500
    a = np.abs(rng.standard_normal((m, k))).astype(np.float32) + 0.5
    b = np.abs(rng.standard_normal((n, k))).astype(np.float32) + 0.5  # positive: inf stays
    a[3, 7], a[m - 1, 400] = np.inf, np.nan  # a full tile's row, the edge rows of C
    b[5, 9], b[n - 1, 0], b[100, 450] = np.nan, -np.inf, np.inf  # full and edge tiles
    c = np.full((m, n), 1.0, np.float32)
    own.gemm(512, False, True, 1.0, a, b, 0.0, c)
    with np.errstate(invalid="ignore"):  # inf * 0 and nan are the point
        want = a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_array_equal(np.isnan(c), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(c) & (c > 0), np.isinf(want) & (want > 0))
    np.testing.assert_array_equal(np.isinf(c) & (c < 0), np.isinf(want) & (want < 0))
    np.testing.assert_array_equal(c, _as_before(a, b))


def test_the_rule_takes_long_k_products_whose_c_is_wider_than_tall():
    def takes(m, n, k, width=512, b1=4, c1=4):
        return bool(_transpose_nt(width, 0, 1, m, n, k, NR, b1, c1))

    assert takes(128, 512, 512) and takes(32, 144, 512) and takes(32, 512, 512)
    assert not takes(128, 512, 10)  # the 10-wide layer's input gradient: k too short
    assert not takes(256, 1024, 256)  # measured slower: more stored than packed
    assert not takes(512, 128, 512) and not takes(16, 512, 512)  # C tall, C narrower than a tile
    assert not takes(128, 512, 512, width=256)  # the AVX2 tile has no transposing store
    assert not takes(128, 512, 512, b1=8) and not takes(128, 512, 512, c1=8)
    assert not bool(_transpose_nt(512, 1, 1, 128, 512, 512, NR, 4, 4))  # only NT


@pytest.mark.skipif(isa.vector_width() != 512, reason="the transposing store is the 512-bit tile's")
def test_a_step_whose_input_gradient_is_computed_transposed_matches_the_reference(monkeypatch):
    """A two-layer step on one BLAS thread: its hidden layer's input gradient G @ W1.T (40 x
    300, k 200: an edge row tile) runs the own GEMM, which takes it as C.T = W1 @ G.T; value
    and gradients equal the reference interpreter's."""
    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    monkeypatch.setattr(choice, "blas_threads", lambda: 1)
    monkeypatch.setattr(choice, "small_products_own", lambda: True)
    assert bool(_transpose_nt(512, 0, 1, 40, 300, 200, NR, 4, 4))
    source = two_layer_step_source((48, 300), (300, 200), 40, seed=21)
    assert "own_gemm_at(512, np.bool_(False), np.bool_(True), np.intp(40), np.intp(300)" in source
