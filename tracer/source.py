"""Finding the user's own source line: the first frame that is not backplan itself."""

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar


def _is_library(module_name: str) -> bool:
    if module_name.startswith("backplan.examples"):
        return False  # the demo models are user code
    return (
        module_name == "backplan"
        or module_name.startswith("backplan.")
        or module_name in ("contextlib", "functools")
    )


def user_frame_loc() -> tuple[str, int] | None:
    frame = sys._getframe(1)
    while frame is not None:
        if not _is_library(frame.f_globals.get("__name__", "")):
            return (frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def loc_text(loc) -> str:
    return f"{os.path.basename(loc[0])}:{loc[1]}" if loc else "<unknown>"


_LOCATED = ("ShapeError", "DtypeError", "BackplanError")
_depth = threading.local()


F = TypeVar("F", bound=Callable[..., Any])


def located(fn: F) -> F:
    """Public ops raise ShapeError and DtypeError naming the op the user called and the user's
    line, as errors from the graph builder do. Only the outermost op call (mean, not the sum it
    calls) rewrites the message, and only when the line is not in it yet."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if depth or type(exc).__name__ not in _LOCATED:
                raise
            raise _with_location(exc, name) from None
        finally:
            _depth.value = depth

    return wrapper  # type: ignore[return-value]


def _with_location(exc: Exception, name: str) -> Exception:
    loc = user_frame_loc()
    message = str(exc)
    if loc is None or f"{loc[0]}:{loc[1]}" in message or loc_text(loc) in message:
        return exc
    if not message.startswith(f"{name}(") and not message.startswith(f"{name}:"):
        message = f"{name}: {message}"
    return type(exc)(f"{message} at {loc_text(loc)}")
