"""The narrow float32 GEMM (codegen/kernels/gemm/narrow.py) against float64 NumPy: edge tiles
(rows not a multiple of 8), every width up to 16, short and empty k, both layouts of B,
operands and result at offsets of larger bases (nothing outside C written), NaN and infinity;
the choice that sends a plan's narrow product there, and a step that runs it against the
reference interpreter."""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import two_layer_step_source

from backplan.codegen.kernels.gemm import choice, isa
from backplan.codegen.kernels.gemm.narrow import NARROW_ROWS, narrow_gemm_at


def _run(a, b, trans_b, m, n, k, pad=5):
    """narrow_gemm_at on operands placed `pad` elements into flat bases, C NaN-filled in a
    base that is `pad` wider each side: (C, the base around it)."""
    a_base = np.concatenate([np.full(pad, 9.0, np.float32), a.reshape(-1)])
    b_base = np.concatenate([np.full(pad, 9.0, np.float32), b.reshape(-1)])
    out = np.full(m * n + 2 * pad, np.nan, np.float32)
    out[:pad] = out[pad + m * n :] = 7.0
    a_base.flags.writeable = b_base.flags.writeable = False  # as the plan passes them
    narrow_gemm_at(
        np.bool_(False), np.bool_(trans_b), np.intp(m), np.intp(n), np.intp(k),
        a_base, np.intp(pad), b_base, np.intp(pad), out, np.intp(pad),
    )  # fmt: skip
    return out[pad : pad + m * n].reshape(m, n), np.concatenate([out[:pad], out[pad + m * n :]])


@pytest.mark.parametrize("trans_b", [False, True])
def test_narrow_gemm_matches_float64(trans_b):
    rng = np.random.default_rng(7)
    for m in (0, 1, 7, NARROW_ROWS, NARROW_ROWS + 1, 31, 128):
        for n in (1, 3, 10, 15, 16):
            for k in (0, 1, 5, 77, 512):
                a = rng.standard_normal((m, k)).astype(np.float32)
                b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
                got, around = _run(a, b, trans_b, m, n, k)
                op_b = (b.T if trans_b else b).astype(np.float64)
                want = a.astype(np.float64) @ op_b
                bound = 4 * (k + 2) * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(op_b))
                assert np.all(np.abs(got - want) <= bound + 1e-30), (m, n, k)
                assert np.all(around == 7.0), (m, n, k)  # nothing written outside C


def test_narrow_gemm_propagates_nan_and_infinity():
    """A NaN or an infinity in a row of A reaches exactly the results it reaches in float64,
    in a full tile and in the edge tile (rows past the last multiple of 8)."""
    rng = np.random.default_rng(8)
    m, n, k = 2 * NARROW_ROWS + 3, 10, 40
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = np.abs(rng.standard_normal((k, n))).astype(np.float32) + 0.5  # positive: inf stays inf
    for row in (2, m - 1):
        a[row, 5] = np.inf
    a[3, 7], a[m - 2, 0] = np.nan, np.nan
    b[11, 4] = np.nan  # column 4 NaN for every row
    got, _ = _run(a, b, False, m, n, k)
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5)
    assert np.isposinf(got[2, 0]) and np.isnan(got[3, 0]) and np.isnan(got[0, 4])


def test_narrow_gemm_refuses_a_transposed_or_a_wide_c():
    a = np.ones(4 * 3, np.float32)
    out = np.zeros(4 * 17, np.float32)
    with pytest.raises(ValueError, match="narrow_gemm_at"):
        narrow_gemm_at(False, False, 4, 17, 3, a, 0, np.ones(3 * 17, np.float32), 0, out, 0)
    with pytest.raises(ValueError, match="narrow_gemm_at"):
        narrow_gemm_at(True, False, 4, 3, 3, a, 0, np.ones(9, np.float32), 0, out, 0)


def test_narrow_choice(monkeypatch):
    """Where small products take the own GEMM, on one BLAS thread, a float32 product with A not
    transposed and C at most 16 wide; never when forced, wider, transposed A, f64 or small."""
    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    monkeypatch.setattr(choice, "blas_threads", lambda: 1)
    monkeypatch.setattr(choice, "small_products_own", lambda: True)
    wide = isa.vector_width() == 512
    assert choice.use_narrow_gemm(128, 10, 512, False, "f32") == wide
    assert choice.use_narrow_gemm(128, 16, 512, False, "f32") == wide
    assert not choice.use_narrow_gemm(128, 17, 512, False, "f32")
    assert not choice.use_narrow_gemm(512, 10, 128, True, "f32")  # own GEMM, as C.T
    assert not choice.use_narrow_gemm(128, 10, 512, False, "f64")
    assert not choice.use_narrow_gemm(16, 10, 64, False, "f32")  # below SMALL_OWN_WORK
    monkeypatch.setattr(choice, "small_products_own", lambda: False)
    assert not choice.use_narrow_gemm(128, 10, 512, False, "f32")
    monkeypatch.setattr(choice, "small_products_own", lambda: True)
    monkeypatch.setattr(choice, "blas_threads", lambda: 2)
    assert not choice.use_narrow_gemm(128, 10, 512, False, "f32")
    monkeypatch.setattr(choice, "blas_threads", lambda: 1)
    for forced in ("own", "blas"):
        monkeypatch.setenv("BACKPLAN_GEMM", forced)
        assert not choice.use_narrow_gemm(128, 10, 512, False, "f32")


