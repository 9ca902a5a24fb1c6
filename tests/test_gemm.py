"""backplan's own GEMM against NumPy in float64: odd and empty shapes, every transpose
combination, strided views, batches with broadcast, f32 and f64, both register widths."""

import re

import numpy as np
import pytest
from helpers import run_with_own_gemm_as_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backplan as bp
from backplan.codegen.kernels import gemm as own
from backplan.codegen.kernels.gemm import isa
from backplan.runtime.backend import use_backend

WIDTHS = (512, 256)
DIMS = st.sampled_from([0, 1, 2, 7, 8, 9, 16, 17, 31, 33, 64, 127, 130])


def _op(x, trans):
    return np.swapaxes(x, -1, -2) if trans else x


def _operands(rng, dtype, m, n, k, ta, tb, batch=()):
    a = rng.standard_normal(batch + ((k, m) if ta else (m, k))).astype(dtype)
    b = rng.standard_normal(batch + ((n, k) if tb else (k, n))).astype(dtype)
    return a, b


def _check(result, a, b, ta, tb, dtype, alpha=1.0, beta=0.0, c0=None):
    """Within the rounding of a blocked sum: k * eps relative to |op(A)| @ |op(B)|."""
    a64, b64 = _op(a, ta).astype(np.float64), _op(b, tb).astype(np.float64)
    expected = alpha * (a64 @ b64)
    scale = abs(alpha) * (np.abs(a64) @ np.abs(b64))
    if beta != 0:
        expected = expected + beta * c0
        scale = scale + abs(beta * c0)
    k = a64.shape[-1]
    bound = 4 * (k + 2) * np.finfo(dtype).eps * scale + np.finfo(dtype).tiny
    assert result.shape == expected.shape
    assert np.all(np.abs(result - expected) <= bound), np.max(np.abs(result - expected) - bound)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=DIMS,
    n=DIMS,
    k=DIMS,
    ta=st.booleans(),
    tb=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
    width=st.sampled_from(WIDTHS),
    scalars=st.sampled_from([(1.0, 0.0), (2.0, 0.5), (-1.0, 1.0), (0.0, 2.0)]),
)
def test_gemm_matches_numpy(m, n, k, ta, tb, dtype, width, scalars):
    rng = np.random.default_rng(m * 10007 + n * 101 + k)
    alpha, beta = scalars
    a, b = _operands(rng, dtype, m, n, k, ta, tb)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    c = c0.copy() if beta != 0 else np.full((m, n), np.nan, dtype)  # beta 0: C is not read
    own.gemm(width, ta, tb, alpha, a, b, beta, c)
    _check(c, a, b, ta, tb, dtype, alpha, beta, c0.astype(np.float64))


@pytest.mark.parametrize("width", WIDTHS)
def test_gemm_strided_views_and_multiple_k_blocks(width):
    """Non-contiguous operands and output (no copies), and k longer than one k block."""
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float64):
        a = rng.standard_normal((90, 600)).astype(dtype)[::2, ::2]  # 45 x 300, strided
        b = rng.standard_normal((300, 80)).astype(dtype).T  # op(B) = b.T, b is F-ordered
        big = np.full((47, 83), 7.0, dtype)
        c = big[1:46, 2:82]
        own.gemm(width, False, True, 1.0, a, b, 0.0, c)
        _check(c, a, b, False, True, dtype)
        assert np.all(big[0] == 7) and np.all(big[:, :2] == 7) and np.all(big[:, 82:] == 7)
        cf = np.asfortranarray(np.zeros((45, 80), dtype))
        own.gemm(width, False, True, 1.0, a, b, 0.0, cf)
        _check(cf, a, b, False, True, dtype)


