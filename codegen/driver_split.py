"""A plan's `run` driver as a chain of small compiled parts.

Numba's LLVM function passes, its lowering and its type inference cost more than linearly in the
length of one function: an unrolled 12-step LSTM's driver (about 900 statements) took minutes
to compile as one function, most of it optimising that one function. Split into parts of at most
`PART_STATEMENTS` statements, each its own compiled function, the cost grows with the plan's
length. `run` (compiled too: a plain Python `run` made an LSTM step 47% slower) calls the parts
in order; a part takes the names it reads that an earlier part (or
`run`'s arguments) defined, and returns the names it defines that a later part reads. A driver
short enough stays one function, exactly as before.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

PART_STATEMENTS = 48  # measured on the unrolled LSTM: 24, 48 and 96 cost alike per statement


@dataclass(frozen=True)
class DriverSource:
    source: str  # defines run (and run_part0... when split)
    statements: int  # top-level statements of the body
    parts: int  # 0 when run is one function


@dataclass
class _Part:
    statements: list[list[str]]  # source lines of each top-level statement
    reads: set  # names read before this part defines them
    defines: set


def driver_source(params: list[str], body: list[str], decorator: str) -> DriverSource:
    """Source defining `run(params)` doing `body`: one function, or a chain of parts."""
    statements = _statements(body)
    if len(statements) <= PART_STATEMENTS:
        return DriverSource(_function("run", params, body, decorator), len(statements), 0)
    parts = [
        _part(statements[i : i + PART_STATEMENTS])
        for i in range(0, len(statements), PART_STATEMENTS)
    ]
    available = set(params)
    sources, calls = [], []
    for index, part in enumerate(parts):
        later = set().union(*(p.reads for p in parts[index + 1 :]))
        arguments = sorted(part.reads & available)
        returned = sorted(part.defines & later)
        available |= part.defines
        lines = [line for statement in part.statements for line in statement]
        name = f"run_part{index}"
        last = index == len(parts) - 1
        if not last:
            lines.append(f"return ({''.join(r + ', ' for r in returned)})")
        sources.append(_function(name, arguments, lines, decorator))
        call = f"{name}({', '.join(arguments)})"
        if last:
            calls.append(f"return {call}")
        elif returned:
            calls.append(f"({''.join(r + ', ' for r in returned)}) = {call}")
        else:
            calls.append(call)
    sources.append(_function("run", params, calls, decorator))
    return DriverSource("\n\n".join(sources), len(statements), len(parts))


def _function(name: str, params: list[str], lines: list[str], decorator: str) -> str:
    header = f"{decorator}\ndef {name}({', '.join(params)}):\n"
    return header + "\n".join("    " + line for line in lines) + "\n"


def _statements(body: list[str]) -> list[list[str]]:
    """The body's top-level statements, each with the comment lines just above it."""
    tree = ast.parse("\n".join(body))
    statements, start = [], 0
    for node in tree.body:
        end = node.end_lineno
        statements.append(body[start:end])
        start = end
    if start < len(body) and statements:
        statements[-1] = statements[-1] + body[start:]  # trailing comments
    return statements


def _part(statements: list[list[str]]) -> _Part:
    reads, defines = set(), set()
    for lines in statements:
        node = ast.parse("\n".join(lines))
        names = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
        reads |= {n.id for n in names if isinstance(n.ctx, ast.Load)} - defines
        defines |= {n.id for n in names if isinstance(n.ctx, ast.Store)}
    return _Part(statements, reads, defines)
