"""A memory plan's rows share the default graph's nodes up to their first recomputed value
(ir/graph.py copy_graph `keep`, ir/remat.py), and each row's fusion grouping resumes from the
row before's where the two stop sharing nodes (ir/grouping_resume.py). Exact: every plan
memory_frontier lowers has the fingerprint (bench/frontier_digest.py: kernels, buffers,
steps, offsets, by place) of the same plan built with every node copied and grouped afresh,
and the rows, floor and a budget's choice are the same."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backplan as bp
from backplan.bench import frontier_digest, internals
from backplan.bench.budget_models import MODEL_MAKERS, deep_chain
from backplan.ir import epilogue, grouping_resume, remat
from backplan.runtime.backend import use_backend

LAYERS = ("tanh", "relu", "softmax", "layer_norm", "sum", "shared", "view", "bfloat16", "wide")


def _layer(kind: str, h, kept: list):
    """Chains, row reductions (softmax, layer norm, a row sum broadcast back: loops with
    reduction tails, some spanning where a row's shared nodes end), a value every later
    shared layer reads, views, a 16-bit round trip (read-backs: grouped afresh), a wider GEMM."""
    if kind == "tanh":
        return bp.tanh(h)
    if kind == "relu":
        return bp.maximum(h, 0.0) + 0.1 * h
    if kind == "softmax":
        return bp.softmax(h, axis=-1)
    if kind == "layer_norm":
        return bp.layer_norm(h)
    if kind == "sum":
        return bp.tanh(h - bp.sum(h * h, axis=1, keepdims=True) * 0.01)
    if kind == "view":
        return bp.tanh(h.reshape(4, 16).T.reshape(8, 8).T)
    if kind == "bfloat16":
        return bp.tanh(h.astype(bp.bfloat16)).astype(bp.float32)
    if kind == "wide":
        return bp.tanh(bp.concatenate([h, h * 2.0], axis=1)[:, 3:11])
    kept.append(bp.tanh(h))  # "shared"
    return kept[-1] + kept[0] if len(kept) > 1 else kept[-1]


def _model(kinds: tuple[str, ...], seed: int):
    rng = np.random.default_rng(seed)
    ws = {
        f"w{i}": (rng.standard_normal((8, 8)) * 0.3).astype(np.float32) for i in range(len(kinds))
    }

    def loss(ws, x):
        kept: list = []
        for i, kind in enumerate(kinds):
            x = _layer(kind, x @ ws[f"w{i}"], kept)
        return bp.mean(x * x)

    return loss, ws, (rng.standard_normal((8, 8)).astype(np.float32),)


@contextmanager
def _counted_resumes():
    """Yields [how many groupings resumed, nodes placed again saved]."""
    counted, original = [0, 0], grouping_resume.resumed_state

    def counting(journal, nodes, bases, **more):
        state = original(journal, nodes, bases, **more)
        counted[0] += 1
        counted[1] += state[0]
        return state

    grouping_resume.resumed_state = counting
    try:
        yield counted
    finally:
        grouping_resume.resumed_state = original


@contextmanager
def _nothing_shared():
    """Every row's graph a whole copy (as before rows shared nodes): nothing resumes."""
    original = remat._first_reader
    remat._first_reader = lambda graph, forward, chosen: 0
    try:
        yield
    finally:
        remat._first_reader = original


def _frontier(fn, params, batch, step: str):
    """(each lowered plan's fingerprint, rows and floor, the plan a budget between the
    first and last rows picks: its recomputed values and peak) on numba."""
    with use_backend("numba"), frontier_digest.fingerprinted_lowerings() as lowered:
        if step == "value_and_grad":
            traced = bp.value_and_grad(fn)
            traced.trace(params, *batch)
            frontier = traced.memory_frontier(params, *batch)
            planner = traced.trace(params, *batch).planner
        else:
            opt = bp.optim.adam(1e-3)

            @bp.compile(donate_argnums=(0, 1), background=False)
            def train(params, state, *batch):
                value, grads = bp.value_and_grad(fn)(params, *batch)
                params, state = opt.update(grads, state, params)
                return params, state, value

            tensors = bp.tree.map(bp.tensor, params)
            args = (tensors, opt.init(tensors), *batch)
            frontier = train.memory_frontier(*args)
            planner = train.lookup(args, {}, count_hit=False)[1].planner
        peaks = [p.peak_bytes for p in frontier.points]
        limit = (peaks[0] + peaks[-1]) // 2
        try:
            planner.fit_peak(limit)
            chosen = planner.recomputed_for[1].drop if planner.recomputed_for else frozenset()
        except bp.MemoryBudgetError as refused:
            chosen = str(refused)
    return list(lowered), (frontier.points, frontier.floor), chosen


@contextmanager
def _counted_epilogue_tests():
    """Yields [how many times a GEMM and the loop after it were tested for an epilogue]."""
    counted, original = [0], epilogue._absorbs

    def counting(*args):
        counted[0] += 1
        return original(*args)

    epilogue._absorbs = counting
    try:
        yield counted
    finally:
        epilogue._absorbs = original


def _same_as_fresh(fn, params, batch, step: str = "value_and_grad", tested=None) -> int:
    """Asserts the frontier's plans equal to those built with nothing shared; returns the
    groupings that resumed. tested, if given, gets the epilogue tests made with and without
    sharing."""
    with _counted_resumes() as resumed, _counted_epilogue_tests() as shared_tests:
        shared = _frontier(fn, params, batch, step)
    with _nothing_shared(), _counted_resumes() as none, _counted_epilogue_tests() as tests:
        fresh = _frontier(fn, params, batch, step)
    assert none[0] == 0
    assert shared[0] == fresh[0]  # every plan lowered, fingerprint for fingerprint
    assert shared[1:] == fresh[1:]  # rows and floor, and a budget's choice
    if tested is not None:
        tested += [shared_tests[0], tests[0]]
    return resumed[0]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(LAYERS), min_size=3, max_size=9).map(tuple),
    step=st.sampled_from(("value_and_grad", "train")),
    seed=st.integers(0, 3),
)
def test_a_resumed_grouping_lowers_every_row_as_a_fresh_one(kinds, step, seed):
    _same_as_fresh(*_model(kinds, seed), step)


