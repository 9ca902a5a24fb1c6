"""bfloat16 buckets summed in their own 16 bits on the wire, for two ranks. MPI sums no 16-bit
float, so they were widened to float32 before the allreduce: twice the bytes on the wire and a
widening pass. With two ranks every element is combined exactly once (two contributions, one
addition, whatever the algorithm), so an MPI operation that widens both to float32, adds,
scales by 1/2 when averaging and rounds to bfloat16 once gives the float32 sum's bits rounded
once, the same as before (checked to the bit, NaN, infinities and subnormals included). On more
ranks each combination would round again: those keep float32 on the wire, and so do float16
(no float16 arithmetic in the operation) and steps whose ranks scale their gradients (unequal
rows) or sum accumulated float32 micro-batches.

The operation is a Numba cfunc handed to MPI_Op_create (through the MPI library's own entry
point), created once per process on first use."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
from numba import carray, cfunc, njit, types

SIGNATURE = types.void(
    types.CPointer(types.uint16),
    types.CPointer(types.uint16),
    types.CPointer(types.int32),
    types.voidptr,
)


CHUNK = 4096  # elements widened at a time: two float32 scratch rows of 16 KiB stay in L1


@njit(nogil=True, cache=True)
def add_bfloat16(invec, inoutvec, n, scale):
    """inoutvec[i] = bfloat16((float32(invec[i]) + float32(inoutvec[i])) * scale), rounded to
    nearest even (NaN kept NaN, quiet); in chunks of plain loops the compiler vectorizes."""
    a = carray(invec, n)
    b = carray(inoutvec, n)
    x_bits = np.empty(CHUNK, np.uint32)
    y_bits = np.empty(CHUNK, np.uint32)
    x = x_bits.view(np.float32)
    y = y_bits.view(np.float32)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _widen(a[start : start + m], x_bits[:m])
        _widen(b[start : start + m], y_bits[:m])
        _add_scaled(x[:m], y[:m], scale)
        _round(x_bits[:m], b[start : start + m])


@njit(nogil=True, cache=True)
def _widen(halves, words):
    for j in range(halves.size):
        words[j] = np.uint32(halves[j]) << np.uint32(16)


@njit(nogil=True, cache=True)
def _add_scaled(x, y, scale):
    for j in range(x.size):
        x[j] = (x[j] + y[j]) * scale


@njit(nogil=True, cache=True)
def _round(words, halves):
    for j in range(words.size):
        bits = words[j]
        nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        rounded = (bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)
        quiet = (bits >> np.uint32(16)) | np.uint32(0x40)
        halves[j] = np.uint16(quiet if nan else rounded)


def _sum(invec, inoutvec, length, datatype):
    add_bfloat16(invec, inoutvec, length[0], np.float32(1.0))


def _mean_of_two(invec, inoutvec, length, datatype):
    add_bfloat16(invec, inoutvec, length[0], np.float32(0.5))


_ops: dict = {}
_lock = threading.Lock()


def bfloat16_op(average: bool):
    """The mpi4py Op summing bfloat16 bit patterns (uint16) of two ranks, halved if average."""
    with _lock:
        if average not in _ops:
            from mpi4py import MPI

            from .driver_mpi import mpi_library

            function = cfunc(SIGNATURE, cache=True)(_mean_of_two if average else _sum)
            handle = ctypes.c_int64(0)  # an int (MPICH) or a pointer (Open MPI): 8 bytes hold both
            error = mpi_library().MPI_Op_create(
                ctypes.c_void_p(function.address), ctypes.c_int(1), ctypes.byref(handle)
            )
            if error:
                raise OSError(f"MPI_Op_create failed with MPI error {error}")
            mask = (1 << (8 * MPI._sizeof(MPI.Op))) - 1
            _ops[average] = (function, MPI.Op.fromhandle(handle.value & mask))
        return _ops[average][1]


def sent_in_16_bits(dtype: str, size: int, scaled: bool = False, accumulated: bool = False):
    """Whether a bucket of this IR dtype travels in its own 16 bits: bfloat16 on two ranks,
    unless ranks scale it before the sum (unequal rows) or it holds float32 micro-batch sums.
    Every rank decides alike (the agreement checked dtype, ranks, rows and accumulate)."""
    return dtype == "bf16" and size == 2 and not scaled and not accumulated
