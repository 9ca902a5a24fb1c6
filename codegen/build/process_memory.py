"""What this process holds for compiled code, measured: the growth of its resident memory while
backplan loaded kernels from the disk cache or Numba compiled them.

A step's peak (ir/peak.py) counts the buffers the step holds; a process also holds, once, what
running compiled code needs: the pages of LLVM's own code that linking touches, the machine
code and the Numba objects of every kernel loaded, and after a compile what the compiler left
resident (freed to malloc but not returned, or kept by Numba). None of it is a step's, and none
of it goes when a step ends. Each load (SignedCacheOnDemand.load_overload) and each compile
(Numba's "numba:compile" event of a backplan function; a user's own @njit is not backplan's
code) is one window: the resident bytes when the first open window
starts and when the last one ends, their growth added up. Windows of two threads at once make
one. The step's own buffers are never allocated inside a window (a kernel loads before it runs),
but another thread's allocations meanwhile are counted too: the figure is the process's, read
from /proc/self/statm, where the kernel says how many pages it holds.
"""

from __future__ import annotations

import contextlib
import os
import threading

from numba.core import event

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_lock = threading.Lock()
_state = {"open": 0, "start": 0, "held": 0, "loads": 0, "compiles": 0}
_statm: list = [None, None]  # (process id, file descriptor): a forked child opens its own


def resident_bytes() -> int | None:
    """The process's resident bytes (VmRSS), or None where /proc/self/statm is not there."""
    pid = os.getpid()
    try:
        if _statm[0] != pid:
            _statm[:] = [pid, os.open("/proc/self/statm", os.O_RDONLY)]
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
    except OSError:
        return None


def _enter(kind: str | None) -> None:
    with _lock:
        if kind is not None:
            _state[kind] += 1
        _state["open"] += 1
        if _state["open"] == 1:
            _state["start"] = resident_bytes() or 0


def _leave() -> None:
    with _lock:
        _state["open"] -= 1
        if _state["open"] == 0 and _state["start"]:
            _state["held"] += max((resident_bytes() or 0) - _state["start"], 0)


class _Look:
    """One look in the disk cache; `found` once it loaded machine code (a miss is no load)."""

    found = False


@contextlib.contextmanager
def loading():
    """A window around a look for machine code in the disk cache: its memory is counted
    either way, a load only where the caller sets `found` on what it yields."""
    _enter(None)
    look = _Look()
    try:
        yield look
    finally:
        _leave()
        if look.found:
            with _lock:
                _state["loads"] += 1


class _Compiles(event.Listener):
    """Compiles of backplan's own functions (library kernels, generated loops and drivers) and
    what Numba compiles inside them; a user's own @njit function compiled beside them is not
    backplan's code, so neither its memory nor its count is added."""

    def __init__(self) -> None:
        self._open = threading.local()  # per thread: whether each compile begun counts

    def on_start(self, event_) -> None:
        stack = self._open.__dict__.setdefault("stack", [])
        ours = _backplans(event_.data.get("dispatcher")) or any(stack)
        stack.append(ours)
        if ours:
            _enter("compiles" if _backplans(event_.data.get("dispatcher")) else None)

    def on_end(self, event_) -> None:
        stack = self._open.__dict__.get("stack")
        if stack and stack.pop():
            _leave()


def _backplans(dispatcher) -> bool:
    """Whether a Numba dispatcher compiles backplan's code: its package, or a module it
    generated (backplan_kernel_* loops, a plan's backplan_kernels_* driver). A bare prefix
    took a user's bp_*.py or backplanner.py for backplan's."""
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", None) or ""
    return module == "backplan" or module.startswith(("backplan.", "backplan_kernel"))


event.register("numba:compile", _Compiles())


def code_bytes() -> int:
    """Bytes this process's resident memory grew by while backplan loaded or compiled code."""
    return _state["held"]


def counts() -> tuple[int, int]:
    """(loads, compiles) measured so far in this process."""
    return _state["loads"], _state["compiles"]
