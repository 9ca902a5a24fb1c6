"""Where the simulation of a forward plan and a backward plan stops, a few moves judged by the
built plans' peaks.

`bp.compile(loss)` whose result backward() follows runs two compiled plans, each holding its
arena for the whole call. The step schedule's simulation of them (ir/step_schedule.py) counts
every value a buffer, while fusion stores an elementwise chain as one buffer and a GEMM's
epilogue in the GEMM's: its error moves with what is recomputed (on an 8-layer MLP of uneven
widths it ranked [11, 15, 21, 23, 25] behind plans whose built peaks are 4% higher), so the
chains of simulated points end above the lowest peak a plan reaches, and budgets between
were refused although a plan fits them. From the lowest built point, one held value more at
a time (tried in order of their simulated peaks), or one recomputed value held again (a value
taken early can stop paying once later ones free the bytes it was taken for: a 7-layer MLP's
descent ended at 704,520 B recomputing six values where five of them reach 696,328 with fewer
FLOPs), a move is kept when the built plan's peak (ir/peak.py, what explain prints and the
checked mode counts) falls.
"""

from __future__ import annotations

from backplan.ir.budget import PlanPoint, ranked_candidates

MAX_BUILT_MOVES = 24  # plans built beyond the simulated chains (each a lowering)
TRIED_PER_MOVE = 2  # plans built for each move, best simulated first
RANKED_PER_MOVE = 8  # held values simulated for each move (the best ranked)


def built_descent(planner, points: list[PlanPoint]) -> list[PlanPoint]:
    """The points found beyond `points`, each lowering the built peak of the one before it;
    planner.evaluate builds them (and keeps them for the frontier and the budgets)."""
    schedule = planner.choices.schedule
    best = min(points, key=lambda p: (planner.evaluate(p).peak_bytes, p.added_flops))
    lowest, found, built = planner.evaluate(best).peak_bytes, [], 0
    while built < MAX_BUILT_MOVES:
        moved = False
        moves = _ranked_moves(schedule, best.drop)[:TRIED_PER_MOVE]
        moves += _ranked_returns(schedule, best.drop)[:TRIED_PER_MOVE]
        for point in moves:
            if built >= MAX_BUILT_MOVES:
                break
            built += 1
            peak = planner.evaluate(point).peak_bytes
            if peak < lowest:
                best, lowest, moved = point, peak, True
                found.append(point)
                break
        if not moved:
            break
    return found


def _ranked_moves(schedule, drop: frozenset) -> list[PlanPoint]:
    """drop with one more held value recomputed, for the RANKED_PER_MOVE best held values
    live at drop's simulated peak (ir/budget.py ranked_candidates): lowest simulated peak
    first, then fewest added FLOPs. Simulating every held value instead cost a 1,120-layer
    chain's compiled frontier 1,120 simulations a move; two plans built a move (not six)
    and three single values tried in the simulated chain (not all) keep the chain's
    frontier within two lowerings of what it cost before."""
    current = schedule.simulate(drop, True)
    moves = []
    for i in ranked_candidates(schedule, current, drop)[:RANKED_PER_MOVE]:
        more = drop | {i}
        outcome = schedule.simulate(more, True)
        moves.append(PlanPoint(more, outcome.peak, outcome.held_bytes, outcome.added_flops))
    return sorted(moves, key=lambda p: (p.peak, p.added_flops))


def _ranked_returns(schedule, drop: frozenset) -> list[PlanPoint]:
    """drop with one recomputed value held again, for up to RANKED_PER_MOVE of them: lowest
    simulated peak first, then fewest added FLOPs."""
    if len(drop) < 2:
        return []
    moves = []
    for i in sorted(drop)[:RANKED_PER_MOVE]:
        fewer = drop - {i}
        outcome = schedule.simulate(fewer, True)
        moves.append(PlanPoint(fewer, outcome.peak, outcome.held_bytes, outcome.added_flops))
    return sorted(moves, key=lambda p: (p.peak, p.added_flops))
