"""What explain prints is the plan that runs: a training step compiled with a budget or a saved
dtype lists, inside its value_and_grad, the saved buffers of the plan the budget chose (the
values it recomputes are not held, the narrowed ones are bfloat16), and its bytes equal what
the step's own planner counts for that plan. Nothing here compiles (explain only)."""

from __future__ import annotations

import numpy as np
import pytest
from test_memory_budget_step import DEPTH, OPT, WIDTH, batch, parameters, train_step

import backplan as bp
from backplan.bench.memory_audit import readme_step
from backplan.runtime.backend import use_backend


def arguments():
    params = parameters()
    return (params, OPT.init(params), *batch())


def held(report) -> int:
    """Bytes the inlined gradients hold from the forward, your own arrays excluded."""
    return report.inner_saved_bytes - report.inner_saved_input_bytes


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_budgeted_training_step_lists_the_saved_buffers_of_the_plan_it_runs(backend):
    with use_backend(backend):
        points = train_step().memory_frontier(*arguments()).points
        assert len(points) >= 2
        default = train_step().explain(*arguments())
        assert held(default) == points[0].saved_bytes
        report = train_step(max_peak_bytes=points[-1].peak_bytes).explain(*arguments())
        assert report.peak_bytes == points[-1].peak_bytes
        assert held(report) == points[-1].saved_bytes < held(default)
        text = str(report)
        assert f"value_and_grad, {report.inner_saved_bytes:,} B" in text
        assert "as max_peak_bytes=" in text


def test_a_saved_bytes_budget_on_a_training_step_lists_what_it_keeps():
    frontier_saved = train_step().memory_frontier(*arguments()).points[-1].saved_bytes
    report = train_step(saved_bytes_budget=frontier_saved).explain(*arguments())
    assert held(report) <= frontier_saved
    assert "as saved_bytes_budget=" in str(report)


def tall_arguments(rows: int = 1024):
    """arguments() at `rows` rows: a GEMM reading a bfloat16 saved buffer packs it whole (a
    float32 one it reads in place), up to 32 KiB of packing pages here, which the 128-row
    batch's bfloat16 buffers (8 KiB saved each) did not make up for."""
    params = parameters()
    rng = np.random.default_rng(0)
    x = bp.tensor(rng.standard_normal((rows, WIDTH)).astype(np.float32))
    return params, OPT.init(params), x, bp.tensor(rng.standard_normal((rows, 2)).astype(np.float32))


@pytest.mark.parametrize("option", ["saved_dtype", "allow_saved_dtype"])
def test_a_training_step_keeping_bfloat16_lists_bfloat16_saved_buffers(option):
    default = train_step().explain(*tall_arguments())
    options = {option: bp.bfloat16}
    if option == "allow_saved_dtype":
        options["max_peak_bytes"] = default.peak_bytes - 1  # full precision does not fit
    report = train_step(**options).explain(*tall_arguments())
    ((_, inner),) = report.inner
    computed = [b for b in inner.saved_buffers if not b.is_region_input]
    # the loss's last product minus y, which the compiled plan computes in the loop reading
    # it for the gradient (never stored), stays float32 (ir/pipeline.py narrowed_for_peak)
    wide = [b for b in computed if b.dtype != np.dtype(bp.bfloat16)]
    assert [b.shape for b in wide] == [(1024, 2)] and len(computed) == DEPTH + 1
    assert "1 of the 5 values the gradient part reads stay in full precision" in " ".join(
        str(report).split()
    )
    assert held(report) == held(default) // 2 + wide[0].nbytes // 2


def deep(ws, x):
    h = x
    for w in ws:
        h = bp.tanh(h @ w)
    return bp.sum(h * h)


def deep_arguments():
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((64, 64)) * 0.1).astype(np.float32) for _ in range(6)]
    return ws, rng.standard_normal((256, 64)).astype(np.float32)


def test_value_and_grad_of_a_budgeted_compiled_function_plans_under_that_budget():
    """value_and_grad traces the compiled function into its joint plan: the budget given to
    bp.compile is that plan's (it was silently ignored: the default plan's peak)."""
    frontier = bp.value_and_grad(deep).memory_frontier(*deep_arguments())
    budget = frontier.points[-1].peak_bytes
    assert budget < frontier.points[0].peak_bytes
    report = bp.value_and_grad(bp.compile(deep, max_peak_bytes=budget)).explain(*deep_arguments())
    assert report.peak_bytes <= budget
    with pytest.raises(ValueError, match=r"bp.compile\(deep, saved_bytes_budget=1,000\)"):
        bp.value_and_grad(bp.compile(deep, saved_bytes_budget=1000))


def test_a_budgeted_compiled_function_inlined_into_another_is_refused():
    inner = bp.compile(deep, max_peak_bytes=10**6)
    outer = bp.compile(lambda ws, x: inner(ws, x) * 2)
    ws, x = deep_arguments()
    with pytest.raises(
        bp.MemoryBudgetError,
        match=r"bp.compile\(deep, max_peak_bytes=1,000,000\) at test_explain_as_run.py:\d+ is "
        "called inside a traced function",
    ):
        outer.explain([bp.tensor(w, requires_grad=True) for w in ws], x)


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_the_readme_step_lists_what_its_own_plan_holds(backend):
    """The step's cleanup merges values the joint plan rebuilds for its gradients (relu's
    input and output, 1 + exp) back into one: the step holds relu's output where the joint
    plan alone holds the matmul before it, and 1 + exp besides. Section 3 lists the step's
    values, named as its forward IR, and their bytes are what the planner counts."""
    with use_backend(backend):
        step, args, _ = readme_step()
        report = step.explain(*args)
        assert held(report) == report.frontier.points[0].saved_bytes
        computed = [b for b in report.inlined_saved if not b.is_region_input]
        assert "relu" in {b.op for b in computed}
        # the reference interpreter's timeline and plot mark the values it stores as saved:
        # on numba also those the compiled plan fuses away (report.fused_saved)
        marked = [b for b in report.view.buffers.values() if b.kind == "saved"]
        listed = computed + report.fused_saved
        assert sorted(b.name for b in marked) == sorted(b.name for b in listed)
        text = " ".join(str(report).split())  # wrapped lines joined
        assert "names and steps are this step's forward IR" in text
        assert f"inside value_and_grad, {report.inner_saved_bytes:,} B" in text
