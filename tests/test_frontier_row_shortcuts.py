"""What a memory frontier's rows take from their rewrite and lowering instead of walking their
graphs again must be what the walks give: the held values a recomputing joint plan knows from
ir/remat.py (held_recomputed) are held_across of its graph, the graph inputs left out, and
the fused bytes of the saved column follow from them alike; the op kernels a lowering notes
(LoweredPlan.op_kinds) are its kernels'; lifetimes, which asks storage roots of views only,
gives each root the latest read of it or of any view of it."""

from __future__ import annotations

import numpy as np
import pytest
from test_frontier_saved_fused import arrays, chain, viewed  # the same small models

import backplan as bp
from backplan.codegen.render.opaque import unsupported_reason
from backplan.ir.layout import Roots, lifetimes, storage_root
from backplan.ir.lowering import _buffers, lower
from backplan.ir.plans import JointPlans
from backplan.ir.remat import forward_nodes, held_across
from backplan.report import fused_saved
from backplan.runtime.backend import use_backend


def cast(ws, x):
    """A narrowing cast in the forward part: its rows walk their graphs."""
    for w in ws:
        x = bp.tanh(x @ w).astype(np.float16).astype(np.float32)
    return bp.sum(x * x)


def _rows(fn, **options):
    """The planner and every recomputing plan of its frontier, built, and plans recomputing
    the first held values, one more each time (a frontier may have no such row)."""
    ws, x = arrays()
    step = bp.value_and_grad(fn, **options)
    planner = step.trace(ws, x).planner
    held = planner.choices.schedule.held
    drops = [p.drop for p in planner.points() if p.drop]
    drops += [frozenset(held[: k + 1]) for k in range(0, len(held), 2)]
    return planner, [planner.build(drop) for drop in drops]


def _walked(plans: JointPlans) -> list:
    graph = plans.plan.graph
    held = held_across(graph, forward_nodes(graph, plans.n_outputs))
    return [v for v in held if v.op != "input"]


@pytest.mark.parametrize("fn", [chain, viewed])
def test_a_rows_held_values_are_what_its_graph_holds(fn):
    with use_backend("numba"):
        _, rows = _rows(fn)
        assert len(rows) >= 2
        for plans in rows:
            assert plans.held_values is not None
            assert len(set(plans.held_values)) == len(plans.held_values)
            assert set(plans.held_values) == set(_walked(plans))
            known = fused_saved.fused_held_bytes(plans)
            plans.held_values = None  # walked, as for any other plan
            assert fused_saved.fused_held_bytes(plans) == known


def test_rows_with_a_forward_cast_or_a_saved_dtype_walk_their_graphs():
    with use_backend("numba"):
        planner, rows = _rows(cast)
        assert rows and all(plans.held_values is None for plans in rows)
        _, rows = _rows(chain, saved_dtype=bp.bfloat16)
        assert rows and all(plans.held_values is None for plans in rows)


def _walked_lifetimes(lowered) -> dict:
    """Each storage root's latest read, every input of every node a kernel computes asked."""
    last = {}
    for step, kernel in zip(lowered.steps, lowered.kernels, strict=True):
        for node in kernel.computed:
            for value in node.inputs:
                root = storage_root(value)
                last[root] = max(last.get(root, -1), step)
    for out in lowered.plan.graph.outputs:
        last[storage_root(out)] = len(lowered.kernels)
    return last


@pytest.mark.parametrize("fn", [chain, viewed, cast])
def test_lifetimes_and_op_kinds_are_the_kernels(fn):
    _, rows = _rows(fn)
    for plans in rows:
        lowered = lower(plans.plan)
        graph = lowered.plan.graph
        found = lifetimes(graph, lowered.kernels, lowered.steps, Roots())
        assert found == _walked_lifetimes(lowered)
        # the latest reads the lowering takes in its walk for the buffers, as it lays out
        read = _buffers(lowered.kernels, lowered.steps, lowered.materialized)[3]
        assert lifetimes(graph, lowered.kernels, lowered.steps, Roots(), read) == found
        ops = [(k.nodes[0].op, k.nodes[0].dtype) for k in lowered.kernels if k.kind == "op"]
        assert list(lowered.op_kinds) == list(dict.fromkeys(ops))
        assert unsupported_reason(lowered) is None