@pytest.mark.parametrize("width", WIDTHS)
def test_b_read_in_place_and_packed_agree(width):
    """One row block of C reads B in place, more rows pack it (driver.py; on 256 bits from
    IN_PLACE_ROWS_256 rows): both, with an edge panel, k over two k blocks, and B's rows
    strided, match float64."""
    from backplan.codegen.kernels.gemm.driver import IN_PLACE_ROWS_256, MC

    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
        b = rng.standard_normal((300, 140)).astype(dtype)[:, ::2]  # 300 x 70, strided columns
        b_rows = np.ascontiguousarray(b)
        for m in (IN_PLACE_ROWS_256, IN_PLACE_ROWS_256 + 1, MC, MC + 1, 3 * MC + 5):
            a = rng.standard_normal((m, 300)).astype(dtype)
            for operand in (b, b_rows):
                c = np.full((m, 70), np.nan, dtype)
                own.gemm(width, False, False, 1.0, a, operand, 0.0, c)
                _check(c, a, operand, False, False, dtype)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_large_b_read_in_place_is_read_row_by_row_first_and_matches(width):
    """A B of LARGE_B_BYTES or more under one row block is read in place after a pass over
    its rows (driver.touch_rows): the product is unchanged, over two k blocks, with strided
    rows, and NaN and inf in B reach only their columns."""
    from backplan.codegen.kernels.gemm.driver import KC, LARGE_B_BYTES, MC

    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float64):
        n = 130
        k = LARGE_B_BYTES // (n * np.dtype(dtype).itemsize) + KC // 2  # over one k block
        wide = rng.standard_normal((k, n + 6)).astype(dtype)
        b = wide[:, 3 : 3 + n]  # rows strided, unit columns: read in place
        assert b.nbytes >= LARGE_B_BYTES
        a = rng.standard_normal((MC, k)).astype(dtype)
        c = np.full((MC, n), np.nan, dtype)
        own.gemm(width, False, False, 1.0, a, b, 0.0, c)
        _check(c, a, b, False, False, dtype)
        b_bad = b.copy()
        b_bad[7, 5], b_bad[k - 1, n - 1] = np.nan, np.inf
        own.gemm(width, False, False, 1.0, a, b_bad, 0.0, c)
        bad = np.zeros(n, bool)
        bad[[5, n - 1]] = True
        assert np.isnan(c[:, 5]).all() and not np.isfinite(c[:, n - 1]).any()
        _check(c[:, ~bad], a, b_bad[:, ~bad], False, False, dtype)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_read_in_place_stays_inside_its_view(width):
    """A with unit-stride rows is read where it lies (driver.py), its last partial panel
    packed: views cut from a NaN-filled array (row stride wider than the view, rows reversed),
    NN and TN, over two row blocks and two k blocks, never read the NaN around them, and an
    inf inside A reaches exactly the results it should."""
    from backplan.codegen.kernels.gemm.driver import KC, MC

    rng = np.random.default_rng(4)
    m, n, k = MC + 11, 45, KC + 7
    for dtype in (np.float32, np.float64):
        for ta in (False, True):
            rows, cols = (k, m) if ta else (m, k)
            big = np.full((rows + 3, cols + 9), np.nan, dtype)
            a = big[1 : 1 + rows, 4 : 4 + cols]
            a[...] = rng.standard_normal(a.shape)
            b = rng.standard_normal((k, n)).astype(dtype)
            for operand in (a, a[::-1]):
                c = np.full((m, n), np.nan, dtype)
                own.gemm(width, ta, False, 1.0, operand, b, 0.0, c)
                _check(c, operand, b, ta, False, dtype)
                c0 = rng.standard_normal((m, n)).astype(dtype)
                c = c0.copy()
                own.gemm(width, ta, False, 0.5, operand, b, -1.0, c)
                _check(c, operand, b, ta, False, dtype, 0.5, -1.0, c0.astype(np.float64))
            a_inf = a.copy()
            a_inf[(5, 9) if ta else (9, 5)] = np.inf  # row 9 of op(A) times row 5 of B
            b_pos = np.abs(b) + 1
            c = np.full((m, n), np.nan, dtype)
            own.gemm(width, ta, False, 1.0, a_inf, b_pos, 0.0, c)
            assert np.all(np.isposinf(c[9])) and np.all(np.isfinite(np.delete(c, 9, axis=0)))


