"""The loop users write keeps the last results bound until the next call returns
(`loss, grads = vg(params, x)`): from call 2 those outputs are alive beside everything the call
allocates. explain prints that loop's peak (report.loop_peak_on_call, peak_bytes, the peak
line's loop sentence) and the checked mode counts exactly it, on both backends; the bench
harness's peak column measures and plans that same loop."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import counted_in_a_loop

import backplan as bp
from backplan.bench.internals import checked_memory, measure
from backplan.bench.memory_calls import model_arrays
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import CompileRunner, ValueAndGradRunner, bench_function
from backplan.runtime.backend import use_backend

CALLS = 4  # a compiled loss that backward() follows runs one joint plan from call 3


def printed_for_the_loop(report) -> list[int]:
    return [report.loop_peak_on_call(n).allocated_peak_bytes for n in range(1, CALLS + 1)]


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_value_and_grad_loop_holds_what_explain_prints_for_it(backend):
    params, batch = model_arrays("transformer")
    with use_backend(backend), checked_memory():
        vg = bp.value_and_grad(bench_function(MODELS["transformer"]))
        report = bp.explain(vg, params, *batch)

        def call():
            loss, grads = vg(params, *batch)
            return loss, grads

        counted = counted_in_a_loop(call, CALLS)
    assert counted == printed_for_the_loop(report)
    kept = sum(a.nbytes for a in params.values()) + 4  # every gradient and the float32 loss
    assert counted[1] == report.peak_on_call(2).allocated_peak_bytes + kept
    assert report.peak_bytes == report.call_peak_bytes + kept  # the peak is the loop's
    assert max(counted) == report.peak.allocated_peak_bytes
    assert f"also holds the previous call's {kept:,} B" in " ".join(str(report).split())


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("joint", [True, False])
def test_a_compiled_loss_loop_keeps_its_loss_while_the_next_one_is_computed(
    backend, joint, monkeypatch
):
    """`loss = f(params, x); loss.backward()` after bp.zero_grad: the old loss is bound until
    the forward returns, so backward()'s plan runs without it, and the gradients were cleared.
    A small loss runs one joint plan from call 3 (inside the call: the old loss held
    throughout); without the joint step (as a big step), two plans on every call."""
    if not joint:
        monkeypatch.setenv("BACKPLAN_JOINT_STEP", "0")
    params, batch = model_arrays("mlp_tiny", requires_grad=True)
    counted, loss = [], None
    with use_backend(backend), checked_memory():
        loss_fn = bp.compile(bench_function(MODELS["mlp_tiny"]))
        report = bp.explain(loss_fn, params, *batch)
        with measure() as measured:
            for _ in range(CALLS):
                measured.restart_at_next_use()
                bp.zero_grad(params)
                loss = loss_fn(params, *batch)
                loss.backward()
                counted.append(measured.peak)
    assert counted == printed_for_the_loop(report)
    if joint:
        assert counted[2] == report.peak_on_call(3).allocated_peak_bytes + 4  # the old loss
    else:
        assert counted[2] == report.peak_on_call(3).allocated_peak_bytes  # gone by backward()


@pytest.mark.parametrize("runner", [ValueAndGradRunner, CompileRunner])
def test_the_harness_measures_the_loop_it_times_and_plans_the_same(runner):
    spec = MODELS["transformer"]
    with use_backend("numba"):
        row = runner(spec, spec.inputs(small=True, dtype=np.float32))
        counted = row.counted_peak_bytes()
        planned, what = row.planned_peak_bytes()
        report = row.explain()
    assert counted["counted"] == counted["predicted"] > 0
    assert counted["bytes"] == planned == report.peak_bytes > report.call_peak_bytes
    assert "peak_bytes" in what and "results held until the call returns" in what


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_donated_training_step_loop_keeps_its_loss_alone(backend):
    """`params, state, loss = step(params, state, x)` with the parameters and the optimizer
    state donated: the new ones go back in as the next call's arrays (counted as such there),
    only the loss stays bound beside the call (the reference interpreter allocates every
    output: counting them all printed 6,792 B where the loop holds 3,592)."""
    from backplan.bench.memory_calls import counted_calls, printed_calls, train_step

    with use_backend(backend), checked_memory():
        step, report = train_step("mlp_tiny", keep=True)
        counted = counted_calls(step, CALLS)
    assert report.kept_output_bytes(1) == 4  # the float32 loss
    assert counted == printed_calls(report, CALLS, loop=True)


def tanh_loss(p, x):
    h = bp.tanh(x @ p["w1"])
    return bp.sum((h @ p["w2"]) ** 2)


def tanh_loss_with_aux(p, x):
    h = bp.tanh(x @ p["w1"])
    return bp.sum((h @ p["w2"]) ** 2), h


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("kind", ["grad", "aux", "forward"])
def test_grad_aux_and_forward_loops_keep_what_they_return(backend, kind):
    """bp.grad hands back the gradients alone (its loss is no kept result: counting it printed
    4 B over the loop), value_and_grad with has_aux the aux too, a compiled forward its
    output."""
    rng = np.random.default_rng(0)
    p = {
        "w1": bp.tensor(rng.standard_normal((16, 64)).astype(np.float32)),
        "w2": bp.tensor(rng.standard_normal((64, 32)).astype(np.float32)),
    }
    x = bp.tensor(rng.standard_normal((8, 16)).astype(np.float32))
    fn = {
        "grad": lambda: bp.grad(tanh_loss),
        "aux": lambda: bp.value_and_grad(tanh_loss_with_aux, has_aux=True),
        "forward": lambda: bp.compile(lambda p, x: bp.tanh(x @ p["w1"])),
    }[kind]()
    with use_backend(backend), checked_memory():
        report = bp.explain(fn, p, x)
        counted = counted_in_a_loop(lambda: fn(p, x), CALLS)
    assert counted == printed_for_the_loop(report)
    kept = {"grad": 16 * 64 * 4 + 64 * 32 * 4, "aux": 4 + 8 * 64 * 4 + 16 * 64 * 4 + 64 * 32 * 4}
    kept["forward"] = 8 * 64 * 4
    assert report.kept_output_bytes(1) == kept[kind]


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_loop_over_sizes_of_a_dynamic_axis_holds_the_last_calls_results(backend):
    """`loss, grads = step(w, x)` over batches of 4, 6 and 9 rows: a call after one at another
    size holds that call's results, which explain's text names and loop_peak_on_call(n,
    kept=...) counts; the checked mode agrees at every call."""
    rng = np.random.default_rng(2)
    w = bp.tensor(rng.standard_normal((5, 7)).astype(np.float32))

    def loss(w, x):
        return bp.mean(bp.tanh(x @ w) * x.sum()), bp.tanh(x @ w)  # aux: (n, 7)

    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "n"}}), has_aux=True)
    xs = {n: bp.tensor(rng.standard_normal((n, 5)).astype(np.float32)) for n in (4, 6, 9)}
    counted, printed, calls, results, last = [], [], {}, None, None
    with use_backend(backend), checked_memory(), measure() as held:
        for n in [4, 6, 4, 6, 9, 4, 4, 6]:
            held.restart_at_next_use()
            results = step(w, xs[n])
            counted.append(held.peak)
            calls[n] = calls.get(n, 0) + 1
            report = step.explain(w, xs[n])
            kept = None if last is None else last.kept_output_bytes(1)
            printed.append(report.loop_peak_on_call(calls[n], kept).allocated_peak_bytes)
            last = report
    del results
    assert counted == printed
    assert "a call after one at another size holds that call's results (4: " in " ".join(
        report.dynamic.split()
    )


def test_kept_must_be_a_byte_count():
    """kept_output_bytes is a method of the report (the n-th call's results): passed without
    calling it, loop_peak_on_call failed deep in the peak's sum ("unsupported operand type(s)
    for +: 'int' and 'method'"); now a TypeError saying what kept is."""
    w = bp.tensor(np.ones((4, 4), np.float32))
    vg = bp.value_and_grad(lambda w, x: bp.mean(bp.tanh(x @ w)))
    report = vg.explain(w, np.ones((8, 4), np.float32))
    other = vg.explain(w, np.ones((3, 4), np.float32))
    for wrong in (other.kept_output_bytes, 1.5, -4, True):
        with pytest.raises(TypeError, match=r"kept is the bytes the previous call's results"):
            report.loop_peak_on_call(2, kept=wrong)
    kept = other.kept_output_bytes(2)
    assert kept == 4 * 4 * 4 + 4  # the gradient and the loss
    with_other = report.loop_peak_on_call(2, kept=kept).allocated_peak_bytes
    assert with_other == report.peak_on_call(2).allocated_peak_bytes + kept
