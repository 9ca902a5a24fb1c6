"""ZeRO-1: each rank owns a contiguous 1/N of every parameter (flattened, split as bpd.shard
splits rows: the first n % N ranks hold one more element), keeps the optimizer state of those
elements only and updates those only. Per dtype (the buckets of that dtype end to end), a
reduce-scatter gives each rank the sum of its shares of the gradients (the send buffer is packed
rank by rank), the optimizer updates them, and an all-gather gives every rank every updated
parameter: the same bytes on the wire as one allreduce. The loss rides in the first
reduce-scatter when it has that dtype, else travels alone (one allreduce of one element).

The shares depend on the parameters alone, not on the buckets, so step.init(params) needs no
batch; the state is the optimizer's state of a tree like params whose leaves are 1-D shares."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from backplan.tracer.pytree import flatten, unflatten
from backplan.tracer.tensor import Tensor

from .agreement import leaf_array
from .buckets import Bucket
from .deadline import wait_or_raise
from .errors import DistributedError
from .failure import check_ranks
from .layout import Layout
from .rows import scale_by_weight
from .world import World, mpi_module


@lru_cache(maxsize=4096)
def split(n: int, size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(counts, displs) of n elements over size ranks, the first n % size ranks one more
    (asked for every parameter on every step: cached, and plain arithmetic)."""
    small, extra = divmod(n, size)
    counts = tuple(small + (r < extra) for r in range(size))
    displs = tuple(r * small + min(r, extra) for r in range(size))
    return counts, displs


def share_tree(params, rank: int, size: int):
    """params with each leaf replaced by this rank's 1-D share of it (a view, no copy)."""
    leaves, treedef = flatten(params)
    shares = []
    for leaf in leaves:
        flat = leaf_array(leaf).reshape(-1)
        counts, displs = split(flat.size, size)
        shares.append(Tensor._from_array(flat[displs[rank] : displs[rank] + counts[rank]]))
    return unflatten(treedef, shares)


@dataclass(frozen=True)
class BucketShards:
    """The gradients of one dtype's buckets end to end (the loss left out), as one bucket:
    parameter i is leaf index i + 1."""

    bucket: Bucket
    params: tuple[int, ...]  # positions among the parameters, in bucket order
    splits: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (counts, displs) per param
    shapes: tuple[tuple[int, ...], ...]

    def counts(self, size: int) -> list[int]:
        """Elements of this bucket each rank receives (the sum of its shares)."""
        return [sum(c[r] for c, _ in self.splits) for r in range(size)]

    def slot(self, size: int) -> int:
        """Elements per rank on the wire: the largest rank's, the others' padded to it, so
        that the fixed-size collectives (reduce_scatter_block, allgather) move the bucket;
        MPICH's variable-size allgatherv was several times slower here on shared memory."""
        return max(self.counts(size))


def shard_buckets(layout: Layout, size: int) -> list[BucketShards]:
    """The gradients as they travel for ZeRO-1, with each parameter's split over the ranks: one
    group per dtype, the layout's buckets of that dtype end to end in bucket order (the loss
    left out). One reduce-scatter and one all-gather per group, not per bucket: this step
    starts them after the call, where buckets overlap nothing, and on the bench mlp (2
    buckets, 2 ranks, load 13) one pair per dtype took 1.05-1.22x the unsharded step against
    1.15-1.30x for a pair per bucket (interleaved, six runs; lower in five)."""
    groups: dict[str, list] = {}
    for bucket in layout.buckets:
        leaves = [leaf for leaf in bucket.leaves if leaf.index != 0]
        if leaves:
            groups.setdefault(bucket.dtype, []).append((bucket, leaves))
    found = []
    for dtype, buckets in groups.items():
        leaves = [leaf for _, bucket_leaves in buckets for leaf in bucket_leaves]
        sizes = [int(np.prod(leaf.shape, dtype=np.int64)) for leaf in leaves]
        found.append(
            BucketShards(
                Bucket(buckets[0][0].index, dtype, tuple(leaves)),
                tuple(leaf.index - 1 for leaf in leaves),
                tuple(split(n, size) for n in sizes),
                tuple(leaf.shape for leaf in leaves),
            )
        )
    return found


