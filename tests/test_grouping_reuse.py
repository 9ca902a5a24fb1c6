"""A new size of a symbolic plan reads back the kernel grouping of a size lowered before
(ir/grouping_reuse.py) only where it equals the grouping computed afresh: over random sizes
(a size of 1 and sizes equal to another dim among them), each size's reused grouping is the
fresh one, kernel for kernel; a size that answers a fusion question otherwise is grouped
afresh; and every size's values are the reference interpreter's."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backplan as bp
from backplan.ir import lowering
from backplan.ir.grouping_reuse import grouping_key
from backplan.runtime.backend import use_backend
from backplan.tracer.dynamic import DynamicEntry

RNG = np.random.default_rng(5)
W = bp.tensor(RNG.standard_normal((6, 4)).astype(np.float32), requires_grad=True)
B = bp.tensor(RNG.standard_normal((4,)).astype(np.float32), requires_grad=True)


def loss(w, b, x):
    """A GEMM with its epilogue, row loops (softmax), a reduction over the batch, a
    reshape adding a unit axis and one merging the batch with a dim of 4."""
    h = bp.tanh(x @ w + b)
    s = bp.softmax(h, axis=-1) * h
    column = bp.mean(s, axis=0)  # over the batch: a size of 1 reduces nothing
    flat = bp.reshape(h, (-1, 1))
    return bp.sum(s * column) + bp.sum(flat * flat) + bp.sum(bp.unsqueeze(column, 0) * h)


def loss_half(w, b, x):
    """A bfloat16 middle: the lowering widens it (ir/widen.py) before grouping."""
    h = bp.astype(bp.tanh(x @ w + b), bp.bfloat16)
    s = bp.astype(bp.softmax(h, axis=-1) * h, bp.float32)
    return bp.sum(s * bp.mean(s, axis=0)) + bp.sum(bp.reshape(s, (-1, 1)))


def batch(n: int):
    return bp.tensor(RNG.standard_normal((n, 6)).astype(np.float32))


def fitted_plan(step):
    (entry,) = [e for e in step._entries.values() if isinstance(e, DynamicEntry)]
    assert entry.fitted is not None, entry.reason
    return entry.fitted


def written(lowered) -> list:
    """The grouping as positions in the lowered graph and shapes as ints."""
    graph = lowered.plan.graph
    position = {v: i for i, v in enumerate(graph.inputs + graph.nodes)}

    def one(k):
        return (
            k.kind,
            [position[n] for n in k.nodes],
            tuple(k.shape),
            [position[n] for n in k.reductions],
            [position[n] for n in k.recomputed],
            None if k.epilogue is None else one(k.epilogue),
        )

    return [
        [one(k) for k in lowered.kernels],
        sorted(position[v] for v in lowered.materialized),
        list(lowered.row_runs),
    ]


def fresh(plan):
    """The lowering of the same plan with nothing to reuse (no symbolic plan's store)."""
    return lowering.lower(replace(plan, shared=None, lowered={}))


@pytest.fixture(scope="module", params=[loss, loss_half])
def symbolic(request):
    step = bp.value_and_grad(bp.compile(request.param, dynamic={"x": {0: "batch"}}), argnums=(0, 1))
    with use_backend("reference"):
        step(W, B, batch(8))
    return fitted_plan(step)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40))  # 0: a mean's 1/n has no value (0 is traced apart)
def test_a_reused_grouping_equals_the_grouping_computed_afresh(symbolic, n):
    plan = symbolic.at(n)[0]
    assert written(lowering.lower(plan)) == written(fresh(plan))


def test_a_size_of_the_same_answers_reuses_and_one_that_flips_a_unit_test_groups_afresh(
    monkeypatch,
):
    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "batch"}}), argnums=(0, 1))
    with use_backend("reference"):
        step(W, B, batch(8))
    symbolic = fitted_plan(step)
    grouped = []
    real = lowering.group_kernels
    monkeypatch.setattr(lowering, "group_kernels", lambda *a: grouped.append(1) or real(*a))
    for n in (11, 13):  # asks every fusion question as 8 does
        lowering.lower(symbolic.at(n)[0])
    assert grouped == []
    lowering.lower(symbolic.at(1)[0])  # a batch of 1: x @ w's rows and mean's axis are unit
    assert grouped == [1]
    lowering.lower(symbolic.at(4)[0])  # the batch equals w's 4 columns: shapes meet
    assert grouped == [1, 1]


def test_a_first_size_whose_dims_meet_leaves_later_sizes_the_probes_groupings(monkeypatch):
    """At 4 rows the batch meets w's 4 columns (shapes (4,) and rows of 4 alike): the sizes
    after it find the grouping of a probe traced at 8 or 12 rows, equal to a fresh one."""
    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "batch"}}), argnums=(0, 1))
    with use_backend("reference"):
        step(W, B, batch(4))
    symbolic = fitted_plan(step)
    template = symbolic.plan.graph
    assert grouping_key(template, None)[0] != grouping_key(symbolic.at(11)[0].graph, None)[0]
    grouped = []
    real = lowering.group_kernels
    monkeypatch.setattr(lowering, "group_kernels", lambda *a: grouped.append(1) or real(*a))
    plan = symbolic.at(11)[0]
    reused = written(lowering.lower(plan))
    assert grouped == []
    assert reused == written(fresh(plan))


@pytest.mark.parametrize("sizes", [(8, 11, 1, 4, 13, 0)])
def test_every_size_gives_the_reference_values_reused_grouping_or_not(sizes):
    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "batch"}}), argnums=(0, 1))
    for n in sizes:
        x = batch(n)
        with use_backend("numba"):
            value, (gw, gb) = step(W, B, x)
        with use_backend("reference"):
            expected, (ew, eb) = bp.value_and_grad(loss, argnums=(0, 1))(W, B, x)
        np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gw.numpy(), ew.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(gb.numpy(), eb.numpy(), rtol=1e-4, atol=1e-5)
    # one trace for every size but 0 and 1, which are traced apart (tracer/dynamic.py)
    assert step.cache_info().traces == 1 + len({n for n in sizes if n < 2})


def test_the_key_tells_apart_sizes_that_meet_another_dim():
    graph_at = {}
    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "batch"}}), argnums=(0, 1))
    with use_backend("reference"):
        step(W, B, batch(8))
    symbolic = fitted_plan(step)
    for n in (8, 9, 4, 1):
        graph_at[n] = symbolic.at(n)[0].graph
    key = {n: grouping_key(g, None)[0] for n, g in graph_at.items()}
    assert key[8] == key[9]
    assert key[4] != key[8] and key[1] != key[8] and key[1] != key[4]
