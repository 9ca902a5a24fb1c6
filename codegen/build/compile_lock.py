"""One process at a time compiles a given cached function for a given signature.

MPI ranks started together, or a program and its twin, sharing one cache folder each looked in
the cache, found nothing and compiled the same plan driver or library function (a GEMM variant,
the convolution), each paying its CPU. On a cache miss a process now takes an flock named by
the function's cache entry and the signature; a process that had to wait looks in the cache
again and loads what the holder saved. Loop batches have their own lock (batch_lock.py), child
driver builds theirs (driver_lock.py); this one covers what compiles in the calling process.

The lock is released, and its file removed, when the compile is saved or raises; the system
releases it when its holder exits or dies. A holder that neither saves nor exits (stopped, or
stuck) is waited for wait_seconds() at most (WAIT_S, or BACKPLAN_COMPILE_LOCK_WAIT_SECONDS),
then the waiter compiles on its own: at worst the old cost, never a hang. A folder where the
file cannot be made or locked (read-only, full, a file system without flock) compiles without
the lock.
"""

from __future__ import annotations

import hashlib
import os
import time

try:
    import fcntl
except ImportError:  # Windows: no lock, and at worst a function compiled twice
    fcntl = None

WAIT_S = 300.0  # the default of wait_seconds()
POLL_S = 0.05
_held: dict[str, int] = {}  # lock path -> descriptor, this process's (Numba compiles one at a time)


def wait_seconds() -> float:
    """How long a waiter waits for another process's compile: BACKPLAN_COMPILE_LOCK_WAIT_SECONDS
    (0: never wait, compile at once), else WAIT_S. Read at each wait, so a test or a program may
    set it after import; a value that is not a number keeps the default."""
    try:
        return max(0.0, float(os.environ.get("BACKPLAN_COMPILE_LOCK_WAIT_SECONDS", WAIT_S)))
    except ValueError:
        return WAIT_S


def lock_path(cache_folder: str, filename_base: str, signature) -> str:
    """`<folder>/<function's index name>.<digest of the signature>.lock`."""
    digest = hashlib.sha256(str(signature).encode()).hexdigest()[:16]
    return os.path.join(cache_folder, f"{filename_base}.{digest}.lock")


def take(path: str) -> bool:
    """Hold the lock at path (a no-op where this process holds it): whether another process
    held it first, so that what it compiled may be in the cache now."""
    if fcntl is None or path in _held:
        return False
    waited, deadline = False, time.monotonic() + wait_seconds()
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # an unwritable or full folder: nothing is cached there either
            return waited
        locked = _lock(fd, path, deadline)
        if locked is None:  # no flock here, or waited wait_seconds(): compile without it
            os.close(fd)
            return True
        waited = waited or locked
        if _is_the_file_at(fd, path):
            _held[path] = fd
            _say_holder(fd)
            return waited
        # the holder removed the file as it let go, and a newcomer may hold a new one there:
        # this lock guards nothing, so take the file that is at the path now
        os.close(fd)


def _lock(fd: int, path: str, deadline: float) -> bool | None:
    """Lock fd, waiting until the deadline or until its file is no longer the one at path
    (released, and held on by a process its holder forked): whether it waited, or None if it
    gave up or the file system has no flock (ENOLCK, EOPNOTSUPP)."""
    notice = None  # the process's compile line names the wait once it is long (compile_notice)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return notice is not None
            except BlockingIOError:
                if notice is None:
                    from backplan.codegen.build import compile_notice  # only a waiter needs it

                    notice = compile_notice.begin(_waiting_for(fd, path)) or ()
                if time.monotonic() > deadline:
                    return None
                if not _is_the_file_at(fd, path):
                    return True  # take() opens the file at the path now
                time.sleep(POLL_S)
            except OSError:
                return None
    finally:
        if notice:
            from backplan.codegen.build import compile_notice

            compile_notice.end(notice)


def _say_holder(fd: int) -> None:
    """The holder's pid in the file, for a waiter's line (a full disk leaves it empty)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def _waiting_for(fd: int, path: str) -> str:
    """`<function> (process <pid> compiles it; this one waits up to <wait_seconds()> s to load
    it)`."""
    try:
        pid = os.pread(fd, 32, 0).decode().strip() or "?"
    except (OSError, UnicodeDecodeError):
        pid = "?"
    name = os.path.basename(path).split("-")[0]
    return (
        f"{name} (process {pid} compiles it; this one waits up to {wait_seconds():g} s to load it)"
    )


def _is_the_file_at(fd: int, path: str) -> bool:
    try:
        there = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def _forget_in_child() -> None:
    """A forked child does not compile what its parent was compiling: it closes its copies of
    the parent's lock files, which would otherwise keep them locked until the child exits."""
    for fd in _held.values():
        os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def release(path: str) -> None:
    """Let go of the lock and remove its file, so that none is left in the cache folder (which
    holds signed entries only). The file goes while it is still locked: a process that opened it
    before and gets the lock then finds no file at the path and takes a new one (take)."""
    fd = _held.pop(path, None)
    if fd is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)  # releases the lock
