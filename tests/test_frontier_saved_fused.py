"""memory_frontier's saved column on numba leaves out the held values the compiled plan computes
inside the loop that reads them (report/fused_saved.py). It counts them without describing
each row (a 10,086-node row's descriptions cost more than lowering it): the bytes must be
those of the fused rows explain lists (section 3: joint_saved_info, inlined_saved_info), for
every plan the frontier weighs: a value_and_grad chain, held views, 16-bit saved buffers, and
a training step whose gradients are inlined."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.ir.plans import JointPlans
from backplan.ir.reference_storage import storage_roots
from backplan.report.fused_saved import _roots, _stored, fused_held_bytes
from backplan.report.inlined_saved import inlined_saved_info
from backplan.report.joint_view import joint_saved_info, joint_view
from backplan.runtime.backend import use_backend


def described(plans) -> int:
    """The fused bytes as explain's rows give them."""
    if isinstance(plans, JointPlans):
        stored = _stored(plans.plan)
        view = joint_view(plans.plan, plans.n_outputs, list(plans.wrt), None, "")
        rows = joint_saved_info(plans.plan, view, stored)
    else:
        stored = _stored(plans.forward)
        rows = inlined_saved_info(plans.forward, plans.inlined_forward, None, stored)
    return sum(r.nbytes for r in rows if r.fused and not r.is_region_input)


def chain(ws, x):
    for w in ws:
        x = bp.tanh(x @ w)
    return bp.mean(x * x)


def viewed(ws, x):
    """Held reshapes and transposes of values the gradients read."""
    for w in ws:
        h = bp.tanh(x @ w)
        x = bp.reshape(bp.transpose(bp.reshape(h, (8, 4, 16)), (1, 0, 2)), (32, 16)) * h
    return bp.sum(x * x)


def arrays(n=5):
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((16, 16)) * 0.3).astype(np.float32) for _ in range(n)]
    return ws, rng.standard_normal((32, 16)).astype(np.float32)


def weighed(planner):
    """Every plan the planner's frontier weighs, narrowed ones too."""
    for narrowed in (False, True) if planner.allow_dtype else (False,):
        for point in planner.points():
            yield planner.build(point.drop, narrowed)


@pytest.mark.parametrize(
    "fn, allow", [(chain, None), (viewed, None), (chain, bp.bfloat16), (viewed, bp.bfloat16)]
)
def test_the_fused_bytes_are_those_of_the_rows_explain_lists(fn, allow):
    ws, x = arrays()
    with use_backend("numba"):
        step = bp.value_and_grad(fn, allow_saved_dtype=allow)
        _, entry = step.lookup((ws, x), {}, count_hit=False)
        found = [(fused_held_bytes(p), described(p)) for p in weighed(entry.planner)]
    assert len(found) >= 2
    assert [a for a, _ in found] == [b for _, b in found]
    if fn is chain and allow is None:
        assert any(a > 0 for a, _ in found)  # the tanh gradient's fused values are counted


def test_a_training_step_with_inlined_gradients_counts_the_same_fused_bytes():
    ws, x = arrays()
    params = [bp.tensor(w) for w in ws]
    opt = bp.optim.sgd(0.1)
    state = opt.init(params)
    grads_of = bp.value_and_grad(viewed)

    def train(params, state, x):
        loss, grads = grads_of(params, x)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    with use_backend("numba"):
        step = bp.compile(train, donate_argnums=(0, 1), max_peak_bytes=10**9)
        _, entry = step.lookup((params, state, bp.tensor(x)), {}, count_hit=False)
        found = [(fused_held_bytes(p), described(p)) for p in weighed(entry.planner)]
    assert len(found) >= 2
    assert [a for a, _ in found] == [b for _, b in found]


def test_each_values_root_from_its_own_view_chain_is_the_whole_graphs():
    """The roots taken from each value's own chain of views (reshapes that NumPy views and
    that it copies, transposes, slices) are storage_roots' over the whole graph."""
    ws, x = arrays(3)

    def views(ws, x):
        for w in ws:
            h = bp.tanh(x @ w)
            t = bp.transpose(bp.reshape(h, (8, 4, 16)), (1, 0, 2))
            x = bp.reshape(t, (32, 16)) * bp.reshape(h, (32, 1, 16))[:, 0, ::2].sum() + h[::2].sum()
        return bp.sum(x * x)

    plan = bp.value_and_grad(views).trace(ws, x).plan
    nodes = plan.graph.nodes
    whole = storage_roots(plan.graph)
    assert sum(whole[n] is not n for n in nodes) >= 6  # views of both kinds
    assert any(n.op == "reshape" and whole[n] is n for n in nodes)  # a reshape NumPy copies
    assert _roots(nodes) == {n: whole[n] for n in nodes}
