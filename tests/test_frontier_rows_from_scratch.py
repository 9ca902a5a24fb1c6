"""Every row memory_frontier lowers is the plan a fresh trace builds and lowers for the same
recomputed values alone: the rows share the default graph's first nodes and carry the row
before's grouping, epilogue answers and each kernel's reads over (ir/grouping_resume.py,
ir/fusion.py materialized), and none of that may show in what is lowered (kernels, buffers
needed, steps, arena offsets: bench/frontier_digest.py's fingerprint). Each row's liveness,
left to be worked out when read (ir/liveness.py), is what an eager walk of its graph gives."""

from __future__ import annotations

from contextlib import contextmanager

import backplan as bp
from backplan.bench import frontier_digest, internals
from backplan.bench.budget_models import deep_chain
from backplan.ir.graph import Graph, Value
from backplan.ir.liveness import INPUT_STEP, OWNED_ROLES, plan_liveness
from backplan.ir.types import TensorType
from backplan.runtime.backend import use_backend


@contextmanager
def _rows_lowered():
    """Yields [(drop, fingerprint of its lowered plan)] for the plans lowered inside it, each
    tagged with the recomputed values of the plan the planner built last."""
    planner, lowering = internals.BudgetPlanner, internals.lowering
    build, lower = planner.build, lowering._lower
    current, found = [None], []

    def building(self, drop=frozenset(), narrowed=False):
        current[0] = (drop, narrowed)
        return build(self, drop, narrowed)

    def lowering_row(plan, *args, **kwargs):
        lowered = lower(plan, *args, **kwargs)
        if current[0] is not None:
            found.append((current[0], frontier_digest.lowered_fingerprint(lowered)))
        return lowered

    planner.build, lowering._lower = building, lowering_row
    try:
        yield found
    finally:
        planner.build, lowering._lower = build, lower


def _alone(fn, params, batch, drop, narrowed) -> str:
    """The fingerprint of drop's plan built and lowered from a fresh trace, no row before it."""
    step = bp.value_and_grad(fn)
    planner = step.trace(params, *batch).planner
    plans = planner.build(drop, narrowed)
    return frontier_digest.lowered_fingerprint(internals.lowering.lower(plans.plan))


def _eager(plan) -> tuple:
    """(first_write, last_read, frees_after) walked from the plan's graph as it is now."""
    graph, nodes = plan.graph, plan.graph.nodes
    first = {v: INPUT_STEP for v in graph.inputs} | {n: i for i, n in enumerate(nodes)}
    last = {i: step for step, n in enumerate(nodes) for i in n.inputs}
    last.update((o, len(nodes)) for o in graph.outputs)
    frees: dict = {}
    for value, written in first.items():
        if written == INPUT_STEP and value.role not in OWNED_ROLES:
            continue
        if written != INPUT_STEP and value in graph.outputs:
            continue
        frees.setdefault(last.get(value, written), []).append(value)
    return first, last, frees


def _rows_are_fresh_plans(fn, params, batch) -> int:
    with use_backend("numba"):
        with _rows_lowered() as rows:
            step = bp.value_and_grad(fn)
            step.trace(params, *batch)
            frontier = step.memory_frontier(params, *batch)
        recomputing = [(key, fp) for key, fp in rows if key[0]]
        assert len(recomputing) >= len(frontier.points) - 1  # every row but the default
        for (drop, narrowed), fingerprint in recomputing:
            assert _alone(fn, params, batch, drop, narrowed) == fingerprint, sorted(drop)
        # a row's liveness, read after its lowering, is the eager walk's
        planner = step.trace(params, *batch).planner
        drop = recomputing[len(recomputing) // 2][0][0]
        plan = planner.build(drop).plan
        internals.lowering.lower(plan)
        assert (plan.first_write, plan.last_read, plan.frees_after) == _eager(plan)
    return len(recomputing)


def test_every_chain_row_is_the_plan_built_alone():
    """A 24-layer tanh chain: each row shares the default graph's first nodes and resumes
    from the row before (all but the first two), yet lowers as if built alone. (mlp_deep's
    and the transformer's rows: tests/test_grouping_resume.py, against rows copied whole.)"""
    assert _rows_are_fresh_plans(*deep_chain(24)) >= 5


def test_liveness_is_worked_out_from_the_graph_as_planned():
    """A plan's liveness, read after its graph's lists changed, is still that of the graph it
    was planned for; one assigned before the first read is kept."""
    graph = Graph()
    x = graph.add_input(TensorType("f32", (4,)))
    y = Value("neg", (x,), {}, TensorType("f32", (4,)))
    z = Value("neg", (y,), {}, TensorType("f32", (4,)))
    graph.nodes, graph.outputs = [y, z], [z]
    plan = plan_liveness(graph)
    other = plan_liveness(graph)
    graph.nodes.append(Value("neg", (z,), {}, TensorType("f32", (4,))))
    assert plan.first_write == {x: INPUT_STEP, y: 0, z: 1}
    assert plan.last_read == {x: 0, y: 1, z: 2}
    assert plan.frees_after == {1: [y]}
    other.last_read = {}
    assert other.last_read == {} and other.frees_after == {1: [y]}


def test_liveness_read_from_many_threads_at_once_is_filled_once():
    """Threads reading a new plan's liveness together all get the same maps (one fill)."""
    from concurrent.futures import ThreadPoolExecutor

    graph = Graph()
    x = graph.add_input(TensorType("f32", (4,)))
    nodes, value = [], x
    for _ in range(2000):
        value = Value("neg", (value,), {}, TensorType("f32", (4,)))
        nodes.append(value)
    graph.nodes, graph.outputs = nodes, [value]
    for _ in range(5):
        plan = plan_liveness(graph)
        with ThreadPoolExecutor(8) as pool:
            read = list(pool.map(lambda p: (p.frees_after, p.last_read), [plan] * 8))
        assert all(f is read[0][0] and last is read[0][1] for f, last in read)
        assert (plan.first_write, plan.last_read, plan.frees_after) == _eager(plan)
