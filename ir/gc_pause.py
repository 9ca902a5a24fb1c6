"""Python's cyclic garbage collector paused while planning builds large graphs.

Lowering a 10,000-node plan allocates hundreds of thousands of objects (values, kernels,
dicts, sets) that stay alive, and each allocation burst triggers a collection; the oldest
generation's collections walk every object the process holds (every plan built so far), and
find nothing to free (measured: `memory_frontier` of the 10,086-node plan spent ~30% of its
CPU time in them, 13 full collections collecting 0 objects). Inside `paused_gc()` the
collector does not run; on leaving the outermost pause it is enabled again if it was on
before, and the next allocation lets it collect whatever cycles the pause left. Explicit
`gc.collect()` calls still collect. Nesting and threads: one count under a lock, so the
collector resumes only when the last pause (of any thread) ends.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_state = {"depth": 0, "was_enabled": False}


@contextmanager
def paused_gc():
    """Pause the cyclic collector for the block (see the module docstring)."""
    with _lock:
        if _state["depth"] == 0:
            _state["was_enabled"] = gc.isenabled()
            gc.disable()
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0 and _state["was_enabled"]:
                gc.enable()
