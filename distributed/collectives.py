"""Moving whole trees between ranks: broadcast the initial weights, split a batch into shards."""

from __future__ import annotations

import numpy as np

from backplan.tracer.pytree import flatten, unflatten
from backplan.tracer.tensor import Tensor

from .agreement import describe, leaf_array, require_same_trees
from .errors import DistributedError
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
        comm.Bcast(array, root=root)
        received.append(_like(leaf, array))
    return unflatten(treedef, received)


def _like(leaf, array: np.ndarray):
    if isinstance(leaf, Tensor):
        return Tensor(array, requires_grad=leaf.requires_grad)
    return array


def shard(array, rank: int, size: int):
    """Rank `rank`'s contiguous share of the first axis of array, one of `size` equal parts.

    Equal parts make the average of the per-rank mean losses equal to the mean loss of the
    whole batch, so the averaged gradients equal the single-process gradients. A first axis
    that `size` does not divide raises; drop or pad the remainder first.

    >>> import numpy as np
    >>> shard(np.arange(6), 1, 3).tolist()
    [2, 3]
    """
    data = leaf_array(array)
    if size < 1 or not 0 <= rank < size:
        raise DistributedError(f"shard(rank={rank}, size={size}): need 0 <= rank < size")
    if data.ndim == 0:
        raise DistributedError("shard() splits the first axis, but got a 0-d value")
    n = data.shape[0]
    if n % size:
        raise DistributedError(
            f"shard(): a batch of {n} rows does not split into {size} equal shards, and "
            "unequal shards would make the averaged gradients differ from the whole batch's; "
            f"use a batch that {size} divides, e.g. array[:{n // size * size}]"
        )
    part = data[rank * (n // size) : (rank + 1) * (n // size)]
    return Tensor(part) if isinstance(array, Tensor) else part
