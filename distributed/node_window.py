"""The buckets of ranks that share one node, in one MPI shared-memory window
(MPI.Win.Allocate_shared): every rank can read every other rank's bucket buffers as its own
memory, so a sum over the ranks needs no message and no copy through MPI's cells. Each rank's
segment holds two counters per bucket (how many times it has written the bucket, and summed its
part of it) and the bucket buffers twice, used by alternate calls: a rank writes a buffer again
two calls later, by which time every other rank has passed the next call's wait on it
(shared_exchange.py), so nobody reads a buffer while it is rewritten.

Memory order: a rank writes its buffer, then bumps its counter (MPI.Win.Sync between them); the
reader sees the counter, syncs, then reads the buffer."""

from __future__ import annotations

import numpy as np

from .world import mpi_module

LINE = 64  # bytes: counters and buffers start on their own cache lines
READY, DONE = 0, 1  # the two counters of a bucket: written, and its own part summed


def _aligned(n: int) -> int:
    return -(-n // LINE) * LINE


def node_comm(comm):
    """comm split by shared memory when every rank of comm is on this node, else None: the same
    verdict on every rank (all share one node exactly when each sees all of them there)."""
    mpi = mpi_module()
    node = comm.Split_type(mpi.COMM_TYPE_SHARED, key=comm.Get_rank())
    if node.Get_size() == comm.Get_size():
        return node
    node.Free()
    return None


def _offsets(counts: list[int], dtypes: list[np.dtype]) -> tuple[list[list[int]], int]:
    """Where each parity's buffer of each bucket starts in a rank's segment, and its bytes."""
    offsets, at = [], _aligned(2 * len(counts) * 8)  # the counters first
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
    """Two counters and two buffers per bucket for every rank of a node communicator, allocated
    together (a collective call: every rank makes the same window at the same point)."""

    def __init__(self, node, counts: list[int], dtypes: list[np.dtype]):
        mpi = mpi_module()
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.counts, self.dtypes = counts, [np.dtype(d) for d in dtypes]
        n = len(counts)
        self._offsets, self.nbytes = _offsets(counts, self.dtypes)
        info = mpi.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's segment near its own core
        self.win = mpi.Win.Allocate_shared(self.nbytes, 1, info, comm=node)
        info.Free()
        self.win.Lock_all(mpi.MODE_NOCHECK)  # a passive epoch for Sync, held while it lives
        segments = []
        for q in range(self.size):
            memory, _ = self.win.Shared_query(q)
            segments.append(np.frombuffer(memory, np.uint8, self.nbytes))
        self._segments = segments
        self.counters = [s[: 2 * n * 8].view(np.int64).reshape(2, n) for s in segments]
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
        self.win.Sync()
        self.counters[self.rank][which, k] = value

    def all_at(self, which: int, k: int, value: int) -> bool:
        """Whether every rank's counter `which` of bucket k reached value (then their writes
        before it are visible here)."""
        if any(c[which, k] < value for c in self.counters):
            return False
        self.win.Sync()
        return True

    def free(self) -> None:
        self.counters = self._segments = []
        self.win.Unlock_all()
        self.win.Free()