def test_the_256_bit_tiles_last_rows_run_as_four_row_tiles():
    """A row block of 6k + 2 or 6k + 4 rows ends in 4-row tiles on the 256-bit path (driver.py):
    NN and TN, A a view inside NaN, C's columns ending in an edge panel, beta 0 (C unread) and
    not, and an inf in a row of the last 4-row tile reaches that row only."""
    from backplan.codegen.kernels.gemm.driver import MC, four_row_start

    assert [four_row_start(256, 6, mc, True) for mc in (128, 16, 8, 4, 12, 7, 2)] == [
        120, 12, 0, 0, 12, 7, 2,
    ]  # fmt: skip
    assert four_row_start(512, 8, 128, True) == 128 and four_row_start(256, 6, 128, False) == 128
    rng = np.random.default_rng(5)
    n, k = 40, 37
    for dtype in (np.float32, np.float64):
        for m in (4, 8, 16, MC, MC + 4, 2 * MC + 8):
            for ta in (False, True):
                rows, cols = (k, m) if ta else (m, k)
                big = np.full((rows + 2, cols + 5), np.nan, dtype)
                a = big[1 : 1 + rows, 2 : 2 + cols]
                a[...] = rng.standard_normal(a.shape)
                b = rng.standard_normal((k, n)).astype(dtype)
                c = np.full((m, n), np.nan, dtype)
                own.gemm(256, ta, False, 1.0, a, b, 0.0, c)
                _check(c, a, b, ta, False, dtype)
                c0 = rng.standard_normal((m, n)).astype(dtype)
                c = c0.copy()
                own.gemm(256, ta, False, 2.0, a, b, 0.5, c)
                _check(c, a, b, ta, False, dtype, 2.0, 0.5, c0.astype(np.float64))
                last = m - 2  # in the block's last 4-row tile
                a_inf = a.copy()
                a_inf[(3, last) if ta else (last, 3)] = np.inf
                c = np.full((m, n), np.nan, dtype)
                own.gemm(256, ta, False, 1.0, a_inf, np.abs(b) + 1, 0.0, c)
                assert np.all(np.isposinf(c[last]))
                assert np.all(np.isfinite(np.delete(c, last, axis=0)))


@pytest.mark.parametrize("width", WIDTHS)
def test_narrow_transposed_products_computed_as_their_transpose(width):
    """A.T @ B with C narrower than the tile and at least as tall (symbols.py computes C.T =
    B.T @ A): every width from 1 to the tile's, C contiguous, strided inside a larger array
    and Fortran-ordered, beta 0 over NaN and beta != 0, match float64."""
    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float64):
        nr = 32 if width == 512 and dtype == np.float32 else 16 if width == 512 else 8
        for n in (1, 7, nr - 1, nr):
            m, k = 3 * nr + 5, 37
            a, b = _operands(rng, dtype, m, n, k, True, False)
            c = np.full((m, n), np.nan, dtype)
            own.gemm(width, True, False, 1.0, a, b, 0.0, c)
            _check(c, a, b, True, False, dtype)
            big = np.full((m + 2, n + 6), 5.0, dtype)
            view, c0 = big[1 : 1 + m, 3 : 3 + n], rng.standard_normal((m, n)).astype(dtype)
            view[...] = c0
            own.gemm(width, True, False, -2.0, a, b, 0.5, view)
            _check(view, a, b, True, False, dtype, -2.0, 0.5, c0.astype(np.float64))
            assert np.all(big[0] == 5) and np.all(big[:, :3] == 5) and np.all(big[:, 3 + n :] == 5)
            cf = np.asfortranarray(np.full((m, n), np.nan, dtype))
            own.gemm(width, True, False, 1.0, a, b, 0.0, cf)
            _check(cf, a, b, True, False, dtype)


