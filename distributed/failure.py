"""A rank whose call raises after the ranks agreed on the call (its plan, its packing). The other
ranks go on into the call's exchange: their collectives would pair with whatever this rank posts
next (its next call's agreement), which MPI reports as an error or, worse, pairs silently.

So the rank that raised completes the call's exchange itself, sending NaN in place of its loss
and gradients (settle). A NaN loss makes every rank, after its exchange, gather one word from
each rank: what failed where. The ranks whose call succeeded then raise RankFailedError naming
the rank and its error, the failed rank raises its own error, no rank applies anything from
that call, and the next call pairs with the next call on every rank. A NaN loss of a real
step costs that one gather and changes nothing else; a step without NaN costs one comparison.

Where the compiled driver had started some buckets itself before the call raised, the others'
sums already hold this rank's real loss, so NaN cannot tell them: the step is marked out of
step instead, and its next call raises RankOutOfStepError on that rank without touching MPI,
which, uncaught, ends every rank through MPI_Abort. (Where it had started none, this rank
posts them in the drivers' order, then the rest, and the call settles as above.)"""

from __future__ import annotations

import numpy as np

from backplan.ir.types import np_dtype

from .errors import RankFailedError


def describe_error(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def nan_arrays(layout):
    """array_of(leaf index) for an exchange: NaN of each leaf's shape and dtype."""
    leaves = {leaf.index: leaf for bucket in layout.buckets for leaf in bucket.leaves}

    def array_of(index: int) -> np.ndarray:
        leaf = leaves[index]
        return np.full(leaf.shape, np.nan, np_dtype(leaf.dtype))

    return array_of


def settle(exchange, error: BaseException, first=()) -> None:
    """On the rank whose call raised after the agreement: start the buckets `first` (those
    the other ranks' compiled drivers start, in their order), then what the exchange has not
    started, with NaN for every leaf, and finish it, which tells the other ranks
    (check_ranks). The caller then raises `error` on this rank."""
    exchange.failure = describe_error(error)
    array_of = nan_arrays(exchange.layout)
    for bucket in first:
        exchange.start_bucket(bucket, array_of)
    exchange.start_rest(array_of)
    exchange.finish()


def check_ranks(world, loss: np.ndarray, failure: str | None, name: str) -> None:
    """After a call's exchange, on every rank: raise RankFailedError when another rank's call
    failed (it sent a NaN loss, so every rank's summed loss is NaN and all come here)."""
    if failure is None and not (loss != loss).any():  # NaN is the one value unequal to itself
        return
    said = world.comm.allgather(failure)
    failed = [(rank, text) for rank, text in enumerate(said) if text is not None]
    if not failed or failure is not None:
        return  # the loss itself is NaN; or this rank failed, and raises its own error
    who = "; ".join(f"rank {rank} of {world.size} raised {text}" for rank, text in failed)
    raise RankFailedError(
        f"{who} during this call of the data-parallel step of {name}(), after the ranks had "
        "agreed on the call. It completed the call's exchange with NaN in place of its "
        "gradients, so no rank got gradients or an update from this call and the ranks stay "
        "in step: call the step again to go on (uncaught, this error ends every rank)"
    )