def test_an_op_without_a_compiled_form_is_named_from_the_noted_kinds():
    ws, x = arrays()
    lowered = lower(bp.value_and_grad(chain).trace(ws, x).planner.build().plan)
    table = {"matmul": None}
    lowered.op_kinds = (("const", "f32"), ("sort", "f32"), *table.items())
    assert unsupported_reason(lowered) == "no compiled form for sort"
    lowered.op_kinds = (("matmul", "i32"),)
    assert unsupported_reason(lowered) == "integer matmul"


def biased(ws, x):
    """Broadcast biases (aliases the loops read) and a 16-bit cast."""
    for w in ws:
        b = bp.sum(w, axis=0)
        x = bp.tanh(x @ w + b) * bp.reshape(b, (1, 16))
    return bp.sum(x.astype(bp.bfloat16).astype(np.float32) * x)


@pytest.mark.parametrize("fn, aliases", [(viewed, False), (biased, True)])
def test_readers_of_the_values_asked_are_those_of_every_value(fn, aliases):
    """_readers asks each input whether it stands for a wanted value (itself or an alias of
    one) before looking its base up: the same readers as the walk of every value."""
    from backplan.ir.fusion import Bases, _readers, group_kernels

    ws, x = arrays()
    graph = bp.value_and_grad(fn).trace(ws, x).planner.build().plan.graph
    homes: list = []
    kernels = group_kernels(graph, None, Bases(), homes=homes)
    every = _readers(kernels, homes[0], graph.outputs, Bases())
    aliased = [k.nodes[0] for k in kernels if k.kind in ("alias", "literal")]
    assert any(Bases()[a] is not a for a in aliased) == aliases  # loops reading aliases
    values = list(every)
    # each node read as its home kernel's, the loops' recomputed values as theirs: the same
    loops = [k for k, kernel in enumerate(kernels) if kernel.kind == "loop"]
    assert any(kernels[k].recomputed for k in loops)
    assert _readers(kernels, homes[0], graph.outputs, Bases(), None, graph.nodes, loops) == every
    for wanted in (set(values), set(values[::3]), set(values[1::2])):
        asked = _readers(kernels, homes[0], graph.outputs, Bases(), wanted)
        assert asked == {v: r for v, r in every.items() if v in wanted}
        by_node = _readers(kernels, homes[0], graph.outputs, Bases(), wanted, graph.nodes, loops)
        assert by_node == asked


def test_value_dtypes_answer_has_half_and_the_float64_question():
    from backplan.ir.widen import half_among, has_half, value_dtypes

    ws, x = arrays()
    for fn in (chain, cast):
        graph = bp.value_and_grad(fn).trace(ws, x).planner.build().plan.graph
        dtypes = value_dtypes(graph)
        assert half_among(dtypes) == has_half(graph) == (fn is cast)
        assert dtypes == {v.dtype for v in [*graph.inputs, *graph.nodes]}
        assert "f64" not in dtypes


@pytest.mark.parametrize("fn", [chain, cast, biased])
def test_a_rows_dtypes_from_its_shared_values_are_its_values(fn):
    """row_dtypes reads only the nodes after those a row shares, the shared ones' dtypes
    from where each first appears in the graph shared (worked out once, or handed on):
    value_dtypes of the row's graph, and the first places the same from either."""
    from backplan.ir.widen import row_dtypes, value_dtypes

    _, rows = _rows(fn)
    graphs = [plans.plan.graph for plans in rows if plans.plan.graph.shares_prefix_of]
    assert len(graphs) >= 2
    first = None
    for graph in graphs:
        found, given = row_dtypes(graph, first)
        assert found == value_dtypes(graph) == row_dtypes(graph)[0]
        assert given == row_dtypes(graph)[1]
        first = given
    # a dtype only after the shared nodes counts; one the shared graph has only later does not
    from backplan.ir.graph import Value, copy_graph
    from backplan.ir.types import TensorType

    source = graphs[0].shares_prefix_of
    row, _ = copy_graph(source, keep=1)
    row.nodes = row.nodes[:1]
    assert row_dtypes(row, first)[0] == value_dtypes(row) == {"f32"}
    last = row.nodes[-1]
    row.nodes.append(Value("astype", (last,), {"dtype": "f64"}, TensorType("f64", last.shape)))
    assert row_dtypes(row, first)[0] == value_dtypes(row) == {"f32", "f64"}


