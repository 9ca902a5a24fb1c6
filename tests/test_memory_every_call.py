"""What explain prints is what runs on EVERY call, not only the second: calls 1..5 of each step
are counted by the checked mode (BACKPLAN_CHECK_MEMORY's counting allocator, one measurement
across the calls, so buffers earlier calls left alive count) and each must equal the peak
explain printed for that call (report.peak_on_call). A small compiled loss that backward()
follows runs two plans on calls 1-2 and one joint plan from call 3 (runtime/joint_step.py),
the two plans' arenas still held: explain prints both peaks and which call runs which."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.bench.early_updates import OPTIMIZERS, readme
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.runtime.backend import use_backend
from backplan.runtime.joint_step import JOINT_FROM_CALL

CALLS = 5


@pytest.fixture(autouse=True, params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _counted_calls(step) -> list[int]:
    """The most bytes held during each call, counted by one measurement open across all the
    calls: what earlier calls left alive (the arenas of plans compiled then and not run now)
    counts too. The step drops what earlier calls returned to it before it calls again."""
    counted = []
    with measure() as measured:
        for _ in range(CALLS):
            measured.restart_peak()
            step()
            counted.append(measured.peak)
    return counted


def _printed(report) -> list[int]:
    return [report.peak_on_call(n).allocated_peak_bytes for n in range(1, CALLS + 1)]


def _mlp_tiny(requires_grad: bool):
    inputs = MODELS["mlp_tiny"].inputs(small=True, dtype=np.float32)
    params = {k: bp.tensor(v, requires_grad=requires_grad) for k, v in inputs.params.items()}
    return params, [bp.tensor(a) for a in inputs.batch(True)]


def test_a_compiled_loss_backward_each_call_holds_what_explain_prints_for_it(backend):
    params, batch = _mlp_tiny(requires_grad=True)
    loss = bp.compile(bench_function(MODELS["mlp_tiny"]))
    report = bp.explain(loss, params, *batch)

    def step():
        bp.zero_grad(params)
        loss(params, *batch).backward()

    assert _counted_calls(step) == _printed(report)
    assert [c.first_call for c in report.call_peaks] == [1, JOINT_FROM_CALL]
    text = " ".join(str(report).split())  # the peak line, unwrapped
    assert f"Calls 1-2 (the forward, then backward()'s plan): " in text
    assert f"from call {JOINT_FROM_CALL} (one joint plan, no saved buffers held" in text
    highest = max(c.peak.peak_bytes for c in report.call_peaks)
    assert report.peak_bytes == highest and report.fits(highest) and not report.fits(highest - 1)


def test_a_value_and_grad_step_holds_what_explain_prints_on_every_call(backend):
    params, batch = _mlp_tiny(requires_grad=False)
    step = bp.value_and_grad(bench_function(MODELS["mlp_tiny"]))
    report = bp.explain(step, params, *batch)
    assert _counted_calls(lambda: step(params, *batch)) == _printed(report)
    assert len(report.call_peaks) == 1


def _training_step(loss, opt, params, batch):
    """(step(), explain report) of a donated training step: value_and_grad and opt.update in
    one compiled call, as the README writes it."""
    held = {"params": params, "state": opt.init(params)}

    @bp.compile(donate_argnums=(0, 1))
    def train_step(params, state, *batch):
        value, grads = bp.value_and_grad(loss)(params, *batch)
        params, state = opt.update(grads, state, params)
        return params, state, value

    report = bp.explain(train_step, held["params"], held["state"], *batch)

    def step():
        # the caller's own arrays, as in a first call: on the reference interpreter the arrays
        # a call returns are allocated by it, and the measurement would keep counting them
        args = bp.tree.map(lambda t: bp.tensor(t.numpy().copy()), (held["params"], held["state"]))
        held.clear()
        held["params"], held["state"], _ = train_step(*args, *batch)

    return step, report


def test_the_readme_training_step_holds_what_explain_prints_on_every_call(backend):
    loss, params, batch = readme()
    params = {k: bp.tensor(v) for k, v in params.items()}
    step, report = _training_step(loss, OPTIMIZERS["readme"](), params, batch)
    del params  # a donated tensor kept alive keeps its old buffer
    assert _counted_calls(step) == _printed(report)


def test_an_adam_training_step_holds_what_explain_prints_on_every_call(backend):
    params, batch = _mlp_tiny(requires_grad=False)
    loss = bench_function(MODELS["mlp_tiny"])
    step, report = _training_step(loss, bp.optim.adam(1e-3), params, batch)
    del params
    assert _counted_calls(step) == _printed(report)


def test_max_batch_answers_for_the_budgeted_step_on_every_call(backend):
    """bp.max_batch's batch fits the budget when the step is compiled with it: the plan the
    budget picks runs on every call (no joint plan from call 3), each call within it."""
    params, batch = _mlp_tiny(requires_grad=True)
    fn = bench_function(MODELS["mlp_tiny"])
    budget = 2 * bp.explain(bp.compile(fn), params, *batch).peak_bytes
    rows = bp.max_batch(bp.compile(fn), [params, *batch], max_peak_bytes=budget)
    x, y = (bp.tensor(np.resize(a.numpy(), (rows, *a.shape[1:]))) for a in batch)
    loss = bp.compile(fn, max_peak_bytes=budget)
    report = bp.explain(loss, params, x, y)
    assert len(report.call_peaks) == 1 and report.peak_bytes <= budget

    def step():
        bp.zero_grad(params)
        loss(params, x, y).backward()

    counted = _counted_calls(step)
    assert counted == _printed(report)
    assert max(counted) + report.peak.input_bytes <= budget


def test_the_frontier_a_report_prints_is_planned_for_the_reports_backend(backend):
    """A report made under one backend and printed under the other listed the other's
    frontier beside its own peak line."""
    params, batch = _mlp_tiny(requires_grad=False)
    step = bp.value_and_grad(bench_function(MODELS["mlp_tiny"]))
    report = bp.explain(step, params, *batch)
    other = "reference" if backend == "numba" else "numba"
    with use_backend(other):
        rows = [p.peak_bytes for p in report.frontier.points]
    assert rows[0] == report.peak_bytes


def test_an_idle_plan_adds_its_arena_and_nothing_else(backend):
    """ir/peak.py: a plan kept compiled but not run (PlanCall.idle) holds its scratch arena
    and constants on numba, nothing on the reference interpreter; the planner's fast count
    (predicted_peak_bytes) agrees with the report's."""
    from backplan.ir.peak import predicted_peak, predicted_peak_bytes

    params, batch = _mlp_tiny(requires_grad=True)
    report = bp.explain(bp.compile(bench_function(MODELS["mlp_tiny"])), params, *batch)
    calls = report.joint_step_calls
    running = [c for c in calls if not c.idle]
    assert len(running) == 1 and len(calls) == 3  # the joint plan; the forward and backward
    held, alone = predicted_peak(calls, backend), predicted_peak(running, backend)
    assert predicted_peak_bytes(calls, backend) == held.peak_bytes
    if backend == "reference":
        assert held == alone
    else:
        arenas = report.call_peaks[0].peak.at_peak()["scratch"]
        assert held.peak_bytes == alone.peak_bytes + arenas