@pytest.mark.skipif(isa.vector_width() != 512, reason="the narrow GEMM is the 512-bit tile's")
def test_a_step_with_a_narrow_last_layer_runs_the_narrow_gemm_and_matches(monkeypatch):
    """A classifier-like step (67 rows: an edge tile; 10 classes) on one BLAS thread calls
    narrow_gemm_at for its last layer's forward product, and its value and gradients equal the
    reference interpreter's."""
    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    monkeypatch.setattr(choice, "blas_threads", lambda: 1)
    monkeypatch.setattr(choice, "small_products_own", lambda: True)
    source = two_layer_step_source((48, 400), (400, 10), 67, seed=12)
    assert source.count("narrow_gemm_at(np.bool_(False), np.bool_(False), np.intp(67)") == 1


def test_narrow_gemm_runs_as_plain_python():
    """BACKPLAN_KERNELS_AS_PYTHON=1: the NumPy twin computes the same product, B either way."""
    import os
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from backplan.codegen.kernels.gemm.narrow import narrow_gemm_at\n"
        "a = np.arange(2 + 9 * 5, dtype=np.float32)\n"
        "b = np.linspace(-1, 1, 1 + 5 * 3).astype(np.float32)\n"
        "for tb in (False, True):\n"
        "    out = np.full(3 + 9 * 3, 7.0, np.float32)\n"
        "    narrow_gemm_at(False, tb, 9, 3, 5, a, 2, b, 1, out, 3)\n"
        "    op_b = b[1:].reshape(3, 5).T if tb else b[1:].reshape(5, 3)\n"
        "    want = a[2:].reshape(9, 5).astype(np.float64) @ op_b\n"
        "    assert np.allclose(out[3:].reshape(9, 3), want, rtol=1e-6), (out, want)\n"
        "    assert np.all(out[:3] == 7.0)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, BACKPLAN_KERNELS_AS_PYTHON="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_EDGE_IN_FRESH_MEMORY = """
import os
import subprocess
import sys

import numpy as np
from backplan.codegen.kernels.gemm.narrow import narrow_gemm_at
rng = np.random.default_rng(3)
for m, k in ((300, 512), (13, 2048), (9, 128)):
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, 10)).astype(np.float32)
    out = np.full(m * 10, np.nan, np.float32)
    narrow_gemm_at(np.bool_(False), np.bool_(False), np.intp(m), np.intp(10), np.intp(k),
                   a.reshape(-1), np.intp(0), b.reshape(-1), np.intp(0), out, np.intp(0))
    want = a.astype(np.float64) @ b
    print(m, k, float(np.abs(out.reshape(m, 10) - want).max() / np.abs(want).max()))
"""


@pytest.mark.skipif(os.name != "posix", reason="glibc's malloc tunables")
def test_the_edge_block_lives_until_the_kernel_has_read_it():
    """Rows past the last full tile are copied into a block the kernel reads by address: that
    block was freed once its address was taken, before the kernel read it. With glibc mapping
    every block and unmapping it when freed, the read faulted (the process died, SIGSEGV, on
    300 x 512 @ 512 x 10, the product a batch of 300 rows makes in a 10-class last layer);
    with the default malloc the kernel read freed memory, which another thread may reuse."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="0", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run(
        [sys.executable, "-c", _EDGE_IN_FRESH_MEMORY],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    rows = [line.split() for line in done.stdout.strip().splitlines()]
    assert [(int(m), int(k)) for m, k, _ in rows] == [(300, 512), (13, 2048), (9, 128)]
    assert all(float(error) < 1e-5 for _, _, error in rows), rows


@pytest.mark.parametrize("trans_b", [False, True])
def test_a_c_of_at_most_twelve_columns_is_computed_as_row_dot_products(trans_b):
    """The mlp's 10-class layer: the same sums as row_dots over B's columns, to the bit (the
    micro-kernel sums in k order, one FMA a step: other roundings)."""
    from backplan.codegen.kernels.gemm.narrow import ROW_DOT_COLUMNS
    from backplan.codegen.kernels.gemm.row_dots import row_dots

    rng = np.random.default_rng(11)
    m, k = 37, 515
    for n in (1, 10, ROW_DOT_COLUMNS):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
        got, _ = _run(a, b, trans_b, m, n, k)
        want = np.empty((m, n), np.float32)
        row_dots(a, b if trans_b else np.ascontiguousarray(b.T), want)
        np.testing.assert_array_equal(got, want)
