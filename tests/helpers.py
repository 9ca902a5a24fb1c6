"""Small shared helpers for tests."""

import inspect
import os


def line_of(marker: str, path: str) -> int:
    """Line number of the first line in path containing marker (so tests need no magic numbers)."""
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if marker in line:
                return number
    raise AssertionError(f"{marker!r} not in {path}")


def here(offset: int = 0) -> str:
    """file:line of the caller (plus offset lines), in backplan's location format."""
    frame = inspect.currentframe().f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno + offset}"