@pytest.mark.parametrize("width", WIDTHS)
def test_batched_gemm_with_broadcast_batch(width):
    """Attention-like batches: b shared by every batch entry (batch size 1), or a shared."""
    rng = np.random.default_rng(2)
    for dtype in (np.float32, np.float64):
        for ta, tb in ((False, False), (False, True), (True, False), (True, True)):
            a, b = _operands(rng, dtype, 33, 17, 9, ta, tb, batch=(5,))
            shared_b = b[:1].copy()
            c = np.empty((5, 33, 17), dtype)
            own.batched_gemm(width, ta, tb, a, shared_b, c)
            _check(c, a, np.broadcast_to(shared_b, b.shape), ta, tb, dtype)
            shared_a = a[:1].copy()
            own.batched_gemm(width, ta, tb, shared_a, b, c)
            _check(c, np.broadcast_to(shared_a, a.shape), b, ta, tb, dtype)
        empty = np.empty((0, 33, 17), dtype)
        own.batched_gemm(width, False, False, a[:0], b[:0], empty)


def test_isa_choice_follows_environment(monkeypatch):
    isa.active_isa.cache_clear()
    try:
        monkeypatch.setenv("BACKPLAN_GEMM_ISA", "avx2")
        assert isa.active_isa() == "avx2" and isa.vector_width() == 256
        isa.active_isa.cache_clear()
        monkeypatch.setenv("BACKPLAN_GEMM_ISA", "sse")
        with pytest.raises(isa.GemmIsaError, match="BACKPLAN_GEMM_ISA='sse'.*unset it"):
            isa.active_isa()
        isa.active_isa.cache_clear()
        monkeypatch.delenv("BACKPLAN_GEMM_ISA")
        assert isa.active_isa() == ("avx512" if isa._host_has_avx512() else "avx2")
    finally:
        isa.active_isa.cache_clear()


