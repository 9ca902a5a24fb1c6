"""Checks that every rank holds the same kind of tree before data moves between them. Each rank
describes its leaves (path, shape, dtype); the descriptions are gathered on every rank and
compared there, so all ranks reach the same verdict and raise the same error together instead
of one raising while the others wait in a collective."""

from __future__ import annotations

import hashlib

import numpy as np

from backplan.tracer.pytree import flatten

from .errors import RankMismatchError, ReplicaMismatchError


def leaf_array(leaf) -> np.ndarray:
    """The NumPy array of a tensor or array leaf."""
    data = getattr(leaf, "_data", None)
    return data if isinstance(data, np.ndarray) else np.asarray(leaf)


def describe(tree, prefix: str = "") -> list[tuple[str, tuple, str]]:
    """(path, shape, dtype) per leaf, in flatten order."""
    leaves, _, paths = flatten(tree, paths=True, prefix=prefix)
    arrays = [leaf_array(leaf) for leaf in leaves]
    return [(p, a.shape, str(a.dtype)) for p, a in zip(paths, arrays, strict=True)]


def leaf_text(shape: tuple, dtype: str) -> str:
    return f"{dtype}[{', '.join(str(n) for n in shape)}]"


def describe_batch(args: tuple, kwargs: dict, argnums) -> list[tuple[str, tuple, str]]:
    """(path, shape, dtype) per leaf of the arguments not differentiated, "rows" in place of
    their first axis (ranks may hold different numbers of rows): a batch argument of another
    dtype changes the loss's dtype, and is named as itself rather than as the loss."""
    nums = {argnums} if isinstance(argnums, int) else set(argnums)
    named = [(f"argument {i}", a) for i, a in enumerate(args) if i not in nums]
    named += [(f"{name}=", value) for name, value in kwargs.items()]
    found = []
    for prefix, value in named:
        leaves, _, paths = flatten(value, paths=True, prefix=prefix)
        for path, leaf in zip(paths, leaves, strict=True):
            array = leaf_array(leaf)
            shape = ("rows", *array.shape[1:]) if array.shape else ()
            found.append((path, shape, str(array.dtype)))
    return found


def first_difference(descriptions: list[list], what: str) -> str | None:
    """A sentence naming the first rank and leaf that differ from rank 0, or None. `what`
    prefixes each leaf's path ("tree leaf " gives "rank 1's tree leaf ['w0'] is ...")."""
    reference = descriptions[0]
    by_path = {p: (s, d) for p, s, d in reference}
    for rank, description in enumerate(descriptions[1:], start=1):
        mine = {p: (s, d) for p, s, d in description}
        for path, shape, dtype in description:
            if path not in by_path:
                return f"rank {rank} has {what}{path}, which rank 0 lacks"
            if by_path[path] != (shape, dtype):
                theirs = leaf_text(*by_path[path])
                return (
                    f"rank {rank}'s {what}{path} is {leaf_text(shape, dtype)} "
                    f"but rank 0's is {theirs}"
                )
        for path, _, _ in reference:
            if path not in mine:
                return f"rank {rank} lacks {what}{path}, which rank 0 has"
        if [p for p, _, _ in description] != [p for p, _, _ in reference]:
            return f"rank {rank} orders its {what}leaves differently from rank 0"
    return None


def settings_difference(settings: list[dict]) -> str:
    """A sentence naming the first rank and setting that differ from rank 0 (settings: each
    rank's {name: value}, gathered)."""
    for rank, mine in enumerate(settings[1:], start=1):
        for name, value in mine.items():
            if settings[0].get(name) != value:
                return (
                    f"rank {rank}'s step has {name}={value!r} but rank 0's has "
                    f"{name}={settings[0].get(name)!r}"
                )
    return "the ranks' steps differ"


def require_same_trees(comm, description: list, what: str, fix: str) -> None:
    """Raise RankMismatchError on every rank when any rank's description differs."""
    problem = first_difference(comm.allgather(description), what)
    if problem:
        raise RankMismatchError(f"{problem}; {fix}")


def fingerprint(description) -> int:
    """A 63-bit digest of a description: equal on two ranks when they hold the same tree."""
    digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def replica_digests(tree) -> list[int]:
    """One digest of the bytes of each leaf."""
    leaves = flatten(tree)[0]
    return [
        int.from_bytes(
            hashlib.blake2b(np.ascontiguousarray(leaf_array(x)).tobytes(), digest_size=8).digest(),
            "little",
        )
        for x in leaves
    ]


def check_replicas(tree, comm=None) -> None:
    """Raise ReplicaMismatchError on every rank unless each leaf of tree holds the same bytes on
    all ranks (parameters after a step should). Costs one hash per leaf and one allgather.

    >>> bpd.check_replicas(params)  # doctest: +SKIP
    """
    from .world import init

    comm = comm or init().comm
    if comm is None or comm.Get_size() == 1:
        return
    require_same_trees(comm, describe(tree), "tree leaf ", "pass the same tree on every rank")
    gathered = comm.allgather(replica_digests(tree))
    paths = flatten(tree, paths=True)[2]
    for rank, digests in enumerate(gathered[1:], start=1):
        for path, mine, reference in zip(paths, digests, gathered[0], strict=True):
            if mine != reference:
                raise ReplicaMismatchError(
                    f"leaf {path} differs between rank 0 and rank {rank}: the replicas have "
                    "drifted apart. Start every rank from bpd.broadcast(params), apply the "
                    "same update on every rank from the averaged gradients, and keep any "
                    "randomness in the update seeded identically on all ranks"
                )