def pack_by_rank(
    shards: BucketShards,
    arrays: list[np.ndarray],
    size: int,
    packed: np.ndarray | None = None,
    slot: int | None = None,
) -> np.ndarray:
    """The bucket's arrays (one per parameter, bucket order) flattened and packed rank by rank,
    each rank's shares in a slot of shards.slot(size) elements, or `slot` (zeros after them):
    what a reduce-scatter of fixed-size blocks hands out. packed: the buffer to pack into (new
    if None)."""
    flats = [np.asarray(a).reshape(-1) for a in arrays]
    slot = shards.slot(size) if slot is None else slot
    if packed is None:
        packed = np.empty(slot * size, flats[0].dtype)
    for r in range(size):
        at = r * slot
        for flat, (c, d) in zip(flats, shards.splits, strict=True):
            packed[at : at + c[r]] = flat[d[r] : d[r] + c[r]]
            at += c[r]
        packed[at : (r + 1) * slot] = 0
    return packed


class ShardedExchange:
    """One step's exchange for ZeRO-1: start(array_of) starts each dtype's reduce-scatter (and
    the loss's allreduce when it travels alone); finish() waits and returns the loss and this
    rank's summed (averaged) share of every gradient; gather(shares) all-gathers the updated
    parameters."""

    def __init__(self, world: World, layout: Layout, average: bool, timeout=None, pool=None):
        self.world = world
        # receive buffers kept between calls (by the training step): MPICH's reduce-scatter and
        # all-gather into fresh buffers made the bench mlp's ZeRO-1 step 60-64 ms against
        # 74-82 ms reusing them (interleaved pairs, 2 ranks); nothing returned points into them
        self.pool = pool if pool is not None else {}
        self.layout = layout
        self.average = average
        self.timeout = timeout
        self.weight: float | None = None
        self.mpi = mpi_module()
        key = ("shards", layout.fingerprint, world.size)
        if key not in self.pool:  # the same for every call of the signature
            shards = shard_buckets(layout, world.size)
            self.pool[key] = shards, [(s.slot(world.size), s.counts(world.size)) for s in shards]
        self.shards, self._sizes = self.pool[key]
        self._loss = None
        self._loss_in_bucket = False
        self._started: list = []
        self.failure: str | None = None  # this rank's call raised: failure.settle

    def start_rest(self, array_of) -> None:
        """Start the exchange unless part of it started (failure.settle): a reduce-scatter
        packs every bucket of its dtype, so a partly started one cannot be completed."""
        if self._started or self._loss is not None:
            raise DistributedError("the ZeRO-1 exchange had partly started")
        self.start(array_of)

    def start(self, array_of) -> None:
        """array_of(leaf index) -> this rank's array of the loss (0) or a gradient. The loss
        rides in the first bucket's reduce-scatter when it has the bucket's dtype: one more
        element at the end of every rank's slot, so every rank receives the sum (one
        collective less per step: each is a point where both ranks must be running)."""
        comm, size = self.world.comm, self.world.size
        loss = np.array(array_of(0), copy=True).reshape(1)
        first = self.shards[0] if self.shards else None
        self._loss_in_bucket = (
            first is not None and np.asarray(array_of(first.params[0] + 1)).dtype == loss.dtype
        )
        if not self._loss_in_bucket:
            if self.weight is not None:
                scale_by_weight(loss, self.weight)
            self._loss = (loss, comm.Iallreduce(self.mpi.IN_PLACE, loss, op=self.mpi.SUM))
        for k, (shards, (slot, _)) in enumerate(zip(self.shards, self._sizes, strict=True)):
            arrays = [array_of(i + 1) for i in shards.params]
            dtype = np.asarray(arrays[0]).dtype
            slot += k == 0 and self._loss_in_bucket
            send = self._buffer("send", shards, slot * size, dtype)
            pack_by_rank(shards, arrays, size, send, slot)
            if k == 0 and self._loss_in_bucket:
                send[slot - 1 :: slot] = loss[0]
            if self.weight is not None:
                scale_by_weight(send, self.weight)
            mine = self._buffer("share", shards, slot, send.dtype)
            request = comm.Ireduce_scatter_block(send, mine, op=self.mpi.SUM)
            self._started.append((send, mine, request))

    def finish(self) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """(the summed loss, 0-d; parameter position -> this rank's summed 1-D share of its
        gradient), averaged over the ranks unless average=False (weighted by rows when ranks
        hold different numbers)."""
        loss = None
        if not self._loss_in_bucket:
            loss, request = self._loss
            self._wait(request, "the allreduce of the loss")
        shares: dict[int, np.ndarray] = {}
        rank = self.world.rank
        for shards, (_, mine, request) in zip(self.shards, self._started, strict=True):
            self._wait(request, f"the reduce-scatter of the {shards.bucket.dtype} gradients")
            mine = self._averaged(mine)
            if loss is None:
                loss = mine[-1:].copy()  # the first bucket's extra element
            offset = 0
            for i, (counts, _) in zip(shards.params, shards.splits, strict=True):
                shares[i] = mine[offset : offset + counts[rank]]
                offset += counts[rank]
        if not self._loss_in_bucket:
            loss = self._averaged(loss)
        check_ranks(self.world, loss, self.failure, self.layout.name)
        return loss.reshape(()), shares

    def _buffer(self, kind: str, shards: BucketShards, n: int, dtype) -> np.ndarray:
        key = (kind, self.layout.fingerprint, shards.bucket.index)
        found = self.pool.get(key)
        if found is None or found.size != n or found.dtype != dtype:
            found = self.pool[key] = np.empty(n, dtype)
        return found

    def _averaged(self, buffer: np.ndarray) -> np.ndarray:
        if self.average and self.weight is None:
            buffer /= buffer.dtype.type(self.world.size)
        return buffer

    def _wait(self, request, what: str) -> None:
        if self.timeout is None:
            request.Wait()
        else:
            wait_or_raise(request, self.timeout, what)

    def gather(self, shares: list[np.ndarray]) -> list[np.ndarray]:
        """Every parameter whole again from every rank's updated share (shares: this rank's,
        by parameter position); returns the parameters' arrays by position."""
        started = []
        for shards, (slot, counts) in zip(self.shards, self._sizes, strict=True):
            mine = self._buffer(
                "share sent", shards, slot, np.asarray(shares[shards.params[0]]).dtype
            )
            n = counts[self.world.rank]
            mine[n:] = 0
            np.concatenate([np.asarray(shares[i]).reshape(-1) for i in shards.params], out=mine[:n])
            full = self._buffer("gathered", shards, slot * self.world.size, mine.dtype)
            request = self.world.comm.Iallgather(mine, full)
            started.append((shards, full, request))
        arrays: list = [None] * len(shares)
        for shards, full, request in started:
            self._wait(request, f"the all-gather of the {shards.bucket.dtype} parameters")
            self._unpack(shards, full, arrays)
        return arrays

    def _unpack(self, shards: BucketShards, full, arrays: list) -> None:
        """full holds rank 0's slot of shares of the bucket's parameters, then rank 1's, ...;
        each parameter is its ranks' shares end to end."""
        slot = self._sizes[self.shards.index(shards)][0]
        offsets = [r * slot for r in range(self.world.size)]
        pieces: dict[int, list] = {i: [] for i in shards.params}
        for r in range(self.world.size):
            for i, (counts, _) in zip(shards.params, shards.splits, strict=True):
                pieces[i].append(full[offsets[r] : offsets[r] + counts[r]])
                offsets[r] += counts[r]
        for i, shape in zip(shards.params, shards.shapes, strict=True):
            arrays[i] = np.concatenate(pieces[i]).reshape(shape)
