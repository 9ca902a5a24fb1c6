"""bfloat16 and float16 arrays on the wire: mpi4py takes neither (bfloat16 is no NumPy dtype it
knows, and MPI sums no 16-bit float), so a 16-bit gradient bucket failed in its allreduce with
'BufferError: DLPack only supports ... float and complex dtypes'. Collectives that move bytes
(broadcast, all-gather) send the 16-bit patterns as uint16; sums run in float32 (as PyTorch
DDP's CPU backends do for 16-bit buckets: no rounding per rank added) and are rounded into the
16-bit dtype once, after the sum; on two ranks 16-bit buckets travel in 16 bits with the same
result (half_sum.py)."""

from __future__ import annotations

import numpy as np

from backplan.ir.types import dtype_name, is_half


def half(dtype) -> bool:
    return is_half(dtype_name(np.dtype(dtype)))


def as_bits(array: np.ndarray) -> np.ndarray:
    """The array itself, or its 16-bit floats' bit patterns (a view: the same memory)."""
    return array.view(np.uint16) if half(array.dtype) else array


def summed_dtype(dtype) -> np.dtype:
    """The dtype MPI adds values of `dtype` in: float32 for the 16-bit floats."""
    return np.dtype(np.float32) if half(dtype) else np.dtype(dtype)


def summed_bytes(nbytes: int, dtype) -> int:
    """The bytes `nbytes` of `dtype` take on the wire where they are summed."""
    return nbytes * summed_dtype(dtype).itemsize // np.dtype(dtype).itemsize
