"""How much of the global batch each rank holds, so that ranks with different numbers of rows
(10 rows on 3 ranks: 4, 3, 3) still average to the whole batch's mean loss and gradient: each
rank's mean is weighted by its rows, sum_r n_r * mean_r / sum_r n_r, instead of 1 / size.

A rank's rows are read from the arguments that are not differentiated: their first axes. When
every rank passes the same lengths (equal shards) nothing changes and nothing more is sent;
otherwise the lengths are gathered, and the arguments whose lengths differ between ranks are
the batch: on each rank they must agree, or every rank raises the same RankMismatchError."""

from __future__ import annotations

import numpy as np

from backplan.tracer.pytree import flatten

from .errors import RankMismatchError

NOT_AN_ARRAY = -1


def batch_lengths(args: tuple, kwargs: dict, argnums) -> tuple[int, ...]:
    """The first-axis length of each leaf of the arguments not differentiated (NOT_AN_ARRAY for
    a 0-d or non-array leaf), in order; hashable, deterministic across processes."""
    return tuple(_length(leaf) for leaf in _batch_leaves(args, kwargs, argnums, paths=None))


def _batch_leaves(args: tuple, kwargs: dict, argnums, paths: list | None) -> list:
    """Leaves of the arguments not differentiated; their paths appended to paths if given."""
    nums = {argnums} if isinstance(argnums, int) else set(argnums)
    named = [(f"argument {i}", a) for i, a in enumerate(args) if i not in nums]
    named += [(f"{name}=", value) for name, value in kwargs.items()]
    leaves: list = []
    for prefix, value in named:
        found = flatten(value, paths=True, prefix=prefix) if paths is not None else flatten(value)
        leaves += found[0]
        if paths is not None:
            paths += found[2]
    return leaves


def _length(leaf) -> int:
    shape = getattr(leaf, "shape", None)
    if not isinstance(shape, tuple) or not shape:
        return NOT_AN_ARRAY
    return int(shape[0])


def lengths_digest(lengths: tuple[int, ...]) -> int:
    """Equal on two ranks holding equal lengths (Python hashes ints and tuples of them the same
    in every process); within int64 with its negation."""
    return hash(lengths) % (1 << 62)


def row_weight(comm, lengths: tuple[int, ...], args, kwargs, argnums) -> float | None:
    """This rank's share of the global batch, n_rank / sum of n (None: no argument's length
    differs); the same verdict on every rank (all of them gather the same lengths), so a
    refusal is raised everywhere together."""
    weights = row_weights(comm, lengths, args, kwargs, argnums)
    return None if weights is None else weights[comm.Get_rank()]


def row_weights(comm, lengths: tuple[int, ...], args, kwargs, argnums) -> list[float] | None:
    """Every rank's share of the global batch (row_weight's, in rank order), or None."""
    gathered = comm.allgather(lengths)
    rows = ranks_rows(gathered, lambda j: _path(args, kwargs, argnums, j))
    if rows is None:
        return None
    total = sum(rows)
    if total == 0:
        raise RankMismatchError("every rank passed a batch of 0 rows: there is no mean to take")
    return [n / total for n in rows]


def ranks_rows(gathered: list[tuple[int, ...]], path_of) -> list[int] | None:
    """Each rank's rows: the common length of the leaves whose lengths differ between ranks
    (None when none differs)."""
    if len({len(lengths) for lengths in gathered}) > 1:
        counts = ", ".join(f"rank {r}: {len(x)}" for r, x in enumerate(gathered))
        raise RankMismatchError(
            f"ranks pass different numbers of non-differentiated arguments ({counts} leaves); "
            "every rank must call the step with arguments of the same structure"
        )
    varying = [j for j in range(len(gathered[0])) if len({x[j] for x in gathered}) > 1]
    if not varying:
        return None
    rows = []
    for rank, lengths in enumerate(gathered):
        found = {lengths[j] for j in varying}
        if len(found) > 1 or NOT_AN_ARRAY in found:
            described = ", ".join(f"{path_of(j)}: {_shown(lengths[j])}" for j in varying)
            raise RankMismatchError(
                f"rank {rank}'s batch arguments disagree about its number of rows ({described}), "
                "so its share of the global batch is unclear; pass every batch argument "
                "sharded the same way (bpd.shard(x, rank, size) for each)"
            )
        rows.append(found.pop())
    return rows


def _shown(length: int) -> str:
    return "not an array" if length == NOT_AN_ARRAY else f"{length} rows"


def _path(args, kwargs, argnums, j: int) -> str:
    paths: list = []
    _batch_leaves(args, kwargs, argnums, paths)
    return paths[j]


def scale_by_weight(buffer: np.ndarray, weight: float) -> None:
    """buffer *= weight in place; a rank of 0 rows adds nothing (its mean is NaN, not 0)."""
    if weight == 0:
        buffer.fill(0)
    else:
        buffer *= buffer.dtype.type(weight)


def average_in_place(buffer: np.ndarray, size: int) -> None:
    """buffer /= size in place; for a power of two as a product with 1/size, which rounds to
    the same bits (both are x / size rounded once) at a vector multiply's speed: a division
    of the bench mlp's 2.7 MB of summed gradients took 56 us a step, the product 30 us."""
    if size & (size - 1) == 0:
        buffer *= buffer.dtype.type(1.0 / size)
    else:
        buffer /= buffer.dtype.type(size)
