"""A plan chosen under a memory budget runs on the compiled (Numba) backend and gives the
default plan's values and gradients; the budget bench's runner calls work for several plans."""

from __future__ import annotations

import numpy as np
from test_memory_budget import arrays, deep_loss

import backplan as bp
from backplan.bench.memory_budget import plan_outputs, same_outputs
from backplan.runtime.backend import use_backend


def test_a_budgeted_joint_plan_runs_compiled_with_the_default_plans_results():
    ws, x, k = arrays()
    with use_backend("numba"):
        default = bp.value_and_grad(deep_loss)
        front = default.memory_frontier(ws, x, k)
        assert len(front.points) > 1
        budget = front.points[-1].peak_bytes
        budgeted = bp.value_and_grad(deep_loss, max_peak_bytes=budget)
        assert bp.explain(budgeted, ws, x, k).peak_bytes <= budget < front.points[0].peak_bytes
        (v0, g0), (v1, g1) = default(ws, x, k), budgeted(ws, x, k)
        assert budgeted.trace(ws, x, k).plan is not default.trace(ws, x, k).plan
    np.testing.assert_allclose(v1.numpy(), v0.numpy(), rtol=1e-5)
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-6)


def test_the_budget_bench_runs_the_default_and_a_recomputing_plan_compiled():
    ws, x, k = arrays()
    entry = bp.value_and_grad(deep_loss).trace(ws, x, k)
    points = entry.planner.points("saved")
    plans = [entry.planner.build(points[0].drop).plan, entry.planner.build(points[-1].drop).plan]
    with use_backend("numba"):
        _, outputs, _ = plan_outputs(plans, [ws, x, k])
    assert len(outputs[1]) == 1 + len(ws) and same_outputs(outputs[0], outputs[1])
    assert any(n.op == "matmul" for n in plans[1].graph.nodes[len(plans[1].graph.nodes) // 2 :])


def test_the_numba_frontier_is_planned_on_the_compiled_accounting():
    """Moves are judged by the peak the compiled step holds (outputs from the call's entry,
    the arena for the whole call), not the reference interpreter's: on this deep MLP a
    reference-driven planner found no move that lowers the compiled peak."""
    from backplan.bench.models import MODELS
    from backplan.bench.peers.backplan_peer import bench_function

    spec = MODELS["mlp_deep"]
    data = spec.make_inputs(dict(spec.config, depth=8, width=64, batch=64), 0).cast(np.float32)
    params = {k: bp.tensor(v) for k, v in data.params.items()}
    batch = [bp.tensor(a) for a in data.batch(True)]
    with use_backend("numba"):
        front = bp.value_and_grad(bench_function(spec)).memory_frontier(params, *batch)
    peaks = [p.peak_bytes for p in front.points]
    assert len(peaks) >= 3 and peaks[-1] < 0.95 * peaks[0]


def test_a_compiled_loss_that_backward_follows_meets_a_budget_below_its_default_peak():
    """bp.compile(f, max_peak_bytes=N) for a loss backward() follows (a forward plan, then a
    backward plan): the schedule's simulation of the two plans saw no gain in recomputing, so
    every budget under the default peak was refused ("recomputing in the backward lowers it no
    further") while a saved_bytes_budget plan of the same function peaked lower. The frontier
    now has that plan, and the budget runs it, counted by the checked mode."""
    from backplan.bench.internals import checked_memory, measure

    rng = np.random.default_rng(0)
    ws = {
        f"w{i}": bp.tensor(rng.standard_normal((16, 16)).astype(np.float32), requires_grad=True)
        for i in range(8)
    }
    x = rng.standard_normal((64, 16)).astype(np.float32)

    def chain(ws, x):
        for w in ws.values():
            x = bp.tanh(x @ w)
        return bp.mean(x * x)

    with use_backend("numba"), checked_memory():
        peaks = [p.peak_bytes for p in bp.compile(chain).memory_frontier(ws, x).points]
        assert len(peaks) > 1 and peaks[-1] < peaks[0]
        budgeted = bp.compile(chain, max_peak_bytes=peaks[0] - 1)
        assert bp.explain(budgeted, ws, x).peak_bytes <= peaks[0] - 1
        with measure() as counted:
            for _ in range(3):
                bp.zero_grad(ws)
                budgeted(ws, x).backward()
    yours = sum(w.nbytes for w in ws.values()) + x.nbytes
    assert counted.peak + yours <= peaks[0] - 1
