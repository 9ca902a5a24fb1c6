"""A guard against host randomness while tracing: `np.random.*` or `random.*` called inside a
traced function would run once, at trace time, and its numbers would be frozen into the plan as
constants (the same dropout mask on every call). While any thread traces, those module functions
are replaced by wrappers that raise TracingError in the tracing thread and pass through in every
other thread; the originals come back when the last trace ends.

Names imported before tracing (`from numpy.random import normal`) and Generator objects made
before tracing are not seen; the fix the error shows applies to them all the same.
"""

from __future__ import annotations

import functools
import random
import threading

import numpy as np

from .errors import TracingError

_lock = threading.Lock()
_depth = 0
_originals: dict[tuple[object, str], object] = {}

FIX = (
    "its numbers would be drawn once, while tracing, and frozen into the plan as constants (the "
    "same values on every call). Use bp.random instead: pass key = bp.random.key(seed) as an "
    "argument, draw with bp.random.normal(key, shape), bp.random.uniform(...), "
    "bp.random.bernoulli(...) or bp.dropout(x, rate, key), and make a fresh key for each call "
    "with bp.random.split(key)"
)


def _targets() -> list[tuple[object, str, str]]:
    """(module, attribute, dotted name) of every host random function worth guarding."""
    found = []
    for name in dir(np.random):
        value = getattr(np.random, name)
        if not name.startswith("_") and callable(value) and not isinstance(value, type):
            found.append((np.random, name, f"np.random.{name}"))
    for name in dir(random):
        value = getattr(random, name)
        if not name.startswith("_") and getattr(value, "__self__", None) is random._inst:
            found.append((random, name, f"random.{name}"))
    return found


def _guard(original, dotted: str, is_tracing):
    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if is_tracing():
            raise TracingError(f"{dotted}() was called while tracing: {FIX}")
        return original(*args, **kwargs)

    return guarded


def enter(is_tracing) -> None:
    """Install the guards (once for all nested and concurrent traces)."""
    global _depth
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        for module, name, dotted in _targets():
            original = getattr(module, name)
            _originals[(module, name)] = original
            setattr(module, name, _guard(original, dotted, is_tracing))


def leave() -> None:
    """Remove the guards when the last trace ends."""
    global _depth
    with _lock:
        _depth -= 1
        if _depth > 0:
            return
        for (module, name), original in _originals.items():
            setattr(module, name, original)
        _originals.clear()
