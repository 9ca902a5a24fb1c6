"""bp.compile(..., background=True) (and value_and_grad's): while the kernels build, calls run
on the reference interpreter and hold its buffers besides the compiled plans' scratch arenas.
explain prints that peak (report.building_peak) and the checked mode counts those calls, so
what is printed is what they hold. The build is made to fail so the calls stay on the
interpreter however fast the machine is (a build that finishes switches them to compiled)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls
from backplan.codegen.build import driver_builder
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

pytestmark = pytest.mark.usefixtures("child_builds")  # no direct driver in their place


def loss(w, x):
    return bp.mean(bp.tanh(x @ w) ** 2)


@pytest.fixture
def failing_build(monkeypatch, tmp_path):
    """A cache folder of its own (nothing compiled yet) and a build that fails at once."""
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "1000")

    def failing():
        return [sys.executable, "-c", "import sys; sys.exit('no compiler')"]

    monkeypatch.setattr(driver_builder, "_command", failing)


def _data(rows: int):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    return bp.tensor(w, requires_grad=True), bp.tensor(
        rng.standard_normal((rows, 6)).astype(np.float32)
    )


@pytest.mark.parametrize("how", ["value_and_grad", "compile"])
def test_calls_while_the_kernels_build_hold_the_printed_building_peak(failing_build, how):
    w, x = _data(9 if how == "compile" else 11)
    with use_backend("numba"), checked_memory():
        if how == "value_and_grad":
            fn = bp.value_and_grad(loss, background=True)

            def step():
                fn(w, x)

        else:
            fn = bp.compile(loss, background=True)

            def step():
                w.grad = None
                fn(w, x).backward()

        report = bp.explain(fn, w, x)
        with pytest.warns(bp.DriverBuildWarning, match="keep running on the reference"):
            step()
            fn.wait_until_compiled(timeout=60)
            assert fn.driver_tier == "reference"
            counted = counted_calls(step, 3)
            # the later calls queue builds of their own plans (a compiled loss's joint plan):
            # they fail too, and their warnings belong here, not in the worker's next test
            assert driver_builder.wait_for_builds(timeout=60)
    building = report.building_peak
    assert counted == [report.building_peak_on_call(n).allocated_peak_bytes for n in (2, 3, 4)]
    assert max(counted) == building.allocated_peak_bytes
    assert building.at_peak()["scratch"] > 0  # the compiled plans' arenas, kept meanwhile
    text = " ".join(str(report).split())
    assert f"holding up to {building.peak_bytes:,} B meanwhile (report.building_peak" in text


def test_a_step_compiled_otherwise_has_no_building_peak():
    w, x = _data(4)
    assert bp.explain(bp.value_and_grad(loss), w, x).building_peak is None
