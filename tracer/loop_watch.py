"""What a loop really does with a compiled function's results, seen on a signature's second
call: which of the first call's results are still alive when the next call starts (the
caller's names hold them while it runs: `loss, grads = step(params, x)`, `new = step(params,
x)`), which of them it is passed as arguments (`params = step(params, x)`, `x = f(x)`: held
once, among the arrays passed in) and which were let go. Each result is followed by its NumPy
buffer (the base of any view of it, weakly referenced), so a `.numpy()` the caller kept counts
as holding it; an output the plan keeps only to write the next call's output into it again
(codegen/run/workspace.py) counts as let go. No guess from shapes or the graph: explain's loop
peak before a second call assumes every result stays bound (report/loop_peak.py), an upper
bound by the bytes passed back, and states it; after one, it prints what this loop holds
(`report.observed_peak_bytes`).

Each signature (and each thread: a loop is one thread's calls) is watched apart: a loop that
alternates signatures (train and eval batches: A, B, A, B) sees A's results on A's second call
and B's on B's, and a call from another thread is never taken as a loop's next call. The
watch costs a flattening of the arguments and results on the calls of a function with a
signature not yet observed, then one attribute read per call; a signature called once waits
WATCHED_CALLS later calls of the function for its second call, then stops being followed."""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from backplan.runtime.memory import output_reuse_check

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
    kept under (one plan of a dynamic axis runs every size, whose results differ in bytes).
    Each leaf is an array or a tensor holding one: its own `.shape` (np.shape of a tensor goes
    through __array_function__, 0.19 ms for a transformer's 17 arguments, twice a new size's
    first call)."""
    return tuple(leaf.shape for leaf in leaves((args, kwargs)) if _buffer(leaf) is not None)


def _buffers(tree) -> dict[int, np.ndarray]:
    found = {}
    for leaf in leaves(tree):
        array = _buffer(leaf)
        if array is not None:
            found[id(array)] = array
    return found


_threads = threading.local()
_thread_numbers = itertools.count()


def thread_number() -> int:
    """This thread's number, never given to another thread of the process: threading.get_ident()
    is, once a thread has ended (glibc hands its stack to the next thread), and a new thread's
    first call would be taken for the second call of the ended thread's loop."""
    number = getattr(_threads, "number", None)
    if number is None:
        number = _threads.number = next(_thread_numbers)
    return number


WATCHED_CALLS = 64  # calls a signature's results wait for that signature's next call


def _stand(results: list, passed: dict) -> LoopObservation:
    """How results of an earlier call stand when a call is passed the buffers `passed`."""
    kept = back = gone = 0
    reused = output_reuse_check()
    for ref, nbytes in results:
        array = ref()
        if array is None:
            gone += nbytes
        elif id(array) in passed:
            back += nbytes
        elif reused is not None and reused(array):  # the plan writes this call's output in it
            gone += nbytes
        else:
            kept += nbytes
    return LoopObservation(kept, back, gone)


class LoopWatch:
    """Per compiled function: each thread's last results of each signature not yet observed,
    and each signature's observation ((entry key, sizes) -> LoopObservation). Safe to call
    from several threads: each follows its own calls."""

    def __init__(self):
        self.observed: dict = {}
        # (thread, (entry key, sizes)) -> (call number, [(weakref to buffer, nbytes)])
        self._waiting: dict = {}
        self._calls = 0
        self._lock = threading.Lock()
        self.active = True  # False while no signature waits, until a new trace

    def before(self, args: tuple, kwargs: dict):
        """At a call's start: how this thread's last results of each waiting signature of the
        call's sizes stand ({key: LoopObservation}), or None (nothing watched). The call's
        signature is known only at its end (`after`), its sizes now."""
        if not self._waiting:
            return None
        thread, shapes = thread_number(), sizes(args, kwargs)
        with self._lock:
            waiting = [
                (key, results)
                for (t, key), (_, results) in self._waiting.items()
                if t == thread and key[1] == shapes
            ]
        if not waiting:
            return None
        passed = _buffers((args, kwargs))
        return {key: _stand(results, passed) for key, results in waiting}

    def after(self, entry_key, seen, result, args: tuple, kwargs: dict) -> None:
        """At a call's end (entry_key: the signature it ran): keep the observation `before`
        made of this thread's last call of the same signature and sizes, else follow this
        call's results until its next call."""
        key = (entry_key, sizes(args, kwargs))
        thread = thread_number()
        with self._lock:
            self._calls += 1
            if key not in self.observed:
                if seen is not None and key in seen:
                    self.observed[key] = seen[key]
                else:
                    mine = _buffers((args, kwargs))
                    results = [
                        (weakref.ref(a), a.nbytes)
                        for i, a in _buffers(result).items()
                        if i not in mine
                    ]
                    self._waiting[(thread, key)] = (self._calls, results)
            oldest = self._calls - WATCHED_CALLS
            self._waiting = {
                k: v
                for k, v in self._waiting.items()
                if k[1] not in self.observed and v[0] > oldest
            }
            self.active = bool(self._waiting)
