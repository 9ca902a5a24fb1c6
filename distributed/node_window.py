"""The buckets of ranks that share one node, in shared memory: every rank maps every other
rank's segment (a file in /dev/shm, mapped and then unlinked) and reads its bucket buffers as
its own memory, so a sum over the ranks needs no message and no copy through MPI's cells. Each
rank's segment holds a counter per bucket (how many times it has written the bucket) and the
bucket buffers twice, used by alternate calls: a rank writes a
buffer again two calls later, by which time every other rank has passed the next call's wait on
it (shared_exchange.py), so nobody reads a buffer while it is rewritten.

Made without a blocking collective: the ranks swap their segments' names with deadline.swap,
so a rank that stopped before it is named in a RankTimeoutError after the step's timeout (MPI's
Comm_split_type and Win_allocate_shared would wait forever), and freed without one: dropping
the last reference unmaps this rank's view (the memory goes once every rank has), so a step
frees its windows when it is collected, whenever that happens on each rank.

Memory order: a rank writes its buffer, then bumps its counter (a memory fence between them,
MPI_Win_sync on a window of this process alone); the reader sees the counter, fences, then
reads the buffer."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time

import numpy as np

from .deadline import SHARE_TAG, swap
from .world import mpi_module

LINE = 64  # bytes: counters and buffers start on their own cache lines
READY = 0  # the row of the counters: how many times each bucket was written
SHARED_FOLDER = "/dev/shm"  # memory-backed files every process of the node can map
NAME_BYTES = 96  # a segment's path as sent to the other ranks (NUL-padded)
_fences: list = []  # the window of this process alone whose Sync is the memory fence


def _aligned(n: int) -> int:
    return -(-n // LINE) * LINE


def fence() -> None:
    """A full memory fence (MPI_Win_sync), so the other ranks see writes before it first."""
    if not _fences:
        mpi = mpi_module()
        win = mpi.Win.Create(None, comm=mpi.COMM_SELF)  # this process alone: no meeting
        win.Lock_all(mpi.MODE_NOCHECK)  # Win_sync needs a passive epoch; held while it lives
        _fences.append(win)
    _fences[0].Sync()


STALE_S = 600  # a segment file this old whose maker is gone was left by a killed job


def remove_stale(folder: str | None = None) -> list[str]:
    """Remove this user's segment files left behind (their maker killed between making and
    unlinking one, e.g. by MPI_Abort while it waited for another rank): older than STALE_S
    and their process gone. The paths removed."""
    folder = folder or SHARED_FOLDER
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "backplan" or not parts[1].isdigit():
            continue
        path = os.path.join(folder, name)
        try:
            info = os.stat(path, follow_symlinks=False)
            if info.st_uid != os.getuid() or now - info.st_mtime < STALE_S:
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def _create(nbytes: int):
    """(path, mapping) of a new segment of nbytes for this rank, or ("", None) where this
    machine has no shared folder."""
    remove_stale()
    path = os.path.join(SHARED_FOLDER, f"backplan-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return "", None
    try:
        os.ftruncate(fd, nbytes)
        return path, mmap.mmap(fd, nbytes)
    except OSError:
        os.unlink(path)
        return "", None
    finally:
        os.close(fd)


def _attach(path: str, nbytes: int):
    """Another rank's segment mapped here, or None when it cannot be (another machine, or not
    a segment of this user and size)."""
    if not path.startswith(os.path.join(SHARED_FOLDER, "backplan-")):
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_size != nbytes:
            return None
        return mmap.mmap(fd, nbytes)
    except OSError:
        return None
    finally:
        os.close(fd)


def share(comm, nbytes: int, seconds: float | None, step: str, check: bytes = b""):
    """Every rank's segment of nbytes mapped here (a list in rank order), or None on every
    rank alike when some rank cannot map every other's (they are not on one node). check:
    bytes written at the start of this rank's segment and compared in the others' (the probe
    of shared_exchange.reduction). Two swaps with the deadline (deadline.swap): the names,
    then whether each rank mapped all; each rank unlinks its file after the second, when
    every rank has mapped it or given up."""
    rank, size = comm.Get_rank(), comm.Get_size()
    size_of = max(nbytes, len(check), 1)
    path, own = _create(size_of)
    try:
        if own is not None:
            own[: len(check)] = check
        name = np.zeros(NAME_BYTES + len(check), np.uint8)
        encoded = np.frombuffer(path.encode(), np.uint8)[:NAME_BYTES]
        name[: encoded.size] = encoded
        name[NAME_BYTES:] = np.frombuffer(check, np.uint8)
        names = swap(comm, name, seconds, step, SHARE_TAG)
        maps = []
        for q in range(size):
            theirs = bytes(names[q, :NAME_BYTES]).rstrip(b"\0").decode(errors="replace")
            mapped = own if q == rank else _attach(theirs, size_of) if theirs else None
            if mapped is not None and mapped[: len(check)] != bytes(names[q, NAME_BYTES:]):
                mapped = None  # a file of that name, but not the one rank q wrote
            maps.append(mapped)
        mapped_all = all(m is not None for m in maps)
        verdicts = swap(comm, np.array([mapped_all], np.uint8), seconds, step, SHARE_TAG)
    finally:
        if path:
            os.unlink(path)
    return maps if verdicts.all() else None


def _offsets(counts: list[int], dtypes: list[np.dtype]) -> tuple[list[list[int]], int]:
    """Where each parity's buffer of each bucket starts in a rank's segment, and its bytes."""
    offsets, at = [], _aligned(len(counts) * 8)  # the counters first
    for _parity in range(2):
        row = []
        for count, dtype in zip(counts, dtypes, strict=True):
            row.append(at)
            at = _aligned(at + count * np.dtype(dtype).itemsize)
        offsets.append(row)
    return offsets, at


def segment_bytes(counts: list[int], dtypes: list[np.dtype]) -> int:
    """The bytes of one rank's segment of a NodeWindow of these buckets (no MPI needed)."""
    return _offsets(counts, dtypes)[1]


