"""memory_frontier of the 10,086-node chain (bench.budget_models.deep_chain), its trace
included, as users call it: each row's peak taken from the step schedule's simulation where
that is the built plan's peak to the byte (BudgetPlanner.analytic_peak: the reference
interpreter, one plan), against every row's plan built for its peak, in interleaved rounds
(CPU seconds, this process pinned), on the current backend. Prints whether both give the same
rows and floor. On numba no row is simulated (compiled plans fuse loops and place an arena),
so both sides build every row.

    BACKPLAN_BACKEND=reference python -m backplan.bench.frontier_rows [--rounds 5]

--against PYTHON: the frontier of another installation (a venv's python with an older checkout
installed, as bench.revisions takes it) against this one, in alternated fresh processes started
outside any checkout (from the root of one, `python -m` would import that checkout's `backplan/`
whatever the installation), each pinned to this process's first CPU: CPU s of trace +
memory_frontier, their medians and ratio, and whether both found the same rows and floor.
--against-path DIR runs the other side with this python and DIR first on PYTHONPATH (a package
copy: DIR/backplan holding an older checkout's backplan/ and subpackage folders).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import backplan as bp
from backplan.bench.internals import BudgetPlanner, current_backend

from .affinity import pin_process
from .budget_models import deep_chain
from .environment import cpu_name


def _frontier(fn, params, batch, simulated: bool) -> tuple[float, tuple]:
    """(CPU s of a fresh trace and its memory_frontier, (rows, floor))."""
    analytic = BudgetPlanner.analytic_peak
    if not simulated:
        BudgetPlanner.analytic_peak = lambda self, drop: None
    try:
        step = bp.value_and_grad(fn)
        gc.collect()
        start = time.process_time()
        step.trace(params, *batch)
        frontier = step.memory_frontier(params, *batch)
        seconds = time.process_time() - start
    finally:
        BudgetPlanner.analytic_peak = analytic
    return seconds, (tuple(frontier.points), frontier.floor)


# one fresh process's frontier, with the public API and bench.budget_models only (which every
# installation compared has): printed as [CPU s, rows and floor, where backplan came from]
_CHILD = """
import gc, json, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import backplan as bp
from backplan.bench.budget_models import deep_chain
fn, params, batch = deep_chain(int(sys.argv[2]))
step = bp.value_and_grad(fn)
gc.collect()
start = time.process_time()
step.trace(params, *batch)
frontier = step.memory_frontier(params, *batch)
seconds = time.process_time() - start
print(json.dumps([seconds, repr((frontier.points, frontier.floor)), bp.__file__]))
"""


def against(python: str, path: str | None, rounds: int, layers: int) -> dict:
    """{"this"/"other": [CPU s per round], "same": rows and floor equal, "where": files}: the
    two installations' frontiers in alternated fresh processes (see the module's docstring)."""
    cpu = min(os.sched_getaffinity(0))
    sides = {
        "this": ([sys.executable], dict(os.environ)),
        "other": ([python or sys.executable], dict(os.environ)),
    }
    if path is not None:
        sides["other"][1]["PYTHONPATH"] = os.pathsep.join(
            [path, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    found = {"this": [], "other": []}
    rows, where = {}, {}
    for r in range(rounds):
        for side in ("this", "other") if r % 2 == 0 else ("other", "this"):
            command, env = sides[side]
            done = subprocess.run(
                [*command, "-c", _CHILD, str(cpu), str(layers)],
                capture_output=True,
                text=True,
                env=env,
                cwd=tempfile.gettempdir(),  # outside any checkout (see the docstring)
                check=True,
            )
            seconds, rows[side], where[side] = json.loads(done.stdout.strip().splitlines()[-1])
            found[side].append(seconds)
    return {**found, "same": rows["this"] == rows["other"], "where": where}


def against_text(found: dict) -> str:
    this, other = statistics.median(found["this"]), statistics.median(found["other"])
    return (
        f"trace + memory_frontier, fresh processes alternated (CPU s): other {other:.3f} "
        f"({', '.join(f'{t:.3f}' for t in found['other'])}; {found['where']['other']}), "
        f"this {this:.3f} ({', '.join(f'{t:.3f}' for t in found['this'])}; "
        f"{found['where']['this']}): {this / other:.3f}x; the same rows and floor: "
        f"{found['same']}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", default=None, help="another installation's python")
    parser.add_argument("--against-path", default=None, help="a package copy's folder")
    parser.add_argument("--layers", type=int, default=1120, help="the chain's layers")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; {pin_process(1)['affinity']}; backend: {current_backend()}")
    if args.against or args.against_path:
        print(against_text(against(args.against, args.against_path, args.rounds, args.layers)))
        return
    fn, params, batch = deep_chain(args.layers)
    times: dict[bool, list[float]] = {False: [], True: []}
    found: dict[bool, tuple] = {}
    for r in range(args.rounds):
        for simulated in (False, True) if r % 2 == 0 else (True, False):
            seconds, found[simulated] = _frontier(fn, params, batch, simulated)
            times[simulated].append(seconds)
    built, simulated = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"trace + memory_frontier of the 10,086-node chain (CPU s, median of {args.rounds}): "
        f"every row built {built:.3f} ({', '.join(f'{t:.3f}' for t in times[False])}), rows "
        f"simulated where exact {simulated:.3f} ({', '.join(f'{t:.3f}' for t in times[True])}), "
        f"{simulated / built:.2f}x; {len(found[True][0])} rows, the same rows and floor: "
        f"{found[True] == found[False]}"
    )


if __name__ == "__main__":
    main()
