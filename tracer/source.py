"""Finding the user's own source line: the first frame that is not backplan itself."""

import os
import sys


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
