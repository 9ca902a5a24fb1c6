"""One process at a time compiles a given driver: MPI ranks, or two scripts, sharing a cache
folder would otherwise each compile the same driver. The child holding `<module>.lock` compiles;
the others wait for it and then find the driver in the cache (Numba looks there before it
compiles). The lock is an flock, released by the system when its holder exits or dies, so a
crashed build never leaves a stale lock; the file itself stays (a few bytes, the holder's pid).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import fcntl
except ImportError:  # Windows: no lock, and at worst a driver compiled twice
    fcntl = None


def lock_path(module_path: str) -> str:
    """The lock of a plan module `bp_<key>.py`: `bp_<key>.lock` beside it."""
    return os.path.splitext(module_path)[0] + ".lock"


@contextmanager
def held(module_path: str) -> Iterator[None]:
    """Hold the driver's lock, waiting for whoever holds it now."""
    if fcntl is None:
        yield
        return
    fd = os.open(lock_path(module_path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock
