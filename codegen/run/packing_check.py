"""The checked mode's reading of backplan's GEMM packing buffers: the pages a call's products
wrote there, against the pages its plan counts (codegen/kernels/gemm/packing.py).

The buffers are kept for the process (codegen/kernels/gemm/scratch.py: one mapping each, only
written pages resident). Before a checked call every free buffer is taken (so no other
thread's GEMM packs into it meanwhile), its pages dropped (MADV_DONTNEED: the next write
maps zeroed pages; nothing of a packing outlives the product that wrote it) and handed back;
after the call, mincore says which pages the call's GEMMs wrote. Each buffer must hold only
pages the plan counts for the calling thread (every product's), no more buffers may be
written than the threads it counts, and no more bytes than it counts; the call then holds the
plan's count, as explain says. A buffer another thread held through the
call is left out (its pages are that thread's)."""

from __future__ import annotations

import ctypes
import mmap

from backplan.codegen.jit import njit
from backplan.codegen.kernels.gemm import scratch

_libc = ctypes.CDLL(None, use_errno=True) if hasattr(mmap, "MADV_DONTNEED") else None
_PAGES = scratch.MAPPED_BYTES // scratch.PAGE


def available() -> bool:
    """Whether this platform lets the pages be dropped and read back (Linux)."""
    return _libc is not None and hasattr(_libc, "mincore")


@njit(cache=True, nogil=True)
def _take(slot):
    return scratch.try_take(slot)


@njit(cache=True, nogil=True)
def _give(slot):
    scratch.give_back(slot)


def drop() -> set[int]:
    """Drop the pages of every kept buffer no thread holds now; the slots dropped."""
    dropped = set()
    for slot, address in scratch.kept_buffers():
        if not _take(slot):
            continue
        try:
            if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(scratch.MAPPED_BYTES),
                             mmap.MADV_DONTNEED) == 0:  # fmt: skip
                dropped.add(slot)
        finally:
            _give(slot)
    return dropped


def written(dropped: set[int], before: set[int]) -> dict[int, set[int]]:
    """slot -> the page indices resident in its buffer: the buffers dropped before the call
    and those mapped during it (before: the slots that had a buffer then)."""
    found = {}
    for slot, address in scratch.kept_buffers():
        if slot in dropped or slot not in before:
            found[slot] = resident_pages(address)
    return found


def resident_pages(address: int) -> set[int]:
    vector = (ctypes.c_ubyte * _PAGES)()
    if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(scratch.MAPPED_BYTES), vector):
        raise OSError(ctypes.get_errno(), "mincore on a GEMM packing buffer")
    return {i for i, v in enumerate(vector) if v & 1}


def kept_slots() -> set[int]:
    return {slot for slot, _ in scratch.kept_buffers()}


def problems(plan, pages: dict[int, set[int]]) -> list[str]:
    """What the call's buffers hold beyond the PackingPlan `plan` (ascending: none)."""
    used = {slot: p for slot, p in pages.items() if p}
    found = []
    if len(used) > 1 + plan.helpers:
        found.append(
            f"{len(used)} buffers written, the plan counts {1 + plan.helpers} (threads packing)"
        )
    allowed = plan.first
    for slot, held in sorted(used.items()):
        beyond = held - allowed
        if beyond:
            found.append(
                f"buffer {slot} wrote {len(held) * scratch.PAGE:,} B, "
                f"{len(beyond) * scratch.PAGE:,} B of it on pages the plan does not count "
                f"(first {min(beyond) * scratch.PAGE:,} B into the buffer)"
            )
    total = sum(len(p) for p in used.values()) * scratch.PAGE
    if total > plan.nbytes - plan.apart:
        found.append(
            f"the buffers hold {total:,} B, the plan counts {plan.nbytes - plan.apart:,} B"
        )
    return found
