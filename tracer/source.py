"""Finding the user's own source: the first frames that are not backplan itself, walked once per
op, and the public backplan function the user called there."""

import sys
import sysconfig

from backplan.runtime.location import SourceLoc, loc_text

__all__ = ["user_frame_loc", "loc_text"]

MAX_USER_FRAMES = 3
_NOT_USER_DIRS = tuple(
    {
        sysconfig.get_paths()[k]
        for k in ("stdlib", "purelib", "platlib")
        if k in sysconfig.get_paths()
    }
)
_outside_user_code: dict[str, bool] = {}
_PLUMBING = frozenset({"apply", "fn"})  # dispatch and the generated elementwise wrappers


def _is_library(module_name: str) -> bool:
    if module_name.startswith("backplan.examples"):
        return False  # the demo models are user code
    return (
        module_name == "backplan"
        or module_name.startswith("backplan.")
        or module_name in ("contextlib", "functools")
    )


def _is_outside_user_code(filename: str) -> bool:
    """Frames of the standard library and installed packages (a test runner, runpy) end the
    user's stack: the user is not looking at them."""
    known = _outside_user_code.get(filename)
    if known is None:
        known = filename.startswith(_NOT_USER_DIRS) or filename.startswith("<frozen")
        _outside_user_code[filename] = known
    return known


def _public_name(name: str, current: str | None) -> str | None:
    """Library frames seen from the inside out; the outermost one with a public name is the
    function the user called (`mse_loss`, not the `mul` it calls)."""
    public = name.isidentifier() and not name.startswith("_") and name not in _PLUMBING
    return name if public else current


def user_frame_loc() -> SourceLoc | None:
    """The innermost user frame as a SourceLoc, with up to MAX_USER_FRAMES user frames around
    it (they stop at backplan's own frames, so a traced function's stack ends at its body) and
    the public function called from it."""
    frame = sys._getframe(1)
    api = None
    while frame is not None and _is_library(frame.f_globals.get("__name__", "")):
        api = _public_name(frame.f_code.co_name, api)
        frame = frame.f_back
    if frame is None:
        return None
    stack = []
    while frame is not None and len(stack) < MAX_USER_FRAMES:
        code = frame.f_code
        if stack and (
            _is_library(frame.f_globals.get("__name__", ""))
            or _is_outside_user_code(code.co_filename)
        ):
            break
        stack.append((code.co_name, code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return SourceLoc(tuple(stack), api)
