"""Which gradients travel together: leaves grouped into buckets of at most `bucket_bytes`, in the
order the joint plan finishes writing them, one dtype per bucket. Pure code over the facts of the
plan, so it is tested without MPI."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

DEFAULT_BUCKET_BYTES = 2 * 1024 * 1024  # PyTorch DDP uses 25 MiB over networks; ours is 2 MiB


@dataclass(frozen=True)
class ExchangedLeaf:
    """One array every rank adds up: the loss (index 0) or a gradient."""

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    ready_step: int  # the joint-plan step that writes it; -1: an input, known on entry
    ready_text: str  # that step as "s41 add at mlp.py:27"


@dataclass(frozen=True)
class Bucket:
    """Leaves packed into one buffer and summed by one non-blocking allreduce."""

    index: int
    dtype: str
    leaves: tuple[ExchangedLeaf, ...]

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def ready_leaf(self) -> ExchangedLeaf:
        """The leaf written last: the bucket's allreduce may start right after its step."""
        return max(self.leaves, key=lambda leaf: (leaf.ready_step, leaf.index))

    @property
    def ready_step(self) -> int:
        return self.ready_leaf.ready_step

    @cached_property
    def unpacking(self) -> tuple[tuple[int, int, int, tuple[int, ...]], ...]:
        """(leaf index, start, stop, shape) of each leaf in the bucket's flat buffer (worked
        out once: every call unpacks its buckets so)."""
        found, start = [], 0
        for leaf in self.leaves:
            stop = start + math.prod(leaf.shape)
            found.append((leaf.index, start, stop, leaf.shape))
            start = stop
        return tuple(found)


def plan_buckets(leaves: list[ExchangedLeaf], bucket_bytes: int) -> list[Bucket]:
    """Fill buckets in the order the plan writes the leaves; a bucket closes when the next leaf
    of its dtype would take it past bucket_bytes (a leaf bigger than that travels alone).

    >>> a = ExchangedLeaf(0, "loss", (), "float32", 4, 3, "s3")
    >>> b = ExchangedLeaf(1, "w", (2,), "float32", 8, 9, "s9")
    >>> [[x.path for x in bucket.leaves] for bucket in plan_buckets([b, a], 8)]
    [['loss'], ['w']]
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    filling: dict[str, list[ExchangedLeaf]] = {}
    closed: list[list[ExchangedLeaf]] = []
    for leaf in sorted(leaves, key=lambda leaf: (leaf.ready_step, leaf.index)):
        current = filling.setdefault(leaf.dtype, [])
        if current and sum(x.nbytes for x in current) + leaf.nbytes > bucket_bytes:
            closed.append(current)
            current = filling[leaf.dtype] = []
        current.append(leaf)
    closed += [group for group in filling.values() if group]
    closed.sort(key=lambda group: (group[-1].ready_step, group[0].index))
    return [Bucket(i, group[0].dtype, tuple(group)) for i, group in enumerate(closed)]


def ring_bytes_sent(nbytes: int, size: int) -> int:
    """Bytes one rank sends in a ring allreduce of nbytes over size ranks: 2 (N - 1) / N of it.
    MPI may pick another algorithm; this is the usual bandwidth-optimal figure."""
    return 0 if size <= 1 else 2 * (size - 1) * nbytes // size
