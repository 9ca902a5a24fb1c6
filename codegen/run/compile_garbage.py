"""Numba's compiles leave reference cycles that hold a first call's arrays; collected at once.

Type inference tries overload templates that fail and keeps the exceptions (its failure cache,
the resolution errors it reports): each exception's traceback holds the frames it went
through, and each of those frames holds its caller through `f_back`, up to the call that
started the compile: the plan's first call, whose frames hold its inputs, scratch views and
output buffers. The exceptions sit in cycles (a frame's locals hold the cache that holds the
exception), so only the cyclic collector frees them, and a process with a large heap (PyTorch
and JAX loaded: ~270,000 long-lived objects) runs a full collection rarely: the first call's
outputs then stay alive after the caller drops them, and the next calls allocate beside them
(the bench transformer, cold, peers loaded: 3 MiB + 13 KiB more than explain's loop peak).

`compiles()` counts Numba's compiles in this process (its "numba:compile" event; loads from
the disk cache do not count). The garbage is collected as each outermost compile ends: the
objects alive when it started are frozen (`gc.freeze`, which moves them out of the collector's
generations in constant time), so the collection walks only what the compile made, and they
are unfrozen right after. The cycles it frees are all made by the compile; the frames they
hold up to the first call are only referenced from them, so those frames and their arrays go
by reference counting once the caller returns. A full collection walks every live object
instead: 129,000 after `import backplan` alone, 58-61 ms of mlp_infer's 0.4 s cold first call.
`collect_if_compiled(before)` runs that full collection after the compiling call only when a
compile since `before` could not be collected at its end (objects someone else froze, which an
unfreeze here would release).
"""

from __future__ import annotations

import gc
import itertools
import threading

from numba.core import event

_count = itertools.count()
_compiles = [0]
_installed = threading.Lock()
_listener: list = []
_nesting = threading.RLock()  # a finalizer the collection runs may compile
_open = [0]  # compiles started and not ended (a library function's inside a plan's)
_frozen = [False]  # whether the outermost open compile froze the older objects
_uncollected = [0]  # outermost compiles that ended without their own collection


class _CompileCounter(event.Listener):
    def on_start(self, event_) -> None:
        with _nesting:
            _compiles[0] = next(_count) + 1
            _open[0] += 1
            if _open[0] == 1:
                _frozen[0] = gc.get_freeze_count() == 0
                if _frozen[0]:
                    gc.freeze()

    def on_end(self, event_) -> None:
        with _nesting:
            _open[0] -= 1
            if _open[0] > 0:
                return
            if not _frozen[0]:
                _uncollected[0] += 1
                return
            _frozen[0] = False
            try:
                gc.collect()
            finally:
                gc.unfreeze()


def compiles() -> int:
    """How many Numba compiles this process has started (counted from the first call here)."""
    if not _listener:
        with _installed:
            if not _listener:
                _listener.append(_CompileCounter())
                event.register("numba:compile", _listener[0])
    return _compiles[0]


def collect_if_compiled(before: int) -> bool:
    """Run a full cyclic collection if Numba compiled anything since `compiles()` was
    `before` that was not collected as it ended; whether it ran."""
    if _compiles[0] == before or not _uncollected[0]:
        return False
    _uncollected[0] = 0
    gc.collect()
    return True
