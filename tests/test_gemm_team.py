"""The GEMM shared between the caller and helper threads (codegen/kernels/gemm/team.py): the
same values as the single-thread GEMM and as NumPy on odd shapes, transposed operands, empty
dimensions, alpha and beta, strided views; from two Python threads at once; after a fork."""

import os
import subprocess
import sys
import textwrap
import threading

import numba
import numpy as np
import pytest

from backplan.codegen.kernels.atomics import FUTEX_AVAILABLE
from backplan.codegen.kernels.gemm import vector_width
from backplan.codegen.kernels.gemm.api import gemm
from backplan.codegen.kernels.gemm.parallel import gemm_parallel

pytestmark = [
    pytest.mark.skipif(not FUTEX_AVAILABLE, reason="the shared GEMM needs futexes (Linux)"),
    pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="Numba runs one thread here"),
]

WIDTH = vector_width()
# (m, k, n): rows 1, 7, 33, 257 and a few products big enough for several chunks each way.
SHAPES = [(1, 7, 33), (7, 33, 1), (33, 257, 7), (257, 33, 70), (257, 65, 257), (70, 9, 513)]
FLAGS = [(False, False), (True, False), (False, True), (True, True)]


def _operands(rng, dtype, m, k, n, ta, tb):
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
    return a, b


def _product(a, b, ta, tb, alpha, beta, c):
    wide = [x.astype(np.float64) for x in (a, b, c)]
    op_a, op_b = (wide[0].T if ta else wide[0]), (wide[1].T if tb else wide[1])
    return alpha * (op_a @ op_b) + (beta * wide[2] if beta else 0.0)


def _both(a, b, ta, tb, alpha, beta, c0, parts=2):
    """(shared GEMM's C, single-thread GEMM's C) from the same starting C."""
    shared, alone = c0.copy(), c0.copy()
    gemm_parallel(parts, WIDTH, ta, tb, alpha, a, b, beta, shared)
    gemm(WIDTH, ta, tb, alpha, a, b, beta, alone)
    return shared, alone


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shared_gemm_equals_the_single_thread_gemm_and_numpy(dtype):
    rng = np.random.default_rng(3)
    tolerance = 1e-4 if dtype == np.float32 else 1e-11
    for m, k, n in SHAPES:
        for ta, tb in FLAGS:
            a, b = _operands(rng, dtype, m, k, n, ta, tb)
            for alpha, beta in ((1.0, 0.0), (0.5, 2.0)):
                c0 = rng.standard_normal((m, n)).astype(dtype)
                shared, alone = _both(a, b, ta, tb, alpha, beta, c0)
                np.testing.assert_array_equal(shared, alone, err_msg=f"{m, k, n, ta, tb}")
                expected = _product(a, b, ta, tb, alpha, beta, c0)
                np.testing.assert_allclose(shared, expected, rtol=tolerance, atol=tolerance)


