"""A size-generic driver: every number in the driver's code becomes a read of one of two
arrays it takes (`lit_i` for integers, `lit_f` for floats), so the plans of one symbolic plan
(ir/symbolic.py) at different sizes render one driver source, compiled once, and each size
passes its own sizes, offsets and scales. Comments and strings are left as they are; the
kernels the driver calls already take every size as an argument.

>>> body, ints, floats = lift_literals(["k_1(v0, np.intp(12), np.float32(0.05))"])
>>> body, ints, floats
(['k_1(v0, np.intp(lit_i[0]), np.float32(lit_f[0]))'], [12], [0.05])
"""

from __future__ import annotations

import re

INTS = "lit_i"
FLOATS = "lit_f"


# A string or a comment (left as they are), or a numeric literal (not part of a name).
_TOKEN = re.compile(
    r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')|(#[^\n]*)"""
    r"|(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)(?![\w.])"
)


def lift_literals(body: list[str]) -> tuple[list[str], list[int], list[float]]:
    """The body with its numeric literals replaced by reads of lit_i / lit_f, and their
    values in order (a regular expression, not the tokenizer: a transformer's driver has
    thousands of tokens and this runs once per batch size)."""
    ints: list[int] = []
    floats: list[float] = []

    def lift(match: re.Match) -> str:
        number = match.group(3)
        if number is None:
            return match.group(0)
        if number.isdigit():
            ints.append(int(number))
            return f"{INTS}[{len(ints) - 1}]"
        floats.append(float(number))
        return f"{FLOATS}[{len(floats) - 1}]"

    if not body or any("\n" in line for line in body):
        return [_TOKEN.sub(lift, line) for line in body], ints, floats
    # one pass over the whole body (no token spans a line: a quarter less than line by line)
    return _TOKEN.sub(lift, "\n".join(body)).split("\n"), ints, floats


def code_text(source: str) -> str:
    """The source without its comment lines: what two renderings must share to share a
    compiled driver (comments show the sizes of the plan rendered first)."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
