"""How soon a script reaches its steady step time:
`python -m backplan.bench.first_minute [--models mlp_tiny mlp transformer] [--seconds 30]`.

Per model, a fresh process with an empty kernel cache folder (the library's compiled functions
are shared in one folder, filled by a first untimed process, as after an installation's first
use) makes `bp.value_and_grad(bp.compile(loss))` and steps it for `--seconds` of wall time from
the first call. Reported: the cold first call, the median step of calls 2-6 (what a short
script gets), the steady step (median of the last tenth of the steps), the first step within
10% of the steady one, and the wall time from the first call to it; and the first step a
native driver ran (the direct driver from the second call, codegen/build/direct_driver.py, or
the compiled driver of the background build), with the wall time to it (None when none ran:
then "steady" is the Python-run driver's speed, not compiled speed) and the tier at the end.

A/B: `--variant NAME PYTHON [VAR=VALUE ...]` (repeatable) runs each model under each variant (an
interpreter, with environment variables set), `--rounds` times, the variants' order alternating
per round, each run a fresh process with its own empty BACKPLAN_CACHE_DIR; the library folder is
one per variant. It prints one JSON line per run, then per model and variant the medians:
`taskset -c 1 python -m backplan.bench.first_minute --models mlp_tiny cnn --rounds 3
--variant linked .venv/bin/python BACKPLAN_DRIVER_LOOPS=linked
--variant address .venv/bin/python BACKPLAN_DRIVER_LOOPS=address`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    if compiled is None and step.driver_tier in ("direct", "compiled"):
        compiled = len(rows) - 1
print(json.dumps({"rows": rows, "tier": step.driver_tier, "compiled_step": compiled}))
"""


def run_child(model: str, seconds: float, env: dict, python: str | None = None) -> dict:
    command = [python or sys.executable, "-I", "-c", CHILD, model, str(seconds)]
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
        # The target: compiled speed within twice the cold first call's wall time.
        "steady_over_first_call": round((rows[fast][0] + rows[fast][1]) / rows[0][1], 2),
        "tier_at_end": result["tier"],
        # The first step run by the compiled driver and the wall time to its end; None: none
        # was (a driver kept as Python by choice, or a build not done when the run ended: then
        # the "steady" step above is the Python-run driver's).
        "compiled_step": result.get("compiled_step"),
        "wall_to_compiled_s": _wall_to(rows, result.get("compiled_step")),
    }


def _wall_to(rows: list, index: int | None) -> float | None:
    return None if index is None else round(rows[index][0] + rows[index][1], 3)


def variant(spec: list[str]) -> tuple[str, str, dict]:
    """(name, interpreter, environment variables) from `NAME PYTHON [VAR=VALUE ...]`."""
    if len(spec) < 2 or any("=" not in item for item in spec[2:]):
        raise SystemExit(f"--variant {' '.join(spec)}: give NAME PYTHON [VAR=VALUE ...]")
    name, python, *assignments = spec
    return name, python, dict(item.split("=", 1) for item in assignments)


def medians(rows: list[dict]) -> dict:
    """Per (model, variant): the median of each number over the rounds (None where any run
    has none: a run that never reached the compiled driver), and each run's value."""
    keys = (
        "first_call_s", "early_step_ms", "steady_step_ms", "first_steady_step",
        "wall_to_steady_s", "steady_over_first_call", "compiled_step", "wall_to_compiled_s",
    )  # fmt: skip
    found = {}
    for model, name in dict.fromkeys((r["model"], r["variant"]) for r in rows):
        runs = [r for r in rows if r["model"] == model and r["variant"] == name]
        line = {"model": model, "variant": name, "runs": len(runs)}
        for key in keys:
            values = [r[key] for r in runs]
            line[key] = None if None in values else round(statistics.median(values), 4)
            line[f"{key}_runs"] = values
        found[(model, name)] = line
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp_tiny", "mlp", "transformer"])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--variant", nargs="+", action="append", metavar="NAME PYTHON [VAR=VALUE]",
        help="a process to run each model in: a name, an interpreter, environment variables",
    )  # fmt: skip
    args = parser.parse_args(argv)
    variants = [variant(v) for v in args.variant or [["this", sys.executable]]]
    libraries = {name: tempfile.mkdtemp(prefix="backplan-library-") for name, _, _ in variants}
    print(json.dumps({"cpu": cpu_name(), "load": os.getloadavg()}))
    rows = []
    for round_ in range(args.rounds):
        for model in args.models:
            for name, python, extra in variants[:: -1 if round_ % 2 else 1]:
                base = {
                    **os.environ, **extra,
                    "BACKPLAN_LIBRARY_CACHE_DIR": libraries[name], "BACKPLAN_QUIET": "1",
                }  # fmt: skip
                if round_ == 0:  # the library, once per variant and model
                    empty = {**base, "BACKPLAN_CACHE_DIR": tempfile.mkdtemp()}
                    run_child(model, 0.0, empty, python)
                env = {**base, "BACKPLAN_CACHE_DIR": tempfile.mkdtemp()}
                row = summary(model, run_child(model, args.seconds, env, python))
                row.update(variant=name, round=round_, load=os.getloadavg()[0])
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.rounds > 1 or len(variants) > 1:
        for line in medians(rows).values():
            print(json.dumps({"median": True, **line}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
