"""Quiet by default: a process prints at most one line about compiling, and only when a compile
has already taken more than BACKPLAN_PROGRESS_SECONDS (default 2): what is compiling and how
long so far. A compile that ends sooner prints nothing; the stage-by-stage lines are
BACKPLAN_VERBOSE=1's (codegen/build/progress.py), and BACKPLAN_QUIET=1 prints nothing at all.

>>> with compiling("@train_step"):  # around a plan's first call, a library kernel's compile
...     pass  # nothing printed: it ended before the threshold
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

_lock = threading.Lock()
_said = [False]  # the process's one line is printed
_open: list[tuple[str, float]] = []  # what is compiling now, outermost first, with its start
_timer: list[threading.Timer] = []


def threshold_seconds() -> float:
    try:
        return float(os.environ.get("BACKPLAN_PROGRESS_SECONDS", "2"))
    except ValueError:
        return 2.0


def quiet() -> bool:
    return os.environ.get("BACKPLAN_QUIET", "") not in ("", "0")


def verbose() -> bool:
    """BACKPLAN_VERBOSE=1: every stage of a compile is a line (and never under BACKPLAN_QUIET)."""
    return os.environ.get("BACKPLAN_VERBOSE", "") not in ("", "0") and not quiet()


@contextmanager
def compiling(what: str):
    """Around work that compiles: the process's one line names the outermost such work (a
    plan's first call, not the library kernel it compiles) once it has run past the threshold.
    Verbose runs have their own lines, so this one stays silent there."""
    entry = begin(what)
    try:
        yield
    finally:
        end(entry)


def begin(what: str):
    """compiling() for callers told of a start and an end apart (Numba's compile events)."""
    if _said[0] or quiet() or verbose():
        return None
    entry = (what, time.perf_counter())
    with _lock:
        _open.append(entry)
        if len(_open) == 1:
            timer = threading.Timer(threshold_seconds(), _say_once)
            timer.daemon = True
            _timer[:] = [timer]
            timer.start()
    return entry


def end(entry) -> None:
    if entry is None:
        return
    with _lock:
        if entry in _open:
            _open.remove(entry)
        if not _open and _timer:
            _timer.pop().cancel()


def _say_once() -> None:
    with _lock:
        if _said[0] or not _open:
            return
        _said[0] = True
        what, start = _open[0]
    print(
        f"backplan: compiling {what}, {time.perf_counter() - start:.0f} s so far (cached for "
        "later runs; BACKPLAN_VERBOSE=1 shows each stage)",
        file=sys.stderr,
        flush=True,
    )
