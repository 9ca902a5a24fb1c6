"""Quiet by default: a process prints at most one line about compiling, and only when a compile
has already taken more than BACKPLAN_PROGRESS_SECONDS (default 2): what is compiling and how
long so far. A compile that ends sooner prints nothing; the stage-by-stage lines are
BACKPLAN_VERBOSE=1's (codegen/build/progress.py), and BACKPLAN_QUIET=1 prints nothing at all.

On a terminal the line is a status line, rewritten each second while anything compiles past the
threshold and erased when it ends: it names whatever compiles now (a training step's 10 s
compile after a 2 s loss function's, not only the first), and leaves nothing behind. Elsewhere
(a log, a pipe) it is printed once, as the first compile passes the threshold.

>>> with compiling("@train_step"):  # around a plan's first call, a library kernel's compile
...     pass  # nothing printed: it ended before the threshold
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager

from backplan.codegen.build import cache_health

_lock = threading.Lock()
_said = [False]  # the process's one line is printed (where stderr is not a terminal)
_open: list[tuple[str, float]] = []  # what is compiling now, outermost first, with its start
_timer: list[threading.Timer] = []
_shown = [False]  # a terminal's status line is on screen now
REFRESH_SECONDS = 1.0  # how often a terminal's status line is rewritten
LIBRARY = "the library's "  # how library compiles are named (library_progress.py, gemm/symbols.py)


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
    if quiet() or verbose() or (_said[0] and not _terminal()):
        return None
    entry = (what, time.perf_counter())
    with _lock:
        _open.append(entry)
        if len(_open) == 1:
            _schedule(threshold_seconds())
    return entry


def end(entry) -> None:
    if entry is None:
        return
    with _lock:
        if entry in _open:
            _open.remove(entry)
        if not _open:
            if _timer:
                _timer.pop().cancel()
            if _shown[0]:  # the status line goes: the user's own output starts on a clean line
                _shown[0] = False
                _write("\r\x1b[K")


def _schedule(seconds: float) -> None:
    """The next look at what compiles (the lock is held)."""
    timer = threading.Timer(seconds, _say)
    timer.daemon = True
    _timer[:] = [timer]
    timer.start()


def _terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def _say() -> None:
    """Past the threshold: the one line (a log), or the status line rewritten (a terminal)."""
    with _lock:
        if not _open or (_said[0] and not _terminal()):
            return
        text = _text(_open)
        if _terminal():  # one row: a wrapped line could not be rewritten in place
            _shown[0] = True
            _write(f"\r\x1b[K{_fitted(text, shutil.get_terminal_size().columns - 1)}")
            _schedule(REFRESH_SECONDS)
            return
        _said[0] = True
    _write(f"{text}\n")


def _text(open_now: list) -> str:
    """The outermost compile (a plan's first call) and, inside it, what compiles now."""
    what, start = open_now[0]
    inner = f" (now {open_now[-1][0]})" if len(open_now) > 1 else ""
    kept = "cached for later runs"
    if cache_health.any_unwritable():
        kept = "compiled in memory: the cache folder cannot be written"
    return (
        f"backplan: compiling {what}{inner}, {time.perf_counter() - start:.0f} s so far "
        f"({kept}; {_hint(open_now)})"
    )


def _hint(open_now: list) -> str:
    """How to skip it: the library's compiles go away with a prebuilt library, which this
    installation lacks (codegen/build/prebuilt_library.py)."""
    from backplan.codegen.build.prebuilt_library import prebuilt_folder, usable

    if any(what.startswith(LIBRARY) for what, _ in open_now) and not usable(prebuilt_folder()):
        return "`python -m backplan cache prebuild` compiles the library once ahead of time"
    return "BACKPLAN_VERBOSE=1 shows each stage"


def _fitted(text: str, width: int) -> str:
    """The line within `width` columns: the hint in parentheses goes first, then whole words
    (a cut word reads as a typo: '...BACKPLAN_VERB')."""
    if len(text) <= width:
        return text
    text = text[: text.rfind(" (")]  # the trailing parenthesis: what is kept, the hint
    if len(text) <= width:
        return text
    cut = text[: max(width - 3, 0)]
    return (cut[: cut.rfind(" ")] if " " in cut else cut) + "..."


def _write(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed at exit: the notice is not worth an error
        pass
