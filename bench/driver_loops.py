"""A compiled driver calling its loops by address (BACKPLAN_DRIVER_LOOPS=address,
codegen/build/loop_calls.py) against the same plan's driver inlining them (`linked`): the
driver's compile (thread CPU s) and the steady step, in one process, steps interleaved:
`taskset -c 1 python -m backplan.bench.driver_loops --models mlp_tiny cnn --rounds 7`.

Per model, each mode makes its own plan of `bp.value_and_grad(bp.compile(loss))` with the
driver compiled in the first call (BACKPLAN_DRIVER=inline) into an empty cache folder, so its
first call is Python-run loops' compile plus the driver's; the driver's own compile is then
timed again apart (a fresh dispatcher of the same source, its callees compiled already).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from .environment import cpu_name
from .measure import interleaved_medians

MODES = ("linked", "address")


def _plan_step(model: str, mode: str):
    """(a call of one step, its compiled plan) with the driver in `mode`."""
    from .models import value_and_grad_step

    os.environ["BACKPLAN_DRIVER_LOOPS"] = mode
    step, args = value_and_grad_step(model)
    step(*args)
    (runner,) = step.trace(*args).runners()
    return (lambda: step(*args)), runner.compiled


def _driver_compile_cpu(plan) -> float:
    """Thread CPU seconds of compiling the plan's driver again, its callees compiled."""
    import numba

    run = plan._compiled_run
    options = {k: v for k, v in run.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = numba.njit(**options, pipeline_class=run._compiler.pipeline_class)(run.py_func)
    start = time.thread_time()
    fresh.compile(run.signatures[0])
    return time.thread_time() - start


def measure(model: str, rounds: int, seconds: float) -> dict:
    os.environ["BACKPLAN_DRIVER"] = "inline"
    os.environ["BACKPLAN_CACHE_DIR"] = tempfile.mkdtemp()
    steps, compile_cpu, statements = {}, {}, None
    for mode in MODES:
        steps[mode], plan = _plan_step(model, mode)
        assert plan.driver_tier == "compiled", plan.driver_tier
        assert ("ADDRESS_DRIVER_JIT_OPTIONS" in plan.source) == (mode == "address")
        compile_cpu[mode] = round(_driver_compile_cpu(plan), 2)
        statements = plan._driver_statements
    step_ms = interleaved_medians(steps, rounds, seconds, settle=3)
    return {
        "model": model,
        "statements": statements,
        "driver_compile_cpu_s": compile_cpu,
        "step_ms": {k: round(v, 4) for k, v in step_ms.items()},
        "address_over_linked": round(step_ms["address"] / step_ms["linked"], 3),
        "cpu": cpu_name(),
        "load": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp_tiny", "cnn"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5, help="per step median")
    args = parser.parse_args(argv)
    for model in args.models:
        print(json.dumps(measure(model, args.rounds, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
