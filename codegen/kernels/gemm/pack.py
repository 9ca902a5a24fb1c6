"""Packing: copy a block of op(A) or op(B) into the panel order the micro-kernel reads.

A block of op(A) (mc x kc) becomes ceil(mc / mr) panels, each kc rows of mr values (rows past
the edge are zero), so the kernel reads A with unit stride. A kc x nc block of op(B) becomes
panels of kc rows of nr values (columns past the edge are zero), each contiguous so that it
stays in L1 while the A panels stream past it (driver.py says when B is read in place
instead). Full panels that read across rows of unit-stride data go through the vector
transpose of transpose_pack; the rest are 2-D slice copies. A bfloat16 operand (uint16 bits)
or a float16 one (int16 bits, symbols.py) is widened into float32 panels here, while it is
copied anyway: the micro-kernel reads float32 and the GEMM needs no widened copy of the
operand.
"""

import numpy as np
from numba import types
from numba.extending import overload

from backplan.codegen.jit import njit
from backplan.codegen.kernels.by_address import by_address
from backplan.codegen.kernels.gemm.transpose_pack import (
    copy_rows_4,
    copy_rows_6,
    copy_rows_8,
    copy_rows_16,
    copy_rows_32,
    transpose_pack_6,
    transpose_pack_8,
    widen_rows_6,
    widen_rows_8,
    widen_rows_16,
    widen_rows_32,
)
from backplan.codegen.kernels.half import bf16_to_f32, f16_to_f32


def copy_block(dst, src):
    """dst[...] = src, widening bfloat16 bits (uint16) or float16 bits (int16) into float32
    (the NumPy twin)."""
    if src.dtype.kind == "u":
        src = (src.astype("uint32") << 16).view("float32")
    elif src.dtype.kind == "i":
        src = src.view("float16").astype("float32")
    dst[...] = src


@overload(copy_block)
def _copy_block(dst, src):
    if isinstance(src, types.Array) and src.dtype == types.uint16:

        def widen(dst, src):
            if not _widen_by_rows(dst, src):
                for i in range(src.shape[0]):
                    for j in range(src.shape[1]):
                        dst[i, j] = bf16_to_f32(src[i, j])

        return widen

    if isinstance(src, types.Array) and src.dtype == types.int16:

        def widen_f16(dst, src):
            if not _widen_by_rows(dst, src):
                for i in range(src.shape[0]):
                    for j in range(src.shape[1]):
                        dst[i, j] = f16_to_f32(np.uint16(src[i, j]))

        return widen_f16

    # Loops, not dst[:, :] = src: an array assigned to a slice makes Numba compile the f-string
    # of its shape-mismatch error (str, join, repr of tuples), about half of the GEMM's cold
    # compile (12.7 -> 6.7 CPU s per dtype on one core).
    def copy(dst, src):
        for i in range(src.shape[0]):
            for j in range(src.shape[1]):
                dst[i, j] = src[i, j]

    def copy_rows(dst, src):
        if not _copy_by_rows(dst, src):
            for i in range(src.shape[0]):
                for j in range(src.shape[1]):
                    dst[i, j] = src[i, j]

    same_float = isinstance(src, types.Array) and isinstance(dst, types.Array)
    same_float = same_float and src.dtype == dst.dtype in (types.float32, types.float64)
    return copy_rows if same_float else copy


@njit(cache=True, nogil=True)
def _copy_by_rows(dst, src):
    """A full panel's rows read from unit-stride rows of the same dtype, one vector load and
    store each: the loop over strided 2-D views stays scalar (~1 ns per element), and the
    panels of an untransposed B and of a transposed A (dW = X.T @ dY) are copied this way
    (the transformer's weight gradient 256x1024^T @ 1024x1024 ran 65 GFLOP/s with the scalar
    copies, 92 with these, thread CPU on one Zen 4 core). False for edges and strided rows
    (the caller copies elementwise)."""
    size, cols = src.itemsize, src.shape[1]
    if src.strides[1] != size or src.strides[0] % size:
        return False
    if dst.strides[1] != size or dst.strides[0] % size:
        return False
    src_addr, ld, kc = src.ctypes.data, src.strides[0] // size, src.shape[0]
    dst_addr, dst_ld = dst.ctypes.data, dst.strides[0] // size
    if cols == 32:
        copy_rows_32(src_addr, ld, kc, dst_addr, dst_ld, dst)
    elif cols == 16:
        copy_rows_16(src_addr, ld, kc, dst_addr, dst_ld, dst)
    elif cols == 8:
        copy_rows_8(src_addr, ld, kc, dst_addr, dst_ld, dst)
    elif cols == 6:
        copy_rows_6(src_addr, ld, kc, dst_addr, dst_ld, dst)
    elif cols == 4:
        copy_rows_4(src_addr, ld, kc, dst_addr, dst_ld, dst)
    else:
        return False
    return True


