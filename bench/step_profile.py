"""Where a bench model's compiled step spends its time, call by call (issue 36's "profile by
kernel": no sampling profiler runs on the shared box).

The plan's driver source (one top-level statement per kernel or library call, the IR line it
computes as a comment above it) is compiled again with the core's cycle counter read before
every statement that calls a function by name (a loop kernel, a GEMM, a row kernel) and once at
the end, then called with the arguments of a captured step. Per call: the median over steps of
the cycles up to the next reading, in microseconds (the counter's rate measured against
perf_counter), and for a GEMM whose call names its sizes (own_gemm_at, narrow_gemm_at,
gemm_at_*) its rate.
Views and reshapes between calls count with the call after them. The profiled driver computes
what the plan's driver computes (tests/test_bench_step_profile.py): it is the same source with
readings added.

    python -m backplan.bench.step_profile --model mlp --threads 1 --steps 300
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from .threads import apply_threads

STAMPS = "_ts"  # the argument the profiled driver writes its readings to
# the index of m (then n, k) in a GEMM call
_GEMM_SIZES = {"own_gemm_at": 3, "own_gemm_at_par": 3, "narrow_gemm_at": 2}


@intrinsic
def cycles(typingctx):
    """The core's time-stamp counter (llvm.readcyclecounter: RDTSC on x86)."""

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic(
            "llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), [])
        )
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(nogil=True)
def _read_cycles():
    return cycles()


@dataclass
class Call:
    """One timed statement of the driver."""

    statement: str  # its source, as generated
    ir_lines: tuple[str, ...]  # the IR lines it computes (its comments since the call before)
    flops: int  # 2 m n k for a GEMM call that names its sizes, else 0


def _calls_by_name(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Expr | ast.Assign):
        call = statement.value
        return isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
    return False


def _gemm_flops(call: ast.Call) -> int:
    name = call.func.id
    first = _GEMM_SIZES.get(name, 2 if name.startswith("gemm_at_") else None)
    if first is None:
        return 0
    sizes = []
    for arg in call.args[first : first + 3]:
        inner = arg.args[0] if isinstance(arg, ast.Call) and arg.args else arg
        if not isinstance(inner, ast.Constant) or not isinstance(inner.value, int):
            return 0
        sizes.append(inner.value)
    return 2 * int(np.prod(sizes)) if len(sizes) == 3 else 0


def _ir_lines(lines: list[str], start: int, end: int) -> tuple[str, ...]:
    """The IR comments ("# %...") on lines start..end-1 (0-based): what the call computes."""
    return tuple(x.strip()[2:] for x in lines[start:end] if x.strip().startswith("# %"))


def timed_source(source: str) -> tuple[str, list[Call]]:
    """(source of `run` with a reading before each call by name and one at the end, the
    calls in order). The readings go to the extra last argument STAMPS."""
    tree = ast.parse(source)
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    lines = source.splitlines()
    run.args.args.append(ast.arg(arg=STAMPS))
    run.decorator_list = []
    body, calls, after_last = [], [], run.lineno

    def stamp():
        index = ast.Constant(len(calls))
        target = ast.Subscript(ast.Name(STAMPS, ast.Load()), index, ast.Store())
        reading = ast.Call(ast.Name("_cycles", ast.Load()), [], [])
        return ast.Assign([target], reading, lineno=0)

    for statement in run.body:
        if isinstance(statement, ast.Return):
            body.append(stamp())
            calls.append(None)
        elif _calls_by_name(statement):
            body.append(stamp())
            calls.append(
                Call(
                    lines[statement.lineno - 1].strip(),
                    _ir_lines(lines, after_last, statement.lineno - 1),
                    _gemm_flops(statement.value),
                )
            )
            after_last = statement.end_lineno
        body.append(statement)
    if not body or not isinstance(body[-1], ast.Return):
        body.append(stamp())
        calls.append(None)
    run.body = body
    ast.fix_missing_locations(run)
    return ast.unparse(run), [c for c in calls if c is not None]


