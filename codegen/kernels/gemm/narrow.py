"""The narrow float32 GEMM: C (m x n, n <= NARROW_COLUMNS) = A (m x k, rows in place) @ op(B).

A classifier's last layer (the mlp's 128 x 512 @ 512 x 10) is too narrow for the blocked GEMM's
8 x 32 tile (two thirds padding) and OpenBLAS ran it at 50-60 GFLOP/s. Here B is copied once
into a k x 16 panel, zero-padded past its n columns (32 KiB for k = 512: it stays in L1), and
one 8 x 16 micro-kernel (kernel.py's, one vector per row) walks A's rows where they lie: per k
step one B vector, 8 broadcasts of A, 8 FMAs. Each tile lands in a 16-wide scratch tile whose
first n columns are copied into C (a 16-wide store would write past C's rows). Rows past the
last full tile of 8 are copied into a zero-padded block first (the kernel reads 8 rows), held
by keep_alive until the kernel has read it: its address was its last use, and Numba freed it
before the kernel ran (a fresh process mapping every block, MALLOC_MMAP_THRESHOLD_=0, crashed
on a 300 x 512 @ 512 x 10 product; otherwise the kernel read freed memory).

Its B panel (or B's columns), last rows and tile live in a buffer of the GEMM's kept slots
(scratch.py), at the places the blocked GEMM packs A, packs B and keeps its tile (float32,
512-bit layout: NARROW_B_OFFSET, NARROW_TILE_OFFSET), so that the pages it writes are the ones
the plan counts (packing.py) and a call allocates nothing; a part that outgrows its place, or
a call finding every slot taken, allocates as before.

Sums run in k order, one FMA per step, as the blocked GEMM's. Measured on one pinned Zen 5 core
(thread CPU, 7 rounds, 128 x 10 x 512): 12.5-13.3 us against OpenBLAS's 19.2-20.2.

Where C is at most ROW_DOT_COLUMNS wide, B's columns are copied into rows (a k x n
transposition, nothing when B comes transposed) and C's elements are computed as dot products
of rows (row_dots.py: 4 x 2 blocks of sums, no lane of padding). On one pinned Zen 5 core (9
interleaved rounds, load ~13, each kernel timed alone) in GFLOP/s, copy included, against this
micro-kernel: 128 x 512 @ 512 x 10 (the mlp's last layer) 130.6 / 93.9, 256 x 128 @ 128 x 10
(mlp_deep's) 118.3 / 87.8, 1024 x 256 @ 256 x 10 152.6 / 117.2, 64 x 1024 @ 1024 x 10 105.2 /
91.2, 128 x 64 @ 64 x 10 78.2 / 63.2, 300 x 512 @ 512 x 3 97.1 / 35.6; at 16 columns the
micro-kernel is ahead (127.6 / 153.8).
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

from backplan.codegen.jit import AS_PYTHON, njit
from backplan.codegen.kernels.gemm import scratch
from backplan.codegen.kernels.gemm.driver import KC, MC, NC
from backplan.codegen.kernels.gemm.kernel import TILES
from backplan.codegen.kernels.gemm.kernel import _emit_kernel as emit_kernel  # kernel.py's tile
from backplan.codegen.kernels.gemm.row_dots import row_dots
from backplan.codegen.kernels.gemm.symbols import _free_slot
from backplan.codegen.kernels.lifetimes import keep_alive

NARROW_LANES = 16  # one 512-bit f32 vector: C's columns padded to it
NARROW_COLUMNS = NARROW_LANES  # the widest C this GEMM computes
NARROW_ROWS = 8  # rows of C per micro-kernel call (8 measured ahead of 4, 12 and 16)
ROW_DOT_COLUMNS = 12  # C up to this wide: row dot products (gemm/row_dots.py) instead
_LANES, _MR, _NV = TILES[512]["f32"]
# Byte offsets of the blocked GEMM's B part and tile in a kept buffer (float32, 512-bit tile:
# symbols._kept_workspace), where the narrow GEMM keeps its last rows and its tile.
NARROW_B_OFFSET = -(-MC // _MR) * _MR * KC * 4
NARROW_TILE_OFFSET = NARROW_B_OFFSET + -(-NC // (_LANES * _NV)) * _LANES * _NV * KC * 4


@intrinsic
def narrow_kernel(typingctx, kc, a_addr, lda, b_addr, c_addr):
    """C tile (NARROW_ROWS x 16, row stride 16) = A rows (in place, row stride lda) @ B panel
    (kc x 16, row stride 16); float32 addresses, strides in elements."""
    sig = types.void(kc, a_addr, lda, b_addr, c_addr)

    def codegen(context, builder, signature, args):
        kc_, a_, lda_, b_, c_ = (
            context.cast(builder, value, fromty, types.intp)
            for value, fromty in zip(args, signature.args, strict=True)
        )
        lanes = ir.Constant(kc_.type, NARROW_LANES)
        one, zero = ir.Constant(ir.FloatType(), 1.0), ir.Constant(ir.FloatType(), 0.0)
        emit_kernel(
            builder, [kc_, a_, b_, lanes, c_, lanes, one, zero], ir.FloatType(),
            NARROW_LANES, NARROW_ROWS, 1, "rows", lda_,
        )  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _kept_or_new(base, offset, stop, length):
    """length float32 elements at base + offset of a kept buffer where they end by stop, else
    a new array (base 0: no kept buffer)."""
    if base != 0 and offset + length * 4 <= stop:
        return scratch.vector_at(base + offset, length, np.float32(0))
    return np.empty(length, np.float32)


@njit(cache=True, nogil=True)
def narrow_gemm_at(trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):
    """out[out_offset:] as (m, n) = A @ op(B): A the (m, k) rows at a[a_offset:], B the (k, n)
    (or, transposed, (n, k)) matrix at b[b_offset:], all C-contiguous float32; n <= 16. The
    arguments of matmul.gemm_at_f32, whose calls it replaces (choice.use_narrow_gemm); A is
    never transposed here."""
    if trans_a or n > NARROW_COLUMNS:
        raise ValueError("narrow_gemm_at: A transposed or C wider than 16 columns")
    op_a = a[a_offset : a_offset + m * k].reshape((m, k))
    if n <= ROW_DOT_COLUMNS and trans_b:  # B's columns are the rows of the (n, k) matrix there
        row_dots(
            op_a, b[b_offset : b_offset + n * k].reshape((n, k)), out_matrix(out, out_offset, m, n)
        )
        return
    slot = _free_slot()
    base = scratch.buffer_of(slot) if slot >= 0 else 0
    if n <= ROW_DOT_COLUMNS:  # C's elements as dot products of A's rows and B's columns
        columns = _kept_or_new(base, 0, NARROW_B_OFFSET, n * k).reshape((n, k))
        for p in range(k):
            for j in range(n):
                columns[j, p] = b[b_offset + p * n + j]
        row_dots(op_a, columns, out_matrix(out, out_offset, m, n))
        keep_alive((columns,))
    else:
        _narrow_panels(m, n, k, trans_b, a, a_offset, b, b_offset, out, out_offset, base)
    if slot >= 0:
        scratch.give_back(slot)


@njit(cache=True, nogil=True)
def out_matrix(out, out_offset, m, n):
    return out[out_offset : out_offset + m * n].reshape((m, n))


@njit(cache=True, nogil=True)
def _narrow_panels(m, n, k, trans_b, a, a_offset, b, b_offset, out, out_offset, base):
    """The 8 x 16 micro-kernel over A's rows, B in a zero-padded k x 16 panel (n > 12)."""
    panel = _kept_or_new(base, 0, NARROW_B_OFFSET, max(k, 1) * NARROW_LANES)
    panel[:] = 0
    for p in range(k):
        for j in range(n):
            at = b_offset + (j * k + p if trans_b else p * n + j)
            panel[p * NARROW_LANES + j] = b[at]
    tile = _kept_or_new(base, NARROW_TILE_OFFSET, scratch.MAPPED_BYTES, NARROW_ROWS * NARROW_LANES)
    full = m - m % NARROW_ROWS
    for i in range(0, m, NARROW_ROWS):
        rows = min(NARROW_ROWS, m - i)
        if i < full:
            a_addr = a.ctypes.data + (a_offset + i * k) * 4
            narrow_kernel(k, a_addr, k, panel.ctypes.data, tile.ctypes.data)
        else:
            edge = _kept_or_new(base, NARROW_B_OFFSET, NARROW_TILE_OFFSET, NARROW_ROWS * max(k, 1))
            edge[:] = 0
            for r in range(rows):
                for p in range(k):
                    edge[r * k + p] = a[a_offset + (i + r) * k + p]
            narrow_kernel(k, edge.ctypes.data, k, panel.ctypes.data, tile.ctypes.data)
            keep_alive((edge,))  # its address was its last use: freed before the kernel read it
        for r in range(rows):
            for j in range(n):
                out[out_offset + (i + r) * n + j] = tile[r * NARROW_LANES + j]
    keep_alive((panel, tile))


if AS_PYTHON:  # the micro-kernel is an LLVM intrinsic, which plain Python cannot call

    def narrow_gemm_at(trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):  # noqa: F811
        op_a = a[a_offset : a_offset + m * k].reshape(m, k)
        op_b = b[b_offset : b_offset + k * n].reshape((n, k) if trans_b else (k, n))
        out[out_offset : out_offset + m * n] = (op_a @ (op_b.T if trans_b else op_b)).reshape(-1)
