"""Where the user made something: the innermost user line, the few user frames around it, and
the public function they called.

A `SourceLoc` is a `(file, line)` tuple, so the IR, its text form and every pass treat it as the
plain location they always had; the extra facts ride along as attributes and are read only where
a person reads them (region names, "produced by", error messages).
"""

from __future__ import annotations

import os


class SourceLoc(tuple):
    """(file, line) of the innermost user frame, plus `stack` (innermost first: (function, file,
    line) of up to three user frames) and `api` (the public backplan function called there, or
    None when it is the primitive itself)."""

    stack: tuple[tuple[str, str, int], ...]
    api: str | None
    text: str

    def __new__(cls, stack: tuple[tuple[str, str, int], ...], api: str | None = None):
        _, file, line = stack[0]
        loc = super().__new__(cls, (file, line))
        loc.stack = stack
        loc.api = api
        loc.text = _stack_text(stack)  # made once: the tracer shares one SourceLoc per line
        return loc

    @property
    def key(self) -> tuple:
        """What tells two locations apart for a person: every frame shown, and the API name."""
        return (self.stack, self.api)


def _frame_text(frame: tuple[str, str, int]) -> str:
    return f"{os.path.basename(frame[1])}:{frame[2]}"


def loc_text(loc) -> str:
    """'seed.py:26 (via linear at seed.py:7)': the outermost user line recorded, then the user
    functions it went through down to the line that made the value."""
    if not loc:
        return "<unknown>"
    text = getattr(loc, "text", None)
    return text if text is not None else f"{os.path.basename(loc[0])}:{loc[1]}"


def _stack_text(stack: tuple[tuple[str, str, int], ...]) -> str:
    outer, inner = stack[-1], stack[-2::-1]
    text = _frame_text(outer)
    if inner:
        text += f" (via {', '.join(f'{f[0]} at {_frame_text(f)}' for f in inner)})"
    return text


def op_text(op: str, loc) -> str:
    """'matmul [reshape]': the public function the user called, with the primitive in brackets
    when they differ; the primitive alone when the user called it directly."""
    api = getattr(loc, "api", None)
    return op if api is None or api == op else f"{api} [{op}]"
