"""memory_frontier builds and lowers every row only to read its peak: it keeps the peaks and
lets the plans go (tracer/budget.py forget_plans), where a 10,086-node plan's 22 rows kept
185 MiB and 1.1 M objects the collector walks alive for as long as the function lived. A
budget then builds its row again: the same plan, at the peak the row printed."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tanh_chain as chain
from helpers import tanh_chain_weights as weights

import backplan as bp
from backplan.tracer.budget import step_peak_bytes


def planner_after_frontier():
    ws, x = weights()
    fn = bp.value_and_grad(chain)
    front = fn.memory_frontier(ws, x)
    assert len(front.points) >= 2
    return fn.trace(ws, x).planner, front


def test_the_frontier_keeps_its_rows_peaks_not_their_plans():
    planner, front = planner_after_frontier()
    rows = planner.frontier(plans=False)
    assert [r.peak_bytes for r in rows] == [p.peak_bytes for p in front.points]
    assert rows[0].plans is not None  # the default plan: what the function runs, kept
    assert all(r.plans is None for r in rows[1:])
    assert [r.peak_bytes for r in planner.frontier(plans=False)] == [r.peak_bytes for r in rows]


@pytest.mark.parametrize("row", [1, -1])
def test_a_budget_after_the_frontier_builds_the_same_plan_at_the_printed_peak(row):
    planner, front = planner_after_frontier()
    limit = front.points[row].peak_bytes
    plans = planner.fit_peak(limit)
    assert step_peak_bytes(plans) == limit
    fresh = bp.value_and_grad(chain).trace(*weights()).planner.fit_peak(limit)
    assert [p.text() for p in plans.named.values()] == [p.text() for p in fresh.named.values()]
    chosen = planner.recomputed_for[1]
    kept = [r for r in planner.frontier(plans=False) if r.drop == chosen.drop]
    assert kept and kept[0].plans is plans  # the chosen plans are kept now, the others not
    others = [r for r in planner.frontier(plans=False)[1:] if r.drop != chosen.drop]
    assert all(r.plans is None for r in others)


def test_the_rows_plans_are_gone_when_the_collector_resumes(monkeypatch):
    """The collector is paused while the rows are built; resumed with their plans still
    referenced, its first young collection walked every row's plans (1.1 M objects on the
    10,086-node chain) and freed none. When memory_frontier resumes it, only the plans it
    keeps (the default plan's) are alive: their kernels are those alive afterwards."""
    import gc

    from backplan.ir import gc_pause
    from backplan.ir.fusion import Kernel
    from backplan.runtime.backend import use_backend

    alive_at_resume = []
    enable = gc.enable

    def counting_enable():
        alive_at_resume.append(sum(issubclass(type(o), Kernel) for o in gc.get_objects()))
        enable()

    ws, x = weights()
    ws, x = ws * 6, np.ones((256, 16), np.float32)  # 24 layers: several rows on numba
    with use_backend("numba"):  # rows are lowered (the reference interpreter simulates them)
        fn = bp.value_and_grad(chain)
        fn.trace(ws, x)
        was_enabled = gc.isenabled()
        gc.enable()
        monkeypatch.setattr(gc_pause.gc, "enable", counting_enable)
        try:
            front = fn.memory_frontier(ws, x)
        finally:
            monkeypatch.undo()
            if not was_enabled:
                gc.disable()
        kept = sum(issubclass(type(o), Kernel) for o in gc.get_objects())  # the default plan's
    assert len(front.points) >= 3 and kept > 0
    assert alive_at_resume == [kept]
