"""Moving whole trees between ranks: broadcast the initial weights, split a batch into shards."""

from __future__ import annotations

import numpy as np

from backplan.tracer.pytree import flatten, unflatten
from backplan.tracer.tensor import Tensor

from .agreement import describe, leaf_array, require_same_trees
from .errors import DistributedError
from .half_wire import as_bits
from .world import init


def broadcast(tree, root: int = 0, comm=None):
    """Every rank gets root's values of tree (a pytree of tensors or arrays), e.g. the initial
    weights, so all replicas start identical. Each rank must pass a tree of the same structure,
    shapes and dtypes (its own random init, say); otherwise every rank raises
    RankMismatchError naming the rank and the leaf. Tensors come back as new tensors that keep
    requires_grad; arrays come back as arrays.

    >>> params = bpd.broadcast(init_mlp([32, 64, 10], seed=rank))  # doctest: +SKIP
    """
    comm = comm if comm is not None else init().comm
    if comm is None or comm.Get_size() == 1:
        return tree
    size = comm.Get_size()
    if not 0 <= root < size:
        raise DistributedError(f"broadcast root={root} but ranks are 0..{size - 1}")
    require_same_trees(
        comm,
        describe(tree),
        "tree leaf ",
        "pass the same structure, shapes and dtypes on every rank to bpd.broadcast",
    )
    leaves, treedef = flatten(tree)
    received = []
    for leaf in leaves:
        array = np.ascontiguousarray(leaf_array(leaf)).copy()
        comm.Bcast(as_bits(array), root=root)
        received.append(_like(leaf, array))
    return unflatten(treedef, received)


def _like(leaf, array: np.ndarray):
    if isinstance(leaf, Tensor):
        return Tensor(array, requires_grad=leaf.requires_grad)
    return array


def shard(array, rank: int, size: int):
    """Rank `rank`'s contiguous share of the first axis of array, split as evenly as it goes:
    10 rows on 3 ranks are 4, 3 and 3 (the first n % size ranks hold one more row).

    data_parallel weights each rank's mean by its rows when the shares differ, so the averaged
    loss and gradients are the whole batch's mean, as with equal parts. A batch of fewer rows
    than ranks raises: a rank would have no rows to take a mean over.

    >>> import numpy as np
    >>> shard(np.arange(6), 1, 3).tolist()
    [2, 3]
    >>> [len(shard(np.arange(10), r, 3)) for r in range(3)]
    [4, 3, 3]
    """
    data = leaf_array(array)
    if size < 1 or not 0 <= rank < size:
        raise DistributedError(f"shard(rank={rank}, size={size}): need 0 <= rank < size")
    if data.ndim == 0:
        raise DistributedError("shard() splits the first axis, but got a 0-d value")
    n = data.shape[0]
    if n < size:
        raise DistributedError(
            f"shard(): a batch of {n} rows cannot give each of {size} ranks a row; "
            f"use a batch of at least {size} rows"
        )
    small, extra = divmod(n, size)
    start = rank * small + min(rank, extra)
    part = data[start : start + small + (rank < extra)]
    return Tensor(part) if isinstance(array, Tensor) else part
