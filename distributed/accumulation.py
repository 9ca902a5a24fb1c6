"""data_parallel(..., accumulate=k): the loss and gradients of k micro-batches summed on each rank
and exchanged once, on the k-th call, as their mean: the step then returns what one call on the
k micro-batches at once would (the mean over every rank's k micro-batches). The micro-batches of
one rank must hold the same number of rows (checked), else the mean of their means would not be
the mean over their rows."""

from __future__ import annotations

import threading

import numpy as np

from .errors import DistributedError


class Accumulator:
    """add(fingerprint, lengths, arrays) -> None for the first k - 1 calls of each round, then
    the k calls' mean per leaf (fresh arrays the accumulator no longer holds)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.calls = 0  # calls of this round so far
        self._sums: list[np.ndarray] | None = None
        self._signature = None
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
            self._sums = [np.array(a, copy=True) for a in arrays]
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

    def _check(self, signature, lengths) -> None:
        if signature[0] != self._signature[0]:
            self._reset()
            raise DistributedError(
                f"data_parallel(accumulate={self.steps}): call {self.calls + 1} of the round "
                "differentiates parameters of another structure, shapes or dtypes than call 1; "
                "the k micro-batches of a round must share the parameters (the round restarts)"
            )
        if lengths != self._signature[1]:
            first = self._signature[1]
            self._reset()
            raise DistributedError(
                f"data_parallel(accumulate={self.steps}): call {self.calls + 1} of the round "
                f"passes batch arguments of {list(lengths)} rows but call 1 passed "
                f"{list(first)}; micro-batches of one round must hold equal rows, or the mean "
                "of their means is not the mean over the rows (the round restarts)"
            )

    def _reset(self) -> None:
        self._sums, self._signature, self.calls = None, None, 0
