"""Measured seconds of each call a compiled plan's driver makes (report.save_trace's times).

The plan's driver source has one top-level statement per kernel, GEMM or library call. While
measured, a plan runs that source as Python (the same compiled kernels it always calls, as the
Python-run driver tier of codegen/build/driver_tier.py does) with a perf_counter reading
before each statement that calls a function by name and one at the end: each call's seconds
are the readings' differences. Views and reshapes between calls count with the call after
them; a driver split into parts (run_part_i) is read part by part."""

from __future__ import annotations

import ast
import sys

from backplan.codegen.build import driver_tier
from backplan.codegen.run import address_calls

STAMP = "_kernel_time_stamp"  # the reading each timed statement is preceded by


def _calls_by_name(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Expr | ast.Assign):
        call = statement.value
        return (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and not call.func.id.startswith("run_part")
        )
    return False


def _reading() -> ast.stmt:
    return ast.Expr(ast.Call(ast.Name(STAMP, ast.Load()), [], []))


def timed_source(source: str) -> tuple[str, int]:
    """(the driver's functions with a reading before each call by name, and one at the end
    of `run`; how many calls are timed)."""
    tree = ast.parse(source)
    timed = 0
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        if node.name != "run" and not node.name.startswith("run_part"):
            continue
        node.decorator_list = []
        body = []
        for statement in node.body:
            if node.name == "run" and isinstance(statement, ast.Return):
                body.append(_reading())
            elif _calls_by_name(statement):
                body.append(_reading())
                timed += 1
            body.append(statement)
        if node.name == "run" and not isinstance(body[-1], ast.Return):
            body.append(_reading())
        node.body = body
    ast.fix_missing_locations(tree)
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    return "\n\n".join(ast.unparse(f) for f in functions), timed


def timed_driver(plan, stamp):
    """A stand-in for `plan`'s driver (a codegen/run/compiled.py CompiledPlan) calling `stamp`
    (which takes a reading) before each call by name and at the end."""
    module = sys.modules[plan._compiled_run.__module__]
    source, _ = timed_source(plan.source)
    scope = driver_tier.python_scope(module)
    scope[STAMP] = stamp
    exec(compile(source, f"<timed {plan.plan.graph.name}>", "exec"), scope)
    return address_calls.with_addresses(scope["run"])
