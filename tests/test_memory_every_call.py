"""What explain prints is what runs on EVERY call, not only the second: calls 1..5 of each step
are counted by the checked mode (BACKPLAN_CHECK_MEMORY's counting allocator, one measurement
across the calls, so buffers earlier calls left alive count) and each must equal the peak
explain printed for that call (report.peak_on_call). A small compiled loss that backward()
follows runs two plans on calls 1-2 and one joint plan from call 3 (runtime/joint_step.py),
the two plans' arenas still held: explain prints both peaks and which call runs which."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import (
    compile_step,
    counted_calls,
    model_arrays,
    printed_calls,
    readme_step,
    train_step,
    vg_step,
)
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.runtime.backend import current_backend, use_backend
from backplan.runtime.joint_step import JOINT_FROM_CALL

CALLS = 5


@pytest.fixture(autouse=True, params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _every_call_as_printed(step, report) -> None:
    assert counted_calls(step, CALLS) == printed_calls(report, CALLS)


def test_a_compiled_loss_backward_each_call_holds_what_explain_prints_for_it(backend):
    step, report = compile_step("mlp_tiny")
    _every_call_as_printed(step, report)
    assert [c.first_call for c in report.call_peaks] == [1, JOINT_FROM_CALL]
    text = " ".join(str(report).split())  # the peak line, unwrapped
    assert "Calls 1-2 (the forward, then backward()'s plan): " in text
    assert f"from call {JOINT_FROM_CALL} (one joint plan, no saved buffers held" in text
    highest = max(c.peak.peak_bytes for c in report.call_peaks)
    assert report.call_peak_bytes == highest
    # the loop's peak: from call 3 the joint plan runs with the last loss still bound (4 B)
    assert report.peak_bytes == report.loop_peak_on_call(JOINT_FROM_CALL).peak_bytes
    assert report.peak_bytes == highest + 4 or report.peak_bytes == highest
    assert report.fits(report.peak_bytes) and not report.fits(report.peak_bytes - 1)


def test_a_value_and_grad_step_holds_what_explain_prints_on_every_call(backend):
    step, report = vg_step("mlp_tiny")
    _every_call_as_printed(step, report)
    assert len(report.call_peaks) == 1


def test_the_readme_training_step_holds_what_explain_prints_on_every_call(backend):
    _every_call_as_printed(*readme_step())


def test_an_adam_training_step_holds_what_explain_prints_on_every_call(backend):
    _every_call_as_printed(*train_step("mlp_tiny"))


def test_max_batch_answers_for_the_budgeted_step_on_every_call(backend):
    """bp.max_batch's batch fits the budget when the step is compiled with it: the plan the
    budget picks runs on every call (no joint plan from call 3), each call within it."""
    params, batch = model_arrays("mlp_tiny", requires_grad=True)
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

    counted = counted_calls(step, CALLS)
    assert counted == printed_calls(report, CALLS)
    assert max(counted) + report.peak.input_bytes <= budget


def test_the_frontier_a_report_prints_is_planned_for_the_reports_backend(backend):
    """A report made under one backend and printed under the other listed the other's
    frontier beside its own peak line."""
    params, batch = model_arrays("mlp_tiny")
    step = bp.value_and_grad(bench_function(MODELS["mlp_tiny"]))
    report = bp.explain(step, params, *batch)
    other = "reference" if backend == "numba" else "numba"
    with use_backend(other):
        rows = [p.peak_bytes for p in report.frontier.points]
    assert rows[0] == report.peak_bytes


def test_a_report_planning_for_its_backend_leaves_other_threads_theirs(backend):
    """Planning the frontier for the report's backend switched the backend of the whole
    process: a step another thread ran meanwhile ran on the report's backend."""
    params, batch = model_arrays("mlp_tiny")
    report = bp.explain(bp.value_and_grad(bench_function(MODELS["mlp_tiny"])), params, *batch)
    planned, seen = report.frontier_source, {}

    def source():
        seen["report"] = current_backend()
        other = threading.Thread(target=lambda: seen.update(other=current_backend()))
        other.start()
        other.join()
        return planned()

    report.frontier_source = source
    with use_backend("reference" if backend == "numba" else "numba"):
        process = current_backend()
        assert report.frontier.points[0].peak_bytes == report.peak_bytes
    assert seen == {"report": backend, "other": process}


