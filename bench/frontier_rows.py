"""memory_frontier of the 10,086-node chain (bench.budget_models.deep_chain), its trace
included, as users call it: each row's peak taken from the step schedule's simulation where
that is the built plan's peak to the byte (BudgetPlanner.analytic_peak: the reference
interpreter, one plan), against every row's plan built for its peak, in interleaved rounds
(CPU seconds, this process pinned), on the current backend. Prints whether both give the same
rows and floor. On numba no row is simulated (compiled plans fuse loops and place an arena),
so both sides build every row.

    BACKPLAN_BACKEND=reference python -m backplan.bench.frontier_rows [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; {pin_process(1)['affinity']}; backend: {current_backend()}")
    fn, params, batch = deep_chain()
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