def test_the_chain_rows_resume_and_lower_as_fresh_ones():
    """A 40-layer tanh chain: every row after the second resumes (its grouping places only
    the nodes from its first recomputed value on), and each plan is the fresh plan; the
    GEMMs before that point followed by a loop the row before's grouping left unchanged take
    its epilogue answers (fewer GEMMs tested, the same kernels)."""
    tested: list = []
    assert _same_as_fresh(*deep_chain(40), tested=tested) >= 3
    shared, fresh = tested
    assert shared < fresh * 0.8


@pytest.mark.parametrize("name", ["mlp_deep", "transformer"])
def test_bench_model_rows_lower_as_fresh_ones(name):
    _same_as_fresh(*MODEL_MAKERS[name]())


def test_a_shared_value_is_the_default_graphs_own_and_never_changed():
    """A row's graph keeps the default graph's inputs and nodes before its first recomputed
    value as they are (no copy), and building and lowering the row changes none of them."""
    fn, params, batch = deep_chain(8)
    with use_backend("numba"):
        planner = bp.value_and_grad(fn).trace(params, *batch).planner
        default = planner.choices.stage.forward
        before = [(n.op, n.inputs, dict(n.attrs), n.type) for n in default.nodes]
        drop = max((p.drop for p in planner.points()), key=len)
        row = planner.build(drop).named
        (plan,) = row.values()
        graph = plan.graph
        assert graph.shares_prefix_of is default
        kept = next(
            i
            for i, (a, b) in enumerate(zip(graph.nodes, default.nodes, strict=False))
            if a is not b
        )
        assert 0 < kept < len(default.nodes) and graph.inputs == default.inputs
        assert all(a is b for a, b in zip(graph.inputs, default.inputs, strict=True))
        assert internals.lowering.lower(plan).kernels
        assert [(n.op, n.inputs, dict(n.attrs), n.type) for n in default.nodes] == before


def _by_place(graph, kernels) -> list:
    place = {v: i for i, v in enumerate([*graph.inputs, *graph.nodes])}

    def at(values) -> list:
        return [place[v] for v in values]

    return [(k.kind, at(k.nodes), at(k.reductions), at(k.recomputed), k.shape) for k in kernels]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(LAYERS), min_size=2, max_size=8).map(tuple),
    at=st.floats(0.0, 1.0),
    back=st.integers(0, 12),
)
def test_grouping_resumed_after_any_number_of_shared_nodes_is_the_fresh_grouping(kinds, at, back):
    """Any q: a graph whose first q nodes are another's, grouped from that one's journal
    (loops open across q included), gives the kernels (nodes, reductions, recomputed values)
    grouping it afresh gives; and so does a third graph sharing fewer nodes, grouped from the
    journal of that resumed grouping (the rows of a frontier, each from the row before)."""
    from backplan.ir.fusion import group_kernels
    from backplan.ir.graph import copy_graph
    from backplan.ir.grouping_resume import recorder, resumer

    fn, params, batch = _model(kinds, 0)
    with use_backend("numba"):
        graph = bp.value_and_grad(fn).trace(params, *batch).planner.choices.stage.forward
    first: list = []
    group_kernels(graph, record=recorder(first))
    q = round(at * len(graph.nodes))
    sharer, _ = copy_graph(graph, keep=q)
    second: list = []
    resumed = group_kernels(sharer, resume=resumer(first[0]), record=recorder(second))
    assert _by_place(sharer, resumed) == _by_place(sharer, group_kernels(sharer))
    third, _ = copy_graph(graph, keep=max(q - back, 0))
    resumed = group_kernels(third, resume=resumer(second[0]))
    assert _by_place(third, resumed) == _by_place(third, group_kernels(third))
