"""What a loop really does with a compiled function's results, seen on a signature's second
call: which of the first call's results are still alive when the next call starts (the
caller's names hold them while it runs: `loss, grads = step(params, x)`, `new = step(params,
x)`), which of them it is passed as arguments (`params = step(params, x)`, `x = f(x)`: held
once, among the arrays passed in) and which were let go. Each result is followed by its NumPy
buffer (the base of any view of it, weakly referenced), so a `.numpy()` the caller kept counts
as holding it. No guess from shapes or the graph: explain's loop peak before a second call
assumes every result stays bound (report/loop_peak.py), an upper bound by the bytes passed
back, and states it; after one, it prints what this loop holds
(`report.observed_peak_bytes`).

The watch costs a flattening of the result on a signature's first call and of the arguments
on its second, then a dictionary lookup per call."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np

from .pytree import leaves
from .tensor import Tensor


@dataclass(frozen=True)
class LoopObservation:
    """The first call's results, in bytes of their buffers (each buffer once, the arrays the
    call was passed left out), as the second call of the same signature found them."""

    kept: int  # alive and not among the call's arguments: held beside it
    passed_back: int  # among the call's arguments: the next call's arrays, counted there
    let_go: int  # no longer alive: the caller dropped them before calling again

    def words(self) -> str:
        parts = [
            f"{self.kept:,} B stayed bound beside it",
            f"{self.passed_back:,} B went back in as its arguments",
            f"{self.let_go:,} B had been let go",
        ]
        return ", ".join(parts)


def _buffer(leaf):
    """The NumPy buffer a result or argument leaf lives in (the base of a view), or None."""
    array = leaf._data if isinstance(leaf, Tensor) else leaf
    if not isinstance(array, np.ndarray):
        return None
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def sizes(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's arrays: with the signature's entry key, what an observation is
    kept under (one plan of a dynamic axis runs every size, whose results differ in bytes)."""
    return tuple(np.shape(leaf) for leaf in leaves((args, kwargs)) if _buffer(leaf) is not None)


def _buffers(tree) -> dict[int, np.ndarray]:
    found = {}
    for leaf in leaves(tree):
        array = _buffer(leaf)
        if array is not None:
            found[id(array)] = array
    return found


class LoopWatch:
    """Per compiled function: the last call's results of a signature not yet observed, and
    each signature's observation ((entry key, sizes) -> LoopObservation)."""

    def __init__(self):
        self.observed: dict = {}
        self._last = None  # (entry key, [(weakref to buffer, nbytes)]) of the last call
        self._lock = threading.Lock()
        self.active = True  # False once the signature last run is observed, until a new trace

    def before(self, args: tuple, kwargs: dict):
        """At a call's start: how the last call's results stand, or None (nothing watched)."""
        last = self._last
        if last is None:
            return None
        key, results = last
        passed = _buffers((args, kwargs))
        kept = back = gone = 0
        for ref, nbytes in results:
            array = ref()
            if array is None:
                gone += nbytes
            elif id(array) in passed:
                back += nbytes
            else:
                kept += nbytes
        return key, LoopObservation(kept, back, gone)

    def after(self, entry_key, seen, result, args: tuple, kwargs: dict) -> None:
        """At a call's end (entry_key: the signature it ran): keep the observation `before`
        made if the last call ran the same signature and sizes, else follow this call's
        results."""
        key = (entry_key, sizes(args, kwargs))
        if key in self.observed:
            self._last, self.active = None, False
            return
        with self._lock:
            if seen is not None and seen[0] == key:
                self.observed[key] = seen[1]
                self._last = None
                return
            mine = _buffers((args, kwargs))
            results = [
                (weakref.ref(a), a.nbytes) for i, a in _buffers(result).items() if i not in mine
            ]
            self._last = (key, results)
