"""One contiguous view of a bucket whose parts live in different ranks' shared segments: a
range of this process's address space whose pages are, part by part, the pages of each rank's
buffer (mapped again from its segment's file, MAP_FIXED over an anonymous reservation). A rank
sums its part of a bucket in place, in its own buffer (shared_exchange.py), and every rank then
reads the whole sum through such a view: no copy, and each leaf of the bucket is one
contiguous array wherever the parts split it.

The reservation is a Python mmap object, so the range is unmapped (overlays included) when the
last array made from it goes; arrays made from it hold it, which is how a step tells whether
the results it returned are still held (`holders`)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

PAGE = mmap.PAGESIZE
_libc: list = []


def _mmap():
    if not _libc:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        )
        _libc.append(libc.mmap)
    return _libc[0]


def available() -> bool:
    """Whether this system maps files over a reserved range (Linux's mmap with MAP_FIXED)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MAP_SHARED")


def stitched(pieces: list[tuple[int, int, int]]) -> mmap.mmap:
    """A reserved range holding, end to end, each (fd, file offset, bytes) piece of a file
    mapped shared (offsets and bytes whole pages but the last piece's bytes, rounded up)."""
    total = sum(-(-n // PAGE) * PAGE for _, _, n in pieces)
    reserved = mmap.mmap(-1, max(total, PAGE))
    holder = ctypes.c_char.from_buffer(reserved)
    base = ctypes.addressof(holder)
    del holder  # the export ends: the reservation can be unmapped with its last array
    mapper, at = _mmap(), 0
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10  # MAP_FIXED
    for fd, offset, nbytes in pieces:
        length = -(-nbytes // PAGE) * PAGE
        if length:
            got = mapper(base + at, length, prot, flags, fd, offset)
            if got != base + at:
                error = ctypes.get_errno()
                raise OSError(error, f"mapping a window buffer's part: {os.strerror(error)}")
        at += length
    return reserved


def holders(reserved: mmap.mmap, kept: int = 1) -> int:
    """How many arrays made from `reserved` (one reference each: numpy's buffer view) are
    alive beyond the `kept` references its owner holds."""
    return sys.getrefcount(reserved) - 2 - kept  # (this call's argument and getrefcount's)


IN_PLACE_BYTES = 1 << 16  # a bucket from which it is summed in place
IN_PLACE_DTYPES = ("f32", "f64", "bf16", "f16")  # buckets whose window buffers hold their dtype


def summed_in_place(dtype: str, nbytes: int, size: int, accumulated: bool = False) -> bool:
    """Whether a bucket (IR dtype, bytes) is summed in place on `size` ranks of one node:
    each rank sums its page_part of every rank's buffer into its own buffer, and reads the
    whole sum through a stitched view (shared_exchange.py). A 16-bit bucket's part is summed
    widened to float32 and rounded once into its 16 bits there; accumulated (its window
    buffers hold float32 sums, data_parallel(accumulate=k)) it is summed into a float32
    buffer of its own. Small buckets are summed whole by every rank (one meeting, not two)."""
    if accumulated and dtype in ("bf16", "f16"):
        return False
    return size >= 2 and dtype in IN_PLACE_DTYPES and nbytes >= IN_PLACE_BYTES and available()