class NodeWindow:
    """A counter and two buffers per bucket for every rank of comm (all on one node), made
    together (every rank makes the same window at the same point; seconds and step: the
    deadline and what a RankTimeoutError names if a rank does not come)."""

    def __init__(self, comm, counts: list[int], dtypes: list[np.dtype], seconds, step: str):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.counts, self.dtypes = counts, [np.dtype(d) for d in dtypes]
        n = len(counts)
        self._offsets, self.nbytes = _offsets(counts, self.dtypes)
        maps = share(comm, self.nbytes, seconds, step)
        if maps is None:
            raise OSError(f"{step}: the ranks could not map each other's shared memory")
        segments = [np.frombuffer(m, np.uint8, self.nbytes) for m in maps]
        self._segments = segments
        self.counters = [s[: n * 8].view(np.int64).reshape(1, n) for s in segments]
        self.written = [0] * n  # calls that wrote each bucket on this rank

    def buffer(self, rank: int, k: int, parity: int) -> np.ndarray:
        """Rank `rank`'s buffer of bucket k for calls of this parity (a 1-D array)."""
        at = self._offsets[parity][k]
        dtype = self.dtypes[k]
        return self._segments[rank][at : at + self.counts[k] * dtype.itemsize].view(dtype)

    def part(self, rank: int, k: int) -> slice:
        """The elements of bucket k that `rank` sums: contiguous, split on cache lines."""
        per_line = max(1, LINE // self.dtypes[k].itemsize)
        lines = -(-self.counts[k] // per_line)
        start = min(self.counts[k], lines * rank // self.size * per_line)
        stop = min(self.counts[k], lines * (rank + 1) // self.size * per_line)
        return slice(start, stop)

    def mark(self, which: int, k: int, value: int) -> None:
        """Publish this rank's counter `which` of bucket k after the writes before it."""
        fence()
        self.counters[self.rank][which, k] = value

    def all_at(self, which: int, k: int, value: int) -> bool:
        """Whether every rank's counter `which` of bucket k reached value (then their writes
        before it are visible here)."""
        if any(c[which, k] < value for c in self.counters):
            return False
        fence()
        return True