def test_a_product_with_a_large_b_read_in_place_is_shared_out_by_columns():
    """Row chunks each read all of a B read in place: one of LARGE_B_BYTES or more (the mlp's
    784 x 512 weight) is cut by columns instead, a small one still by rows; either way the
    shared GEMM equals the single-thread GEMM."""
    from backplan.codegen.kernels.gemm.driver import LARGE_B_BYTES
    from backplan.codegen.kernels.gemm.team import _split

    rng = np.random.default_rng(6)
    for k, by_rows in ((LARGE_B_BYTES // (4 * 300) + 1, False), (64, True)):
        a, b = _operands(rng, np.float32, 100, k, 300, False, False)
        c0 = np.zeros((100, 300), np.float32)
        assert bool(_split(2, WIDTH, False, b, c0)[0]) == by_rows
        shared, alone = _both(a, b, False, False, 1.0, 0.0, c0)
        np.testing.assert_array_equal(shared, alone)
        np.testing.assert_allclose(shared, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


def test_shared_gemm_reads_strided_views_and_writes_a_strided_c():
    """Operands and C as column slices of bigger arrays (row strides wider than the rows)."""
    rng = np.random.default_rng(4)
    big_a = rng.standard_normal((257, 100)).astype(np.float32)
    big_b = rng.standard_normal((80, 300)).astype(np.float32)
    a, b = big_a[:, 3:68], big_b[:65, 1:258]  # (257, 65) @ (65, 257)
    out = np.full((257, 400), np.nan, np.float32)
    c = out[:, 5:262]
    gemm_parallel(2, WIDTH, False, False, 1.0, a, b, 0.0, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    assert np.isnan(out[:, :5]).all() and np.isnan(out[:, 262:]).all()  # nothing outside C


def test_empty_dimensions_and_k_zero():
    """m or n zero: nothing written; k zero: C = beta * C (beta 0 overwrites NaN)."""
    a, b = np.ones((0, 5), np.float32), np.ones((5, 4), np.float32)
    c = np.empty((0, 4), np.float32)
    gemm_parallel(2, WIDTH, False, False, 1.0, a, b, 0.0, c)
    c = np.full((3, 0), 7.0, np.float32)
    gemm_parallel(2, WIDTH, False, False, 1.0, np.ones((3, 5), np.float32), b[:, :0], 0.0, c)
    c = np.full((40, 64), np.nan, np.float32)
    gemm_parallel(2, WIDTH, False, False, 1.0, np.ones((40, 0), np.float32),
                  np.ones((0, 64), np.float32), 0.0, c)  # fmt: skip
    assert (c == 0).all()
    c = np.full((40, 64), 3.0, np.float32)
    gemm_parallel(2, WIDTH, True, True, 1.0, np.ones((0, 40), np.float32),
                  np.ones((64, 0), np.float32), 0.5, c)  # fmt: skip
    assert (c == 1.5).all()


def test_nan_and_inf_in_an_operand_reach_their_rows_only():
    rng = np.random.default_rng(6)
    a = rng.standard_normal((257, 33)).astype(np.float32)
    b = rng.standard_normal((33, 70)).astype(np.float32)
    a[5, 3], a[200, 0] = np.nan, np.inf
    c = np.empty((257, 70), np.float32)
    gemm_parallel(2, WIDTH, False, False, 1.0, a, b, 0.0, c)
    with np.errstate(invalid="ignore"):
        expected = a.astype(np.float64) @ b
    np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4)
    assert np.isnan(c[5]).all() and not np.isnan(np.delete(c, [5, 200], axis=0)).any()


def test_two_python_threads_share_the_helpers_at_once():
    """Two threads call the shared GEMM at the same time, many times: one owns the helpers,
    the other runs alone; every result is the single-thread GEMM's."""
    rng = np.random.default_rng(7)
    cases = []
    for m, k, n in ((257, 65, 257), (70, 9, 513), (33, 257, 7)):
        for ta, tb in FLAGS:
            a, b = _operands(rng, np.float32, m, k, n, ta, tb)
            alone = np.empty((m, n), np.float32)
            gemm(WIDTH, ta, tb, 1.0, a, b, 0.0, alone)
            cases.append((a, b, ta, tb, alone))
    failures, start = [], threading.Barrier(2)

    def work(offset):
        start.wait()
        for i in range(60):
            a, b, ta, tb, alone = cases[(i + offset) % len(cases)]
            c = np.full_like(alone, np.nan)
            gemm_parallel(2, WIDTH, ta, tb, 1.0, a, b, 0.0, c)
            if not np.array_equal(c, alone):
                failures.append((i, offset))

    threads = [threading.Thread(target=work, args=(offset,)) for offset in (0, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_on_one_numba_thread_the_caller_runs_the_whole_product():
    from backplan.codegen.kernels.gemm import team

    rng = np.random.default_rng(8)
    a, b = _operands(rng, np.float32, 257, 65, 257, False, False)
    gemm_parallel(2, WIDTH, False, False, 1.0, a, b, 0.0, np.empty((257, 257), np.float32))
    before, threads = team.chunks_helped(), numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        c = np.empty((257, 257), np.float32)
        for _ in range(5):
            gemm_parallel(2, WIDTH, False, False, 1.0, a, b, 0.0, c)
    finally:
        numba.set_num_threads(threads)
    assert team.chunks_helped() == before
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


FORKED_CHILD = textwrap.dedent(
    """
    import os
    import numpy as np
    from backplan.codegen.kernels.gemm import team, vector_width
    from backplan.codegen.kernels.gemm.parallel import gemm_parallel

    a = np.random.default_rng(0).standard_normal((257, 65)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((65, 257)).astype(np.float32)
    c = np.empty((257, 257), np.float32)
    gemm_parallel(2, vector_width(), False, False, 1.0, a, b, 0.0, c)
    expected = a.astype(np.float64) @ b
    pid = os.fork()
    if pid == 0:
        ok = True
        for _ in range(20):
            c[...] = np.nan
            gemm_parallel(2, vector_width(), False, False, 1.0, a, b, 0.0, c)
            ok = ok and np.allclose(c, expected, rtol=1e-4, atol=1e-4)
        os._exit(0 if ok and team.helpers_running() == team.helpers_wanted() else 3)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), "helpers", team.helpers_running())
    """
)


def test_a_forked_child_starts_helpers_of_its_own():
    """After a fork only the forking thread exists: the child restarts its helpers and gets
    the same products."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", FORKED_CHILD], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "child 0 helpers" in done.stdout, done.stdout + done.stderr[-2000:]
