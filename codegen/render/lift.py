"""A size-generic driver: every number in the driver's code becomes a read of one of two
arrays it takes (`lit_i` for integers, `lit_f` for floats), so the plans of one symbolic plan
(ir/symbolic.py) at different sizes render one driver source, compiled once, and each size
passes its own sizes, offsets and scales. Strings are left as they are; a comment (the IR line
above each statement) keeps its value names but shows every number as `n`: with the sizes in
them, a process whose first size was another rendered other text for the same cache entry,
which rewrote the file, and Numba, whose index is stamped with the file, compiled the driver
again (a loaded dynamic artifact at 4,000 rows after one at 1,000: 30-70 s). The kernels the
driver calls already take every size as an argument.

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
    if not body or any("\n" in line for line in body):
        return [_lifted(line, ints, floats) for line in body], ints, floats
    # one pass over the whole body (no token spans a line: a quarter less than line by line)
    return _lifted("\n".join(body), ints, floats).split("\n"), ints, floats


def _lifted(text: str, ints: list[int], floats: list[float]) -> str:
    """The text lifted, its numbers appended to ints and floats. re.split hands back each
    match's three groups between the texts around it: no match object and no call per
    literal (0.64 against 0.72 ms a transformer's driver, 6.6 against 9.9 an unrolled
    LSTM's)."""
    parts = _TOKEN.split(text)  # text, string, comment, number, text, string, ...
    for k in range(3, len(parts), 4):
        number = parts[k]
        if number is None:  # a string, kept as it is, or a comment, its numbers hidden
            string = parts[k - 2]
            parts[k] = string if string is not None else _sizeless(parts[k - 1])
        elif number.isdigit():
            parts[k] = f"{INTS}[{len(ints)}]"
            ints.append(int(number))
        else:
            parts[k] = f"{FLOATS}[{len(floats)}]"
            floats.append(float(number))
        parts[k - 2] = parts[k - 1] = ""
    return "".join(parts)


# A number in a comment that is not part of a name (%12, f32): the IR line's sizes and scales.
_COMMENT_NUMBER = re.compile(r"(?<![%\w.])(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w])")


def _sizeless(comment: str) -> str:
    return _COMMENT_NUMBER.sub("n", comment)


def code_text(source: str) -> str:
    """The source without its comment lines: what two renderings must share to share a
    compiled driver (comments show the sizes of the plan rendered first)."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
