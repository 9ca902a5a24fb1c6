"""data_parallel: run the joint plan on this rank's shard, then add up the loss and gradients of
all ranks bucket by bucket, in the order the plan finishes them."""

from __future__ import annotations

import numpy as np

from backplan.runtime import is_grad_enabled
from backplan.tracer.fastpath import call_key
from backplan.tracer.pytree import flatten, unflatten
from backplan.tracer.tensor import Tensor

from .agreement import check_replicas as verify_replicas
from .agreement import leaf_array, require_same_trees
from .buckets import DEFAULT_BUCKET_BYTES
from .errors import RankMismatchError
from .layout import Layout, build_layout
from .report import DataParallelReport
from .world import World, current_world, init, mpi_module

MISMATCH_FIX = (
    "every rank must differentiate parameters of the same structure, shapes and dtypes "
    "(start them all from bpd.broadcast(params)) with the same bucket_bytes"
)


class DataParallelStep:
    """A training step over all ranks; see data_parallel."""

    def __init__(self, fn, average: bool, bucket_bytes: int, check_replicas: bool, comm):
        if not all(hasattr(fn, name) for name in ("lookup", "argnums", "has_aux")):
            raise TypeError(
                "data_parallel needs the training step as bp.value_and_grad(loss_fn), whose "
                f"joint plan says when each gradient is ready; got {type(fn).__name__}"
            )
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.fn = fn
        self.average = average
        self.bucket_bytes = bucket_bytes
        self.check_replicas = check_replicas
        self._comm = comm
        self._layouts: dict = {}
        self._agreed: set[int] = set()

    def __call__(self, *args, **kwargs):
        world = init(self._comm)
        if world.size == 1:
            return self.fn(*args, **kwargs)
        if self.check_replicas:
            verify_replicas(self._differentiated(args), world.comm)
        result = self.fn(*args, **kwargs)
        (loss, aux), grads = result if self.fn.has_aux else ((result[0], None), result[1])
        layout = self.layout(args, kwargs)
        self._agree(world, layout)
        arrays = [leaf_array(loss)] + [leaf_array(g) for g in flatten(grads)[0]]
        summed = _exchange(world, layout, arrays, self.average)
        loss, grads = summed[0], unflatten(layout.grad_treedef, summed[1:])
        return ((loss, aux), grads) if self.fn.has_aux else (loss, grads)

    def layout(self, args, kwargs=None) -> Layout:
        """The buckets for these arguments' signature (cached per signature)."""
        kwargs = kwargs or {}
        key, _ = call_key(args, kwargs, is_grad_enabled())
        found = self._layouts.get(key) if key is not None else None
        if found is None:
            found = build_layout(self.fn, args, kwargs, self.bucket_bytes)
            if key is not None:
                self._layouts[key] = found
        return found

    def explain(self, *args, size: int | None = None, **kwargs) -> DataParallelReport:
        """The buckets, when each allreduce may start, when it starts and is waited on, and the
        bytes each rank sends per step; traces but runs nothing and needs no MPI. size defaults
        to the number of ranks after bpd.init(), else 2."""
        world = current_world()
        size = size or (world.size if world is not None else 2)
        return DataParallelReport(self.layout(args, kwargs), size, self.bucket_bytes)

    def _differentiated(self, args):
        nums = self.fn.argnums
        return args[nums] if isinstance(nums, int) else tuple(args[i] for i in nums)

    def _agree(self, world: World, layout: Layout) -> None:
        """One 16-byte allreduce per call: max of (fingerprint, -fingerprint) equals this rank's
        own pair on every rank only when all fingerprints are equal. On a mismatch every rank
        gathers the leaf lists and raises the same error, before any gradient moves."""
        mine = np.array([layout.fingerprint, -layout.fingerprint], np.int64)
        highest = np.empty_like(mine)
        world.comm.Allreduce(mine, highest, op=mpi_module().MAX)
        if (highest == mine).all():
            return
        require_same_trees(world.comm, layout.description(), "", MISMATCH_FIX)
        raise RankMismatchError(
            f"ranks split the gradients into buckets differently (this rank, {world.rank}: "
            f"bucket_bytes={self.bucket_bytes}, {len(layout.buckets)} buckets); {MISMATCH_FIX}"
        )


def _exchange(world: World, layout: Layout, arrays: list, average: bool) -> list[Tensor]:
    """Start one Iallreduce per bucket in plan order, then wait for each in that order and
    unpack it, so unpacking bucket k overlaps the transfer of the buckets after it."""
    MPI = mpi_module()
    started = []
    for bucket in layout.buckets:
        buffer = np.concatenate([arrays[leaf.index].ravel() for leaf in bucket.leaves])
        started.append((bucket, buffer, world.comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)))
    results: list = [None] * layout.n_leaves
    for bucket, buffer, request in started:
        request.Wait()
        if average:
            buffer /= buffer.dtype.type(world.size)
        buffer.flags.writeable = False
        offset = 0
        for leaf in bucket.leaves:
            count = int(np.prod(leaf.shape, dtype=np.int64))
            part = buffer[offset : offset + count].reshape(leaf.shape)
            results[leaf.index] = Tensor._from_array(part)
            offset += count
    return results


def data_parallel(
    value_and_grad_fn,
    average: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    check_replicas: bool = False,
    comm=None,
) -> DataParallelStep:
    """A training step that runs value_and_grad_fn on this rank's shard and returns the loss
    and gradients averaged over all ranks (summed with average=False), for any pytree of
    parameters. aux outputs (has_aux=True) stay this rank's own.

    Gradients travel in buckets of up to bucket_bytes, filled in the order the joint plan
    writes them; each bucket's non-blocking allreduce starts in that order as soon as the
    compiled call returns (the plan runs as one call, so the plan decides the order, not yet
    the overlap with compute; `step.explain(*args)` shows both). check_replicas=True hashes
    the differentiated arguments on every call and raises ReplicaMismatchError when any rank's
    differ (a debug mode: it costs a hash of every parameter per step). With one rank the
    step is value_and_grad_fn itself: no MPI call at all.

    >>> import backplan as bp, backplan.distributed as bpd  # doctest: +SKIP
    >>> step = bpd.data_parallel(bp.value_and_grad(loss_fn))  # doctest: +SKIP
    >>> loss, grads = step(params, bpd.shard(x, rank, size), y_shard)  # doctest: +SKIP
    """
    return DataParallelStep(value_and_grad_fn, average, bucket_bytes, check_replicas, comm)
