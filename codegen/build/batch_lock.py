"""One process at a time compiles a given batch of loops (codegen/build/loop_batch.py).

Processes sharing a cache folder and starting the same program at once (the ranks of
`mpiexec -n 2`, two test workers) each compiled the same plan's loops: twice the CPU, where the
second could load what the first saved. The lock is an flock on `k_batch_<digest of the batch's
note paths>.lock` in the cache folder's `__pycache__`, released by the system when its holder
exits or dies (no stale lock; the file stays, a few bytes). A holder that does not finish (a
stopped process) is waited for at most WAIT_SECONDS; then this process compiles on its own.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from backplan.codegen.build import cache

try:
    import fcntl
except ImportError:  # Windows: no lock, and at worst a batch compiled twice
    fcntl = None

WAIT_SECONDS = 120.0
POLL_SECONDS = 0.05


def lock_path(note_paths: list[str]) -> str | None:
    """The lock of the batch whose loop forms have these note paths; None when the cache
    folder cannot be written (nothing is saved there for another process to load)."""
    directory = cache.writable_cache_dir()
    if directory is None:
        return None
    digest = hashlib.sha256("\n".join(sorted(note_paths)).encode()).hexdigest()[:24]
    return os.path.join(directory, "__pycache__", f"k_batch_{digest}.lock")


@contextmanager
def held(note_paths: list[str]) -> Iterator[bool]:
    """Hold the batch's lock, waiting (at most WAIT_SECONDS) for whoever holds it now; yields
    whether it is held."""
    path = lock_path(note_paths) if fcntl is not None else None
    if path is None:
        yield False
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    locked = False
                    break
                time.sleep(POLL_SECONDS)
        yield locked
    finally:
        os.close(fd)  # releases the lock
