"""A memory budget on the training step users write: `bp.compile(step, max_peak_bytes=N)` around
`bp.value_and_grad(loss)` and an optimizer update (parameters and state donated). The inlined
value_and_grad's gradient part is where the step recomputes: the budget is met with the peak
explain predicts (checked to the byte), the same parameters as the default plan, or refused
before compiling with the smallest peak and what holds it there."""

from __future__ import annotations

import re

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, count_held, measure
from backplan.runtime.backend import use_backend

DEPTH, WIDTH, BATCH = 4, 32, 128  # 2-3 layers: no plan holds less once compiled (the
# gradient part's own buffers are as wide as what it would stop holding)


def loss_fn(params, x, y):
    h = x
    for w in params["ws"]:
        h = bp.tanh(h @ w)
    return bp.mean((h @ params["out"] - y) ** 2)


def parameters():
    rng = np.random.default_rng(1)
    ws = [(rng.standard_normal((WIDTH, WIDTH)) * 0.3).astype(np.float32) for _ in range(DEPTH)]
    out = (rng.standard_normal((WIDTH, 2)) * 0.3).astype(np.float32)
    return {"ws": [bp.tensor(w) for w in ws], "out": bp.tensor(out)}


def batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    return bp.tensor(x), bp.tensor(rng.standard_normal((BATCH, 2)).astype(np.float32))


OPT = bp.optim.adam(1e-2)


def train_step(**budget):
    @bp.compile(donate_argnums=(0, 1), **budget)
    def step(params, state, x, y):
        loss, grads = bp.value_and_grad(loss_fn)(params, x, y)
        params, state = OPT.update(grads, state, params)
        return params, state, loss

    return step


def frontier():
    params = parameters()
    return train_step().memory_frontier(params, OPT.init(params), *batch())


def three_steps(step):
    """(parameters after three steps, losses, the third step's measured peak, its explain)."""
    params = parameters()
    state = OPT.init(params)
    x, y = batch()
    losses = []
    for _ in range(2):
        params, state, loss = step(params, state, x, y)
        losses.append(loss.item())
    with measure() as measured:
        count_held([loss.numpy()])  # the loop: the second loss bound until the third returns
        params, state, loss = step(params, state, x, y)
    losses.append(loss.item())
    report = step.explain(params, state, x, y)
    return [np.asarray(p) for p in bp.tree.leaves(params)], losses, measured.peak, report


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_training_step_under_a_budget_holds_its_prediction_and_trains_the_same(backend):
    with use_backend(backend), checked_memory():
        points = frontier().points
        assert len(points) >= 2
        default, smallest = points[0].peak_bytes, points[-1].peak_bytes
        budget = (default + smallest) // 2
        budgeted = three_steps(train_step(max_peak_bytes=budget))
        plain = three_steps(train_step())
    params, losses, measured, report = budgeted
    assert report.peak_bytes <= budget < default
    assert measured == report.peak.allocated_peak_bytes  # the compiled step's own buffers
    assert plain[3].peak_bytes == default
    assert plain[2] == plain[3].peak.allocated_peak_bytes
    np.testing.assert_allclose(losses, plain[1], rtol=1e-6)
    for new, old in zip(params, plain[0], strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-7)
    assert f"To fit max_peak_bytes={budget:,}, the step recomputes" in " ".join(str(report).split())


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_budget_below_the_smallest_peak_is_refused_with_what_holds_it(backend):
    with use_backend(backend):
        smallest = frontier().points[-1].peak_bytes
        params = parameters()
        step = train_step(max_peak_bytes=smallest - 1)
        with pytest.raises(bp.MemoryBudgetError) as refused:
            step(params, OPT.init(params), *batch())
    text = str(refused.value)
    assert f"no plan fits max_peak_bytes={smallest - 1:,} bytes" in text
    assert f"The smallest peak any plan reaches is {smallest:,} B" in text
    assert re.search(
        r"gradients of the value_and_grad called at test_memory_budget_step.py:\d+", text
    )
    unit = "kernel" if backend == "numba" else "step"
    assert re.search(
        rf"That peak is reached at forward {unit} \d+ \(.*\) at "
        r"test_memory_budget_step.py:\d+: inputs",
        text,
    )
    assert "donated" in text  # the parameters and state passed in, by category
    if backend == "numba":
        assert re.search(r"scratch arena [\d,]+ B .*\(matmul f32\[128,32\] at test_memory", text)
    assert not step._plan_runners()  # refused before any plan was compiled


def test_saved_bytes_budget_on_a_training_step_is_met_with_the_same_parameters():
    """saved_bytes_budget counts the forward values the inlined gradients read (your own
    arrays apart): met by recomputing, with the same parameters as the default plan."""
    params = parameters()
    state = OPT.init(params)
    held = train_step().trace(params, state, *batch()).planner.choices.schedule.held_bytes()
    step = train_step(saved_bytes_budget=held // 2)
    planner = step.trace(params, state, *batch()).planner
    assert planner.recomputed_for[1].held_bytes <= held // 2
    budgeted, plain = three_steps(step), three_steps(train_step())
    for new, old in zip(budgeted[0], plain[0], strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-7)


def test_the_training_step_budget_bench_measures_what_it_predicts():
    """bench.memory_budget_train's rows: each plan's saved bytes within its budget, the
    checked mode's measured peak equal to the predicted one, recomputing adds FLOPs."""
    from backplan.bench.memory_budget_train import budget_rows

    params = parameters()
    rows = budget_rows(loss_fn, params, [np.asarray(a) for a in batch()], rounds=1)
    default, *budgeted = rows.values()  # 1/3 and 1/5 would peak higher here: not rows
    assert default["flops"] == 0 and budgeted and all(r["flops"] > 0 for r in budgeted)
    assert all(r["saved"] < default["saved"] and r["peak"] <= default["peak"] for r in budgeted)
    assert all(r["measured"] == r["peak"] for r in rows.values())