def test_a_grouping_knows_its_loops_from_what_each_reads():
    """group_kernels takes every loop's index from its reads (a resumed grouping's from the
    journal's too) instead of walking the kernels: each row's journal lists its loops as the
    walk does, rows resumed from the row before among them."""
    planner, rows = _rows(chain)
    journals = 0
    for plans in rows:
        journal = lower(plans.plan).grouping
        if journal is None:
            continue
        journals += 1
        walked = [k for k, kernel in enumerate(journal.kernels) if kernel.kind == "loop"]
        assert journal.loops == walked and walked
    assert journals >= 3


def _walked_needed(graph, kernels, home) -> set:
    """The values needing a buffer, every input of every kernel asked, each value's kernel
    looked up: outputs, what a loop or alias reads from another kernel that is no literal,
    every operand of any other kernel; then those a literal or alias kernel holds left out."""
    from backplan.ir.fusion import alias_base

    needed = {alias_base(o) for o in graph.outputs} | set(graph.outputs)
    for k, kernel in enumerate(kernels):
        for node in kernel.computed:
            for value in node.inputs:
                source = alias_base(value)
                owner = home.get(source)
                if kernel.kind in ("loop", "alias") and (
                    owner == k
                    or source in kernel.recomputed
                    or (owner is not None and kernels[owner].kind == "literal")
                ):
                    continue
                needed.add(source)
    return {v for v in needed if v in home and kernels[home[v]].kind not in ("literal", "alias")}


def literal_operand(ws, x):
    """A GEMM of a literal (bp.ones): its operand is a literal kernel's value, and so is the
    gradient's (the transpose of it a GEMM reads)."""
    for w in ws:
        x = bp.tanh(x @ w)
    return bp.sum(x @ bp.ones((16, 16), dtype=np.float32))


@pytest.mark.parametrize("fn", [chain, viewed, biased, literal_operand])
def test_the_values_needing_a_buffer_are_the_walks(fn):
    """materialized leaves out the values of literal and alias kernels by set operations:
    the same values as the walk looking up each one's kernel (aliases and literals among
    the kernels, so leaving them in fails)."""
    from backplan.ir.fusion import Bases, group_kernels, materialized

    _, rows = _rows(fn)
    for graph in [rows[0].plan.graph.shares_prefix_of, *(p.plan.graph for p in rows)]:
        homes: list = []
        kernels = group_kernels(graph, None, Bases(), homes=homes)
        found = materialized(graph, kernels, Bases(), homes[0])
        assert found == _walked_needed(graph, kernels, homes[0])
    assert any(k.kind in ("alias", "literal") for k in kernels)


def unused_last(ws, x):
    """The last weight is never read: its gradient is a literal (zeros), an output."""
    for w in ws[:-1]:
        x = bp.tanh(x @ w)
    return bp.sum(x * x)


@pytest.mark.parametrize("fn, literal", [(chain, False), (unused_last, True)])
def test_literal_outputs_are_the_outputs_whose_base_a_literal_kernel_holds(fn, literal):
    """literal_outputs walks the kernels only where an output's base is a `full` node: the
    outputs whose alias base is a literal kernel's node, as the walk of every kernel finds."""
    from backplan.ir.fusion import alias_base
    from backplan.ir.lowering import literal_nodes, literal_outputs

    ws, x = arrays()
    lowered = lower(bp.value_and_grad(fn).trace(ws, x).planner.build().plan)
    literals = literal_nodes(lowered.kernels)
    outputs = lowered.plan.graph.outputs
    walked = {i: alias_base(o) for i, o in enumerate(outputs) if alias_base(o) in literals}
    assert literal_outputs(lowered) == walked
    assert bool(walked) == literal
