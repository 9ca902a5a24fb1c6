"""bp.compile(fn, background=True) and value_and_grad / grad's: that function's first calls run on
the reference interpreter, with no compiler in the call, while a child process compiles its
kernels and drivers (the backward plans .backward() reaches included); then it switches, says so
on stderr, and reports it (fn.driver_tier, fn.wait_until_compiled). background=False compiles in
the call whatever BACKPLAN_DRIVER says."""

import sys

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import driver_builder, kernel_cache
from backplan.runtime.backend import use_backend

pytestmark = pytest.mark.usefixtures("child_builds")  # no direct driver in their place

WAIT_S = 300  # a generous bound on a background build on a loaded machine; never asserted on


def loss(w, x):
    return bp.mean(bp.tanh(x @ w) ** 2)


def data(rows: int, requires_grad: bool = False):
    """rows: a batch size of the test's own, so that its plans are new in this process too."""
    rng = np.random.default_rng(100 + rows)
    w = bp.tensor(rng.standard_normal((4, 3)).astype(np.float32), requires_grad=requires_grad)
    x = bp.tensor(rng.standard_normal((rows, 4)).astype(np.float32))
    return w, x


def eager_value_and_grad(w, x):
    """The oracle: the same loss run op by op on NumPy (eager ops use the reference path)."""
    w = bp.tensor(w.numpy(), requires_grad=True)
    value = loss(w, x)
    value.backward()
    return value.numpy(), w.grad.numpy()


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """A cache folder of its own, so nothing this test compiles is cached already; the env's
    BACKPLAN_DRIVER stays the default (background), which background= must override."""
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "1000")  # only the switch line may print
    monkeypatch.setenv("BACKPLAN_VERBOSE", "1")  # the switch is a detail line


def backplan_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.startswith("backplan:")]


def test_compile_background_runs_reference_first_then_switches_forward_and_backward(
    fresh_cache, capfd
):
    w, x = data(2, requires_grad=True)
    expected_value, expected_grad = eager_value_and_grad(w, x)
    capfd.readouterr()
    with use_backend("numba"):
        fn = bp.compile(loss, background=True)
        assert fn.driver_tier is None  # no call, no plan
        compiled_before = kernel_cache.counts().compiled
        value = fn(w, x)
        value.backward()
        assert kernel_cache.counts().compiled == compiled_before  # no compiler in the calls
        program = fn.trace(w, x).program
        assert [r.driver_tier for r in program.runners()] == ["reference", "reference"]
        assert fn.driver_tier == "reference"
        first_grad = w.grad.numpy().copy()
        assert fn.wait_until_compiled(timeout=WAIT_S), [
            r.compiled.driver_error for r in program.runners()
        ]
        assert fn.driver_tier == "compiled"
        assert [r.driver_tier for r in program.runners()] == ["compiled", "compiled"]
        bp.zero_grad(w)
        later = fn(w, x)
        later.backward()
        # everything came from the child through the cache: no compile in this process
        assert kernel_cache.counts().compiled == compiled_before
        assert [len(r.compiled._run.overloads) for r in program.runners()] == [1, 1]
    close(value.numpy(), expected_value)
    close(first_grad, expected_grad)
    close(later.numpy(), expected_value)
    close(w.grad.numpy(), expected_grad)
    switched = [line for line in backplan_lines(capfd) if "calls switch" in line]
    assert len(switched) == 2, switched  # one line per plan: the forward and the backward


def test_value_and_grad_background_switches_and_is_quiet_under_backplan_quiet(
    fresh_cache, monkeypatch, capfd
):
    monkeypatch.setenv("BACKPLAN_QUIET", "1")
    w, x = data(3)
    expected_value, expected_grad = eager_value_and_grad(w, x)
    capfd.readouterr()
    with use_backend("numba"):
        step = bp.value_and_grad(loss, background=True)
        first_value, first_grad = step(w, x)
        assert step.driver_tier == "reference"
        assert step.wait_until_compiled(timeout=WAIT_S)
        assert step.driver_tier == "compiled"
        value, grad = step(w, x)
    for v, g in ((first_value, first_grad), (value, grad)):
        close(v.numpy(), expected_value)
        close(g.numpy(), expected_grad)
    assert backplan_lines(capfd) == []


def test_grad_of_a_background_compile_function_takes_its_choice(fresh_cache):
    """value_and_grad / grad inline a bp.compile function's trace into their own plan, so
    they take its background= unless given their own."""
    w, x = data(4)
    _, expected_grad = eager_value_and_grad(w, x)
    inner = bp.compile(loss, background=True)
    assert bp.value_and_grad(inner, background=False).background is False
    with use_backend("numba"):
        grad_fn = bp.grad(inner)
        first = grad_fn(w, x)
        assert grad_fn.driver_tier == "reference"
        assert grad_fn.wait_until_compiled(timeout=WAIT_S)
        later = grad_fn(w, x)
    close(first.numpy(), expected_grad)
    close(later.numpy(), expected_grad)


def test_background_false_compiles_in_the_call_whatever_the_environment_says(
    fresh_cache, monkeypatch
):
    monkeypatch.setenv("BACKPLAN_DRIVER", "reference")
    w, x = data(5, requires_grad=True)
    expected_value, expected_grad = eager_value_and_grad(w, x)
    with use_backend("numba"):
        fn = bp.compile(loss, background=False)
        versions_before = kernel_cache.counts().versions
        value = fn(w, x)
        value.backward()
        # Machine code of its kernels came into this process in the call: compiled here, or
        # loaded from what an earlier test's build process compiled (kernels are shared).
        assert kernel_cache.counts().versions > versions_before
        assert fn.driver_tier == "compiled"
        assert fn.wait_until_compiled(timeout=0)
        follows_env = bp.compile(loss)  # None: BACKPLAN_DRIVER=reference
        follows_env(*data(7))  # plans of their own (the first one's driver is cached now)
        assert follows_env.driver_tier == "reference"
        assert follows_env.wait_until_compiled(timeout=WAIT_S)
    close(value.numpy(), expected_value)
    close(w.grad.numpy(), expected_grad)


def test_a_failed_background_build_warns_and_calls_stay_on_the_reference(fresh_cache, monkeypatch):
    def failing():
        return [sys.executable, "-c", "import sys; print('no compiler', file=sys.stderr); 1/0"]

    monkeypatch.setattr(driver_builder, "_command", failing)
    w, x = data(6)
    expected_value, expected_grad = eager_value_and_grad(w, x)
    with use_backend("numba"):
        step = bp.value_and_grad(loss, background=True)
        with pytest.warns(bp.DriverBuildWarning, match=r"keep running on the reference"):
            step(w, x)
            assert not step.wait_until_compiled(timeout=60)
        assert step.driver_tier == "reference"
        value, grad = step(w, x)
    close(value.numpy(), expected_value)
    close(grad.numpy(), expected_grad)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0, "background"])
def test_a_background_that_is_not_a_bool_or_none_is_refused_by_name(bad):
    for make in (
        lambda: bp.compile(loss, background=bad),
        lambda: bp.compile(background=bad),
        lambda: bp.value_and_grad(loss, background=bad),
        lambda: bp.grad(loss, background=bad),
    ):
        with pytest.raises(TypeError, match=f"True, False or None, got {bad!r}"):
            make()


def test_nothing_called_means_nothing_compiled_yet():
    fn = bp.compile(loss, background=True)
    assert fn.driver_tier is None
    assert fn.wait_until_compiled(timeout=0) is False
