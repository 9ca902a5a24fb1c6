"""A plan and its lowering are freed by reference counting, not left to Python's cyclic
collector: the plan caches its lowering (`plan.lowered`) and the lowering points at a copy of
the plan, not back at it (ir/lowering.py `detached`). Before, each was a cycle, and the plans
of a 10,086-node memory_frontier waited for one full collection of ~0.9 s. The collector is
off in these tests, so what a `del` does not free stays alive."""

from __future__ import annotations

import gc
import weakref

import pytest
from helpers import tanh_chain as chain
from helpers import tanh_chain_weights as weights

import backplan as bp
from backplan.ir.lowering import lower


@pytest.fixture(autouse=True)
def collector_off():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    (gc.enable if was else gc.disable)()


def frontier_refs(front: str) -> tuple[list, int]:
    """Weak references to every plan and lowering of the frontier's rows (two rows or more),
    and the rows' count; the function, its trace and its frontier are dropped on return."""
    ws, x = weights()
    if front == "compile":  # a loss backward() follows: a forward and a backward plan
        ws = [bp.tensor(w, requires_grad=True) for w in ws]
    fn = bp.value_and_grad(chain) if front == "value_and_grad" else bp.compile(chain)
    frontier = fn.memory_frontier(ws, x)
    rows = fn.trace(ws, x).planner.frontier()
    plans = [p for row in rows for p in row.plans.named.values()]
    lowered = [lower(p) for p in plans]
    assert len(frontier.points) == len(rows) >= 2
    return [weakref.ref(o) for o in plans + lowered], len(rows)


@pytest.mark.parametrize("front", ["value_and_grad", "compile"])
def test_the_frontiers_plans_are_freed_when_the_function_is(front):
    refs, rows = frontier_refs(front)
    alive = [r() for r in refs if r() is not None]
    assert alive == [], f"{len(alive)} of {len(refs)} plans and lowerings ({rows} rows) alive"


def test_a_lowering_keeps_a_usable_plan_after_the_plan_is_dropped():
    """Whoever keeps only the lowered plan (a runner does) still reads the plan's graph and
    liveness through it; the plan itself, once dropped, is gone."""
    ws, x = weights()
    plan = bp.value_and_grad(chain).trace(ws, x).plan
    graph, frees, text = plan.graph, plan.frees_after, plan.text()
    lowered = lower(plan)
    assert lower(plan) is lowered  # cached on the plan
    gone = weakref.ref(plan)
    del plan
    assert gone() is None
    assert lowered.plan.graph is graph and lowered.plan.frees_after is frees
    assert lowered.plan.text() == text and lowered.interpreted is lowered.plan
    assert lowered.plan.lowered == {}  # the copy holds no lowering: nothing points back
