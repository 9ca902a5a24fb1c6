"""The planner's analytic peak (tracer/budget.py BudgetPlanner.analytic_peak): the step
schedule's simulation of a plan recomputing some held values, plus the arrays passed in,
equals to the byte the peak of the plan built and accounted by ir/peak.py, on the reference
interpreter running one plan. memory_frontier's rows and the candidates a budget passes over
then build no plan; the frontier and the budgets' choices stay what building every row gave."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backplan as bp
from backplan.ir.gemm_packing import packing_bytes
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend
from backplan.tracer.budget import BudgetPlanner, step_peak_bytes

LAYERS = (
    "tanh",
    "sin",
    "diamond",
    "view",
    "shared",
    "relu",
    "constant",
    "bfloat16",
    "exp",
    "softmax",
    "layer_norm",
    "halves",
    "gather",
    "where",
    "dropout",
)
ROWS = np.array([3, 0, 7, 7, 1, 5, 2, 4])


def _layer(kind: str, h, kept: list, constant):
    """One layer of the random step: chains, diamonds (a value read twice), a value shared by
    a later layer, views (reshapes, transposes), a captured constant, a 16-bit round trip,
    row composites (softmax, layer norm), slices joined, a gather, a select, a random mask."""
    if kind == "tanh":
        return bp.tanh(h)
    if kind == "sin":
        return bp.sin(h) * 0.5
    if kind == "exp":
        return bp.exp(-h * h)
    if kind == "diamond":
        a = bp.tanh(h)
        return a * bp.sin(a) + a
    if kind == "view":
        return bp.tanh(h.reshape(4, 16).T.reshape(8, 8).T)
    if kind == "relu":
        return bp.maximum(h, 0.0)
    if kind == "constant":
        return bp.tanh(h * constant)
    if kind == "bfloat16":
        return bp.tanh(h.astype(bp.bfloat16)).astype(bp.float32)
    if kind == "softmax":
        return bp.softmax(h, axis=-1)
    if kind == "layer_norm":
        return bp.layer_norm(h)
    if kind == "halves":  # slices of one value joined again, in the other order
        return bp.tanh(bp.concatenate([h[:, 4:], h[:, :4] * 2.0], axis=1))
    if kind == "gather":
        return bp.tanh(bp.take(h, ROWS, axis=0))
    if kind == "where":
        return bp.where(h > 0.0, bp.tanh(h), h * 0.1)
    if kind == "dropout":
        return bp.dropout(bp.tanh(h), 0.25, bp.random.key(len(kept)))
    kept.append(bp.tanh(h))  # "shared": read again by every later shared layer
    return kept[-1] + kept[0] if len(kept) > 1 else kept[-1]


def _model(kinds: tuple[str, ...], seed: int):
    rng = np.random.default_rng(seed)
    ws = {
        f"w{i}": (rng.standard_normal((8, 8)) * 0.3).astype(np.float32) for i in range(len(kinds))
    }
    constant = rng.standard_normal((8, 8)).astype(np.float32)

    def loss(ws, x):
        kept: list = []
        for i, kind in enumerate(kinds):
            x = _layer(kind, x @ ws[f"w{i}"], kept, constant)
        return bp.mean(x * x)

    return loss, ws, rng.standard_normal((8, 8)).astype(np.float32)


def _planner(kinds: tuple[str, ...], step: str, seed: int = 0) -> BudgetPlanner:
    """The planner of value_and_grad(loss), or of the README's training step (donated
    parameters and adam state, the gradients inlined), on the reference interpreter."""
    loss, ws, x = _model(kinds, seed)
    if step == "value_and_grad":
        return bp.value_and_grad(loss).trace(ws, x).planner
    opt = bp.optim.adam(1e-3)

    @bp.compile(donate_argnums=(0, 1), background=False)
    def train(params, state, x):
        value, grads = bp.value_and_grad(loss)(params, x)
        params, state = opt.update(grads, state, params)
        return params, state, value

    params = bp.tree.map(bp.tensor, ws)
    args = (params, opt.init(params), x)
    train.memory_frontier(*args)
    return train.lookup(args, {}, count_hit=False)[1].planner


def _built_peak(planner: BudgetPlanner, drop: frozenset) -> int:
    return step_peak_bytes(planner.build(drop))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=5).map(tuple),
    step=st.sampled_from(("value_and_grad", "train")),
    data=st.data(),
)
def test_the_analytic_peak_is_the_built_plans_peak_to_the_byte(kinds, step, data):
    with use_backend("reference"):
        planner = _planner(kinds, step)
        held = planner.choices.schedule.held
        drop = frozenset(data.draw(st.lists(st.sampled_from(held), unique=True)) if held else ())
        analytic = planner.analytic_peak(drop)
        if "bfloat16" in kinds:
            # run widened (float32 between roundings), which the simulation does not model:
            # the row is built and its peak is the widened plan's (test_reference_peak_half)
            assert analytic is None
        else:
            assert analytic == _built_peak(planner, drop), (kinds, step, sorted(drop))


@pytest.mark.parametrize("name", ["transformer", "cnn", "lstm12", "ln_gelu", "mlp_deep"])
def test_the_analytic_peak_is_exact_on_the_bench_models(name):
    """Attention, convolutions (im2col), recurrent cells, layer norm and GELU, softmax
    cross-entropy: every frontier point and a few random recomputed sets, small sizes."""
    from backplan.bench.models import MODELS
    from backplan.bench.peers.backplan_peer import bench_function

    spec = MODELS[name]
    inputs = spec.inputs(True, np.float32)
    with use_backend("reference"):
        planner = (
            bp.value_and_grad(bench_function(spec))
            .trace(inputs.params, *inputs.batch(True))
            .planner
        )
        held = planner.choices.schedule.held
        rng = np.random.default_rng(0)
        drops = [p.drop for p in planner.points()] + [
            frozenset(rng.choice(held, size=k, replace=False).tolist()) for k in (1, len(held))
        ]
        for drop in drops:
            assert planner.analytic_peak(drop) == _built_peak(planner, drop), sorted(drop)


def _every_row_built(planner: BudgetPlanner) -> BudgetPlanner:
    """The same choices, each plan built for its peak (what memory_frontier did before)."""
    built = BudgetPlanner(planner.choices, planner.input_bytes, planner.name)
    built.analytic_peak = lambda drop: None
    return built


CHAIN = ("tanh",) * 6 + ("diamond", "shared", "view", "shared")


def test_the_frontier_builds_no_row_and_lists_the_built_peaks():
    with use_backend("reference"):
        planner = _planner(CHAIN, "value_and_grad")
        frontier = planner.memory_frontier()
        peaks = [p.peak_bytes for p in frontier.points]
        assert len(peaks) > 2 and peaks == sorted(peaks, reverse=True)
        assert len(set(peaks)) == len(peaks)  # strictly falling: monotone
        rows = planner.frontier(plans=False)
        assert all(e.plans is None for e in rows if e.drop)  # only peaks were simulated
        assert [_built_peak(planner, e.drop) for e in rows] == peaks
        before = _every_row_built(planner).memory_frontier()
        assert before.points == frontier.points and before.floor == frontier.floor


def _chosen(planner: BudgetPlanner, limit: int):
    """(the held values the plan fit_peak chose recomputes, its built peak), or the refusal."""
    try:
        plans = planner.fit_peak(limit)
    except bp.MemoryBudgetError as refused:
        return str(refused)
    point = planner.recomputed_for[1].drop if planner.recomputed_for else frozenset()
    return point, step_peak_bytes(plans)


def test_budgets_choose_the_plans_building_every_candidate_chose():
    """Between rows, on rows, under the floor (the same refusal, word for word)."""
    with use_backend("reference"):
        planner = _planner(CHAIN, "value_and_grad")
        frontier = planner.memory_frontier()
        peaks = [p.peak_bytes for p in frontier.points]
        lowest = (frontier.floor or frontier.points[-1]).peak_bytes
        middle = peaks[len(peaks) // 2]
        limits = {peaks[0], middle, middle - 1, peaks[1] + 1, peaks[-1], lowest, lowest - 1}
        for limit in sorted(limits):
            fresh = BudgetPlanner(planner.choices, planner.input_bytes, planner.name)
            chosen = _chosen(fresh, limit)
            assert chosen == _chosen(_every_row_built(planner), limit), limit
            assert isinstance(chosen, str) == (limit < lowest)
            if not isinstance(chosen, str):
                assert chosen[1] <= limit


def test_compiled_plans_are_still_built_for_their_peaks():
    """The numba plans fuse loops and place an arena, which the simulation does not model:
    their rows keep the built peak, so none is taken from it."""
    with use_backend("numba"):
        planner = _planner(("tanh", "tanh", "tanh"), "value_and_grad")
        assert planner.analytic_peak(frozenset()) is None
        row = planner.frontier(plans=False)[0]
        assert row.peak_bytes == _built_peak(planner, row.drop)


def test_the_compiled_simulation_stores_no_literal():
    """Compiled code reads a `full` as a literal (ir/fusion.py), so the compiled simulation
    leaves it out: on the bench's mlp_deep (32 tanh layers, softmax cross-entropy), where
    nothing else it models differs from the kernels, its peak is then the built plan's to the
    byte; counted, the loss's scalar seed put it 4 B above."""
    from backplan.bench.budget_models import mlp_deep

    fn, params, batch = mlp_deep()
    with use_backend("numba"):
        planner = bp.value_and_grad(fn).trace(params, *batch).planner
        schedule = planner.choices.schedule
        for point in planner.points()[:3]:
            simulated = schedule.simulate(point.drop, True).peak + planner.input_bytes
            # the built peak is the loop's: the last loss and gradients bound throughout
            simulated += planner.kept_bytes()
            # and it counts the GEMM's packing pages, which the simulation leaves out (the
            # same products, the same pages, whatever is recomputed)
            calls = planner.build(point.drop).peak_calls()
            simulated += max(packing_bytes(lower(c.plan, c.private_saved)) for c in calls)
            assert simulated == _built_peak(planner, point.drop), sorted(point.drop)
