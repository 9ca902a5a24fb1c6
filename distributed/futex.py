"""Sleeping until another process on the node changes a word of shared memory, and waking the
processes that sleep on it: Linux's futex (FUTEX_WAIT, FUTEX_WAKE, not private: the word is in
a file mapping every rank maps, node_window.py). A rank waiting for another's counter spun on
sched_yield, burning its core's time while the rank it waited for was off its own (on a busy
machine, most of an mlp step's wait) and, to the scheduler, a process that never sleeps: a
sleeper is woken at once when the word changes and preempts the work that took its core.
Elsewhere (not Linux, no libc), `available` is False and the callers spin as before."""

from __future__ import annotations

import ctypes
import os
import platform
import sys

FUTEX_WAIT, FUTEX_WAKE = 0, 1
_NUMBERS = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238, "riscv64": 98}
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall():
    if not sys.platform.startswith("linux") or platform.machine() not in _NUMBERS:
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_long
    return function


_call = _syscall()
_number = ctypes.c_long(_NUMBERS.get(platform.machine(), -1))
available = _call is not None and os.environ.get("BACKPLAN_DP_SPIN") != "1"


def _word(value: int) -> ctypes.c_int:
    """The low 32 bits of a counter (what FUTEX_WAIT compares), as the C int it reads."""
    low = value & 0xFFFFFFFF
    return ctypes.c_int(low - 2**32 if low >= 2**31 else low)


def wait(address: int, seen: int, seconds: float) -> None:
    """Sleep until the 32-bit word at address (the low half of a little-endian counter) no
    longer holds the low 32 bits of `seen`, someone wakes it, or `seconds` pass; at once if it
    already differs. May also return early (a signal): the caller checks again."""
    whole = int(seconds)
    limit = _Timespec(whole, int((seconds - whole) * 1e9))
    _call(
        _number,
        ctypes.c_void_p(address),
        ctypes.c_int(FUTEX_WAIT),
        _word(seen),
        ctypes.byref(limit),
        None,
        ctypes.c_int(0),
    )


def wake(address: int) -> None:
    """Wake every process sleeping on the word at address (none: a cheap system call)."""
    _call(
        _number,
        ctypes.c_void_p(address),
        ctypes.c_int(FUTEX_WAKE),
        ctypes.c_int(_WAKE_ALL),
        None,
        None,
        ctypes.c_int(0),
    )
