"""The buckets of ranks that share one node, in shared memory: every rank maps every other
rank's segment (a file in /dev/shm, unlinked as soon as made: the other ranks open it as
/proc/PID/fd/FD while its maker holds it open, so nothing is left behind) and reads its bucket
buffers as its own memory, so a sum over the ranks needs no message and no copy through MPI's
cells. Each rank's segment holds a counter per bucket (how many times it has written the
bucket), a line of bytes saying which ranks sleep on those counters, a line of words saying
which results a rank still held (shared_exchange.publish_holds), and the bucket buffers once
per generation, used by successive calls in turn: a rank writes a buffer again two calls later
or more, by which time every other rank has passed the next call's wait on it
(shared_exchange.py), so nobody reads a buffer while it is rewritten. A window aligned on pages
keeps every rank's file open, so that stitched() maps parts of several ranks' buffers end to
end (window_views.py).

Made without a blocking collective: the ranks swap their segments' names with deadline.swap,
so a rank that stopped before it is named in a RankTimeoutError after the step's timeout (MPI's
Comm_split_type and Win_allocate_shared would wait forever), and freed without one: dropping
the last reference unmaps this rank's view (the memory goes once every rank has), so a step
frees its windows when it is collected, whenever that happens on each rank.

Memory order: a rank writes its buffer, then bumps its counter (a memory fence between them,
MPI_Win_sync on a window of this process alone); the reader sees the counter, fences, then
reads the buffer."""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import stat
import time
import weakref

import numpy as np

from . import futex
from .deadline import SHARE_TAG, swap
from .window_views import PAGE, holders, stitched
from .world import mpi_module

LINE = 64  # bytes: counters and buffers start on their own cache lines
READY = 0  # the row of the counters: how many times each bucket was written
SHARED_FOLDER = "/dev/shm"  # memory-backed files every process of the node can map
NAME_BYTES = 96  # a segment's path as sent to the other ranks (NUL-padded)
_fences: list = []  # the window of this process alone whose Sync is the memory fence
SPIN_S = 5e-5  # a wait spins this long (the ranks' usual skew on idle cores), then sleeps
SLEEP_S = 0.05  # a sleeping wait looks again at least this often (a wake-up is never lost)
NOBODY = bytes(LINE)  # a sleepers' line with no rank asleep (compared as bytes: 0.4 us, not 5)


