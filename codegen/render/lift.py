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

import io
import tokenize

INTS = "lit_i"
FLOATS = "lit_f"


def lift_literals(body: list[str]) -> tuple[list[str], list[int], list[float]]:
    """The body with its numeric literals replaced by reads of lit_i / lit_f, and their
    values in order."""
    text = "\n".join(body) + "\n"
    replacements = []
    ints: list[int] = []
    floats: list[float] = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type != tokenize.NUMBER:
            continue
        value = eval(token.string)  # noqa: S307 - a NUMBER token of our own generated code
        if isinstance(value, int):
            name = f"{INTS}[{len(ints)}]"
            ints.append(value)
        elif isinstance(value, float):
            name = f"{FLOATS}[{len(floats)}]"
            floats.append(value)
        else:
            continue
        replacements.append((token.start, token.end, name))
    lines = text.split("\n")
    for (row, start), (end_row, end), name in reversed(replacements):
        assert row == end_row  # a number token never spans lines
        line = lines[row - 1]
        lines[row - 1] = line[:start] + name + line[end:]
    return lines[:-1], ints, floats


def code_text(source: str) -> str:
    """The source without its comment lines: what two renderings must share to share a
    compiled driver (comments show the sizes of the plan rendered first)."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
