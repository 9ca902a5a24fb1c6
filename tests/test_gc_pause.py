"""The collector pause around the memory planner's row building (ir/gc_pause.py): off inside,
back as it was after, across nesting, exceptions and threads, and really held while the
frontier's rows are built and lowered."""

import gc
import importlib
import threading

import numpy as np
import pytest

import backplan as bp
from backplan.ir.gc_pause import paused_gc
from backplan.tracer import budget


@pytest.fixture(autouse=True)
def collector_restored():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_enabled_again_after_the_outermost_pause():
    gc.enable()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause ended, the outer one holds
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_exception_inside_still_ends_the_pause():
    gc.enable()
    with pytest.raises(ZeroDivisionError), paused_gc():
        raise ZeroDivisionError
    assert gc.isenabled()


def test_two_threads_resume_the_collector_only_when_both_pauses_end():
    gc.enable()
    entered, release = threading.Barrier(2), threading.Event()
    seen = {}

    def hold(name):
        with paused_gc():
            entered.wait()
            if name == "first":
                return  # leaves its pause while the second thread is still inside
            release.wait()
            seen["inside"] = gc.isenabled()

    first = threading.Thread(target=hold, args=("first",))
    second = threading.Thread(target=hold, args=("second",))
    first.start(), second.start()
    first.join()
    seen["after_first"] = gc.isenabled()
    release.set()
    second.join()
    assert seen == {"after_first": False, "inside": False}
    assert gc.isenabled()


def test_the_frontiers_rows_are_built_with_the_collector_paused(monkeypatch):
    """Every row's plans are lowered for their peak with the collector off (the 10,086-node
    plan's full collections were ~30% of memory_frontier's time), and it is on again after."""
    states = []
    original = budget.step_peak_bytes

    def recording(*args, **kwargs):
        states.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(budget, "step_peak_bytes", recording)
    gc.enable()
    f = bp.value_and_grad(lambda w, x: bp.tanh(bp.tanh(bp.tanh(x @ w) @ w) @ w).sum())
    w = np.full((8, 8), 0.1, np.float32)
    x = np.ones((4, 8), np.float32)
    frontier = f.memory_frontier(w, x)
    assert len(frontier.points) >= 1 and states and not any(states)
    assert gc.isenabled()


@pytest.mark.parametrize("front", ["value_and_grad", "compile"])
def test_the_pipeline_plans_a_trace_with_the_collector_paused(monkeypatch, front):
    """The trace's pipeline (autodiff, passes, the default plans) runs paused, for
    value_and_grad and bp.compile alike; the collector is on again once the call returns."""
    name = "functional" if front == "value_and_grad" else "compile"
    module = importlib.import_module(f"backplan.tracer.{name}")
    states = []
    original = module.plan_choices

    def recording(*args, **kwargs):
        states.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "plan_choices", recording)
    gc.enable()
    w = bp.tensor(np.full((8, 8), 0.1, np.float32), requires_grad=True)
    x = np.ones((4, 8), np.float32)
    if front == "value_and_grad":
        bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())(w, x)
    else:
        bp.compile(lambda w, x: bp.tanh(x @ w).sum())(w, x).backward()
    assert states == [False]
    assert gc.isenabled()


def test_a_new_batch_size_is_planned_with_the_collector_paused(monkeypatch):
    """A new size of a symbolic plan is instantiated, lowered, rendered and given its runner
    with the collector off (its objects outlive the call; collections during it promoted them
    and a full one walked every size's plans), its values still the reference's, and the
    collector is on again after each call."""
    from backplan.ir import symbolic
    from backplan.runtime import backend

    states: dict[str, list] = {"at": [], "lower": [], "runner": []}

    def recording(name, original):
        def record(*args, **kwargs):
            states[name].append(gc.isenabled())
            return original(*args, **kwargs)

        return record

    monkeypatch.setattr(symbolic.SymbolicPlan, "at", recording("at", symbolic.SymbolicPlan.at))
    monkeypatch.setattr(backend, "lower", recording("lower", backend.lower))
    monkeypatch.setattr(backend, "make_runner", recording("runner", backend.make_runner))

    def loss(w, x):
        return bp.tanh(x @ w).sum()

    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "batch"}}))
    w = np.linspace(-0.5, 0.5, 24, dtype=np.float32).reshape(6, 4)
    gc.enable()
    for n in (5, 8, 3, 11):
        x = np.linspace(-2, 2, n * 6, dtype=np.float32).reshape(n, 6)
        value, grad = step(bp.tensor(w), x)
        assert gc.isenabled()
        with backend.use_backend("reference"):
            want, want_grad = step(bp.tensor(w), x)
        np.testing.assert_allclose(value, want, rtol=1e-5)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert states["at"] and not any(states["at"])  # every new size instantiated paused
    assert len(states["lower"]) >= 4 and not any(states["lower"])
    assert states["runner"].count(False) >= 3  # the sizes after the first (shared plans)
    assert step.cache_info().traces == 1
