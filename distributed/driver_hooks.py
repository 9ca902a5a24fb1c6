"""The joint plan's compiled driver with the exchange inside it: after the driver statement that
last touches a bucket's gradient buffers, a call starting that bucket's allreduce, and after
every later call a test of the started ones (MPI progresses them only inside MPI calls). The
driver's other statements are unchanged: the same kernels in the same order, no cut in the
plan, no fusion lost. Pure text work on the generated source, so explain() can show where each
allreduce starts without MPI or a compile."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

DECORATOR = "@njit(**JIT_OPTIONS)\ndef run("
TABLE = "dp_table"
IMPORT = "from backplan.distributed.driver_mpi import dp_progress, {start} as dp_start\n"
_IR_NAME = re.compile(r"^\s*# %(\d+) = ")


@dataclass(frozen=True)
class HookedDriver:
    source: str  # the module, its `run` taking TABLE after the plan driver's arguments
    start_after: tuple[int, ...]  # per bucket: the driver statement its allreduce starts after
    ir_names: tuple[tuple[int, ...], ...]  # per bucket: IR values (%N) that statement computes
    calls_after: tuple[int, ...]  # per bucket: driver calls that run while it is in flight


def hook_driver(
    source: str, buffer_names: list[list[str]], start: str = "dp_start"
) -> HookedDriver | None:
    """source with each bucket's start and the progress tests placed; buffer_names: per bucket,
    the driver's parameters (output buffers) holding its leaves; start: the driver_mpi function
    that starts a bucket for this MPI's handle width (its name is in the source, so drivers
    for two MPIs are cached apart). None when the driver is split into parts
    (codegen/render/driver_split.py) or has no single `run` to hook."""
    at = source.find(DECORATOR)
    if at < 0 or "def run_part0(" in source or source.count("\ndef run(") != 1:
        return None
    head, function = source[:at], source[at:]
    lines = function.split("\n")
    signature, body = lines[1], [line[4:] for line in lines[2:]]
    statements = _statements(body)
    if not statements:
        return None
    starts = [_last_touch(statements, set(names)) for names in buffer_names]
    ends_in_return = isinstance(statements[-1][1], ast.Return)
    final = len(statements) - (2 if ends_in_return else 1)  # hooks go before a return
    if final < 0:
        return None
    starts = [min(final, s) if s >= 0 else final for s in starts]
    first = min(starts)
    out = []
    calls_after = [0] * len(starts)
    for i, (text, node) in enumerate(statements):
        is_return = isinstance(node, ast.Return)
        out += text
        out += [f"dp_start({TABLE}, {k})" for k, s in enumerate(starts) if s == i]
        if i > first and not is_return and _is_call(node):
            out.append(f"dp_progress({TABLE})")
            for k, s in enumerate(starts):
                calls_after[k] += s < i
    new_signature = signature[: signature.rindex(")")] + f", {TABLE}):"
    function = "\n".join(["@njit(**JIT_OPTIONS)", new_signature] + ["    " + x for x in out])
    ir_names = tuple(tuple(_ir_names(statements[s][0])) for s in starts)
    hooked = head + IMPORT.format(start=start) + "\n" + function + "\n"
    return HookedDriver(hooked, tuple(starts), ir_names, tuple(calls_after))


def _statements(body: list[str]) -> list[tuple[list[str], ast.stmt]]:
    """The body's top-level statements, each with the comment lines just above it."""
    while body and not body[-1].strip():
        body = body[:-1]
    tree = ast.parse("\n".join(body))
    found, start = [], 0
    for node in tree.body:
        found.append((body[start : node.end_lineno], node))
        start = node.end_lineno
    if found and start < len(body):
        found[-1] = (found[-1][0] + body[start:], found[-1][1])
    return found


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _view_base(value: ast.AST) -> str | None:
    """The array a view expression (x.reshape(...), x[...], chains of them) is a view of."""
    while True:
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            value = value.func.value
        elif isinstance(value, ast.Subscript):
            value = value.value
        elif isinstance(value, ast.Name):
            return value.id
        else:
            return None


def _last_touch(statements, tracked: set[str]) -> int:
    """The last statement reading or writing a tracked buffer or a view of one (a view
    defined from a tracked name is tracked from then on); -1 when none does."""
    last = -1
    for i, (_, node) in enumerate(statements):
        if _names(node) & tracked:
            last = i
            if isinstance(node, ast.Assign) and _view_base(node.value) in tracked:
                tracked |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return last


def _is_call(node: ast.stmt) -> bool:
    """A statement that runs a kernel (a call, or an assignment of one's result): worth a test
    of the started allreduces after it; view definitions are not."""
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Call)
    if isinstance(node, ast.Assign):
        return isinstance(node.value, ast.Call) and _view_base(node.value) is None
    return False


def _ir_names(text: list[str]) -> list[int]:
    return [int(m.group(1)) for line in text if (m := _IR_NAME.match(line))]
