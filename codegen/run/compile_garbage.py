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
the disk cache do not count), and `collect_if_compiled(before)` runs one full collection when a
compile happened since `before`: right after the compiling call, so what it left goes now,
not at some later step (the collection frees the same garbage a later one would; the extra is
one walk of the live objects, small beside the compile it follows).
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


class _CompileCounter(event.Listener):
    def on_start(self, event_) -> None:
        _compiles[0] = next(_count) + 1

    def on_end(self, event_) -> None:
        pass


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
    `before`; whether it ran."""
    if _compiles[0] == before:
        return False
    gc.collect()
    return True
