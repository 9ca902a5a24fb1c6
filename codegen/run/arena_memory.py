"""Scratch arenas in reserved address space, so that a new batch size's arena grows over the
previous size's pages instead of faulting all of its bytes in fresh.

A new size's first call used to fault its whole arena in: the transformer's 12-row arena, 44 MB,
cost ~2 ms of the kernel zeroing pages (more, and far more under load, than the planning cuts
left to make), while the previous size's 29 MB arena, full of pages, had just been freed at the
switch (tracer/dynamic.py). An arena of RESERVE_FROM bytes or more is now the 2 MiB-aligned
start of a private anonymous mapping that reserves RESERVE_FACTOR times its bytes of address
space (MAP_NORESERVE: no memory until touched), its whole 2 MiB blocks advised for transparent
huge pages (the last, partial one in 4 KiB pages: a huge page there would hold up to 2 MiB past
the arena, which explain does not count). When a size switch frees idle arenas, their mappings
are offered (`offer`); the next workspace a call
checks out takes the best one over (codegen/run/workspace.py): the pages already there stay,
only the bytes beyond them fault, and pages past the new arena's end are given back
(MADV_DONTNEED), so the process holds the new size's arena alone, as explain counts. Offers not
taken by the end of the call are dropped (`withdraw_offers`).

Measured on the 2-vCPU EPYC, one thread (scripts in BENCHMARKS 31): a 44 MB arena written once
costs 3.2 ms from np.empty (539 faults: its unaligned first and last 2 MiB fault 4 KiB at a
time), 2.4 ms from a reservation (27 faults), 1.6-1.8 ms grown over a 29 MB one (12 faults; 2.2 ms
and 520 faults before the old arena's last, partial block was collapsed: `_collapse`);
written when faulted already 1.1 ms. Under load, fresh pages also cost the most system time
(BENCHMARKS 31): the pages kept are exempt.

An arena is reported to tracemalloc in NumPy's domain, as np.empty's was (PyTraceMalloc_Track
for its bytes, again at each new length; untracked when the mapping goes), so a tracemalloc
measurement of a step sees the same arena bytes as before.

Elsewhere than Linux, or under strict overcommit (vm.overcommit_memory = 2, where a reservation
counts against the commit limit whatever its flags), arenas are plain NumPy arrays as before.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import weakref

import numpy as np

HUGE_PAGE = 1 << 21
RESERVE_FROM = 4 << 20  # smaller arenas come from malloc's free lists: no faults to save
RESERVE_FACTOR = 4  # address space reserved per arena byte: later sizes up to 4x fit in place
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value (Python < 3.13)


def _reservations_work() -> bool:
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() != "2"
    except OSError:
        return False


RESERVING = _reservations_work()
NUMPY_DOMAIN = 389047  # np.lib.tracemalloc_domain: where NumPy reports its array buffers


def _tracemalloc_calls():
    """(track, untrack): CPython's PyTraceMalloc_Track / _Untrack (no-ops while tracemalloc is
    not tracing), or None where ctypes cannot reach them."""
    api = ctypes.pythonapi
    try:
        track, untrack = api.PyTraceMalloc_Track, api.PyTraceMalloc_Untrack
    except AttributeError:
        return None
    track.argtypes = [ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t]
    untrack.argtypes = [ctypes.c_uint, ctypes.c_size_t]
    track.restype = untrack.restype = ctypes.c_int
    return track, untrack


_TRACEMALLOC = _tracemalloc_calls()


MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux's value (Python < 3.14)


class Reservation:
    """Address space for one arena at a time, of up to `capacity` bytes, from a 2 MiB boundary.

    Arrays over it keep its mapping alive (their base is the mmap object): it is unmapped when
    the last one and the reservation are gone."""

    __slots__ = ("_map", "_start", "_huge", "capacity", "spanned")

    def __init__(self, nbytes: int):
        length = _round_up(max(nbytes, 1) * RESERVE_FACTOR, HUGE_PAGE) + HUGE_PAGE
        self._map = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
        address = np.frombuffer(self._map, np.uint8, count=1).ctypes.data
        self._start = -address % HUGE_PAGE
        self.capacity = length - self._start
        self.spanned = 0  # bytes the last arena over it spanned: pages may be held up to there
        self._huge = -1  # bytes from the start advised for huge pages (-1: not advised yet)
        if _TRACEMALLOC is not None:  # its arena leaves tracemalloc's count with the mapping
            untrack = weakref.finalize(
                self._map, _TRACEMALLOC[1], NUMPY_DOMAIN, address + self._start
            )
            untrack.atexit = False

    def arena(self, nbytes: int) -> np.ndarray:
        """A uint8 array of nbytes over the start; pages the last arena held past its end are
        given back first."""
        if nbytes > self.capacity:
            raise ValueError(f"an arena of {nbytes} bytes in a reservation of {self.capacity}")
        keep, whole = _round_up(nbytes, mmap.PAGESIZE), nbytes // HUGE_PAGE * HUGE_PAGE
        if self.spanned > keep:
            self._map.madvise(mmap.MADV_DONTNEED, self._start + keep, self.spanned - keep)
        partial = self._huge if whole > self._huge >= 0 and self.spanned > self._huge else None
        self.spanned = nbytes
        self._advise_huge(whole)
        if partial is not None:
            self._collapse(partial)
        arena = np.frombuffer(self._map, np.uint8, count=nbytes, offset=self._start)
        if _TRACEMALLOC is not None:  # as NumPy reports np.empty's buffer (replaces a last one)
            _TRACEMALLOC[0](NUMPY_DOMAIN, arena.ctypes.data, nbytes)
        return arena

    def _advise_huge(self, whole: int) -> None:
        """Huge pages for the arena's whole 2 MiB blocks only: a fault in its last, partial
        block would map 2 MiB, up to 2 MiB beyond the arena held (as np.empty's array, whose
        mapping ends with it, never did); past `whole` pages are 4 KiB, whatever the system's
        THP mode."""
        if whole == self._huge or not hasattr(mmap, "MADV_NOHUGEPAGE"):
            return
        if whole:
            self._map.madvise(mmap.MADV_HUGEPAGE, self._start, whole)
        self._map.madvise(mmap.MADV_NOHUGEPAGE, self._start + whole)
        self._huge = whole

    def _collapse(self, offset: int) -> None:
        """The last arena's partial 2 MiB block at offset, in 4 KiB pages, is whole in this
        one: made one huge page now (MADV_COLLAPSE, Linux 6.1: its pages copied in, the rest
        zeroed), else the rest of it faults 4 KiB at a time (a 44 MB arena grown over a 29 MB
        one: 520 faults, 2.2 ms against 12 faults, 1.8 ms). Where the kernel cannot, the block
        stays as it is."""
        try:
            self._map.madvise(MADV_COLLAPSE, self._start + offset, HUGE_PAGE)
        except OSError:
            pass

    def unviewed(self) -> bool:
        """No array views it any more (this object's reference and getrefcount's argument)."""
        return sys.getrefcount(self._map) == 2


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def new_arena(nbytes: int) -> tuple[np.ndarray, Reservation | None]:
    """(arena, its reservation or None): reserved when big enough and the platform allows."""
    if RESERVING and nbytes >= RESERVE_FROM:
        try:
            reservation = Reservation(nbytes)
        except OSError:  # address space or mappings exhausted: a plain array, as before
            pass
        else:
            return reservation.arena(nbytes), reservation
    return np.empty(nbytes, np.uint8), None


# Reservations a size switch freed, for the next checked-out workspace to take over. Read
# without the lock on every checkout (an empty list: nothing to do); taken under it, so that two
# threads never build arenas over one reservation.
OFFERED: list[Reservation] = []
_offers_lock = threading.Lock()


def offer(reservations) -> None:
    """Offer freed reservations nothing views any more (the rest are let go)."""
    free = [r for r in reservations if r.unviewed()]
    with _offers_lock:
        OFFERED.extend(free)


def take_offer(nbytes: int) -> Reservation | None:
    """The offered reservation that fits nbytes holding the most pages (the others are dropped:
    one call takes one offer); None for an arena too small to reserve (the offers stay)."""
    if nbytes < RESERVE_FROM or not RESERVING:
        return None
    with _offers_lock:
        offers = OFFERED[:]
        OFFERED.clear()
    fitting = [r for r in offers if r.capacity >= nbytes and r.unviewed()]
    return max(fitting, key=lambda r: min(r.spanned, nbytes), default=None)


def withdraw_offers() -> None:
    """Drop every offer (the call that made them ended without taking one)."""
    with _offers_lock:
        OFFERED.clear()
