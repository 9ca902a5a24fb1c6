"""How soon a script reaches its steady step time:
`python -m backplan.bench.first_minute [--models mlp_tiny mlp transformer] [--seconds 30]`.

Per model, a fresh process with an empty kernel cache folder (the library's compiled functions
are shared in one folder, filled by a first untimed process, as after an installation's first
use) makes `bp.value_and_grad(bp.compile(loss))` and steps it for `--seconds` of wall time from
the first call. Reported: the cold first call, the median step of calls 2-6 (what a short
script gets), the steady step (median of the last tenth of the steps), the first step within
10% of the steady one, and the wall time from the first call to it; and the first step the
compiled driver ran, with the wall time to it (None when it never ran: then "steady" is the
Python-run driver's speed, not compiled speed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from .child import child_result
from .environment import cpu_name

CHILD = r"""
import json, sys, time
from backplan.bench.models import value_and_grad_step
step, args = value_and_grad_step(sys.argv[1])
limit = float(sys.argv[2])
rows = []
compiled = None
start = time.perf_counter()
while not rows or time.perf_counter() - start < limit:
    a = time.perf_counter()
    step(*args)
    rows.append((a - start, time.perf_counter() - a))
    if compiled is None and step.driver_tier == "compiled":
        compiled = len(rows) - 1
print(json.dumps({"rows": rows, "tier": step.driver_tier, "compiled_step": compiled}))
"""


def run_child(model: str, seconds: float, env: dict) -> dict:
    command = [sys.executable, "-I", "-c", CHILD, model, str(seconds)]
    return child_result(command, env, seconds + 900, "first-minute child")


def summary(model: str, result: dict) -> dict:
    rows = result["rows"]
    times = sorted(t for _, t in rows[-max(3, len(rows) // 10) :])
    steady = times[len(times) // 2]
    early = sorted(t for _, t in rows[1:6]) or [steady]
    fast = next(i for i, (_, t) in enumerate(rows) if t <= 1.1 * steady)
    return {
        "model": model,
        "first_call_s": round(rows[0][1], 3),
        "early_step_ms": round(early[len(early) // 2] * 1e3, 3),
        "steady_step_ms": round(steady * 1e3, 3),
        "steps": len(rows),
        "first_steady_step": fast,
        "wall_to_steady_s": round(rows[fast][0] + rows[fast][1], 3),
        "tier_at_end": result["tier"],
        # The first step run by the compiled driver and the wall time to its end; None: none
        # was (a driver kept as Python by choice, or a build not done when the run ended: then
        # the "steady" step above is the Python-run driver's).
        "compiled_step": result.get("compiled_step"),
        "wall_to_compiled_s": _wall_to(rows, result.get("compiled_step")),
    }


def _wall_to(rows: list, index: int | None) -> float | None:
    return None if index is None else round(rows[index][0] + rows[index][1], 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp_tiny", "mlp", "transformer"])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    library = tempfile.mkdtemp(prefix="backplan-library-")
    base = {**os.environ, "BACKPLAN_LIBRARY_CACHE_DIR": library, "BACKPLAN_QUIET": "1"}
    print(json.dumps({"cpu": cpu_name(), "load": os.getloadavg()}))
    for model in args.models:
        run_child(model, 0.0, {**base, "BACKPLAN_CACHE_DIR": tempfile.mkdtemp()})  # the library
        env = {**base, "BACKPLAN_CACHE_DIR": tempfile.mkdtemp()}
        print(json.dumps(summary(model, run_child(model, args.seconds, env))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
