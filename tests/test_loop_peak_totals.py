"""The peak explain prints (report.peak_bytes) and budgets bound is the loop's: what the process
holds in the loop users write, the arrays passed in included. Measured with the checked mode
(the step's own buffers) plus the caller's arrays the step did not allocate, per call:
- a non-donated `params, loss = step(params, x)` or `x = f(x)`: explain counts every result as
  kept, an upper bound by the bytes passed back; a second call shows they went back in as its
  arguments, and report.observed_peak_bytes is what the loop held;
- `new, loss = step(params, x)` keeps the new params apart: printed exactly, before and after;
- `grads = step(params, x)` returning gradients of the parameters' structure keeps them apart;
- a donated training step keeps its loss alone;
- a value_and_grad budget set at the default plan's one-call peak is met in the loop (the
  default plan's loop holds its last gradients beside the next call, above it)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import counted_in_a_loop

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

CALLS = 4


def arrays(width=24, rows=8, depth=3):
    rng = np.random.default_rng(5)
    params = {
        f"w{i}": bp.tensor((rng.standard_normal((width, width)) * 0.2).astype(np.float32))
        for i in range(depth)
    }
    return params, bp.tensor(rng.standard_normal((rows, width)).astype(np.float32))


def loss(p, x):
    h = x
    for k in sorted(p):
        h = bp.tanh(h @ p[k])
    return bp.sum(h * h)


def nbytes(tree) -> int:
    return sum(leaf.numpy().nbytes for leaf in bp.tree.leaves(tree))


def sgd_step():
    vg = bp.value_and_grad(loss)

    def step(p, x):
        value, g = vg(p, x)
        return {k: p[k] - 0.05 * g[k] for k in p}, value

    return step


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_params_passed_back_without_donation_are_held_once_once_seen(backend):
    """Before a loop runs, explain counts every result as kept (an upper bound by the params
    passed back, stated); a second call shows the new params came back in as its arguments,
    and report.observed_peak holds what the process held, call for call."""
    params, x = arrays()
    p_bytes, x_bytes = nbytes(params), nbytes(x)
    with use_backend(backend), checked_memory():
        step = bp.compile(sgd_step())
        before = bp.explain(step, params, x)
        state = {"p": params}

        def call():
            state["p"], value = step(state["p"], x)  # the old params go once the call returns
            return value

        counted = counted_in_a_loop(call, CALLS)
        after = bp.explain(step, params, x)
    # call 1 is passed your params; from call 2 the params are the last call's results, which
    # the checked mode counts among the step's buffers: only x is the caller's own then
    held = [counted[0] + p_bytes + x_bytes] + [c + x_bytes for c in counted[1:]]
    assert before.loop_observed is None and before.observed_peak_bytes is None
    assert before.kept_output_bytes(1) == p_bytes + 4  # stated: every result kept
    assert before.peak_bytes == max(held) + p_bytes  # the upper bound, by the params
    seen = after.loop_observed
    assert (seen.kept, seen.passed_back, seen.let_go) == (4, p_bytes, 0)
    observed = [after.loop_peak_on_call(n, kept=seen.kept if n > 1 else 0) for n in (1, 2, 3, 4)]
    assert held == [p.peak_bytes for p in observed]
    assert after.observed_peak_bytes == max(held)
    text = " ".join(str(after).split())
    assert "went back in as its arguments" in text
    assert f"this loop holds {max(held):,} B" in text


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_new_params_kept_apart_are_held_as_printed(backend):
    """`new, value = step(params, x)`: the old params stay the arguments, the new ones stay
    bound beside the next call; the printed peak is exact, and so is what a second call saw.
    (The rule of shapes this replaces printed |params| too few here.)"""
    params, x = arrays()
    with use_backend(backend), checked_memory():
        step = bp.compile(sgd_step())
        before = bp.explain(step, params, x)
        counted = counted_in_a_loop(lambda: step(params, x), CALLS)
        after = bp.explain(step, params, x)
    held = [c + nbytes(params) + nbytes(x) for c in counted]
    assert held == [before.loop_peak_on_call(n).peak_bytes for n in range(1, CALLS + 1)]
    assert max(held) == before.peak_bytes == after.observed_peak_bytes
    seen = after.loop_observed
    assert (seen.kept, seen.passed_back, seen.let_go) == (nbytes(params) + 4, 0, 0)


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_one_array_passed_back_is_held_once_once_seen(backend):
    """`x = f(x)`: the result is the next call's argument; printed before, it counts as kept
    too (an upper bound by |x|); seen on a second call, the loop holds one call's peak."""
    _, x = arrays(rows=32)
    with use_backend(backend), checked_memory():
        f = bp.compile(lambda x: bp.tanh(x * 1.5) + 0.5)
        before = bp.explain(f, x)
        box = {"x": x}

        def call():
            box["x"] = f(box["x"])

        counted = counted_in_a_loop(call, CALLS)
        after = bp.explain(f, x)
    x_bytes = nbytes(x)
    # call 1 reads your x; later calls the last result, counted by the checked mode
    held = [counted[0] + x_bytes] + counted[1:]
    assert before.peak_bytes == max(held) + x_bytes
    assert after.loop_observed.passed_back == x_bytes and after.loop_observed.kept == 0
    assert after.observed_peak_bytes == max(held) == after.call_peak_bytes


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_gradients_of_the_params_structure_are_kept_apart(backend):
    """bp.compile around bp.grad returns a dict shaped as the params: gradients, not the
    params' next value, so a loop keeps them beside the next call (`grads = step(params, x)`)."""
    params, x = arrays()
    with use_backend(backend), checked_memory():
        step = bp.compile(lambda p, x: bp.grad(loss)(p, x))
        report = bp.explain(step, params, x)
        counted = counted_in_a_loop(lambda: step(params, x), CALLS)
    held = [c + nbytes(params) + nbytes(x) for c in counted]
    assert held == [report.loop_peak_on_call(n).peak_bytes for n in range(1, CALLS + 1)]
    assert max(held) == report.peak_bytes
    assert report.kept_output_bytes(1) == nbytes(params)


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_donated_training_step_holds_its_printed_peak(backend):
    params, x = arrays()
    opt = bp.optim.adam(1e-2)
    vg = bp.value_and_grad(loss)

    def train(p, s, x):
        value, g = vg(p, x)
        p, s = opt.update(g, s, p)
        return p, s, value

    with use_backend(backend), checked_memory():
        step = bp.compile(train, donate_argnums=(0, 1))
        state = {"p": {k: bp.tensor(v.numpy().copy()) for k, v in params.items()}}
        state["s"] = opt.init(state["p"])
        report = bp.explain(step, state["p"], state["s"], x)
        yours = nbytes(state["p"]) + nbytes(state["s"]) + nbytes(x)  # updated in place

        def call():
            state["p"], state["s"], value = step(state["p"], state["s"], x)
            return value

        counted = counted_in_a_loop(call, CALLS)
    # compiled, the new params and state are written into yours; the reference interpreter
    # allocates them, so from call 2 they are the step's buffers (counted) and x alone yours
    later = nbytes(x) if backend == "reference" else yours
    held = [counted[0] + yours] + [c + later for c in counted[1:]]
    assert held == [report.loop_peak_on_call(n).peak_bytes for n in range(1, CALLS + 1)]
    assert max(held) == report.peak_bytes
    assert report.kept_output_bytes(1) == 4


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_budget_at_the_one_call_peak_is_met_by_the_loop(backend):
    """max_peak_bytes at the default plan's one-call peak: that plan's loop holds its last
    loss and gradients beside the next call, above the budget, so another plan runs (or the
    budget is refused); the loop of the plan chosen holds at most the budget."""
    params, x = arrays(width=16, rows=128, depth=6)
    with use_backend(backend), checked_memory():
        default = bp.explain(bp.value_and_grad(loss), params, x)
        budget = default.call_peak_bytes
        assert default.peak_bytes == budget + nbytes(params) + 4 > budget
        within = bp.value_and_grad(loss, max_peak_bytes=budget)
        report = bp.explain(within, params, x)
        counted = counted_in_a_loop(lambda: within(params, x), CALLS)
        value, grads = within(params, x)
    held = [c + nbytes(params) + nbytes(x) for c in counted]
    assert max(held) == report.peak_bytes <= budget
    assert held == [report.loop_peak_on_call(n).peak_bytes for n in range(1, CALLS + 1)]
    expected, g = bp.value_and_grad(loss)(params, x)
    np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-6)
    for k in g:
        np.testing.assert_allclose(grads[k].numpy(), g[k].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_compiled_loss_under_a_budget_holds_its_printed_peak_in_a_loop(backend):
    """`loss = f(params, x); loss.backward()` under max_peak_bytes: the old loss is bound
    while the next forward runs; the budget bounds what that loop holds."""
    params, x = arrays(width=16, rows=128, depth=6)
    params = {k: bp.tensor(v.numpy(), requires_grad=True) for k, v in params.items()}
    with use_backend(backend), checked_memory():
        front = bp.compile(loss).memory_frontier(params, x)
        budget = front.points[-1].peak_bytes
        f = bp.compile(loss, max_peak_bytes=budget)
        report = bp.explain(f, params, x)
        box = {}

        def call():  # the old loss is bound until the forward returns, not through backward()
            bp.zero_grad(params)
            box["loss"] = f(params, x)
            box["loss"].backward()

        counted = counted_in_a_loop(call, CALLS)
    # the float32 1.0 backward() passes its plan as the loss's cotangent is counted as a
    # gradient it allocates (not an array passed in), in the checked mode too
    held = [c + nbytes(params) + nbytes(x) for c in counted]
    assert held == [report.loop_peak_on_call(n).peak_bytes for n in range(1, CALLS + 1)]
    assert max(held) == report.peak_bytes <= budget


def test_the_pass_back_sentence_is_left_out_where_every_result_goes_back_donated():
    """The batch has the weights' type (f32[8, 8]); the new weights go back in donated, so
    no result could be passed back undonated: explain said one could. Without donation the
    sentence stays, as does every figure."""
    rng = np.random.default_rng(4)
    w = bp.tensor(rng.standard_normal((8, 8)).astype(np.float32))
    x = bp.tensor(rng.standard_normal((8, 8)).astype(np.float32))

    def step(w, x):
        loss, grad = bp.value_and_grad(lambda w: bp.mean(bp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * grad, loss

    sentence = "passes back in as the next arguments without donating"
    donated = " ".join(str(bp.compile(step, donate_argnums=0).explain(w, x)).split())
    assert "the loop users write" in donated and sentence not in donated
    assert sentence in " ".join(str(bp.compile(step).explain(w, x)).split())