def test_an_idle_plan_adds_its_arena_and_nothing_else(backend):
    """ir/peak.py: a plan kept compiled but not run (PlanCall.idle) holds its scratch arena
    (unless it freed it: keeps_arena=False) and constants on numba, nothing on the reference
    interpreter; the planner's fast count (predicted_peak_bytes) agrees with the report's."""
    from backplan.ir.peak import predicted_peak, predicted_peak_bytes

    params, batch = model_arrays("mlp_tiny", requires_grad=True)
    report = bp.explain(bp.compile(bench_function(MODELS["mlp_tiny"])), params, *batch)
    calls = report.joint_step_calls
    running = [c for c in calls if not c.idle]
    assert len(running) == 1 and len(calls) == 3  # the joint plan; the forward and backward
    held, alone = predicted_peak(calls, backend), predicted_peak(running, backend)
    assert predicted_peak_bytes(calls, backend) == held.peak_bytes
    # the joint step's forward and backward free their arenas when the joint plan takes over
    # (runtime/joint_step.py): idle, they hold their constants alone (none here)
    assert held.peak_bytes == alone.peak_bytes
    kept = [dataclasses.replace(c, keeps_arena=True) for c in calls]
    if backend == "reference":
        assert held == alone == predicted_peak(kept, backend)
    else:
        arenas = report.call_peaks[0].peak.at_peak()["scratch"]
        assert predicted_peak(kept, backend).peak_bytes == alone.peak_bytes + arenas


def test_call_peaks_name_the_plans_each_step_runs(backend):
    """value_and_grad runs one joint plan, a training step (no backward of its own) one plan."""
    assert [c.runs for c in vg_step("mlp_tiny")[1].call_peaks] == ["one joint plan"]
    assert [c.runs for c in train_step("mlp_tiny")[1].call_peaks] == ["the forward plan"]


def test_a_call_back_on_two_plans_holds_the_printed_fallback_peak(backend):
    """After the joint plan ran, a loss backward()ed from another seed (its forward rerun for
    the saved buffers), one never backward()ed, and the two-plan calls that follow hold at most
    report.fallback_peak: the two plans, the joint plan's arena still held. The joint call's
    default-seed gradients are dropped before the forward reruns (they were held beside it)."""
    params, batch = model_arrays("mlp_tiny", requires_grad=True)
    loss = bp.compile(bench_function(MODELS["mlp_tiny"]))
    report = bp.explain(loss, params, *batch)
    seeds = [1.0, 1.0, 1.0, 2.0, None, 1.0, 1.0]  # None: the loss is never backward()ed
    counted = []
    with measure() as measured:
        for seed in seeds:
            measured.restart_peak()
            bp.zero_grad(params)
            out = loss(params, *batch)
            if seed is not None:
                out.backward(None if seed == 1.0 else bp.tensor(np.float32(seed)))
            del out
            counted.append(measured.peak)
    fallback = report.fallback_peak.allocated_peak_bytes
    assert counted[:3] == printed_calls(report, 3)
    assert counted[3] == fallback and counted[4] <= fallback and counted[5:] == [fallback] * 2
    text = " ".join(str(report).split())
    assert f"holds up to {report.fallback_peak.peak_bytes:,} B" in text


def test_explain_says_background_calls_run_on_the_reference_interpreter(backend):
    params, batch = model_arrays("mlp_tiny")
    loss = bench_function(MODELS["mlp_tiny"])
    say = "with background=True its calls run on the reference interpreter until the kernels"
    for background, said in ((True, True), (None, False)):
        report = bp.explain(bp.value_and_grad(loss, background=background), params, *batch)
        assert (say in " ".join(str(report).split())) == (said and backend == "numba")
