"""max_peak_bytes: a budget met by recomputing (any op, matmuls and tanh included) or refused
before anything compiles; the frontier of plans it chooses from; bp.max_batch."""

from __future__ import annotations

import os

import numpy as np
import pytest

import backplan as bp
from backplan.ir.budget import plan_frontier
from backplan.tracer.budget import step_peak_bytes

DEPTH, WIDTH, BATCH = 8, 16, 32


def deep_loss(ws, x, k):
    h = x
    for i, w in enumerate(ws):
        h = bp.tanh(h @ w)
        if i == 2:
            h = bp.dropout(h, 0.25, k)
    return (h * h).sum()


def arrays(batch=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    ws = [(rng.standard_normal((WIDTH, WIDTH)) * 0.4).astype(np.float32) for _ in range(DEPTH)]
    return ws, rng.standard_normal((batch, WIDTH)).astype(np.float32), bp.random.key(3)


def step_peak(fn, *args) -> int:
    report = bp.explain(fn, *args)
    return report.peak_bytes  # the arrays passed in included


def test_a_budget_below_the_default_peak_is_met_with_the_same_bits():
    ws, x, k = arrays()
    default = bp.value_and_grad(deep_loss)
    default_peak = step_peak(default, ws, x, k)
    front = default.memory_frontier(ws, x, k)
    budget = front.points[len(front.points) // 2].peak_bytes
    assert budget < default_peak
    budgeted = bp.value_and_grad(deep_loss, max_peak_bytes=budget)
    assert step_peak(budgeted, ws, x, k) <= budget
    plan = budgeted.trace(ws, x, k).plan
    assert any(n.op == "matmul" for n in plan.graph.nodes[len(plan.graph.nodes) // 2 :])
    (v0, g0), (v1, g1) = default(ws, x, k), budgeted(ws, x, k)
    assert v0.numpy().tobytes() == v1.numpy().tobytes()
    for a, b in zip(g0, g1, strict=True):
        assert a.numpy().tobytes() == b.numpy().tobytes()


def test_compile_under_a_budget_recomputes_and_keeps_the_gradients():
    ws, x, k = arrays()
    params = [bp.tensor(w, requires_grad=True) for w in ws]
    default = bp.compile(deep_loss)
    front = default.memory_frontier(params, x, k)
    assert len(front.points) > 2
    budget = front.points[-1].peak_bytes
    budgeted = bp.compile(deep_loss, max_peak_bytes=budget)
    report = bp.explain(budgeted, params, x, k)
    assert report.peak_bytes <= budget
    assert {r.op for r in report.recomputed} >= {"tanh"}
    grads = []
    for fn in (default, budgeted):
        bp.zero_grad(params)
        fn(params, x, k).backward()
        grads.append([p.grad.numpy().tobytes() for p in params])
    assert grads[0] == grads[1]


def test_a_budget_no_plan_reaches_is_refused_before_compiling():
    ws, x, k = arrays()
    front = bp.value_and_grad(deep_loss).memory_frontier(ws, x, k)
    smallest = front.points[-1].peak_bytes
    fn = bp.value_and_grad(deep_loss, max_peak_bytes=smallest - 1)
    with pytest.raises(bp.MemoryBudgetError) as caught:
        fn(ws, x, k)
    message = str(caught.value)
    assert f"{smallest:,} B" in message and "added FLOPs" in message
    assert "test_memory_budget.py:" in message and "bp.max_batch" in message
    assert fn.cache_info().traces == 0 and fn.driver_tier is None


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "1MB"])
def test_a_budget_that_is_not_a_positive_int_is_refused(bad):
    with pytest.raises((TypeError, ValueError), match=f"max_peak_bytes.*{bad!r}"):
        bp.compile(deep_loss, max_peak_bytes=bad)
    with pytest.raises((TypeError, ValueError), match="max_peak_bytes"):
        bp.value_and_grad(deep_loss, max_peak_bytes=bad)


def test_a_budget_below_the_arrays_passed_in_is_refused_with_the_numbers():
    ws, x, k = arrays()
    inputs = sum(w.nbytes for w in ws) + x.nbytes + 16  # the key: two uint64
    with pytest.raises(bp.MemoryBudgetError, match=f"1,000 is smaller.*{inputs:,} B") as info:
        bp.value_and_grad(deep_loss, max_peak_bytes=1000)(ws, x, k)
    assert str(info.value).count(f"{inputs:,}") == 1  # said once: (10,256 B (10.0 KiB))


def _training_step(outer=None, inner=None, saved=None):
    @bp.compile(max_peak_bytes=outer, saved_bytes_budget=saved)
    def step(ws, x, k):
        loss, grads = bp.value_and_grad(deep_loss, max_peak_bytes=inner)(ws, x, k)
        return [w - 0.1 * g for w, g in zip(ws, grads, strict=True)], loss

    return step


def test_a_budget_on_a_training_step_recomputes_in_its_inlined_gradients():
    """The step's plan inlines the value_and_grad's: a budget on the step recomputes in that
    gradient part (the dropout mask from its key, bit for bit), down to the smallest peak of
    the step's own frontier; saved_bytes_budget counts what those gradients read."""
    ws, x, k = arrays()
    front = _training_step().memory_frontier(ws, x, k)
    default, smallest = front.points[0].peak_bytes, front.points[-1].peak_bytes
    assert smallest < default
    new_ws, loss = _training_step(outer=smallest)(ws, x, k)
    plain_ws, plain_loss = _training_step()(ws, x, k)
    assert _training_step(outer=smallest).explain(ws, x, k).peak_bytes <= smallest
    np.testing.assert_allclose(loss.numpy(), plain_loss.numpy(), rtol=1e-6)
    for new, old in zip(new_ws, plain_ws, strict=True):
        np.testing.assert_allclose(new.numpy(), old.numpy(), rtol=1e-6, atol=1e-7)
    with pytest.raises(bp.MemoryBudgetError, match=rf"reaches is {smallest:,} B"):
        _training_step(outer=smallest - 1)(ws, x, k)
    planner = _training_step().trace(ws, x, k).planner
    fewest = planner.saved_chain(planner.build())[-1].saved  # at a peak no higher
    assert fewest < planner.choices.schedule.held_bytes()
    saved_ws, _ = _training_step(saved=fewest)(ws, x, k)
    with pytest.raises(bp.MemoryBudgetError, match="saved_bytes_budget=1 cannot be met"):
        _training_step(saved=1)(ws, x, k)
    for new, old in zip(saved_ws, plain_ws, strict=True):
        np.testing.assert_allclose(new.numpy(), old.numpy(), rtol=1e-6, atol=1e-7)


def test_a_budgeted_value_and_grad_inside_a_compiled_step_is_refused():
    """Inlined, the step's peak is what a budget must bound: the budget on the value_and_grad
    is refused, pointing at the step's; called on its own it is met."""
    ws, x, k = arrays()
    smallest = bp.value_and_grad(deep_loss).memory_frontier(ws, x, k).points[-1].peak_bytes
    with pytest.raises(
        bp.MemoryBudgetError,
        match=rf"value_and_grad\(deep_loss, max_peak_bytes={smallest:,}\) at "
        r"test_memory_budget.py:\d+ is called inside a traced function.*Give the budget to "
        rf"the step instead: bp.compile\(step, max_peak_bytes={smallest:,}\)",
    ):
        _training_step(inner=smallest)(ws, x, k)
    assert bp.value_and_grad(deep_loss, max_peak_bytes=smallest).explain(ws, x, k).peak_bytes <= (
        smallest
    )


def test_saved_bytes_budget_is_met_by_recomputing_a_matmul_and_tanh():
    rng = np.random.default_rng(1)
    w = bp.tensor(rng.standard_normal((8, 8)).astype(np.float32), requires_grad=True)
    x = bp.tensor(rng.standard_normal((4, 8)).astype(np.float32))

    def f(w, x):
        return bp.sum(bp.tanh(bp.tanh(x @ w) @ w))

    assert bp.explain(bp.compile(f), w, x).saved_bytes - 8 * 8 * 4 - 4 * 8 * 4 > 0
    report = bp.explain(bp.compile(f, saved_bytes_budget=1), w, x)
    assert report.saved_bytes == report.saved_input_bytes  # only w and x: nothing computed
    assert {r.op for r in report.recomputed} == {"tanh"}


def test_the_frontier_is_monotone_and_each_budget_picks_a_plan_no_higher():
    ws, x, k = arrays()
    front = bp.value_and_grad(deep_loss).memory_frontier(ws, x, k)
    peaks = [p.peak_bytes for p in front.points]
    flops = [p.added_flops for p in front.points]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert flops == sorted(flops) and flops[0] == 0
    budgets = sorted({p + d for p in peaks for d in (0, 100)}, reverse=True)
    chosen = [step_peak(bp.value_and_grad(deep_loss, max_peak_bytes=b), ws, x, k) for b in budgets]
    assert all(c <= b for c, b in zip(chosen, budgets, strict=True))
    assert chosen == sorted(chosen, reverse=True)
    assert "memory frontier of deep_loss" in str(front)


def test_the_simulated_peak_is_the_joint_plans_peak():
    ws, x, k = arrays()
    fn = bp.value_and_grad(deep_loss)
    entry = fn.trace(ws, x, k)
    choices = entry.planner.choices
    inputs = entry.planner.input_bytes
    kept = sum(w.nbytes for w in ws) + 4  # a loop's last gradients and loss, bound throughout
    for point in plan_frontier(choices.schedule):
        assert step_peak_bytes(choices.build(point.drop)) == inputs + point.peak + kept


def test_first_moves_keep_segments_short():
    """The planner drops values whose chains meet no other recomputed one first, as sqrt(n)
    checkpointing keeps every other value rather than recomputing a long run at once."""
    ws, x, k = arrays()
    entry = bp.value_and_grad(deep_loss).trace(ws, x, k)
    schedule = entry.planner.choices.schedule
    points = plan_frontier(schedule)
    tanhs = [i for i in schedule.held if schedule.values[i].op == "tanh"]
    first = next(p for p in points if len(p.drop) >= 2).drop
    dropped = sorted(tanhs.index(i) for i in first if i in tanhs)
    assert all(b - a > 1 for a, b in zip(dropped, dropped[1:], strict=False))


def test_max_batch_fits_and_one_more_does_not():
    ws, x, k = arrays()
    budget = 40_000
    batch = bp.max_batch(bp.value_and_grad(deep_loss), (ws, x, k), max_peak_bytes=budget)
    assert 0 < batch < 10_000
    for size, fits in ((batch, True), (batch + 1, False)):
        xb = np.resize(x, (size, WIDTH))
        fn = bp.value_and_grad(deep_loss, max_peak_bytes=budget)
        if fits:
            assert step_peak(fn, ws, xb, k) <= budget
            value, _ = fn(ws, xb, k)
            assert np.isfinite(value.item())
        else:
            with pytest.raises(bp.MemoryBudgetError):
                fn(ws, xb, k)


def test_explain_reports_the_frontier_max_peak_bytes_chooses_from():
    ws, x, k = arrays()
    fn = bp.value_and_grad(deep_loss)
    report = fn.explain(ws, x, k)
    assert report.frontier.points == fn.memory_frontier(ws, x, k).points
    assert len(report.frontier.points) > 2
    assert str(report.frontier) in str(report).replace("\n  ", "\n")


def test_a_donating_step_is_budgeted_at_the_peak_explain_prints():
    # the new parameters and momentum go into the donated buffers: the budget planner must
    # not count them as fresh outputs, or it refuses budgets the step meets
    from backplan.runtime.backend import use_backend

    ws, x, _ = arrays()
    params = [bp.tensor(w) for w in ws]
    opt = bp.optim.sgd(0.1, momentum=0.9)

    def train_step(params, state, x):
        loss, grads = bp.value_and_grad(lambda p: (bp.tanh(x @ p[0]) @ p[1]).sum())(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    args = (params, opt.init(params), x)
    with use_backend("numba"):
        step = bp.compile(train_step, donate_argnums=(0, 1))
        report = step.explain(*args)
        assert report.peak.at_peak()["donated"] > 0
        assert step.memory_frontier(*args).points[0].peak_bytes == report.peak_bytes
        budgeted = bp.compile(train_step, donate_argnums=(0, 1), max_peak_bytes=report.peak_bytes)
        assert budgeted.explain(*args).peak_bytes == report.peak_bytes


def test_a_budget_computed_with_numpy_is_taken():
    ws, x, k = arrays()
    budget = np.int64(bp.value_and_grad(deep_loss).explain(ws, x, k).peak_bytes)
    assert (
        bp.value_and_grad(deep_loss, max_peak_bytes=budget).explain(ws, x, k).peak_bytes <= budget
    )
    assert bp.max_batch(bp.value_and_grad(deep_loss), (ws, x, k), max_peak_bytes=budget) >= BATCH
    with pytest.raises(ValueError, match="positive number of bytes"):
        bp.compile(deep_loss, max_peak_bytes=np.int32(-3))


def _sgd_step(**options):
    opt = bp.optim.sgd(0.1)

    def loss_fn(p, x, y):
        return bp.mean((bp.relu(x @ p["w1"]) @ p["w2"] - y) ** 2)

    @bp.compile(**options)
    def train_step(params, state, x, y):
        loss, grads = bp.value_and_grad(loss_fn)(params, x, y)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    rng = np.random.default_rng(0)
    params = {
        "w1": bp.tensor(rng.standard_normal((16, 32)).astype(np.float32)),
        "w2": bp.tensor(rng.standard_normal((32, 1)).astype(np.float32)),
    }
    x, y = np.ones((32, 16), np.float32), np.ones((32, 1), np.float32)  # 32 rows, as w2
    return train_step, (params, opt.init(params), x, y)


def test_max_batch_of_a_donating_step_leaves_its_parameters_alone():
    # the README's step: parameters are plain tensors, donated; w2 has as many rows as x
    step, args = _sgd_step(donate_argnums=(0, 1))
    batch = bp.max_batch(step, args, max_peak_bytes=200_000)
    assert batch > 32
    params, state, x, y = args
    for size, fits in ((batch, True), (batch + 1, False)):
        grown = (np.resize(x, (size, 16)), np.resize(y, (size, 1)))
        assert (step.explain(params, state, *grown).peak_bytes <= 200_000) == fits


def test_max_batch_that_resizes_a_parameter_says_which_leaves_it_resized():
    step, args = _sgd_step()  # nothing donated: w2 (32 rows) looks like data
    with pytest.raises(bp.ShapeError, match=r"max_batch: .*argument 0 \(leaf 1\).*donate_argnums"):
        bp.max_batch(step, args, max_peak_bytes=200_000)


def test_a_refusal_where_no_plan_recomputes_says_the_default_plan_is_the_smallest():
    """One row in the frontier: the refusal says recomputing lowers nothing, not 'recomputing
    0 more value(s) for 0 added FLOPs; the default plan peaks at' the same number again."""

    def linear(w, x):
        return bp.sum(x @ w)

    w, x = np.ones((4, 3), np.float32), np.ones((8, 4), np.float32)
    front = bp.value_and_grad(linear).memory_frontier(w, x)
    assert len(front.points) == 1
    smallest = front.points[0].peak_bytes
    with pytest.raises(bp.MemoryBudgetError) as refused:
        bp.value_and_grad(linear, max_peak_bytes=smallest - 1)(w, x)
    text = str(refused.value)
    assert f"reaches is {smallest:,} B" in text and "the default plan's: recomputing" in text
    assert "0 more value(s)" not in text and "default plan peaks at" not in text


def test_max_batch_refuses_an_array_given_as_args_instead_of_taking_its_rows():
    """bp.max_batch(fn, x, ...) for a function of one argument: tuple(x) would call fn with
    each row as an argument ('takes 1 positional argument but 32 were given')."""
    _, x, _ = arrays()
    step = bp.compile(lambda x: bp.sum(bp.tanh(x) ** 2))
    with pytest.raises(TypeError, match=r"got ndarray of shape \(32, 16\); .* pass \(x,\)"):
        bp.max_batch(step, x, max_peak_bytes=40_000)
    assert bp.max_batch(step, (x,), max_peak_bytes=40_000) > 0


def test_max_batch_of_an_empty_batch_says_so_instead_of_searching_forever():
    """Doubling a batch of 0 rows stays 0: the search never ended (and repeating no rows
    into a larger batch divides by zero)."""
    step = bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())
    w, x = bp.tensor(np.ones((8, 8), np.float32)), bp.tensor(np.ones((0, 8), np.float32))
    with pytest.raises(ValueError, match="max_batch: the data's axis 0 is empty"):
        bp.max_batch(step, (w, x), max_peak_bytes=8192)


def test_max_batch_takes_an_integer_axis_and_counts_negative_ones_from_the_end():
    """axis=1.0 failed deep inside NumPy's take; axis=-2 of 2-D data is axis 0."""
    step = bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())
    w, x = bp.tensor(np.ones((8, 8), np.float32)), bp.tensor(np.ones((4, 8), np.float32))
    with pytest.raises(TypeError, match=r"max_batch: axis must be an integer .*got 1\.0"):
        bp.max_batch(step, (w, x), max_peak_bytes=8192, axis=1.0)
    assert bp.max_batch(step, (w, x), 8192, axis=-2) == bp.max_batch(step, (w, x), 8192)


def test_max_batch_says_when_its_answer_is_only_the_search_limit(monkeypatch):
    """A budget every batch fits used to return 2 * MAX_BATCH - 1 as if it were the largest."""
    import backplan.tracer.max_batch as search

    monkeypatch.setattr(search, "MAX_BATCH", 64)
    step = bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())
    w, x = bp.tensor(np.ones((8, 8), np.float32)), bp.tensor(np.ones((4, 8), np.float32))
    with pytest.warns(UserWarning, match=r"every batch up to 127 rows fits .* may be larger"):
        assert bp.max_batch(step, (w, x), max_peak_bytes=10**9) == 127


def _resident_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS")
def test_max_batch_plans_a_large_candidate_without_writing_its_batch():
    """Each candidate's batch is zeros of the leaf's dtype and C order (tracing reads no
    values); repeating the rows wrote the whole batch: 1 GiB resident for this 2^22-row
    candidate (4 GiB and minutes at MAX_BATCH rows, where a budget was generous)."""
    from backplan.tracer.max_batch import _batch_resizer

    step = bp.value_and_grad(lambda w, x, y: bp.mean(bp.tanh(x @ w)) + bp.sum(y))
    w = bp.tensor(np.ones((64, 64), np.float32))
    x = bp.tensor(np.asfortranarray(np.arange(8 * 64, dtype=np.float32).reshape(8, 64)))
    labels = np.arange(8)
    resize = _batch_resizer(step, (w, x, labels), 0)
    before = _resident_bytes()
    w2, big, big_labels = resize(2**22)
    assert _resident_bytes() - before < 64 * 2**20  # of 1 GiB + 32 MiB
    assert w2 is w
    assert big.shape == (2**22, 64) and big.numpy().dtype == np.float32
    assert big.numpy().flags.c_contiguous and big_labels.dtype == labels.dtype
    assert big_labels.shape == (2**22,)
