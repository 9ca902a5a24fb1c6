"""One process at a time compiles a given cached function for a given signature.

MPI ranks started together, or a program and its twin, sharing one cache folder each looked in
the cache, found nothing and compiled the same plan driver or library function (a GEMM variant,
the convolution), each paying its CPU. On a cache miss a process now takes an flock named by
the function's cache entry and the signature; a process that had to wait looks in the cache
again and loads what the holder saved. Loop batches have their own lock (batch_lock.py), child
driver builds theirs (driver_lock.py); this one covers what compiles in the calling process.

The lock is released, and its file removed, when the compile is saved; the system releases it
when its holder exits or dies. A compile that raises keeps it until its process ends, so a
waiter gives up after WAIT_S and compiles on its own: at worst the old cost, never a hang.
"""

from __future__ import annotations

import hashlib
import os
import time

try:
    import fcntl
except ImportError:  # Windows: no lock, and at worst a function compiled twice
    fcntl = None

WAIT_S = 300.0
POLL_S = 0.05
_held: dict[str, int] = {}  # lock path -> descriptor, this process's (Numba compiles one at a time)


def lock_path(cache_folder: str, filename_base: str, signature) -> str:
    """`<folder>/<function's index name>.<digest of the signature>.lock`."""
    digest = hashlib.sha256(str(signature).encode()).hexdigest()[:16]
    return os.path.join(cache_folder, f"{filename_base}.{digest}.lock")


def take(path: str) -> bool:
    """Hold the lock at path (a no-op where this process holds it): whether another process
    held it first, so that what it compiled may be in the cache now."""
    if fcntl is None or path in _held:
        return False
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # an unwritable folder: nothing is cached there either
        return False
    waited, deadline = False, time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            waited = True
            if time.monotonic() > deadline:
                os.close(fd)
                return True
            time.sleep(POLL_S)
    _held[path] = fd
    return waited


def release(path: str) -> None:
    """Let go of the lock and remove its file, so that none is left in the cache folder (which
    holds signed entries only). A process that opened the file before it was removed still gets
    the lock on it, and one that came later makes a new file: at worst both compile, as without
    a lock, and both save the same code."""
    fd = _held.pop(path, None)
    if fd is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)  # releases the lock
