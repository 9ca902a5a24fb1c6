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
posts them in the drivers' order, then the rest, and the call settles as above.)

A rank whose call raises before the ranks agreed on it (tracing, a micro-batch's checks) posts
the agreement anyway, marked failed (step.py): every rank then gathers what failed where and
the others raise RankFailedError before anything moves. A non-final call of an accumulating
round that raises is counted and noted; the round's last call tells the others the same way and
every rank drops the round. A rank whose ZeRO-1 update raises still joins the all-gather, sending
NaN in place of its range, so the others raise RankFailedError instead of returning it.

The rank that raised waits for the other ranks while it settles, and without a data_parallel
timeout a hung rank would keep it waiting forever: it waits at most SETTLE_S seconds (or the
timeout), then gives up. Its step is then out of step (the error says so), and its error,
uncaught, ends every rank through MPI_Abort, the hung one too."""

from __future__ import annotations

import numpy as np

from backplan.ir.types import np_dtype

from .errors import RankFailedError

SETTLE_S = 120.0  # how long a rank that raised waits for the others to complete the call


def settle_seconds(timeout: float | None) -> float:
    """The deadline of a failed rank's waits: the step's timeout, else SETTLE_S (a rank that
    raised must not wait forever for one that hangs)."""
    return SETTLE_S if timeout is None else timeout


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
    (check_ranks); each wait settle_seconds at most. The caller then raises `error`."""
    exchange.failure = describe_error(error)
    exchange.timeout = settle_seconds(exchange.timeout)
    array_of = nan_arrays(exchange.layout)
    for bucket in first:
        exchange.start_bucket(bucket, array_of)
    exchange.start_rest(array_of)
    exchange.finish()


IN_STEP = (
    "; the ranks stay in step: call the step again to go on (uncaught, this error ends every rank)"
)
AFTER_AGREEMENT = (
    "during this call of the data-parallel step of {name}, after the ranks had agreed on the "
    "call. It completed the call's exchange with NaN in place of its gradients, so no rank got "
    "gradients or an update from this call" + IN_STEP
)
BEFORE_AGREEMENT = (
    "during this call of the data-parallel step of {name}, before the ranks had agreed on the "
    "call (tracing, or its own checks). It told the other ranks in the agreement, so no rank "
    "exchanged or applied anything from this call" + IN_STEP
)
IN_UPDATE = (
    "during this call of the data-parallel step of {name}, in its ZeRO-1 update. It joined the "
    "all-gather with NaN in place of its range, so no rank returns this call's parameters or "
    "state: those passed in still hold" + IN_STEP
)
DIVERGED = (
    "in its update of an earlier call of the data-parallel step of {name} (shard_optimizer="
    "False: each rank applies the whole update itself), after the ranks had exchanged that "
    "call's gradients: its parameters and optimizer state are those before that update, the "
    "other ranks' those after it, so the ranks no longer hold the same parameters and none can "
    "go on; restart from the last checkpoint (uncaught, this error ends every rank)"
)


def check_ranks(world, loss: np.ndarray, failure: str | None, name: str) -> None:
    """After a call's exchange, on every rank: raise RankFailedError when another rank's call
    failed (it sent a NaN loss, so every rank's summed loss is NaN and all come here)."""
    if failure is None:  # NaN is the one value unequal to itself
        if loss.size == 1:  # the usual scalar loss: compared without NumPy's reduction
            value = loss.item()
            if value == value:
                return
        elif not (loss != loss).any():
            return
    raise_for_others(world, failure, name, AFTER_AGREEMENT)


def raise_for_others(world, failure: str | None, name: str, when: str) -> list:
    """Every rank comes here together once any rank said it failed: gather what failed where;
    the ranks whose call went well raise RankFailedError naming the failed ranks and their
    errors, a failed rank gets [(rank, its error)] back (to raise its own). When nobody failed
    (a real NaN loss), every rank gets []."""
    said = world.comm.allgather(failure)
    failed = [(rank, text) for rank, text in enumerate(said) if text is not None]
    if failed and failure is None:
        raise RankFailedError(failed_text(failed, world.size, name, when))
    return failed


def failed_text(failed: list, size: int, name: str, when: str) -> str:
    """RankFailedError's message: [(rank, its error)], when it failed (the constants above)."""
    who = "; ".join(f"rank {rank} of {size} raised {text}" for rank, text in failed)
    return f"{who} " + when.format(name=f"{name}()")


def out_of_step_text(world, error: BaseException, name: str, telling=None, why: str = "") -> str:
    """RankOutOfStepError's message for a rank whose call raised `error` and could not tell
    the others (telling: what raised meanwhile, e.g. a RankTimeoutError) or settle (why)."""
    if telling is not None:
        why = f"telling the other ranks raised {describe_error(telling)}"
    return (
        f"this rank ({world.rank} of {world.size}) raised {describe_error(error)} during an "
        f"earlier call of the data-parallel step of {name}, and {why}: the other ranks' "
        "collectives of that call no longer pair with this rank's, so this step cannot go on. "
        "Uncaught, this error ends every rank (MPI_Abort); restart from the last checkpoint"
    )