def profiled_driver(compiled_plan):
    """The plan's driver with readings (timed_source), compiled in its module's scope."""
    source, calls = timed_source(compiled_plan.source)
    scope = dict(sys.modules[compiled_plan._compiled_run.__module__].__dict__)
    scope["_cycles"] = cycles
    exec(compile(source, f"<profiled {compiled_plan.plan.graph.name}>", "exec"), scope)
    return njit(nogil=True)(scope["run"]), calls


def captured_arguments(step, args) -> tuple[object, list]:
    """(the compiled plan, the arrays its driver was called with) from one more call of a
    value_and_grad step; arrays the call handed back read-only are copied writeable."""
    (runner,) = step.trace(*args).runners()
    plan = getattr(runner, "compiled", None)
    if plan is None:
        raise RuntimeError(
            f"step_profile: the step ran on {type(runner).__name__}, not a compiled plan "
            "(BACKPLAN_BACKEND=numba profiles the compiled one)"
        )
    seen, driver = {}, plan._run

    def capture(*arrays):
        seen["arrays"] = arrays
        return driver(*arrays)

    plan._run = capture
    try:
        step(*args)
    finally:
        plan._run = driver
    if "arrays" not in seen:
        raise RuntimeError(
            "step_profile: the step did not call its plan's driver (a direct driver ran "
            "instead); run with BACKPLAN_DIRECT_DRIVER=0"
        )
    arrays = [
        a.copy() if isinstance(a, np.ndarray) and not a.flags.writeable else a
        for a in seen["arrays"]
    ]
    return plan, arrays


def counter_ghz() -> float:
    """Cycle-counter ticks per nanosecond, against perf_counter over 0.2 s."""
    start_ticks, start = _read_cycles(), time.perf_counter()
    time.sleep(0.2)
    return (_read_cycles() - start_ticks) / (time.perf_counter() - start) / 1e9


def profile(model: str, steps: int) -> tuple[list[Call], np.ndarray, np.ndarray]:
    """(calls, median microseconds per call, microseconds from the first reading to the last
    of each step: preemptions by other processes included)."""
    from .models import value_and_grad_step

    step, args = value_and_grad_step(model)
    for _ in range(3):
        step(*args)
    plan, arrays = captured_arguments(step, args)
    driver, calls = profiled_driver(plan)
    readings = np.zeros(len(calls) + 1, np.int64)
    for _ in range(5):
        driver(*arrays, readings)
    per_step = np.zeros((steps, len(calls)), np.int64)
    whole = np.zeros(steps)
    for i in range(steps):
        driver(*arrays, readings)
        per_step[i] = np.diff(readings)
        whole[i] = readings[-1] - readings[0]
    ghz = counter_ghz()
    return calls, np.median(per_step, axis=0) / ghz / 1e3, whole / ghz / 1e3


def print_profile(model: str, calls: list[Call], us: np.ndarray, whole_us: np.ndarray) -> None:
    print(
        f"{model}: {len(calls)} calls; sum of their medians {us.sum():.1f} us; whole step "
        f"min {whole_us.min():.1f}, median {np.median(whole_us):.1f} us"
    )
    for call, took in zip(calls, us, strict=True):
        rate = f"{call.flops / took / 1e3:6.1f} GFLOP/s" if call.flops else " " * 14
        more = f" (+{len(call.ir_lines) - 1})" if len(call.ir_lines) > 1 else ""
        what = (call.ir_lines[0] + more) if call.ir_lines else ""
        print(f"{took:9.1f} us {100 * took / us.sum():5.1f}%  {rate}  {call.statement[:40]:40s}  "
              f"{what[:60]}")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    options = parser.parse_args(argv)
    apply_threads(options.threads)
    calls, us, whole = profile(options.model, options.steps)
    print_profile(options.model, calls, us, whole)
    return 0


if __name__ == "__main__":
    sys.exit(main())
