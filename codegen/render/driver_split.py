"""A plan's `run` driver as a chain of small compiled parts.

Numba's lowering, type inference and LLVM passes cost more than linearly in the length of one
function: an unrolled 12-step LSTM's driver (about 900 statements) took minutes to compile as one
function. Split into parts of at most `PART_STATEMENTS` statements, each its own compiled
function, the cost grows with the plan's length. A driver of at most `SPLIT_ABOVE` statements
stays one function, exactly as before: below that, linking the kernels again into every part
costs more than it saves. `run` (compiled too: a plain Python `run` made an LSTM step 47%
slower) calls the parts in order; a part takes the names it reads that an earlier part (or
`run`'s arguments) defined, and returns the names it defines that a later part reads.
"""

from __future__ import annotations

import ast
import keyword
import re
from dataclasses import dataclass

# Measured (2-core box, cold cache): mlp_deep's ~380-statement driver compiles faster as one
# function (28 s) than in parts (41-45 s: each part, and `run`, links and optimises again the
# kernels it calls); an unrolled 12-step LSTM's ~900 statements in 48-statement parts: 362 s ->
# 89 s. Parts of 24, 48 or 96 statements cost alike per statement.
SPLIT_ABOVE = 600  # statements
PART_STATEMENTS = 48


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
    counted = _first_lines(body)
    if counted is not None and counted <= max(SPLIT_ABOVE, PART_STATEMENTS):
        return DriverSource(_function("run", params, body, decorator), counted, 0)
    statements = _statements(body)
    if len(statements) <= max(SPLIT_ABOVE, PART_STATEMENTS):
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


def _first_lines(body: list[str]) -> int | None:
    """The body's top-level statements counted off their first lines, which alone start at
    column 0 (comments, blank lines, block bodies and continuations do not); None where a `;`
    may put two on one line. Parsing the body (_statements) cost an unrolled 12-step LSTM's
    warm first call 70 ms of 400, for a driver too short to split."""
    if any(";" in line for line in body):
        return None
    return sum(1 for line in body if line[:1] not in ("", " ", "\t", "#", ")", "]", "}"))


def _function(name: str, params: list[str], lines: list[str], decorator: str) -> str:
    """A function of these lines; `pass` where they hold no statement (a plan whose outputs
    are all literals or views runs no kernel: its driver has nothing to do)."""
    header = f"{decorator}\ndef {name}({', '.join(params)}):\n"
    if not any(line.strip() and not line.lstrip().startswith("#") for line in lines):
        lines = [*lines, "pass"]
    return header + "\n".join("    " + line for line in lines) + "\n"


def _statements(body: list[str]) -> list[tuple[list[str], ast.stmt, str]]:
    """The body's top-level statements, each with the comment lines just above it, its parsed
    form and its last line (the body is parsed once: parsing each statement again cost an
    unrolled 48-step LSTM's first call a tenth of a second)."""
    tree = ast.parse("\n".join(body))
    statements, start = [], 0
    for node in tree.body:
        end = node.end_lineno
        statements.append((body[start:end], node, body[end - 1]))
        start = end
    if start < len(body) and statements:
        lines, node, line = statements[-1]
        statements[-1] = (lines + body[start:], node, line)  # trailing comments
    return statements


def _part(statements: list[tuple[list[str], ast.stmt, str]]) -> _Part:
    reads, defines = set(), set()
    for _, node, line in statements:
        loads, stores = _simple_names(line, node) or _names(node)
        reads |= loads - defines
        defines |= stores
    return _Part([lines for lines, _, _ in statements], reads, defines)


def _names(node: ast.stmt) -> tuple[set, set]:
    """(names read, names written) by a statement."""
    names = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
    return (
        {n.id for n in names if isinstance(n.ctx, ast.Load)},
        {n.id for n in names if isinstance(n.ctx, ast.Store)},
    )


_IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z_]\w*")
_NOT_NAMES = frozenset(("True", "False", "None"))


def _simple_names(line: str, node: ast.stmt) -> tuple[set, set] | None:
    """_names of a one-line call or assignment to names (`line`), read off its text; None for
    any other statement. Nearly every statement of a driver is one, and walking their syntax
    trees cost an unrolled 48-step LSTM's first call a fifth of a second."""
    if node.lineno != node.end_lineno or node.col_offset or not line.isascii():
        return None
    if isinstance(node, ast.Assign):
        targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        if not all(isinstance(t, ast.Name) for t in targets):
            return None
        stores = {t.id for t in targets}
        _, assigned, text = line.partition(" = ")
        if not assigned:
            return None
    elif isinstance(node, ast.Expr):
        stores, text = set(), line
    else:
        return None
    if any(c in text for c in "=#;'\""):
        return None  # keyword arguments, strings, comments, two statements: the tree knows
    loads = set(_IDENTIFIER.findall(text)) - _NOT_NAMES
    if any(keyword.iskeyword(name) for name in loads):
        return None
    return loads, stores
