"""A first call does not wait for its plan's driver to compile: it runs the driver as Python
calling the same compiled kernels while a child process compiles the driver into the cache, then
switches (codegen/build/driver_tier.py). Both tiers give bitwise the same results as each other and
the reference's within rounding; a failed build warns and keeps the calls correct; the lines
say what happens; a bad index reads the same on the Python tier."""

import sys

import numpy as np
import pytest
from helpers import script_facts

import backplan as bp
from backplan.codegen.build import driver_builder, driver_tier
from backplan.runtime.backend import use_backend

pytestmark = pytest.mark.usefixtures("child_builds")  # no direct driver in their place


def loss(w, x):
    return bp.mean(bp.tanh(x @ w) ** 2)


def data(rows: int):
    """rows: a batch size of the test's own, so that its plan is new in this process too."""
    rng = np.random.default_rng(rows)
    w = bp.tensor(rng.standard_normal((5, 3)).astype(np.float32))
    x = bp.tensor(rng.standard_normal((rows, 5)).astype(np.float32))
    return w, x


@pytest.fixture
def background(monkeypatch, tmp_path):
    """A cache folder of its own, so the driver is not already compiled and cached."""
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("BACKPLAN_DRIVER", "background")


def compiled_plan(step, *args):
    return step.trace(*args).runner().compiled


def test_first_calls_run_the_python_driver_then_switch_to_the_compiled_one(background):
    w, x = data(2)
    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(loss))
        first_value, first_grad = step(w, x)
        plan = compiled_plan(step, w, x)
        assert plan.driver_tier == "python"
        assert plan.wait_for_driver(timeout=240), plan.driver_error
        assert plan.driver_tier == "compiled" and plan.driver_seconds > 0
        value, grad = step(w, x)
        again = bp.value_and_grad(bp.compile(loss))  # a new plan finds the driver cached
        again(w, x)
        assert compiled_plan(again, w, x).driver_tier == "compiled"
    # The same loop bodies, compiled in two forms (codegen/render/kernel_source.py): the Python
    # driver's address kernels go through a shorter LLVM pipeline than the compiled driver's, so
    # fastmath may contract a multiply-add into an FMA in one and not the other (measured on an
    # AMD EPYC: one element a float32 ulp apart); the results agree to rounding.
    np.testing.assert_allclose(value.numpy(), first_value.numpy(), rtol=1e-6)
    np.testing.assert_allclose(grad.numpy(), first_grad.numpy(), rtol=1e-6, atol=1e-8)
    with use_backend("reference"):
        expected_value, expected_grad = bp.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value.numpy(), expected_value.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-5, atol=1e-7)


def test_a_failed_build_warns_and_calls_stay_correct(background, monkeypatch):
    def failing():
        script = "import sys; print('no compiler', file=sys.stderr); sys.exit(3)"
        return [sys.executable, "-c", script]

    monkeypatch.setattr(driver_builder, "_command", failing)
    w, x = data(3)
    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(loss))
        with pytest.warns(bp.DriverBuildWarning, match=r"status 3: no compiler"):
            first = step(w, x)
            plan = compiled_plan(step, w, x)
            assert not plan.wait_for_driver(timeout=60)
        assert plan.driver_tier == "python" and "status 3" in plan.driver_error
        second = step(w, x)
    assert second[0].numpy() == first[0].numpy()
    assert np.array_equal(second[1].numpy(), first[1].numpy())


def test_lines_say_the_driver_builds_in_the_background_and_when_it_is_ready(
    background, monkeypatch, capfd
):
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "0")
    monkeypatch.setenv("BACKPLAN_VERBOSE", "1")
    w, x = data(4)
    capfd.readouterr()
    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(loss))
        step(w, x)
        plan = compiled_plan(step, w, x)
        assert plan.wait_for_driver(timeout=240), plan.driver_error
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("backplan:")]
    assert any("builds in a background process" in line for line in lines), lines
    assert any("compiled driver ready after" in line for line in lines), lines


def test_quiet_background_build_prints_nothing(background, monkeypatch, capfd):
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "0")
    monkeypatch.setenv("BACKPLAN_QUIET", "1")
    w, x = data(5)
    capfd.readouterr()
    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(loss))
        step(w, x)
        plan = compiled_plan(step, w, x)
        assert driver_builder.wait_for_builds(timeout=240)  # what the benchmark harness waits on
        assert plan.driver_tier == "compiled" and driver_builder.pending() == 0
    assert "backplan:" not in capfd.readouterr().err


