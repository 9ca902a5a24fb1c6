"""The thread count of the OpenBLAS libraries loaded in this process (SciPy's, which compiled
GEMMs call through Numba, and NumPy's), lowered when cores are busy and raised back after.

OpenBLAS threads a GEMM above about 262,144 multiply-adds (m * n * k) on every thread it was
started with, whatever else runs on the machine; with another process on the second core of a
2-vCPU box the digits CNN's steps took 17-216 ms against 1.2-2 ms at OPENBLAS_NUM_THREADS=1.
Its own `*_set_num_threads` (a global, under a microsecond to call) is the lever; threadpoolctl
uses the same symbols, but is not a dependency of backplan.

The count is never raised above the ceiling, the count the library had before backplan first
lowered it; a count someone else set since (threadpoolctl, a user's call) becomes the ceiling.
"""

from __future__ import annotations

import ctypes
import os
import threading

# (set, get) symbol pairs, by the prefixes OpenBLAS builds use (SciPy's and NumPy's wheels
# rename theirs: scipy_openblas_*, and *64_ for the 64-bit-integer build).
_SYMBOLS = (
    ("openblas_set_num_threads", "openblas_get_num_threads"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
)


def loaded_openblas(maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of the OpenBLAS libraries mapped into this process (none where /proc is missing)."""
    try:
        with open(maps_path) as file:
            paths = {line.split()[-1] for line in file if "openblas" in line.lower()}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def _controls(path: str):
    """(set, get) of one library, or None when it has neither pair of symbols."""
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return None
    for set_name, get_name in _SYMBOLS:
        setter, getter = getattr(library, set_name, None), getattr(library, get_name, None)
        if setter is not None and getter is not None:
            setter.argtypes, setter.restype = [ctypes.c_int], None
            getter.argtypes, getter.restype = [], ctypes.c_int
            return setter, getter
    return None


class BlasPool:
    """limit(n): each library's count to min(n, its ceiling); found on the first call."""

    def __init__(self, find=loaded_openblas):
        self._find = find
        self._libraries = None  # [[set, get, ceiling, count we set or None]]
        self._lock = threading.Lock()
        self._asked = None  # the last request

    def limit(self, threads: int) -> None:
        """Sizes every library for `threads`; the same request as the last one returns at
        once (a step's common case), leaving a count someone else set since as it is."""
        if threads == self._asked:
            return
        with self._lock:
            self._asked = threads
            if self._libraries is None:
                found = (_controls(path) for path in self._find())
                self._libraries = [[s, g, g(), None] for s, g in filter(None, found)]
            for entry in self._libraries:
                setter, getter, ceiling, ours = entry
                now = getter()
                if ours is None or now != ours:  # set by someone else: their count rules
                    ceiling = entry[2] = now
                target = max(1, min(threads, ceiling))
                if target != now:
                    setter(target)
                entry[3] = target

    def counts(self) -> list[int]:
        """Each library's thread count now (for tests and reports)."""
        with self._lock:
            return [entry[1]() for entry in self._libraries or []]


BLAS_POOL = BlasPool()
if hasattr(os, "register_at_fork"):  # a fork while another thread held the lock: a fresh one
    os.register_at_fork(after_in_child=lambda: setattr(BLAS_POOL, "_lock", threading.Lock()))
