"""A memory frontier lists plans worth choosing: each row lowers the peak of the row before it
by at least 1% (tracer/budget.py worth_lowering). A plan that buys a few bytes for
added FLOPs is no row, but stays a plan a budget between rows may run, and a refusal's
"smallest peak" is still the lowest any plan reaches."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

D = 32


def loss(p, x, y):
    h = x
    for i in range(len(p)):
        h = bp.tanh(h @ p[f"w{i}"])
    return bp.mse_loss(h, y)


def arrays(layers=4):
    """Three layers on numba: since a GEMM's epilogue writes over its product (52562c2), the
    first recomputation of four layers lowers the peak by 64 KiB (a row); of three, by 4 B."""
    rng = np.random.default_rng(0)
    p = {f"w{i}": (rng.standard_normal((D, D)) * 0.3).astype(np.float32) for i in range(layers)}
    x = rng.standard_normal((512, D)).astype(np.float32)
    return p, x, rng.standard_normal((512, D)).astype(np.float32)


def assert_rows_worth_choosing(points):
    for before, row in itertools.pairwise(points):
        assert row.added_flops > before.added_flops
        assert before.peak_bytes - row.peak_bytes >= before.peak_bytes // 100, (
            before,
            row,
        )


def test_a_plan_lowering_the_peak_by_four_bytes_is_no_frontier_row():
    """On numba this step's first recomputation lowers the peak by 4 B for +10% FLOPs (the
    gradient part's own buffers are as wide as what it stops holding): it was listed."""
    with use_backend("numba"):
        frontier = bp.value_and_grad(loss).memory_frontier(*arrays(3))
        assert_rows_worth_choosing(frontier.points)
        assert len(frontier.points) == 1
        default = frontier.points[0].peak_bytes
        # the plan is still there for a budget just under the default: it runs and fits
        report = bp.value_and_grad(loss, max_peak_bytes=default - 1).explain(*arrays(3))
        assert default - default // 100 < report.peak_bytes < default
        # and a budget under every plan is refused naming the lowest peak, not the row's
        with pytest.raises(bp.MemoryBudgetError) as refused:
            bp.value_and_grad(loss, max_peak_bytes=report.peak_bytes - 1).explain(*arrays(3))
        assert f"The smallest peak any plan reaches is {report.peak_bytes:,} B" in str(
            refused.value
        )


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_rows_that_lower_the_peak_enough_stay_and_each_runs_as_its_budget(backend):
    with use_backend(backend):
        points = bp.value_and_grad(loss).memory_frontier(*arrays()).points
        assert_rows_worth_choosing(points)
        if backend == "reference":
            assert len(points) == 3  # each recomputed tanh(x @ w) frees 64 KiB of 600 KiB
        for row in points:
            vg = bp.value_and_grad(loss, max_peak_bytes=row.peak_bytes)
            assert vg.explain(*arrays()).peak_bytes == row.peak_bytes
