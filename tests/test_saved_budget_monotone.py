"""saved_bytes_budget: a lower budget never gives a higher peak. Swept from the default plan's
saved bytes down to one byte, on both backends (explain only, nothing compiles), for a compiled
function and a training step: every budget is met (saved bytes within it) at a peak no higher
than any larger budget's, or refused, and once refused every lower budget is refused too, the
refusal saying why and pointing at max_peak_bytes."""

from __future__ import annotations

import pytest
from test_explain_as_run import arguments, held, train_step
from test_memory_budget import arrays, deep_loss

import backplan as bp
from backplan.runtime.backend import use_backend


def deep_arguments():
    ws, x, key = arrays()
    return [bp.tensor(w, requires_grad=True) for w in ws], x, key


def region_saved(report) -> int:
    """What saved_bytes_budget bounds: the saved buffers the step allocates (not your arrays;
    the copy of a NumPy argument the backward reads, taken at the call, counted)."""
    return sum(b.nbytes for b in report.saved_buffers if not b.is_region_input)


CASES = {
    "compile": (
        lambda budget: bp.compile(deep_loss, saved_bytes_budget=budget),
        deep_arguments,
        region_saved,
        lambda: bp.compile(deep_loss),
    ),
    "training step": (
        lambda budget: train_step(saved_bytes_budget=budget),
        arguments,
        held,
        train_step,
    ),
}


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_lower_saved_budget_never_gives_a_higher_peak(case, backend):
    make, args, saved_of, default_fn = CASES[case]
    with use_backend(backend):
        default = default_fn().explain(*args())  # traced here: a plan's update order is
        # chosen for the backend it is traced under
        top = saved_of(default)
        # one byte under the default plan's own figure: a plan printing more is over budget
        budgets = sorted({max(1, top - top * k // 16) for k in range(17)} | {top - 1}, reverse=True)
        peaks, refused = [], []
        for budget in budgets:
            try:
                report = make(budget).explain(*args())
            except bp.MemoryBudgetError as error:
                refused.append(budget)
                assert "never gives a higher peak" in str(error) or "fewest saved" in str(error)
                assert "max_peak_bytes" in str(error)
                continue
            assert not refused, f"{budget} met after a larger budget {refused[0]} was refused"
            assert saved_of(report) <= budget
            peaks.append(report.peak_bytes)
        # the default plan meets its own saved bytes, run on every call as on the unbudgeted
        # function's first calls (which, small, runs one joint plan from call 3: call_peaks)
        # in a loop: from call 2 the last results bound beside those plans
        assert peaks[0] == default.loop_peak_on_call(2).peak_bytes
        assert peaks == sorted(peaks, reverse=True), list(zip(budgets, peaks, strict=False))
        assert len(set(peaks)) >= 2  # some budget lowers the peak
        assert refused and refused[-1] == 1  # saving nothing is out of reach here
