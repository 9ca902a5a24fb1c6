"""bp.max_batch against real runs: at the batch it answers, the step run in a loop under the
budget holds at most the budget (measured by the checked mode, plus the arrays passed in, the
last call's results bound while the next runs); one above it, even the plan with the smallest
peak (the one the refusal names) holds more than the budget when run so.
The prediction is not taken on trust: both sides are measured."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import counted_in_a_loop
from test_memory_budget import WIDTH, arrays, deep_loss

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

BUDGET = 40_000
SMALLEST = re.compile(r"The smallest peak any plan reaches is ([\d,]+) B")


def measured_peak(fn, *args) -> int:
    """The checked mode's peak over a loop of the step, `loss, grads = fn(*args)` keeping the
    last results bound until the next call returns (what peak_bytes and budgets bound), plus
    the arrays passed in."""
    return max(counted_in_a_loop(lambda: fn(*args), 3)) + bp.explain(fn, *args).peak.input_bytes


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_max_batch_fits_when_run_and_one_more_does_not(backend):
    ws, x, k = arrays()
    with use_backend(backend), checked_memory():
        batch = bp.max_batch(bp.value_and_grad(deep_loss), (ws, x, k), max_peak_bytes=BUDGET)
        fits = np.resize(x, (batch, WIDTH))
        within = bp.value_and_grad(deep_loss, max_peak_bytes=BUDGET)
        assert measured_peak(within, ws, fits, k) <= BUDGET

        above = np.resize(x, (batch + 1, WIDTH))
        with pytest.raises(bp.MemoryBudgetError) as refused:
            bp.value_and_grad(deep_loss, max_peak_bytes=BUDGET)(ws, above, k)
        smallest = int(SMALLEST.search(str(refused.value)).group(1).replace(",", ""))
        lowest = bp.value_and_grad(deep_loss, max_peak_bytes=smallest)  # that plan, run
        assert measured_peak(lowest, ws, above, k) == smallest > BUDGET
