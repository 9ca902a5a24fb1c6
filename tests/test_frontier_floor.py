"""The lowest peak a refusal names is a plan memory_frontier shows: where it is no row (it
lowers the last row's peak by less than 1%, tracer/budget.py worth_lowering) the frontier lists
it below the rows as its floor, and the refusal says it is under the last row. A budget under
the last row ran that unlisted plan, and a refusal quoted a peak the frontier did not have."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend


def loss(p, x, y):
    h = x
    for i in range(len(p)):
        h = bp.tanh(h @ p[f"w{i}"])
    return bp.mse_loss(h, y)


def arrays(width=32, layers=3):
    """Three layers: on numba their first recomputation lowers the peak by 4 B, no row (of four
    layers by 64 KiB since a GEMM's epilogue writes over its product, 52562c2)."""
    rng = np.random.default_rng(0)
    p = {
        f"w{i}": (rng.standard_normal((width, width)) * 0.3).astype(np.float32)
        for i in range(layers)
    }
    x = rng.standard_normal((512, width)).astype(np.float32)
    return p, x, rng.standard_normal((512, width)).astype(np.float32)


def test_the_floor_under_the_last_row_is_listed_and_is_what_a_budget_there_runs():
    with use_backend("numba"):
        frontier = bp.value_and_grad(loss).memory_frontier(*arrays())
        last, floor = frontier.points[-1], frontier.floor
        assert floor is not None and floor.peak_bytes < last.peak_bytes
        assert floor.added_flops > last.added_flops
        text = str(frontier)
        assert f"below the last row: {floor.peak_bytes:,} B" in text
        assert "the lowest peak any plan reaches" in text
        ran = bp.value_and_grad(loss, max_peak_bytes=last.peak_bytes - 1).explain(*arrays())
        assert ran.peak_bytes == floor.peak_bytes  # the plan a budget under the last row runs
        with pytest.raises(bp.MemoryBudgetError) as refused:
            bp.value_and_grad(loss, max_peak_bytes=floor.peak_bytes - 1).explain(*arrays())
    words = " ".join(str(refused.value).split())
    assert f"The smallest peak any plan reaches is {floor.peak_bytes:,} B" in words
    assert f"under memory_frontier's last row, {last.peak_bytes:,} B" in words


def test_a_frontier_whose_last_row_is_the_lowest_peak_has_no_floor_line():
    """On the reference interpreter each recomputed tanh frees a whole buffer: the last row is
    the lowest peak, and the refusal names it alone."""
    with use_backend("reference"):
        frontier = bp.value_and_grad(loss).memory_frontier(*arrays(layers=4))
        last = frontier.points[-1]
        assert len(frontier.points) > 1 and frontier.floor is None
        assert "below the last row" not in str(frontier)
        with pytest.raises(bp.MemoryBudgetError) as refused:
            bp.value_and_grad(loss, max_peak_bytes=last.peak_bytes - 1).explain(*arrays(layers=4))
    words = " ".join(str(refused.value).split())
    assert f"The smallest peak any plan reaches is {last.peak_bytes:,} B" in words
    assert "memory_frontier's last row" not in words


def test_the_plot_draws_the_floor_as_its_own_point_below_the_rows(tmp_path):
    pytest.importorskip("matplotlib", reason="pip install 'backplan[plot]'")
    with use_backend("numba"):
        frontier = bp.value_and_grad(loss).memory_frontier(*arrays())
    floor = frontier.floor
    lines = {line.get_label(): line for line in frontier.figure().axes[0].get_lines()}
    drawn = [label for label in lines if label.startswith("lowest peak")]
    assert len(drawn) == 1
    x, y = lines[drawn[0]].get_xdata()[0], lines[drawn[0]].get_ydata()[0]
    assert (x, y) == (floor.added_flops / 1e6, floor.peak_bytes / 2**20)
    assert y < min(p.peak_bytes for p in frontier.points) / 2**20
    frontier.plot(tmp_path / "frontier.svg")
    assert "lowest peak" in (tmp_path / "frontier.svg").read_text()


def test_a_floor_whose_saved_buffers_are_narrowed_says_it_rounds():
    """With allow_saved_dtype the lowest plan may keep its saved buffers in bfloat16: the
    floor line, like a row, says so (the backward reads rounded values), and the plot too.
    The floor is set on mlp_deep's real bfloat16 frontier: since the backward's GEMMs read
    bfloat16 saved values with no float32 copies, its last row is its lowest plan."""
    from dataclasses import replace

    from backplan.bench.budget_models import mlp_deep
    from backplan.report.frontier import FrontierPoint

    fn, params, batch = mlp_deep()
    with use_backend("numba"):
        frontier = bp.value_and_grad(fn, allow_saved_dtype=bp.bfloat16).memory_frontier(
            params, *batch
        )
        plain = bp.value_and_grad(loss).memory_frontier(*arrays())
    last = frontier.points[-1]
    assert last.rounds
    lower = FrontierPoint(
        last.peak_bytes - 10_240, last.added_flops + 1, last.recomputed + 3, last.saved_bytes,
        "bfloat16",
    )  # fmt: skip
    frontier = replace(frontier, floor=lower)
    floor = frontier.floor
    line = next(x for x in str(frontier).splitlines() if "below the last row" in x)
    assert f"{floor.recomputed} recomputed, saved buffers in bfloat16 (rounds))" in line
    assert plain.floor is not None and not plain.floor.rounds
    assert "rounds" not in next(x for x in str(plain).splitlines() if "below the last" in x)
    if importlib.util.find_spec("matplotlib") is not None:
        labels = [line.get_label() for line in frontier.figure().axes[0].get_lines()]
        assert "lowest peak (no row: under 1% below the last), saved in bfloat16 (rounds)" in labels
