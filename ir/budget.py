"""The memory planner: which values a step holds from its forward into its backward, and which
it recomputes there instead (any op: a matmul, a tanh, a whole segment between two values it
keeps), so that its peak fits a budget with the least added arithmetic.

`plan_frontier` walks from the default plan towards the smallest peak it can reach. Each move
recomputes, of the held values live at the current peak, those freeing the most bytes per added
FLOP (a value whose chain would join an existing recomputed segment waits: segments stay short,
as in sqrt(n) checkpointing), and is kept only if the simulated peak goes down. Every plan on
the way is a point: peak bytes against added FLOPs, peaks strictly falling as FLOPs rise, so
the cheapest point under a budget never has a higher peak than the one a larger budget picks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .step_schedule import Outcome, StepSchedule

STEPS_TO_FLOOR = 24  # a move frees about 1/24 of the peak: the frontier's resolution
MAX_SIMULATIONS = 160  # bounds planning time on very large steps
SINGLES_TRIED = 3  # single values tried, best ranked first, before batches grow (_growing)


@dataclass(frozen=True)
class PlanPoint:
    """One plan: the held values recomputed instead (ids of the schedule), its simulated peak
    (bytes the plan holds, the caller's arrays excluded), held bytes and added FLOPs."""

    drop: frozenset[int]
    peak: int
    held_bytes: int
    added_flops: int


def plan_frontier(
    schedule: StepSchedule, objective: str = "peak", compiled: bool = False
) -> list[PlanPoint]:
    """The plans from the default one (nothing more recomputed) to the lowest peak found.
    objective "saved" lowers the held bytes instead of the peak (saved_bytes_budget).
    compiled: moves are judged by the peak the compiled executor holds (each plan's arena
    and outputs for the whole call), not the reference interpreter's."""
    drop: frozenset[int] = frozenset()
    current = schedule.simulate(drop, compiled)
    points = [_point(drop, current)]
    locked: set[int] = set()
    step_bytes = max(_measure(current, objective) // STEPS_TO_FLOOR, 1)
    simulations = 1
    while simulations < MAX_SIMULATIONS:
        batch = _next_batch(schedule, current, drop, locked, step_bytes, objective)
        trial, singles = None, 0
        while batch:
            trial = schedule.simulate(drop | frozenset(batch), compiled)
            simulations += 1
            if _measure(trial, objective) < _measure(current, objective):
                break
            if len(batch) == 1:  # the next-ranked single values, a few
                locked.add(batch[0])
                singles += 1
                batch = _next_batch(schedule, current, drop, locked, 1, objective)
                if singles >= SINGLES_TRIED or simulations >= MAX_SIMULATIONS:
                    batch = []
                continue
            batch = batch[: len(batch) // 2]
        if not batch:
            batch, trial, tried = _growing(schedule, current, drop, objective, compiled)
            simulations += tried
        if not batch:
            break
        drop, current = drop | frozenset(batch), trial
        points.append(_point(drop, current))
    return points


def _growing(schedule, current: Outcome, drop, objective: str, compiled: bool):
    """(batch, its outcome, simulations) when no small batch lowers the peak: twice as many
    of the ranked candidates at a time, up to all of them. A compiled step holds its
    backward's arena for the whole step, so recomputing one value only moves its bytes into
    that arena; recomputing several, one after another, reuses the same arena bytes."""
    ranked = _next_batch(schedule, current, drop, set(), None, objective)
    size, tried = 2, 0
    while size <= 2 * len(ranked) and size > 1:
        batch = ranked[:size]
        trial = schedule.simulate(drop | frozenset(batch), compiled)
        tried += 1
        if _measure(trial, objective) < _measure(current, objective):
            return batch, trial, tried
        if size >= len(ranked):
            break
        size *= 2
    return [], None, tried


def cheapest_within(points: list[PlanPoint], limit: int, measure: str = "peak"):
    """The point with the fewest added FLOPs whose peak (or held bytes) fits limit, or None."""
    fitting = [p for p in points if getattr(p, _FIELD[measure]) <= limit]
    return min(fitting, key=lambda p: (p.added_flops, p.peak), default=None)


def refined_within(
    schedule: StepSchedule,
    points: list[PlanPoint],
    limit: int,
    objective: str = "peak",
    compiled: bool = False,
    built=None,
) -> PlanPoint | None:
    """A plan that fits limit with fewer added FLOPs than the cheapest frontier point that
    fits, or None. The frontier moves in batches of about 1/STEPS_TO_FLOOR of the peak, so
    the first point under a budget can overshoot it by most of a batch of recomputed values
    (a transformer at 1/3 of its saved bytes: one GEMM output too many, +1.6% of the step's
    FLOPs). From the point before it, one value at a time: the cheapest single value whose
    recomputation makes the plan fit, else the best-ranked value that lowers the measure.
    built (compiled plans): point -> its built plan's peak (ir/peak.py), asked of the
    frontier's points in order of added FLOPs until one fits limit; each trial is then judged
    by its simulated peak plus what the plan it starts from, its nearest built one, holds
    beyond its own simulated peak (fusion, literals, the arrays passed in). Judged by the
    simulation alone, budgets between a transformer's rows (simulated 2-4 MB above the built
    peaks) found no plan between and ran the next row, with more FLOPs than one that fits."""
    if built is None:
        chosen = cheapest_within(points, limit, objective)
    else:
        chosen = _cheapest_built_within(points, limit, built)
    if chosen is None or chosen == points[0]:
        return None
    start = points[points.index(chosen) - 1]
    current = schedule.simulate(start.drop, compiled)
    if built is not None:
        limit -= built(start) - current.peak  # the limit on the simulation's scale
    drop = start.drop
    tries = 0
    while tries < MAX_REFINING and current.added_flops < chosen.added_flops:
        ranked = _next_batch(schedule, current, drop, set(), None, objective)[:REFINE_WIDTH]
        trials = [(i, schedule.simulate(drop | {i}, compiled)) for i in ranked]
        tries += len(trials)
        fitting = [
            (t.added_flops, i, t)
            for i, t in trials
            if _measure(t, objective) <= limit and t.added_flops < chosen.added_flops
        ]
        if fitting:
            _, i, trial = min(fitting, key=lambda f: f[:2])
            return _point(drop | {i}, trial)
        lower = [(i, t) for i, t in trials if _measure(t, objective) < _measure(current, objective)]
        if not lower:
            return None
        drop, current = drop | {lower[0][0]}, lower[0][1]
    return None


def _cheapest_built_within(points: list[PlanPoint], limit: int, built) -> PlanPoint | None:
    """The point with the fewest added FLOPs whose built peak fits limit; points are asked
    cheapest first, so those after it are not built."""
    for point in sorted(points, key=lambda p: (p.added_flops, p.peak)):
        if built(point) <= limit:
            return point
    return None


MAX_REFINING = 48  # simulations one refinement may try
REFINE_WIDTH = 12  # candidates tried per value added


_FIELD = {"peak": "peak", "saved": "held_bytes"}


def _measure(outcome: Outcome, objective: str) -> int:
    return outcome.peak if objective == "peak" else outcome.held_bytes


def _point(drop: frozenset[int], outcome: Outcome) -> PlanPoint:
    return PlanPoint(drop, outcome.peak, outcome.held_bytes, outcome.added_flops)


def ranked_candidates(schedule: StepSchedule, current: Outcome, drop) -> list[int]:
    """The held values live at current's peak that drop keeps, best first (as _next_batch
    ranks them: bytes freed per added FLOP, then the segment rule, then forward order)."""
    return _next_batch(schedule, current, drop, set(), None, "peak")


def _next_batch(schedule, current: Outcome, drop, locked, step_bytes, objective) -> list:
    """The best candidates, best first, until they hold step_bytes: held values live at the
    peak (every kept held value when lowering held bytes), ranked by bytes per added FLOP,
    those that would lengthen a recomputed segment after those that would not, earlier
    forward values first (they are recomputed late in the backward, when less is live).
    A value's bytes are those recomputing it frees (held_nbytes): a held view (a layer norm's
    output reshaped for its matmul) keeps the buffer it views; ranked by its own zero bytes
    it came last, behind every matmul."""
    pool = current.live_held if objective == "peak" else schedule.held
    scored = []
    for i in pool:
        if i in drop or i in locked:
            continue
        flops, touches = schedule.chain_cost(i, drop, current.recomputed)
        touches = touches or i in current.read_by_copies
        ratio = schedule.held_nbytes[i] / (flops + 1)
        scored.append(((-_rounded(ratio), touches, schedule.position[i]), i))
    scored.sort()
    batch, total = [], 0
    for _, i in scored:
        batch.append(i)
        total += schedule.held_nbytes[i]
        if step_bytes is not None and total >= step_bytes:
            break
    return batch


def _rounded(ratio: float) -> float:
    """Two significant digits: ratios this close are ties, decided by the segment rule."""
    return float(f"{ratio:.2g}")
