"""A loss backward()ed with retain_graph=True and then again runs both backward plans (the one
that keeps the saved buffers, compiled with an arena of its own, then the one that frees them)
while the first one's gradients sit in .grad: more than the training loop's peak line, which
backward()s each loss once. explain prints that call's peak (report.retain_peak, and after a
joint plan ran, with its arena: retain_after_joint_peak); the checked mode counts it exactly,
on both backends."""

from __future__ import annotations

import pytest

import backplan as bp
from backplan.bench.memory_calls import model_arrays
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.runtime.backend import use_backend


@pytest.fixture(autouse=True, params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _counted(retains: list[bool]) -> tuple[list[int], object]:
    """The bytes of its own buffers each call holds (one measurement across the calls, as the
    process holds them), each loss backward()ed twice (retain_graph first) where retains says."""
    params, batch = model_arrays("mlp_tiny", requires_grad=True)
    loss = bp.compile(bench_function(MODELS["mlp_tiny"]))
    report = bp.explain(loss, params, *batch)
    counted = []
    with measure() as measured:
        for retain in retains:
            measured.restart_peak()
            bp.zero_grad(params)
            out = loss(params, *batch)
            if retain:
                out.backward(retain_graph=True)
            out.backward()
            del out
            counted.append(measured.peak)
    return counted, report


def test_a_loss_backwarded_twice_holds_the_printed_retain_peak(backend):
    counted, report = _counted([True] * 4)
    retain = report.retain_peak.allocated_peak_bytes
    assert counted == [retain] * 4
    assert retain > report.peak.allocated_peak_bytes  # more than the training loop's peak line
    text = " ".join(str(report).split())
    assert f"retain_graph=True, then again, holds {report.retain_peak.peak_bytes:,} B" in text


def test_after_the_joint_plan_ran_it_holds_that_arena_too(backend):
    counted, report = _counted([False, False, False, True, True])
    after = report.retain_after_joint_peak.allocated_peak_bytes
    assert counted[3:] == [after, after]
    if backend == "numba":  # the joint plan keeps its arena, which the interpreter does not
        assert after > report.retain_peak.allocated_peak_bytes
        assert f", {report.retain_after_joint_peak.peak_bytes:,} B after the joint plan ran" in (
            " ".join(str(report).split())
        )


def test_calls_after_a_retain_graph_call_hold_the_peak_printed_for_them(backend, monkeypatch):
    """The plan that keeps the saved buffers (backward(retain_graph=True)) has an arena of its
    own, which later calls went on holding beside what explain prints for them; the next call
    now frees it before it runs. Two plans each call (no joint plan): every call without
    retain_graph holds report.peak, every call with it report.retain_peak."""
    monkeypatch.setenv("BACKPLAN_JOINT_STEP", "0")
    retains = [True, False, False, True, True, False]
    counted, report = _counted(retains)
    assert report.joint_step_calls is None
    plain, retain = report.peak.allocated_peak_bytes, report.retain_peak.allocated_peak_bytes
    assert counted == [retain if r else plain for r in retains]
    assert "frees it" in " ".join(str(report).split())
