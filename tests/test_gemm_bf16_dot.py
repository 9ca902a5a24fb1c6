"""The bfloat16 GEMM on VDPBF16PS (AVX512_BF16): k-pair packing, the dot-product micro-kernel
against float64 and against the widening path, its numerics (denormals flushed), and the
per-process choice between the two paths (BACKPLAN_GEMM_BF16)."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from backplan.codegen.kernels.gemm import isa, symbols
from backplan.codegen.kernels.gemm.pair_pack import pack_pairs

BF16 = np.dtype(ml_dtypes.bfloat16)
HAS_DOT = isa._target_has_bf16_dot()
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="the host CPU has no AVX512_BF16")
SHAPES = [  # m, n, k: ones, odd k (a zero-padded pair), edges of the 8x32 tile, k over KC
    (1, 1, 1),
    (8, 32, 2),
    (7, 33, 5),
    (16, 40, 3),
    (33, 70, 257),
    (130, 96, 520),
    (0, 5, 3),
    (3, 4, 0),
]


def _pairs_model(src, lanes):
    """The k-pair layout written out in NumPy: dst[(p * lanes + q) * 2 + h] = src[q, 2p + h]."""
    rows, k = src.shape
    padded = np.zeros((lanes, k + k % 2), np.uint16)
    padded[:rows, :k] = src
    return padded.reshape(lanes, -1, 2).transpose(1, 0, 2).ravel()


@pytest.mark.parametrize("lanes", [8, 32])
def test_pair_packing_matches_the_layout_for_every_stride(lanes):
    """Unit stride along k (word transpose), along the lanes (interleave), neither (scalar),
    odd k, and panels cut by the edge, all against the NumPy model of the layout."""
    rng = np.random.default_rng(3)
    for rows in (lanes, lanes - 1, 5, 1):
        for k in (1, 2, 7, 64, 255):
            base = rng.integers(0, 1 << 16, (lanes + 3, 2 * k + 5), dtype=np.uint16)
            sources = {
                "k-major": base[:rows, :k],
                "lane-major": np.ascontiguousarray(base[:rows, :k].T).T,
                "strided": base[: 2 * rows : 2, : 2 * k : 2] if 2 * rows <= lanes + 3 else None,
            }
            for name, src in sources.items():
                if src is None:
                    continue
                dst = np.full((k + 1) // 2 * lanes * 2, 0xFFFF, np.uint16)
                pack_pairs(src, lanes, dst)
                np.testing.assert_array_equal(dst, _pairs_model(src, lanes), (name, rows, k))


def _gemm(entry, a, b, c, ta, tb, alpha=1.0, beta=0.0):
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    a, b = a.view(np.uint16), b.view(np.uint16)
    entry(
        512, ta, tb, m, n, k,
        a.ctypes.data, *a.strides, b.ctypes.data, *b.strides, c.ctypes.data, *c.strides,
        alpha, beta,
    )  # fmt: skip


def _operands(rng, m, n, k, ta, tb, integers=False):
    shape_a, shape_b = (k, m) if ta else (m, k), (n, k) if tb else (k, n)
    if integers:
        return (rng.integers(-4, 5, s).astype(BF16) for s in (shape_a, shape_b))
    return (rng.standard_normal(s).astype(BF16) for s in (shape_a, shape_b))


def _op(x, trans):
    return x.T if trans else x


@needs_dot
@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
def test_dot_gemm_against_float64_and_the_widening_path(ta, tb):
    """Random bf16 operands: within float32 summation error of the float64 product; results
    of the dot path and the widening path differ by summation order only."""
    rng = np.random.default_rng(11)
    for m, n, k in SHAPES:
        a, b = _operands(rng, m, n, k, ta, tb)
        dot, widened = (np.full((m, n), np.nan, np.float32) for _ in range(2))
        _gemm(symbols._gemm_bf16_dot, a, b, dot, ta, tb)
        _gemm(symbols._gemm_bf16, a, b, widened, ta, tb)
        a64, b64 = _op(a, ta).astype(np.float64), _op(b, tb).astype(np.float64)
        bound = 4 * (k + 2) * np.finfo(np.float32).eps * (np.abs(a64) @ np.abs(b64))
        assert np.all(np.abs(dot - a64 @ b64) <= bound), (m, n, k)
        assert np.all(np.abs(dot - widened) <= 2 * bound), (m, n, k)


@needs_dot
def test_dot_gemm_equals_the_widening_path_bitwise_on_whole_numbers_with_alpha_beta():
    """Whole numbers sum exactly in any order: the two paths agree bit for bit, with alpha,
    beta, a strided C and strided operands."""
    rng = np.random.default_rng(12)
    for ta, tb in [(False, False), (True, True), (True, False), (False, True)]:
        for m, n, k in SHAPES:
            a, b = _operands(rng, m, n, k, ta, tb, integers=True)
            a, b = np.repeat(a, 2, axis=1)[:, ::2], np.repeat(b, 2, axis=0)[::2]
            c0 = rng.integers(-3, 4, (m, 2 * n)).astype(np.float32)[:, ::2]
            dot, widened = np.repeat(c0, 2, axis=1)[:, ::2], c0.copy()  # dot's C strided
            _gemm(symbols._gemm_bf16_dot, a, b, dot, ta, tb, alpha=2.0, beta=-0.5)
            _gemm(symbols._gemm_bf16, a, b, widened, ta, tb, alpha=2.0, beta=-0.5)
            np.testing.assert_array_equal(dot.view(np.uint32), widened.view(np.uint32))


DENORMAL = np.array([0x0040], np.uint16).view(BF16)  # 2**-127, a bfloat16 (and float32) denormal


@needs_dot
def test_dot_gemm_flushes_denormals_as_the_instruction_does():
    """VDPBF16PS reads denormal inputs as zero and flushes denormal sums (documented in
    docs/ops.md); the widening path keeps them."""
    a = np.array([[DENORMAL[0], 0]], BF16)
    b = np.array([[1], [0]], BF16)
    dot, widened = np.full((1, 1), np.nan, np.float32), np.full((1, 1), np.nan, np.float32)
    _gemm(symbols._gemm_bf16_dot, a, b, dot, False, False)
    _gemm(symbols._gemm_bf16, a, b, widened, False, False)
    assert dot[0, 0] == 0.0
    assert widened[0, 0] == np.float32(2.0**-127)


def test_bf16_path_choice(monkeypatch):
    """The flag forces the widening path; a bad value and 'dot' on a CPU without AVX512_BF16
    are refused, naming the variable; the 256-bit ISA widens."""
    try:
        monkeypatch.setenv("BACKPLAN_GEMM_BF16", "widen")
        isa.bf16_gemm_path.cache_clear()
        assert isa.bf16_gemm_path() == "widen"
        assert symbols.entry("bf16") is symbols._gemm_bf16
        monkeypatch.setenv("BACKPLAN_GEMM_BF16", "fast")
        isa.bf16_gemm_path.cache_clear()
        with pytest.raises(isa.GemmIsaError, match="BACKPLAN_GEMM_BF16='fast'"):
            isa.bf16_gemm_path()
        monkeypatch.setenv("BACKPLAN_GEMM_BF16", "dot")
        monkeypatch.setattr(isa, "_target_has_bf16_dot", lambda: False)
        isa.bf16_gemm_path.cache_clear()
        with pytest.raises(isa.GemmIsaError, match="AVX512_BF16"):
            isa.bf16_gemm_path()
        monkeypatch.delenv("BACKPLAN_GEMM_BF16")
        isa.bf16_gemm_path.cache_clear()
        assert isa.bf16_gemm_path() == "widen"
        monkeypatch.setattr(isa, "_target_has_bf16_dot", lambda: True)
        monkeypatch.setenv("BACKPLAN_GEMM_ISA", "avx2")
        isa.bf16_gemm_path.cache_clear()
        isa.active_isa.cache_clear()
        assert isa.bf16_gemm_path() == "widen"
    finally:
        isa.bf16_gemm_path.cache_clear()
        isa.active_isa.cache_clear()


_PROBE = """
import numpy as np
from backplan.codegen.kernels.gemm import gemm
a = np.array([[0x0040, 0]], np.uint16)  # a bfloat16 denormal, then a zero
b = np.array([[0x3F80], [0]], np.uint16)  # 1.0, 0
c = np.full((1, 1), np.nan, np.float32)
gemm(512, False, False, 1.0, a, b, 0.0, c)
print(float(c[0, 0]))
"""


@needs_dot
@pytest.mark.parametrize(("flag", "flushed"), [("", True), ("widen", False)])
def test_the_published_bf16_gemm_follows_the_flag(flag, flushed):
    """What compiled code calls (the symbol backplan_gemm_bf16) is the dot path by default on
    this CPU and the widening path under BACKPLAN_GEMM_BF16=widen (told by the denormal)."""
    env = {**os.environ, "BACKPLAN_GEMM_BF16": flag}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert (float(out) == 0.0) is flushed, out


@needs_dot
def test_bf16_blocks_on_threads_run_the_published_gemm():
    """The GEMM cut over threads (parallel.py) gives bfloat16 blocks to the published bf16
    GEMM, here the dot path (told by the flushed denormal), and float32 blocks to its own
    blocked GEMM: both against float64, batched too."""
    from backplan.codegen.kernels.gemm.parallel import batched_gemm_parallel, gemm_parallel

    rng = np.random.default_rng(13)
    a, b = rng.standard_normal((40, 24)).astype(BF16), rng.standard_normal((24, 70)).astype(BF16)
    a[0, :] = 0
    a[0, 0] = DENORMAL[0]  # row 0 of C: one denormal product each, flushed
    b[0, :] = 1
    want = a.astype(np.float64) @ b.astype(np.float64)
    for rows, cols in [(40, 70), (40, 20)]:  # cut by rows, then by columns
        c = np.full((rows, cols), np.nan, np.float32)
        gemm_parallel(
            2, 512, False, False, 1.0, a[:rows].view(np.uint16), b[:, :cols].view(np.uint16), 0.0, c
        )
        assert c[0, 0] == 0.0
        bound = (
            4
            * 26
            * np.finfo(np.float32).eps
            * np.abs(a.astype(np.float64))
            @ np.abs(b.astype(np.float64))
        )
        assert np.all(np.abs(c[1:] - want[1:rows, :cols]) <= bound[1:rows, :cols])
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    c32 = np.empty((40, 70), np.float32)
    gemm_parallel(2, 512, False, False, 1.0, a32, b32, 0.0, c32)
    assert c32[0, 0] == np.float32(2.0**-127)
    batched = np.empty((2, 40, 70), np.float32)
    stack_a = np.stack([a, a]).view(np.uint16)
    batched_gemm_parallel(512, False, False, stack_a, b.view(np.uint16)[None], batched)
    assert batched[1, 0, 0] == 0.0
    np.testing.assert_array_equal(batched[0], batched[1])