@pytest.mark.parametrize("forced_isa", ["", "avx2"])
def test_compiled_plans_with_own_gemm_equal_reference(monkeypatch, forced_isa):
    """Plans whose matmuls (2-D, batched with broadcast, and the backward's transposed
    products) call the own GEMM equal the reference interpreter, on both register widths."""
    from op_samples import SAMPLES
    from test_codegen import (
        assert_trees_close,
        batch_graph,
        block_loss,
        block_params,
        mlp_loss,
        mlp_params,
        run_both,
    )

    import backplan as bp
    from backplan.codegen.run.compiled import CompiledPlan
    from backplan.ir.lowering import lower
    from backplan.ir.pipeline import build_joint_plan

    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    monkeypatch.setenv("BACKPLAN_GEMM_ISA", forced_isa)
    isa.active_isa.cache_clear()
    try:
        samples = [s for s in SAMPLES if s.op == "matmul" and "f64" in s.dtypes]
        graph, arrays, wrt = batch_graph(samples, "f64")
        plan = build_joint_plan(graph, wrt)
        compiled = CompiledPlan(lower(plan))
        assert re.search(r"own_gemm(_at)?\(", compiled.source)  # on views or placements
        assert "own_batched_gemm(" in compiled.source
        assert re.search(rf"own_gemm(_at)?\({isa.vector_width()},", compiled.source)
        from backplan.ir.interpreter import run_plan

        for got, expected in zip(compiled(list(arrays)), run_plan(plan, list(arrays)), strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
        rng = np.random.default_rng(3)
        x = bp.tensor(rng.standard_normal((2, 4, 8)).astype(np.float32))
        ref, got = run_both(lambda *a: bp.value_and_grad(block_loss)(*a), block_params(rng), x)
        assert_trees_close(ref, got)
        params = mlp_params(rng, [6, 16, 16, 4])
        x = bp.tensor(rng.standard_normal((5, 6)).astype(np.float32))
        labels = bp.tensor(rng.integers(0, 4, 5))
        ref, got = run_both(lambda *a: bp.value_and_grad(mlp_loss)(*a), params, x, labels)
        assert_trees_close(ref, got)
    finally:
        isa.active_isa.cache_clear()


def test_choice_table_and_override(monkeypatch):
    from backplan.codegen.kernels.gemm import choice

    monkeypatch.setenv("BACKPLAN_GEMM", "blas")
    assert not choice.use_own_gemm(128, 512, 784, False, "f32")
    monkeypatch.setenv("BACKPLAN_GEMM", "fast")
    with pytest.raises(choice.GemmChoiceError, match="BACKPLAN_GEMM='fast'.*unset it"):
        choice.use_own_gemm(128, 512, 784, False, "f32")
    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setattr(choice, "vector_width", lambda: 512)  # the 512-bit tile's table
    wide = True
    assert choice.use_own_gemm(128, 784, 512, True, "f32") == wide
    assert not choice.use_own_gemm(128, 512, 784, False, "f64")  # measured mixed: BLAS
    assert not choice.use_own_gemm(4, 4, 4, False, "i64")
    monkeypatch.setattr(choice, "small_products_own", lambda: False)  # the Intel table
    assert not choice.use_own_gemm(32, 128, 128, False, "f32")  # small: BLAS is ahead
    assert not choice.use_own_gemm(512, 10, 512, False, "f32")  # narrow: the tile is padding
    assert not choice.use_own_gemm(512, 10, 128, False, "f32", trans_a=True)
    assert choice.use_own_gemm(64, 128, 128, False, "f32") == wide  # from 2**20 on: own
    assert choice.use_own_gemm(128, 512, 10, True, "f32") == wide  # k <= SHORT_K: C's stores
    assert not choice.use_own_gemm(32, 128, 10, True, "f32")  # below SMALL_OWN_WORK
    assert not choice.use_own_gemm(128, 10, 512, False, "f32")  # narrow: BLAS
    monkeypatch.setattr(choice, "small_products_own", lambda: True)  # Zen 5's
    assert choice.use_own_gemm(32, 128, 128, False, "f32") == wide  # 512K: own
    assert choice.use_own_gemm(128, 512, 10, True, "f32") == wide  # a short k too
    assert not choice.use_own_gemm(16, 64, 64, False, "f32")  # below SMALL_OWN_WORK
    assert not choice.use_own_gemm(512, 10, 512, False, "f32")  # narrow NN: BLAS
    assert choice.use_own_gemm(512, 10, 128, False, "f32", trans_a=True) == wide  # as C.T
    assert not choice.use_own_gemm(512, 10, 128, True, "f32", trans_a=True)
    assert not choice.use_own_gemm(128, 512, 784, False, "f64")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    if choice.blas_threads() > 1:
        assert not choice.use_own_gemm(128, 784, 512, True, "f32")


def test_choice_on_the_256_bit_tile(monkeypatch):
    """AVX2's f32 tile: own from 2**20 multiply-adds over k > SHORT_K with C 32 wide, a narrow
    A.T @ B (run as its transpose) from 2**18; BLAS for a short k, other narrow products,
    f64 and more than one BLAS thread."""
    from backplan.codegen.kernels.gemm import choice

    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setattr(choice, "vector_width", lambda: 256)
    assert choice.use_own_gemm(128, 512, 784, False, "f32")  # the mlp's forward
    assert choice.use_own_gemm(128, 512, 512, True, "f32")  # its NT input gradient
    assert choice.use_own_gemm(784, 512, 128, False, "f32", trans_a=True)  # TN weights
    assert choice.use_own_gemm(128, 128, 256, False, "f32", trans_a=True)  # mlp_deep's
    assert choice.use_own_gemm(512, 10, 128, False, "f32", trans_a=True)  # narrow, as C.T
    assert not choice.use_own_gemm(64, 10, 128, False, "f32", trans_a=True)  # below 2**18
    assert not choice.use_own_gemm(128, 10, 512, False, "f32")  # narrow NN: BLAS
    assert not choice.use_own_gemm(128, 512, 10, True, "f32")  # k = 10: BLAS
    assert not choice.use_own_gemm(32, 128, 128, False, "f32")  # below 2**20
    assert not choice.use_own_gemm(128, 512, 784, False, "f64")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    if choice.blas_threads() > 1:
        assert not choice.use_own_gemm(128, 512, 784, False, "f32")


def test_parallel_gemm_blocks_cover_c_exactly():
    """Row blocks (m >= n) and column blocks (n > m), more blocks than rows, and batches."""
    from backplan.codegen.kernels.gemm.parallel import batched_gemm_parallel, gemm_parallel

    rng = np.random.default_rng(5)
    for m, n, k in ((70, 9, 33), (9, 70, 33), (3, 2, 5), (0, 4, 4)):
        for parts in (1, 2, 3, 16):
            for ta, tb in ((False, False), (True, True), (False, True)):
                a, b = _operands(rng, np.float32, m, n, k, ta, tb)
                c = np.full((m, n), np.nan, np.float32)
                gemm_parallel(parts, 512, ta, tb, 1.0, a, b, 0.0, c)
                _check(c, a, b, ta, tb, np.float32)
    a, b = _operands(rng, np.float64, 33, 17, 9, False, True, batch=(5,))
    c = np.empty((5, 33, 17))
    batched_gemm_parallel(256, False, True, a, b[:1], c)
    _check(c, a, np.broadcast_to(b[:1], b.shape), False, True, np.float64)


def test_own_gemm_plan_runs_as_plain_python(tmp_path):
    """BACKPLAN_KERNELS_AS_PYTHON=1 with the own GEMM chosen: the NumPy twins stand in."""
    script = (
        "import numpy as np, backplan as bp\n"
        "from backplan.runtime.backend import use_backend\n"
        "w = bp.tensor(np.linspace(-1, 1, 12).reshape(3, 4))\n"
        "x = bp.tensor(np.linspace(0, 1, 30).reshape(5, 2, 3))\n"
        "with use_backend('numba'):\n"
        "    v, g = bp.value_and_grad(lambda w, x: bp.sum(bp.tanh(x @ w) ** 2))(w, x)\n"
        "print(float(v.item()), float(np.sum(g.numpy())))\n"
    )
    printed = run_with_own_gemm_as_python(script, tmp_path)
    w = np.linspace(-1, 1, 12).reshape(3, 4)
    x = np.linspace(0, 1, 30).reshape(5, 2, 3)
    t = np.tanh(x @ w)
    grad = np.einsum("bij,bik->jk", x, 2 * t * (1 - t**2))
    value, grad_sum = map(float, printed.split())
    np.testing.assert_allclose([value, grad_sum], [np.sum(t**2), grad.sum()], rtol=1e-10)


def test_convolution_products_take_the_own_gemm_unless_narrow(monkeypatch):
    """conv_gemm_width: the own GEMM's tile width for a convolution's product of a measured own
    class at any size and BLAS thread count, 0 (BLAS) where C is narrower than the tile, for
    float64, or under BACKPLAN_GEMM=blas; a plan's conv calls pass the width chosen."""
    from backplan.codegen.kernels.gemm import choice

    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    for width, blas in [(512, 1), (512, 2), (256, 1), (256, 2)]:
        monkeypatch.setattr(choice, "vector_width", lambda width=width: width)
        monkeypatch.setattr(choice, "blas_threads", lambda blas=blas: blas)
        assert choice.conv_gemm_width(32, 512, 144, "f32") == width
        # small: the own GEMM on 512 bits; on 256 bits BLAS below CONV_OWN_MIN_K
        assert choice.conv_gemm_width(16, 2048, 9, "f32") == (512 if width == 512 else 0)
        assert choice.conv_gemm_width(144, 512, 32, "f32") == (512 if width == 512 else 0)
        assert choice.conv_gemm_width(16, 9, 2048, "f32") == 0  # nine columns: padding
        assert choice.conv_gemm_width(16, 9, 2048, "f32", trans_b=True) == choice.ROW_DOTS
        assert choice.conv_gemm_width(32, 512, 144, "f64") == 0
    monkeypatch.undo()
    monkeypatch.setenv("BACKPLAN_GEMM", "blas")
    assert choice.conv_gemm_width(32, 512, 144, "f32") == 0
    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    assert choice.conv_gemm_width(16, 9, 2048, "f64") == isa.vector_width()

    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    rng = np.random.default_rng(3)
    x = bp.tensor(rng.standard_normal((8, 4, 6, 6)).astype(np.float32))
    w = bp.tensor(rng.standard_normal((32, 4, 3, 3)).astype(np.float32))

    def loss(w, x):
        return bp.sum(bp.conv2d(x, w, padding=1) ** 2)

    vg = bp.value_and_grad(loss, argnums=(0,))
    with use_backend("numba"):
        source = vg.trace(w, x).runner().compiled.source
    width = isa.vector_width()
    # forward 32 x 288 x 36 (k = 36: BLAS on 256 bits), weight gradient 32 x 36 x 288
    assert re.search(rf"\bconv2d_gemm\(.*, 1, {512 if width == 512 else 0}\)", source), source
    assert re.search(rf"conv2d_weight_grad_gemm\(.*, 1, {width}\)", source), source


def test_large_float32_products_run_the_own_gemm_in_blocks_where_blas_would_thread(monkeypatch):
    """More than one BLAS thread: a large f32 product (a measured own class) is cut over
    min(threads, BLAS threads) own GEMM blocks; small, narrow, f64, one thread or a forced
    choice keep BLAS or the serial own GEMM (use_own_gemm)."""
    from backplan.codegen.kernels.gemm import choice

    monkeypatch.setattr(choice, "blas_threads", lambda: 2)
    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    wide = isa.vector_width() == 512
    assert choice.own_parallel_parts(128, 512, 784, "f32", threads=2) == (2 if wide else 1)
    assert choice.own_parallel_parts(128, 512, 784, "f32", threads=4) == (2 if wide else 1)
    assert choice.own_parallel_parts(128, 512, 784, "f32", threads=1) == 1
    assert choice.own_parallel_parts(128, 512, 784, "f64", threads=2) == 1
    assert choice.own_parallel_parts(512, 10, 512, "f32", threads=2) == 1  # narrow
    assert choice.own_parallel_parts(64, 128, 128, "f32", threads=2) == 1  # 2**20: one block's
    assert choice.own_parallel_parts(128, 128, 128, "f32", threads=2) == (2 if wide else 1)
    monkeypatch.setenv("BACKPLAN_GEMM", "blas")
    assert choice.own_parallel_parts(128, 512, 784, "f32", threads=2) == 1
    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    assert choice.own_parallel_parts(128, 512, 784, "f32", threads=2) == 1


@pytest.mark.skipif(isa.vector_width() != 512, reason="the own f32 class is the 512-bit tile's")
def test_a_two_thread_float32_step_runs_the_parallel_own_gemm_and_matches(monkeypatch):
    """At two threads with two BLAS threads the mlp-like step's large products are
    own_gemm_at_par calls (no BLAS, no fused epilogue), its narrow last layer's products BLAS
    calls run on one BLAS thread (workspace.sized_launch), and its values and gradients equal
    the reference interpreter's."""
    import numba

    from backplan.codegen.kernels.gemm import choice

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread")
    monkeypatch.setattr(choice, "blas_threads", lambda: 2)
    rng = np.random.default_rng(11)
    w0 = bp.tensor(rng.standard_normal((256, 128)).astype(np.float32) * 0.1)
    w1 = bp.tensor(rng.standard_normal((128, 128)).astype(np.float32) * 0.1)
    w2 = bp.tensor(rng.standard_normal((128, 24)).astype(np.float32) * 0.1)
    x = bp.tensor(rng.standard_normal((128, 256)).astype(np.float32))

    def loss(w0, w1, w2, x):
        return bp.sum((bp.tanh(bp.relu(x @ w0) @ w1) @ w2) ** 2)

    vg = bp.value_and_grad(loss, argnums=(0, 1, 2))
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        with use_backend("numba"):
            value, grads = vg(w0, w1, w2, x)
            compiled = vg.trace(w0, w1, w2, x).runner().compiled
    finally:
        numba.set_num_threads(previous)
    with use_backend("reference"):
        want_value, want_grads = vg(w0, w1, w2, x)
    source = compiled.source
    assert source.count("own_gemm_at_par(np.intp(2)") >= 3, source
    assert "gemm_at_f32(" in source, source  # the 24-wide layer: BLAS
    assert compiled._launch_guard._one_thread
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-4)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
