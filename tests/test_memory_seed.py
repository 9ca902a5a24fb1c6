"""backward()'s seed (the ones it starts from) is an array backward() allocates, not one the
caller passes in: explain counts it as a gradient held from the backward call on, the arrays
you pass in are exactly yours, and the checked mode counts the seed where explain does."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend


def _loss(w, x):
    return bp.sum(bp.tanh(x @ w) ** 2)


@pytest.fixture(params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _step():
    w = bp.tensor(np.linspace(-1, 1, 24 * 5, dtype=np.float32).reshape(24, 5), requires_grad=True)
    x = np.linspace(-2, 2, 7 * 24, dtype=np.float32).reshape(7, 24)
    loss = bp.compile(_loss)
    report = bp.explain(loss, w, x)

    def step():
        bp.zero_grad([w])
        loss(w, x).backward()

    return step, report, w.numpy().nbytes + x.nbytes


def test_the_arrays_you_pass_in_are_yours_the_seed_a_gradient(backend):
    step, report, yours = _step()
    assert report.peak.input_bytes == yours  # was yours + 4: the float32 seed
    text = " ".join(str(report).split())
    assert f"the {yours:,} B of arrays you pass in included" in text
    # the seed is held while backward()'s plan runs, as a gradient
    two_plans = report.peak_on_call(1).steps  # calls 1-2 run two plans, then a joint plan
    backward = [s for s in two_plans if s.plan == "backward"]
    forward = [s for s in two_plans if s.plan == "forward"]
    assert forward and backward
    assert all(s.held.get("gradients", 0) == 0 for s in forward)
    assert all(s.held.get("gradients", 0) >= 4 for s in backward)


def test_the_checked_mode_counts_the_seed_where_explain_does(backend):
    step, report, _ = _step()
    assert counted_calls(step, 2) == printed_calls(report, 2)
