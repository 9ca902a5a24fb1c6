"""A plan's compiled driver: its compile time and its step, with library functions called by
address (codegen/build/native_calls.py, what backplan builds) against the same driver with
every callee linked into it (the driver before), in one process, interleaved:
`taskset -c 1 python -m backplan.bench.driver_compile --model cnn_digits [--rounds 4]`.

Compile times are given in wall and in the compiling thread's CPU seconds: on a shared machine
the CPU seconds are what compare. The model's first call runs the driver as Python (its
kernels and library functions compile then, as in a script's first call); each round then
compiles the driver afresh both ways
(nothing from the disk cache for `run` itself; callees are compiled already, as in a build
process after the first calls) and times steps of each in turn. Models: `cnn_digits` (the
example's training step, batch 32) or any bench model's value_and_grad step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types

from . import internals
from .environment import cpu_name
from .measure import interleaved_medians


def _step(model: str):
    """A function taking no argument that runs one training step of the model."""
    import backplan as bp

    if model != "cnn_digits":
        from .models import value_and_grad_step

        fn, args = value_and_grad_step(model)
        return lambda: fn(*args)
    from backplan.examples import cnn_digits as digits

    key, init_key = bp.random.split(bp.random.key(0))
    params = digits.init_params(init_key)
    x_train, y_train, _, _ = digits.load_digits_split(seed=0)
    x, y = bp.tensor(x_train[:32]), bp.tensor(y_train[:32])
    state = [params, digits.OPTIMIZER.init(params), key]

    def step():
        *state[:], _ = digits.train_step(*state[:2], x, y, state[2])

    return step


def _first_plan(model: str):
    """(step, its plan, the driver's argument types): the first call runs the Python-run
    driver and hands the build this process would start to us instead."""
    driver_tier = internals.driver_tier
    captured = []
    driver_tier.worth_compiling = lambda *_: True  # a build for every plan, the mlp's too
    internals.compiled_plan._build_driver = lambda plan, kinds, label: captured.append(
        (plan, driver_tier.numba_signature(kinds))
    )
    step = _step(model)
    step()
    return step, *captured[0]


def fresh_driver(run, linked: bool):
    """A new dispatcher of the plan's driver: as built (library by address) or linked."""
    import numba

    scope = run.py_func.__globals__
    if linked:
        scope = {k: internals.native_calls.unwrapped(v) for k, v in scope.items()}
    function = types.FunctionType(run.py_func.__code__, scope, "run")
    options = {k: v for k, v in internals.JIT_OPTIONS.items() if k != "cache"}
    return numba.njit(**options, pipeline_class=run._compiler.pipeline_class)(function)


def measure(model: str, rounds: int, seconds: float) -> dict:
    os.environ["BACKPLAN_DRIVER"] = "background"
    step, plan, signature = _first_plan(model)
    run = plan._compiled_run
    compile_s: dict[str, list] = {"linked": [], "by address": []}
    cpu_s: dict[str, list] = {"linked": [], "by address": []}
    drivers = {}
    for r in range(rounds):
        for name in list(compile_s)[:: 1 if r % 2 == 0 else -1]:
            driver = fresh_driver(run, name == "linked")
            start, cpu = time.perf_counter(), time.thread_time()
            driver.compile(signature)
            compile_s[name].append(round(time.perf_counter() - start, 2))
            cpu_s[name].append(round(time.thread_time() - cpu, 2))
            drivers[name] = driver

    def tier(driver):
        def call():
            plan._run = driver
            step()

        return call

    plan.driver_tier = "compiled"
    step_ms = interleaved_medians({k: tier(d) for k, d in drivers.items()}, 2 * rounds, seconds)
    return {
        "model": model,
        "statements": plan._driver_statements,
        "compile_s": compile_s,
        "compile_median_s": {k: statistics.median(v) for k, v in compile_s.items()},
        "compile_cpu_s": cpu_s,  # the compile's own CPU time: what a busy machine does not stretch
        "compile_cpu_median_s": {k: statistics.median(v) for k, v in cpu_s.items()},
        "step_ms": step_ms,
        "cpu": cpu_name(),
        "load": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn_digits")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=1.0, help="per step median")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.model, args.rounds, args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
