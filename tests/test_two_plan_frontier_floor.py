"""bp.compile(loss) that backward() follows runs a forward plan and a backward plan: its memory
frontier reaches the lowest peak any choice of recomputed values gives (every subset of the
held values built and its peak taken), and a budget at that peak is met, not refused.

On this 7-layer MLP of uneven widths the frontier used to stop at 745,480 B where 712,712 B is
reachable: the simulation of two compiled plans counts fused values as buffers, its chain
stopped after one held value failed to lower it, and max_peak_bytes=712,712 was refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import backplan as bp
from backplan.ir.budget import PlanPoint
from backplan.runtime.backend import use_backend

WIDTHS = (32, 128, 64, 256, 32, 64, 128, 32)


def _loss(ws, x):
    for w in ws.values():
        x = bp.tanh(x @ w)
    return bp.mean(x * x)


def _arrays():
    rng = np.random.default_rng(0)
    ws = {
        f"w{i}": bp.tensor(
            (rng.standard_normal((a, b)) * 0.2).astype(np.float32), requires_grad=True
        )
        for i, (a, b) in enumerate(itertools.pairwise(WIDTHS))
    }
    return ws, rng.standard_normal((64, WIDTHS[0])).astype(np.float32)


def _lowest_built_peak(planner) -> int:
    """Every subset of the held values recomputed, each plan built: the lowest peak."""
    held = planner.choices.schedule.held
    return min(
        planner.evaluate(PlanPoint(frozenset(drop), 0, 0, 0)).peak_bytes
        for size in range(len(held) + 1)
        for drop in itertools.combinations(held, size)
    )


def test_the_two_plan_frontier_reaches_the_lowest_peak_any_plan_has():
    ws, x = _arrays()
    with use_backend("numba"):
        f = bp.compile(_loss)
        rows = [p.peak_bytes for p in f.memory_frontier(ws, x).points]
        planner = f.lookup((ws, x), {}, count_hit=False)[1].planner
        fresh = type(planner)(planner.choices, planner.input_bytes, "f")
        fresh.numpy_inputs = planner.numpy_inputs  # x, a NumPy array: copied where saved
        floor = _lowest_built_peak(fresh)
        assert rows == sorted(rows, reverse=True) and rows[-1] == floor < rows[0]
        budgeted = bp.compile(_loss, max_peak_bytes=floor)
        assert bp.explain(budgeted, ws, x).peak_bytes <= floor


def test_a_budget_under_that_floor_is_refused_with_it():
    ws, x = _arrays()
    with use_backend("numba"):
        floor = bp.compile(_loss).memory_frontier(ws, x).points[-1].peak_bytes
        budgeted = bp.compile(_loss, max_peak_bytes=floor - 1)
        quoted = f"smallest peak any plan reaches is {floor:,} B"
        with pytest.raises(bp.MemoryBudgetError, match=quoted):
            bp.explain(budgeted, ws, x)