def test_a_bad_label_reads_the_same_on_the_python_driver(monkeypatch):
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")

    def labelled(w, labels):
        return bp.cross_entropy(bp.tensor(np.eye(3, dtype=np.float32)) @ w, labels)

    step = bp.value_and_grad(bp.compile(labelled))
    w = bp.tensor(np.ones((3, 5), np.float32))
    with use_backend("numba"):
        value, _ = step(w, bp.tensor(np.array([0, 4, 2])))
        assert compiled_plan(step, w, bp.tensor(np.array([0, 4, 2]))).driver_tier == "python"
        assert np.isfinite(value.numpy())
        with pytest.raises(bp.ExecutionError, match=r"label -1 at position 2 is out of range"):
            step(w, bp.tensor(np.array([0, 4, -1])))


def test_an_unknown_driver_mode_is_refused(monkeypatch):
    monkeypatch.setenv("BACKPLAN_DRIVER", "eventually")
    with pytest.raises(ValueError, match=r"BACKPLAN_DRIVER='eventually'; use one of background"):
        driver_tier.driver_mode()


def test_a_mode_variable_set_empty_means_its_default(monkeypatch):
    """`BACKPLAN_DRIVER=$MODE python ...` with MODE unset sets it to "": the default, as an
    empty BACKPLAN_GEMM or BACKPLAN_QUIET is (each raised ValueError naming '')."""
    import os
    import subprocess
    import sys

    from backplan.codegen.build import loop_calls

    for name in ("BACKPLAN_DRIVER", "BACKPLAN_DRIVER_AT_EXIT", "BACKPLAN_DRIVER_LOOPS"):
        monkeypatch.setenv(name, "")
    assert driver_tier.driver_mode() == "background"
    assert driver_tier.at_exit_mode() == "kill"
    assert loop_calls.mode() == "linked"
    code = "from backplan.runtime.backend import current_backend; print(current_backend())"
    env = {**os.environ, "BACKPLAN_BACKEND": ""}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "numba", run.stderr[-2000:]


def test_reference_first_calls_compile_nothing_here_then_switch(background, monkeypatch, capfd):
    """BACKPLAN_DRIVER=reference: the first call waits for no compiler; the child compiles the
    kernels and the driver, and later calls run them."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "reference")
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "0")
    monkeypatch.setenv("BACKPLAN_VERBOSE", "1")
    from backplan.codegen.build import kernel_cache

    w, x = data(6)
    capfd.readouterr()
    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(loss))
        before = kernel_cache.counts().compiled
        first_value, first_grad = step(w, x)
        plan = compiled_plan(step, w, x)
        assert plan.driver_tier == "reference"
        assert kernel_cache.counts().compiled == before  # nothing compiled in this process
        assert plan.wait_for_driver(timeout=240), plan.driver_error
        value, grad = step(w, x)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("backplan:")]
    assert any("run on the reference interpreter while" in line for line in lines), lines
    with use_backend("reference"):
        expected_value, expected_grad = bp.value_and_grad(loss)(w, x)
    assert first_value.numpy() == expected_value.numpy()  # the first call was the reference's
    assert np.array_equal(first_grad.numpy(), expected_grad.numpy())
    np.testing.assert_allclose(value.numpy(), expected_value.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-5, atol=1e-7)


NEXT_PROCESS = """
import json, sys
import numpy as np
import backplan as bp
from backplan.codegen.build import driver_builder
from backplan.codegen.build import driver_tier
from backplan.runtime.backend import use_backend

def loss(w, x):
    return bp.mean(bp.tanh(x @ w) ** 2)

w = bp.tensor(np.ones((5, 3), np.float32))
x = bp.tensor(np.ones((13, 5), np.float32))
step = bp.value_and_grad(bp.compile(loss))
with use_backend("numba"):
    step(w, x)
    plan = step.trace(w, x).runner().compiled
    tier = plan.driver_tier
    built = driver_builder.wait_for_builds(timeout=240)
print(json.dumps({"tier": tier, "built": built, "now": plan.driver_tier}))
"""


def test_a_next_process_starts_on_the_driver_the_last_one_built(tmp_path):
    import os

    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels"),
        "BACKPLAN_DRIVER": "background",
    }

    def run() -> dict:
        return script_facts(NEXT_PROCESS, env=env, timeout=300)

    assert run() == {"tier": "python", "built": True, "now": "compiled"}
    assert run() == {"tier": "compiled", "built": True, "now": "compiled"}


def test_a_plan_without_scratch_gives_its_driver_argument_types(monkeypatch):
    """A plan with no scratch arena (w * x summed) has an empty tuple of scratch views: the
    types a driver build compiles for raised TypeError (a list + a tuple), so under
    BACKPLAN_DRIVER=reference such a plan warned 'could not start the driver build' and never
    left the reference interpreter; bench.memory's load_driver raised too."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")  # no build started by the call itself
    w = np.ones((2, 3), np.float32)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(lambda w, x: (w * x).sum()))
        step(w, x)
        plan = compiled_plan(step, w, x)
        types = plan.call_types([w, x])
    assert len(types) == 2 + len(plan._constants) + len(plan.layout.outputs)  # noqa: SLF001
