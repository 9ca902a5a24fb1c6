"""bfloat16 and float16 buckets summed in their own 16 bits on the wire, for two ranks. MPI sums
no 16-bit float, so they were widened to float32 before the allreduce: twice the bytes on the
wire and a widening pass. With two ranks every element is combined exactly once (two
contributions, one addition, whatever the algorithm), so an MPI operation that widens both to
float32, adds, scales by 1/2 when averaging and rounds to the 16-bit dtype once gives the
float32 sum's bits rounded once, the same as before (checked to the bit, NaN, infinities,
subnormals and float16 overflow included; halving before rounding keeps a float16 mean finite
where the sum is not). On more ranks each combination would round again: those keep float32
on the wire, and so do steps whose ranks scale their gradients (unequal rows) or sum
accumulated float32 micro-batches.

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
BFLOAT16, FLOAT16 = 0, 1  # add_half's kind


@njit(nogil=True, cache=True)
def add_half(invec, inoutvec, n, scale, kind):
    """inoutvec[i] = half((float32(invec[i]) + float32(inoutvec[i])) * scale), rounded to nearest
    even once (NaN kept NaN; float16 overflows to inf), half: bfloat16 or float16 (kind); in
    chunks of plain loops the compiler vectorizes."""
    a = carray(invec, n)
    b = carray(inoutvec, n)
    x_bits = np.empty(CHUNK, np.uint32)
    y_bits = np.empty(CHUNK, np.uint32)
    x = x_bits.view(np.float32)
    y = y_bits.view(np.float32)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        if kind == BFLOAT16:
            _widen_bfloat16(a[start : start + m], x_bits[:m])
            _widen_bfloat16(b[start : start + m], y_bits[:m])
        else:
            _widen_float16(a[start : start + m], x_bits[:m])
            _widen_float16(b[start : start + m], y_bits[:m])
        _add_scaled(x[:m], y[:m], scale)
        if kind == BFLOAT16:
            _round_bfloat16(x_bits[:m], b[start : start + m])
        else:
            _round_float16(x_bits[:m], b[start : start + m])


@njit(nogil=True, cache=True)
def _widen_bfloat16(halves, words):
    for j in range(halves.size):
        words[j] = np.uint32(halves[j]) << np.uint32(16)


@njit(nogil=True, cache=True)
def _widen_float16(halves, words):
    """float16 bit patterns to float32 ones, exactly: exponent and fraction moved into place
    and scaled by 2**112 (subnormals become normal), infinities and NaN rebuilt, sign put back."""
    real = words.view(np.float32)
    for j in range(halves.size):
        words[j] = (np.uint32(halves[j]) & np.uint32(0x7FFF)) << np.uint32(13)
        real[j] = real[j] * np.float32(5.192296858534828e33)  # 2**112
    for j in range(halves.size):
        h = np.uint32(halves[j])
        special = (h & np.uint32(0x7C00)) == np.uint32(0x7C00)
        body = np.uint32(0x7F800000) | ((h & np.uint32(0x3FF)) << np.uint32(13))
        words[j] = ((h & np.uint32(0x8000)) << np.uint32(16)) | (body if special else words[j])


@njit(nogil=True, cache=True)
def _add_scaled(x, y, scale):
    for j in range(x.size):
        x[j] = (x[j] + y[j]) * scale


@njit(nogil=True, cache=True)
def _round_bfloat16(words, halves):
    for j in range(words.size):
        bits = words[j]
        nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        rounded = (bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)
        quiet = (bits >> np.uint32(16)) | np.uint32(0x40)
        halves[j] = np.uint16(quiet if nan else rounded)


@njit(nogil=True, cache=True)
def _round_float16(words, halves):
    """float32 bit patterns to float16 rounded to nearest even (words are scratch after): a
    results' subnormals by a float addition of 0.5 that rounds at their last bit, normals by
    the integer carry, overflow to inf, NaN to a quiet NaN."""
    real = words.view(np.float32)
    for j in range(words.size):
        bits = words[j]
        sign = bits & np.uint32(0x80000000)
        magnitude = bits ^ sign
        odd = (magnitude >> np.uint32(13)) & np.uint32(1)
        normal = (magnitude - np.uint32(112 << 23) + np.uint32(0xFFF) + odd) >> np.uint32(13)
        words[j] = magnitude
        real[j] = real[j] + np.float32(0.5)
        subnormal = words[j] - np.uint32(126 << 23)
        if magnitude >= np.uint32(143 << 23):
            out = np.uint32(0x7E00) if magnitude > np.uint32(0x7F800000) else np.uint32(0x7C00)
        elif magnitude < np.uint32(113 << 23):
            out = subnormal
        else:
            out = normal
        halves[j] = np.uint16(out | (sign >> np.uint32(16)))


def _bfloat16_sum(invec, inoutvec, length, datatype):
    add_half(invec, inoutvec, length[0], np.float32(1.0), BFLOAT16)


def _bfloat16_mean_of_two(invec, inoutvec, length, datatype):
    add_half(invec, inoutvec, length[0], np.float32(0.5), BFLOAT16)


def _float16_sum(invec, inoutvec, length, datatype):
    add_half(invec, inoutvec, length[0], np.float32(1.0), FLOAT16)


def _float16_mean_of_two(invec, inoutvec, length, datatype):
    add_half(invec, inoutvec, length[0], np.float32(0.5), FLOAT16)


FUNCTIONS = {
    ("bf16", False): _bfloat16_sum,
    ("bf16", True): _bfloat16_mean_of_two,
    ("f16", False): _float16_sum,
    ("f16", True): _float16_mean_of_two,
}
_ops: dict = {}
_lock = threading.Lock()


def half_op(dtype: str, average: bool):
    """The mpi4py Op summing the bit patterns (uint16) of two ranks' bfloat16 or float16 (IR
    dtype) values, halved if average."""
    with _lock:
        key = (dtype, average)
        if key not in _ops:
            from mpi4py import MPI

            from .driver_mpi import mpi_library

            function = cfunc(SIGNATURE, cache=True)(FUNCTIONS[key])
            handle = ctypes.c_int64(0)  # an int (MPICH) or a pointer (Open MPI): 8 bytes hold both
            error = mpi_library().MPI_Op_create(
                ctypes.c_void_p(function.address), ctypes.c_int(1), ctypes.byref(handle)
            )
            if error:
                raise OSError(f"MPI_Op_create failed with MPI error {error}")
            mask = (1 << (8 * MPI._sizeof(MPI.Op))) - 1
            _ops[key] = (function, MPI.Op.fromhandle(handle.value & mask))
        return _ops[key][1]


def sent_in_16_bits(dtype: str, size: int, scaled: bool = False, accumulated: bool = False):
    """Whether a bucket of this IR dtype travels in its own 16 bits: bfloat16 and float16 on two
    ranks, unless ranks scale it before the sum (unequal rows) or it holds float32 micro-batch
    sums. Every rank decides alike (the agreement checked dtype, ranks, rows and accumulate)."""
    return dtype in ("bf16", "f16") and size == 2 and not scaled and not accumulated
