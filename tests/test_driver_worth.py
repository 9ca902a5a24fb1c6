"""The default background mode builds a compiled driver only where it would make a step
noticeably faster (codegen/build/driver_tier.worth_compiling): a step dominated by a few big
GEMMs keeps its Python-run driver, with no build process beside it; a small step builds one."""

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import driver_builder
from backplan.runtime.backend import use_backend

pytestmark = pytest.mark.usefixtures("child_builds")  # no direct driver in their place


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """The builds submitted, recorded instead of started (nothing compiles here)."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "background")
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    submitted = []
    monkeypatch.setattr(driver_builder, "submit", submitted.append)
    return submitted


def loss(w, x):
    return bp.mean(bp.tanh(x @ w) ** 2)


def plan_after_one_call(rows: int, width: int):
    w = bp.tensor(np.full((width, width), 0.01, np.float32))
    x = bp.tensor(np.ones((rows, width), np.float32))
    step = bp.value_and_grad(bp.compile(loss))
    with use_backend("numba"):
        value, _ = step(w, x)
        plan = step.trace(w, x).runner().compiled
    return plan, float(value.numpy())


def test_a_gemm_bound_step_keeps_the_python_driver_and_builds_nothing(builds):
    plan, value = plan_after_one_call(256, 512)
    assert builds == [] and plan.driver_tier == "python"
    assert "under 5% of a step" in plan.driver_skipped
    assert plan.wait_for_driver(timeout=0) is False  # nothing is coming: no wait
    assert value == pytest.approx(np.tanh(512 * 0.01) ** 2, rel=1e-4)


def test_a_small_step_builds_its_compiled_driver(builds):
    plan, _ = plan_after_one_call(4, 5)
    assert len(builds) >= 1 and plan.driver_skipped is None