def _aligned(n: int) -> int:
    return -(-n // LINE) * LINE


def fence() -> None:
    """A full memory fence (MPI_Win_sync), so the other ranks see writes before it first."""
    if not _fences:
        mpi = mpi_module()
        win = mpi.Win.Create(None, comm=mpi.COMM_SELF)  # this process alone: no meeting
        win.Lock_all(mpi.MODE_NOCHECK)  # Win_sync needs a passive epoch; held while it lives
        _fences.append(win)
        atexit.register(_free_fences)  # registered after MPI_Finalize's hook: runs before it
    _fences[0].Sync()


def _free_fences() -> None:
    """Free the fence window before MPI_Finalize: a window still locked then leaves its
    remote keys to MPI's transport (UCX prints "object ... was not returned to mpool
    ucp_rkeys" on every rank's stdout as the program ends)."""
    mpi = mpi_module()
    while _fences:
        win = _fences.pop()
        if not mpi.Is_finalized():
            win.Unlock_all()
            win.Free()


def _create(nbytes: int):
    """(fd, mapping) of a new segment of nbytes for this rank, or (-1, None) where this
    machine has no shared folder. Its file is unlinked at once (no wait between): the other
    ranks open it as /proc/PID/fd/FD while this rank keeps fd open, so a rank killed at any
    point leaves nothing behind."""
    path = os.path.join(SHARED_FOLDER, f"backplan-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return -1, None
    os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        return -1, None


_OPENED = re.compile(r"/proc/\d+/fd/\d+")


def _attach(path: str, nbytes: int, keep: dict | None = None):
    """Another rank's segment mapped here, or None when it cannot be (another machine, or not
    a segment of this user and size). keep: {id of the mapping: a descriptor of its file}."""
    if not _OPENED.fullmatch(path):
        return None
    try:
        target = os.readlink(path)
        segment = os.path.join(SHARED_FOLDER, "backplan-")
        if not (target.startswith(segment) and target.endswith(" (deleted)")):
            return None
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        if info.st_size != nbytes:
            return None
        mapped = mmap.mmap(fd, nbytes)
        if keep is not None:  # its file kept open too (window_views.stitched maps it again)
            keep[_attached_key(mapped)] = os.dup(fd)
        return mapped
    except OSError:
        return None
    finally:
        os.close(fd)


def _attached_key(mapped) -> int:
    return id(mapped)


def share(
    comm, nbytes: int, seconds: float | None, step: str, check: bytes = b"", fds: list | None = None
):
    """Every rank's segment of nbytes mapped here (a list in rank order), or None on every
    rank alike when some rank cannot map every other's (they are not on one node). check:
    bytes written at the start of this rank's segment and compared in the others' (the probe
    of shared_exchange.reduction). Two swaps with the deadline (deadline.swap): the names,
    then whether each rank mapped all; each rank closes its file after the second, when every
    rank has mapped it or given up. fds: filled with a descriptor of every rank's file, in
    rank order (the caller closes them), when every rank mapped all."""
    rank, size = comm.Get_rank(), comm.Get_size()
    size_of = max(nbytes, len(check), 1)
    fd, own = _create(size_of)
    path = f"/proc/{os.getpid()}/fd/{fd}" if own is not None else ""
    kept: dict | None = {} if fds is not None else None  # id of a mapping -> its file's dup
    maps: list = []
    shared = False
    try:
        if own is not None:
            own[: len(check)] = check
            if kept is not None:
                kept[_attached_key(own)] = os.dup(fd)
        name = np.zeros(NAME_BYTES + len(check), np.uint8)
        encoded = np.frombuffer(path.encode(), np.uint8)[:NAME_BYTES]
        name[: encoded.size] = encoded
        name[NAME_BYTES:] = np.frombuffer(check, np.uint8)
        names = swap(comm, name, seconds, step, SHARE_TAG)
        for q in range(size):
            theirs = bytes(names[q, :NAME_BYTES]).rstrip(b"\0").decode(errors="replace")
            mapped = own if q == rank else _attach(theirs, size_of, kept) if theirs else None
            if mapped is not None and mapped[: len(check)] != bytes(names[q, NAME_BYTES:]):
                mapped = None  # a file of that name, but not the one rank q wrote
            maps.append(mapped)
        mapped_all = all(m is not None for m in maps)
        verdicts = swap(comm, np.array([mapped_all], np.uint8), seconds, step, SHARE_TAG)
        shared = bool(verdicts.all())
    finally:
        if own is not None:
            os.close(fd)  # every rank opened it or gave up (the mapping keeps the memory)
        if kept is not None:
            if shared:
                fds.extend(kept.pop(_attached_key(m)) for m in maps)
            for extra in kept.values():  # not shared, or a mapping found not to be rank q's
                os.close(extra)
    return maps if shared else None


def _offsets(
    counts: list[int], dtypes: list[np.dtype], generations: int = 2, align: int = LINE
) -> tuple[list[list[int]], int]:
    """Where each generation's buffer of each bucket starts in a rank's segment (on `align`
    bytes), and its bytes: the counters, the sleepers' line and the holds' line first."""
    offsets, at = [], _aligned(len(counts) * 8) + 2 * LINE

    def placed(n: int) -> int:
        return -(-n // align) * align

    for _generation in range(generations):
        row = []
        for count, dtype in zip(counts, dtypes, strict=True):
            at = placed(at)
            row.append(at)
            at = _aligned(at + count * np.dtype(dtype).itemsize)
        offsets.append(row)
    return offsets, placed(at)


def segment_bytes(
    counts: list[int], dtypes: list[np.dtype], generations: int = 2, align: int = LINE
) -> int:
    """The bytes of one rank's segment of a NodeWindow of these buckets (no MPI needed)."""
    return _offsets(counts, dtypes, generations, align)[1]


def resident_bytes(nbytes: int) -> int:
    """The memory a segment of nbytes holds once written: whole pages (shared memory is
    mapped and backed by the page)."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _close(fds: list) -> None:
    for fd in fds:
        os.close(fd)


class NodeWindow:
    """A counter and `generations` buffers per bucket for every rank of comm (all on one node),
    made together (every rank makes the same window at the same point; seconds and step: the
    deadline and what a RankTimeoutError names if a rank does not come). align: PAGE keeps
    every rank's files open and its buffers on whole pages, for stitched() views."""

    def __init__(
        self,
        comm,
        counts: list[int],
        dtypes: list[np.dtype],
        seconds,
        step: str,
        generations: int = 2,
        align: int = LINE,
    ):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.counts, self.dtypes = counts, [np.dtype(d) for d in dtypes]
        self.generations = generations
        n = len(counts)
        self._offsets, self.nbytes = _offsets(counts, self.dtypes, generations, align)
        self._fds: list = [] if align % PAGE == 0 else None
        maps = share(comm, self.nbytes, seconds, step, fds=self._fds)
        if maps is None:
            raise OSError(f"{step}: the ranks could not map each other's shared memory")
        if self._fds:
            weakref.finalize(self, _close, self._fds)
        segments = [np.frombuffer(m, np.uint8, self.nbytes) for m in maps]
        self._segments = segments
        self.counters = [s[: n * 8].view(np.int64).reshape(1, n) for s in segments]
        at = _aligned(n * 8)  # a byte per rank (up to LINE ranks): sleeping on these counters
        self._sleepers = [s[at : at + LINE] for s in segments]
        # per rank, two calls' words (call % 2): whether the rank still held, at that call,
        # the results it was given two calls before (shared_exchange.py)
        self.holds = [s[at + LINE : at + 2 * LINE].view(np.int64) for s in segments]
        self.written = [0] * n  # calls that wrote each bucket on this rank
        self._views: dict = {}  # (rank, k, parity) -> buffer(): made once, not per call
        self._stitched: dict = {}  # (k, generation) -> window_views.stitched reservation

    def stitched(self, k: int, generation: int):
        """The reservation (window_views.stitched) whose pages are, part by part
        (page_part), every rank's buffer of bucket k of that generation: the whole bucket
        once each rank has written its part. Made once; arrays made from it hold it."""
        found = self._stitched.get((k, generation))
        if found is None:
            size = self.dtypes[k].itemsize
            pieces = []
            for q in range(self.size):
                part = self.page_part(q, k)
                offset = self._offsets[generation][k] + part.start * size
                pieces.append((self._fds[q], offset, (part.stop - part.start) * size))
            found = self._stitched[(k, generation)] = stitched(pieces)
        return found

    def held(self, k: int, generation: int) -> bool:
        """Whether an array made from bucket k's stitched view of that generation is alive."""
        found = self._stitched.get((k, generation))
        return found is not None and holders(found, kept=2)  # (the dict's, found's)

    def page_part(self, rank: int, k: int) -> slice:
        """The elements of bucket k that `rank` sums in place: contiguous, split on pages."""
        return self._split(rank, k, PAGE)

    def buffer(self, rank: int, k: int, parity: int) -> np.ndarray:
        """Rank `rank`'s buffer of bucket k for calls of this generation (parity: call %
        generations; a 1-D array, the same view object every time)."""
        found = self._views.get((rank, k, parity))
        if found is None:
            at = self._offsets[parity][k]
            dtype = self.dtypes[k]
            found = self._segments[rank][at : at + self.counts[k] * dtype.itemsize].view(dtype)
            self._views[(rank, k, parity)] = found
        return found

    def part(self, rank: int, k: int) -> slice:
        """The elements of bucket k that `rank` sums: contiguous, split on cache lines."""
        return self._split(rank, k, LINE)

    def _split(self, rank: int, k: int, unit: int) -> slice:
        """Rank `rank`'s 1/N of bucket k's elements, in whole units of `unit` bytes."""
        per_unit = max(1, unit // self.dtypes[k].itemsize)
        units = -(-self.counts[k] // per_unit)
        start = min(self.counts[k], units * rank // self.size * per_unit)
        stop = min(self.counts[k], units * (rank + 1) // self.size * per_unit)
        return slice(start, stop)

    def mark(self, which: int, k: int, value: int) -> None:
        """Publish this rank's counter `which` of bucket k after the writes before it, and wake
        the ranks sleeping until it changes (wait_at). The wake-up is a system call (2-11 us
        here, three a step): made only when a rank said it sleeps on this rank's counters. A
        sleeper raises its byte, fences, then reads the counter; this rank writes the counter,
        fences, then reads the bytes: one of them sees the other's write (as in Dekker's
        mutual exclusion), so a sleeper is never missed (and sleeps SLEEP_S at most)."""
        fence()
        self.counters[self.rank][which, k] = value
        if futex.available:
            fence()
            if self.size > LINE or self._sleepers[self.rank].tobytes() != NOBODY:
                futex.wake(self._address(self.rank, which, k))

    def _address(self, rank: int, which: int, k: int) -> int:
        return self.counters[rank].ctypes.data + (which * len(self.counts) + k) * 8

    def wait_at(self, which: int, k: int, value: int, seconds: float = SLEEP_S) -> bool:
        """Whether every rank's counter `which` of bucket k reached value within about
        `seconds` (all_at): spin SPIN_S, then sleep on the first counter short of it until its
        rank marks it (futex.py), looking again at least every SLEEP_S."""
        start = time.perf_counter()
        spin_until, end = start + min(SPIN_S, seconds), start + seconds
        while not self.all_at(which, k, value):
            now = time.perf_counter()
            if now >= end:
                return False
            if now < spin_until or not futex.available:
                os.sched_yield()  # the rank it waits for may share this core
                continue
            for q, counters in enumerate(self.counters):
                if counters[which, k] < value:
                    self._sleep(q, which, k, value, min(SLEEP_S, end - now))
                    break
        return True

    def _sleep(self, q: int, which: int, k: int, value: int, seconds: float) -> None:
        """Sleep on rank q's counter `which` of bucket k while it is below value, with this
        rank's byte in q's sleepers' line raised (mark wakes only when one is)."""
        flag = self.rank < LINE
        if flag:
            self._sleepers[q][self.rank] = 1
            fence()
        seen = int(self.counters[q][which, k])
        if seen < value:
            futex.wait(self._address(q, which, k), seen, seconds)
        if flag:
            self._sleepers[q][self.rank] = 0

    def all_at(self, which: int, k: int, value: int) -> bool:
        """Whether every rank's counter `which` of bucket k reached value (then their writes
        before it are visible here)."""
        for counters in self.counters:
            if counters[which, k] < value:
                return False
        fence()
        return True


class CounterRequest:
    """Waited for like an mpi4py request, completed by every rank's counter READY of buffer
    `index` of a window reaching `call` (the subclass's Test() acts on the buffers then)."""

    window: NodeWindow
    index: int
    call: int

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name, so deadline.py waits on either
        raise NotImplementedError

    def Wait(self) -> None:  # noqa: N802
        while not self.Test():
            self.block(SLEEP_S)

    def block(self, seconds: float) -> None:
        """Wait up to `seconds` for every rank's write (deadline.unfinished's pause)."""
        self.window.wait_at(READY, self.index, self.call, seconds)
