"""data_parallel(..., accumulate=k): the loss and gradients of k micro-batches summed on each rank
and exchanged once, on the k-th call, as their mean: the step then returns what one call on the
k micro-batches at once would (the mean over every rank's k micro-batches). The micro-batches of
one rank must hold the same number of rows (checked), else the mean of their means would not be
the mean over their rows.

16-bit gradients (bfloat16, float16) are summed in float32, as the exchange sums them across
ranks: a bfloat16 running sum keeps 8 bits, so adding k micro-batches rounded k times (the
k-th addend lost up to 1/256 of the sum each time) where one big batch rounds once. The sums
stay float32 until the exchange rounds its result into the leaf's dtype, once.

A call of a round that raises before its last (its plan, or its checks) still counts as one of
the round's k calls, and the round remembers the first failure: the other ranks make no MPI
call until the round's last call either, so the last call tells them (step.py) and every rank
drops the round. Rounds thus keep pairing call for call on every rank."""

from __future__ import annotations

import threading

import numpy as np

from .errors import DistributedError
from .half_wire import summed_dtype


class Accumulator:
    """add(fingerprint, lengths, arrays) -> None for the first k - 1 calls of each round, then
    the k calls' mean per leaf (fresh arrays the accumulator no longer holds; float32 for a
    16-bit leaf)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.calls = 0  # calls of this round so far
        self._sums: list[np.ndarray] | None = None
        self._signature = None
        self.failure: str | None = None  # the first call of this round that raised
        self._lock = threading.Lock()

    @property
    def last_of_round(self) -> bool:
        """Whether the next call completes a round (and so exchanges)."""
        return self.calls + 1 >= self.steps

    def add(self, fingerprint: int, lengths: tuple, arrays: list) -> list[np.ndarray] | None:
        """Add one call's arrays (loss first, then gradients); calls from two threads take
        turns, so no call's arrays are added twice or lost."""
        with self._lock:
            return self._add(fingerprint, lengths, arrays)

    def _add(self, fingerprint: int, lengths: tuple, arrays: list) -> list[np.ndarray] | None:
        signature = (fingerprint, lengths)
        if self._sums is None:
            self._sums = [np.asarray(a).astype(summed_dtype(np.asarray(a).dtype)) for a in arrays]
            self._signature = signature
        else:
            self._check(signature, lengths)
            for total, array in zip(self._sums, arrays, strict=True):
                np.add(total, array, out=total)
        self.calls += 1
        if self.calls < self.steps:
            return None
        sums, self._sums, self.calls = self._sums, None, 0
        for total in sums:
            total /= total.dtype.type(self.steps)
        return sums

    def failed(self, text: str) -> None:
        """A call of this round before its last raised: count it and note the round's first
        failure (the round's last call tells the other ranks, see drop)."""
        with self._lock:
            self.calls += 1
            if self.failure is None:
                self.failure = f"{text} (call {self.calls} of a round of accumulate={self.steps})"

    def drop(self) -> str | None:
        """End this round without a result (its last call failed, or an earlier one did);
        returns the failure noted, if any."""
        with self._lock:
            failure = self.failure
            self._sums, self._signature, self.calls, self.failure = None, None, 0, None
            return failure

    def _check(self, signature, lengths) -> None:
        """Raise for a call unlike the round's first (the round then fails on every rank at its
        last call: the caller counts the call as failed)."""
        if signature[0] != self._signature[0]:
            raise DistributedError(
                f"data_parallel(accumulate={self.steps}): call {self.calls + 1} of the round "
                "differentiates parameters of another structure, shapes or dtypes than call 1; "
                "the k micro-batches of a round must share the parameters"
            )
        if lengths != self._signature[1]:
            raise DistributedError(
                f"data_parallel(accumulate={self.steps}): call {self.calls + 1} of the round "
                f"passes batch arguments of {list(lengths)} rows but call 1 passed "
                f"{list(self._signature[1])}; micro-batches of one round must hold equal rows, "
                "or the mean of their means is not the mean over the rows"
            )