@njit(cache=True, nogil=True)
def _widen_by_rows(dst, src):
    """Rows of a full panel read from unit-stride 16-bit rows, one vector each (the
    elementwise loop over a strided 2-D view stays scalar: ~1 ns per element). False when
    the block is not such a panel (edges, strided rows): the caller copies elementwise."""
    cols = src.shape[1]
    if src.strides[1] != 2 or src.strides[0] % 2 or dst.strides[1] != 4 or dst.strides[0] % 4:
        return False
    args = (
        src.ctypes.data,
        src.strides[0] // 2,
        src.shape[0],
        dst.ctypes.data,
        dst.strides[0] // 4,
        src,
    )
    if cols == 32:
        widen_rows_32(*args)
    elif cols == 16:
        widen_rows_16(*args)
    elif cols == 8:
        widen_rows_8(*args)
    elif cols == 6:
        widen_rows_6(*args)
    else:
        return False
    return True


@njit(cache=True, nogil=True)
def _transposing(src, rows, lanes):
    """A full panel whose source rows have unit stride inside: the vector path applies
    (mr is 6 or 8 and nr a multiple of 8 for every tile in kernel.TILES)."""
    return rows == lanes and src.strides[1] == src.itemsize and src.strides[0] % src.itemsize == 0


# pack_a and pack_b are called by address (by_address.py): linked, the GEMM symbol optimised and
# emitted their code again (about 0.4 of its 4.5 CPU s cold); a call per block costs nothing.
@by_address(cache=True, nogil=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=True)
def pack_a(width, a, trans_a, i0, mc, p0, kc, mr, out):
    """Panels of op(A)[i0:i0+mc, p0:p0+kc]; op(A) = A.T when trans_a."""
    for panel in range((mc + mr - 1) // mr):
        first = i0 + panel * mr
        rows = min(mr, i0 + mc - first)
        dst = out[panel * kc * mr : (panel + 1) * kc * mr].reshape((kc, mr))
        if trans_a:
            copy_block(dst[:, :rows], a[p0 : p0 + kc, first : first + rows])
        elif _transposing(a, rows, mr):
            src = a.ctypes.data + first * a.strides[0] + p0 * a.itemsize
            ld = a.strides[0] // a.itemsize
            if mr == 8:
                transpose_pack_8(src, ld, kc, dst.ctypes.data, mr, out, a)
            else:
                transpose_pack_6(src, ld, kc, dst.ctypes.data, mr, out, a)
        else:
            copy_block(dst[:, :rows], a[first : first + rows, p0 : p0 + kc].T)
        if rows < mr:
            dst[:, rows:] = 0


@by_address(cache=True, nogil=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=True)
def pack_b(width, b, trans_b, p0, kc, j0, nc, nr, out):
    """Panels of op(B)[p0:p0+kc, j0:j0+nc]; op(B) = B.T when trans_b."""
    for panel in range((nc + nr - 1) // nr):
        first = j0 + panel * nr
        cols = min(nr, j0 + nc - first)
        dst = out[panel * kc * nr : (panel + 1) * kc * nr].reshape((kc, nr))
        if not trans_b:
            copy_block(dst[:, :cols], b[p0 : p0 + kc, first : first + cols])
        elif _transposing(b, cols, nr):
            src = b.ctypes.data + first * b.strides[0] + p0 * b.itemsize
            ld = b.strides[0] // b.itemsize
            for group in range(nr // 8):
                src_rows = src + group * 8 * b.strides[0]
                transpose_pack_8(
                    src_rows, ld, kc, dst.ctypes.data + group * 8 * out.itemsize, nr, out, b
                )
        else:
            copy_block(dst[:, :cols], b[first : first + cols, p0 : p0 + kc].T)
        if cols < nr:
            dst[:, cols:] = 0
