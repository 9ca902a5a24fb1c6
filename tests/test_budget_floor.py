"""bench.memory_budget's recompute floor: a lower bound on the FLOPs any recomputation plan adds
to hold at most a budget of saved bytes, which says when a step-time target is out of reach."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_budget import main, recompute_floor


def _planner(depth: int = 6):
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((8, 8)) * 0.4).astype(np.float32) for _ in range(depth)]
    x = rng.standard_normal((4, 8)).astype(np.float32)

    def loss(ws, x):
        h = x
        for w in ws[:-1]:
            h = bp.tanh(h @ w)
        a = h @ ws[-1]  # not held: two held values are made from it (a shared chain)
        return (bp.tanh(a) * bp.exp(a)).sum()

    return bp.value_and_grad(loss).trace(ws, x).planner


def test_no_plan_adds_fewer_flops_than_the_floor_and_the_floor_is_tight_enough_to_matter():
    """Every subset of held values recomputed (all 2^n plans, simulated): the fewest FLOPs a
    plan holding at most each budget adds is at least the floor; the floor is 0 where nothing
    must go, and at 1/3 of the saved bytes within 2x of what the best plan adds (a bound
    that said 0 would decide nothing)."""
    planner = _planner()
    schedule = planner.choices.schedule
    held = list(schedule.held)
    assert 6 <= len(held) <= 12
    total = schedule.held_bytes()
    best: dict[int, int] = {}
    limits = [total, total * 2 // 3, total // 3, total // 5, 0]
    for r in range(len(held) + 1):
        for drop in itertools.combinations(held, r):
            outcome = schedule.simulate(frozenset(drop))
            for limit in limits:
                if outcome.held_bytes <= limit:
                    best[limit] = min(best.get(limit, outcome.added_flops), outcome.added_flops)
    assert recompute_floor(planner, total) == 0
    for limit in limits:
        assert recompute_floor(planner, limit) <= best[limit], limit
    third = total // 3
    assert best[third] > 0 and 2 * recompute_floor(planner, third) >= best[third]


def test_the_frontier_bench_refuses_no_time_instead_of_timing_anyway(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--frontier", "3", "--no-time"])
    assert refused.value.code == 2
    assert "--no-time cannot apply" in capsys.readouterr().err
