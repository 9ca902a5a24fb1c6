"""Never silent, for the library: the first use of a heavy library kernel (convolution,
attention) compiles it once per installation and version, for seconds, inside the user's first
call and before any plan's own progress line could say so (a CNN's first call waited 20 s with
no line). Such a compile counts toward the process's one line about compiling
(codegen/build/compile_notice.py); under BACKPLAN_VERBOSE=1 each says when it starts compiling,
for which argument types, and how long it took.

>>> announce_compiles({conv2d_gemm: 3.0})  # in the library module, after the definition
"""

from __future__ import annotations

import threading
import time

from numba.core import event

from backplan.codegen.build import compile_notice, progress

# id(dispatcher) -> (the dispatcher, kept alive so that its id is never another's; its
# measured cold compile in seconds)
_MEASURED: dict[int, tuple[object, float]] = {}
_lock = threading.Lock()


def announce_compiles(measured: dict) -> None:
    """measured: library dispatcher -> seconds its compile took on a 2-core Zen 3 box."""
    with _lock:
        for dispatcher, seconds in measured.items():
            _MEASURED[id(dispatcher)] = (dispatcher, seconds)


class _Listener(event.Listener):
    """Numba announces each compile (a load from its cache is no compile)."""

    def __init__(self):
        self.started: dict[int, float] = {}
        self.notices: dict[int, object] = {}

    def on_start(self, ev):
        key = id(ev.data.get("dispatcher"))
        if key not in _MEASURED or progress.quiet():
            return
        if not progress.verbose():
            self.notices[key] = compile_notice.begin(f"the library's {_name(key)}")
            return
        self.started[key] = time.perf_counter()
        progress.say(
            f"compiling the library's {_name(key)} for {_types(ev.data.get('args'))} (once per "
            f"installation and version, about {_MEASURED[key][1]:.0f} s)"
        )

    def on_end(self, ev):
        key = id(ev.data.get("dispatcher"))
        compile_notice.end(self.notices.pop(key, None))
        start = self.started.pop(key, None)
        if start is not None:
            progress.say(f"compiled {_name(key)} in {time.perf_counter() - start:.1f} s")


def _name(key: int) -> str:
    return _MEASURED[key][0].py_func.__name__


def _types(args) -> str:
    arrays = {str(t.dtype) for t in args or () if hasattr(t, "ndim") and hasattr(t, "dtype")}
    return " and ".join(sorted(arrays)) + " arrays" if arrays else "its arguments"


event.register("numba:compile", _Listener())
