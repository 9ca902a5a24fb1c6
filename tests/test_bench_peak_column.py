"""The harness's peak column measures what a compiled step holds: backplan's rows are counted
by the checked mode (BACKPLAN_CHECK_MEMORY's counting allocator, which sees the arenas and
outputs inside compiled kernels that tracemalloc misses), beside the plan's prediction; a
difference is printed as a mismatch."""

from __future__ import annotations

import numpy as np

from backplan.bench.measure import QUICK
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import BackplanCompilePeer, BackplanPeer
from backplan.bench.peers.numpy_peer import NumpyPeer
from backplan.bench.progress import Progress
from backplan.bench.report.format import footnotes
from backplan.bench.suite import CHECKED_MODE, Settings, bench_model
from backplan.runtime.backend import use_backend


def test_compiled_rows_are_measured_by_the_checked_mode_and_equal_the_plan():
    # the compile + backward() row's third step runs one joint plan (a small loss,
    # runtime/joint_step.py): explain's peak for that call is what it is compared with
    peers = [BackplanPeer(), BackplanCompilePeer(), NumpyPeer()]
    settings = Settings(small=True, schedule=QUICK, warm_compile=False)
    with use_backend("numba"):
        rows = {
            r["peer"]: r
            for r in bench_model(MODELS["mlp_tiny"], peers, settings, Progress(enabled=False))
        }
    for peer in ("backplan", "backplan.compile"):
        peak = rows[peer]["peak_bytes"]
        assert rows[peer]["status"] == "ok", rows[peer]["note"]
        assert peak["measured_by"] == CHECKED_MODE
        # the counting allocator saw the step's own buffers (far more than tracemalloc sees)
        assert peak["counted"] > 0 and peak["counted"] == peak["counted_predicted"]
        assert peak["measured"] == peak["planned"]
        assert sum(peak["counted_held"].values()) == peak["counted"]
        assert 0 < peak["left_alive"] <= peak["counted"]  # the arena kept from the last step
    assert rows["numpy"]["peak_bytes"]["measured_by"] == "tracemalloc"


def test_the_reference_interpreter_falls_back_to_tracemalloc():
    settings = Settings(small=True, schedule=QUICK, warm_compile=False)
    with use_backend("reference"):
        (row,) = bench_model(
            MODELS["mlp_tiny"], [BackplanPeer()], settings, Progress(enabled=False)
        )
    assert row["peak_bytes"]["measured_by"] == "tracemalloc"
    assert "counted" not in row["peak_bytes"]


def test_a_counted_peak_other_than_the_plan_is_printed_as_a_mismatch():
    row = {
        "peer": "backplan",
        "status": "ok",
        "peak_bytes": {"measured": 9_000, "counted": 5_000, "counted_predicted": 4_096},
    }
    (line,) = footnotes([row])
    assert "MEMORY MISMATCH" in line and "5,000" in line and "4,096" in line
    row["peak_bytes"].update(counted_held={"scratch": 3_000, "output 1": 2_000}, left_alive=3_000)
    (line,) = footnotes([row])
    assert line.endswith(
        "(held at the peak: scratch 3,000, output 1 2,000; 3,000 B of it left alive by the "
        "earlier steps)"
    )
    row["peak_bytes"]["counted"] = 4_096
    assert footnotes([row]) == []


def test_the_memory_table_row_has_the_checked_peak_and_timed_frontier_rows():
    from backplan.bench.memory_table import model_row

    with use_backend("numba"):
        row = model_row("mlp_tiny", rounds=1, count=2, fresh=False)
    cells = [c.strip() for c in row.strip("|").split("|")]
    predicted = cells[1]
    assert cells[2] == f"{predicted} ="  # counted + arrays passed in == printed peak
    rows, frontier = cells[-1].split(": ", 1)
    assert rows == "1 of 1" and frontier.startswith(f"{predicted} +0.0% ")
    assert frontier.endswith(" 1.00x")


def test_the_imported_torch_row_is_counted_too():
    """bp.from_torch's row (its runner builds itself differently) gets its twin as well: its
    measured peak equals its plan's, and no memory fact is lost."""
    import pytest

    pytest.importorskip("torch")
    from backplan.bench.peers.imported_peer import ImportedRunner

    spec = MODELS["mlp_tiny"]
    with use_backend("numba"):
        runner = ImportedRunner(spec, spec.inputs(small=True, dtype=np.float32))
        runner.step()
        counted = runner.counted_peak_bytes()
        planned = runner.planned_peak_bytes()[0]
    assert counted["counted"] == counted["predicted"] > 0
    assert counted["bytes"] == planned
