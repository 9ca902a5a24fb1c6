"""Loop kernels are shared: plans with the same loop body compile it once, whatever their sizes
and value names; an unrolled loop compiles as many kernels for 16 steps as for 4; a slow first
call says what it compiles on stderr, a fast one says nothing."""

import re

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import kernel_cache
from backplan.runtime.backend import use_backend


def scaled_tanh(w, x):
    return bp.sum(bp.tanh(x * w + 1.0) * 0.5)


def rnn(u, xs, steps):
    h = bp.tanh(xs[0])
    for t in range(1, steps):
        h = bp.tanh(xs[t] + h @ u)
    return bp.sum(h * h)


def joint(fn, *args, **static):
    """value_and_grad's compiled plan for these arguments, and its first call's results."""
    vg = bp.value_and_grad(lambda *a: fn(*a, **static))
    value, grad = vg(*args)
    return vg.trace(*args).runner().compiled, value, grad


def floats(rng, *shape):
    return bp.tensor(rng.standard_normal(shape).astype(np.float32))


def test_two_plans_with_the_same_loop_bodies_compile_them_once():
    rng = np.random.default_rng(0)
    with use_backend("numba"):
        first, _, _ = joint(scaled_tanh, floats(rng, 4, 8), floats(rng, 4, 8))
        before = kernel_cache.counts()
        second, value, grad = joint(scaled_tanh, w := floats(rng, 3, 5), x := floats(rng, 3, 5))
        after = kernel_cache.counts()
    assert second.source != first.source  # another plan: other sizes
    assert {k.digest for k in second.loop_kernels} == {k.digest for k in first.loop_kernels}
    assert after.versions == before.versions  # nothing new compiled or loaded
    with use_backend("reference"):
        expected_value, expected_grad = bp.value_and_grad(scaled_tanh)(w, x)
    np.testing.assert_allclose(value.numpy(), expected_value.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-5, atol=1e-6)


def test_an_unrolled_loop_compiles_as_many_kernels_for_16_steps_as_for_4():
    rng = np.random.default_rng(1)
    u = floats(rng, 6, 6)
    with use_backend("numba"):
        short, _, _ = joint(rnn, u, floats(rng, 4, 3, 6), steps=4)
        before = kernel_cache.counts()
        xs = floats(rng, 16, 3, 6)
        long, value, grad = joint(rnn, u, xs, steps=16)
        after = kernel_cache.counts()
    assert len(long.loop_kernels) == len(short.loop_kernels)
    assert after.versions - before.versions <= len(long.loop_kernels) - len(
        {k.digest for k in long.loop_kernels} & {k.digest for k in short.loop_kernels}
    )
    with use_backend("reference"):
        expected_value, expected_grad = bp.value_and_grad(lambda a, b: rnn(a, b, 16))(u, xs)
    np.testing.assert_allclose(value.numpy(), expected_value.numpy(), rtol=1e-4)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "env, expect_lines",
    [
        ({"BACKPLAN_PROGRESS_SECONDS": "0", "BACKPLAN_VERBOSE": "1"}, True),
        ({"BACKPLAN_PROGRESS_SECONDS": "1000", "BACKPLAN_VERBOSE": "1"}, False),
        ({"BACKPLAN_PROGRESS_SECONDS": "0", "BACKPLAN_VERBOSE": "1", "BACKPLAN_QUIET": "1"}, False),
        ({"BACKPLAN_PROGRESS_SECONDS": "0"}, False),  # details only under BACKPLAN_VERBOSE
    ],
)
def test_progress_lines_appear_only_when_the_compile_is_predicted_slow(
    env, expect_lines, monkeypatch, capfd
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rng = np.random.default_rng(2)
    capfd.readouterr()
    with use_backend("numba"):
        compiled, _, _ = joint(scaled_tanh, floats(rng, 2, 7), floats(rng, 2, 7))
    err = capfd.readouterr().err
    lines = [
        line
        for line in err.splitlines()
        if line.startswith(("backplan: @", "backplan: the lambda"))
    ]
    if not expect_lines:
        assert lines == []
        return
    kernels = len(compiled.loop_kernels)
    assert f"of {kernels} loop kernels" in lines[0] and "cached" in lines[0]
    assert lines[-1].endswith(" s") and f"{kernels} in all" in lines[-1]


@pytest.mark.parametrize("driver", ["inline", "python"])
def test_progress_counts_kernels_compiled_in_either_form(driver, monkeypatch, tmp_path, capfd):
    """Compiled drivers compile a kernel's array-view form, first calls on a Python-run driver
    its address form (codegen/render/kernel_source.py): either way the ready line counts it once."""
    monkeypatch.setenv("BACKPLAN_DRIVER", driver)
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "0")
    monkeypatch.setenv("BACKPLAN_VERBOSE", "1")
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))

    def unusual(w, x):  # loop bodies no other test compiles, one set per driver mode
        if driver == "inline":
            return bp.sum(bp.sin(bp.cos(x * w) + bp.abs(w)) * (x - 3.0))
        return bp.sum(bp.sin(bp.abs(x * w) - bp.cos(w)) * (x + 2.0))

    rng = np.random.default_rng(4)
    capfd.readouterr()
    with use_backend("numba"):
        compiled, _, _ = joint(unusual, floats(rng, 3, 5), floats(rng, 3, 5))
    ready = [line for line in capfd.readouterr().err.splitlines() if ": ready: " in line]
    total = len(compiled.loop_kernels)
    done, cached = map(
        int, re.search(r"ready: (\d+) kernels compiled, (\d+) cached", ready[0]).groups()
    )
    assert done >= 1 and done + cached == total, ready


def test_a_kernel_predicted_cached_that_compiles_counts_as_one_more_to_compile(monkeypatch, capfd):
    """The cached count is a prediction (an index on disk may hold other argument types): a
    first call at a new size printed "8/7 kernels compiled" and "ready: 10 kernels compiled, 5
    cached, 12 in all". Such a kernel now moves from cached to compiled, so the lines add up."""
    from backplan.codegen.build import progress

    monkeypatch.setattr(progress, "LINE_INTERVAL", 0.0)
    guess = progress.CompileEstimate(4, 2, 1.0, frozenset({"a", "b"}))
    capfd.readouterr()
    lines = progress._Lines("@f", guess, set())
    for digest in ("c", "a", "d", "c"):
        lines.kernel_done(digest)
    lines.done()
    said = [line.split(": ", 2)[2] for line in capfd.readouterr().err.splitlines()]
    assert said[0].startswith("compiling 2 of 4 loop kernels (2 cached)")
    assert [line.split(",")[0] for line in said[1:4]] == [
        "1/2 kernels compiled",
        "2/3 kernels compiled",
        "3/3 kernels compiled",
    ]
    assert said[4].startswith("ready: 3 kernels compiled, 1 cached, 4 in all"), said


def test_a_forward_only_plan_under_no_grad_shares_the_training_plans_kernels(monkeypatch):
    """bp.no_grad() retraces (a forward-only plan, no saved buffers). Where its loops have the
    bodies the training forward has (an MLP: bias + relu loops), it compiles no new kernel; a
    plan that fuses further without saved values would compile those loops anew.

    With a GEMM's epilogue written over its product (ir/layout.py, the default) the forward-only
    plan's bias + relu loop writes over the product, which the training plan cannot (its relu
    output is a saved buffer): one buffer less a layer for one more loop variant (one view for
    the read and the write). The sharing of equal bodies is checked with that layout off."""
    from backplan.examples.mlp import init_mlp, mlp_loss
    from backplan.ir import layout

    monkeypatch.setattr(layout, "EPILOGUE_OVER_PRODUCT", False)

    rng = np.random.default_rng(3)
    params = init_mlp([6, 8, 8, 3], seed=3)
    x = floats(rng, 5, 6)
    labels = bp.tensor(rng.integers(0, 3, 5))
    fn = bp.compile(mlp_loss)
    with use_backend("numba"):
        fn(params, x, labels).backward()
        before = kernel_cache.counts()
        with bp.no_grad():
            value = fn(params, x, labels)
        after = kernel_cache.counts()
    assert fn.cache_info().traces == 2
    assert after.loaded == before.loaded
    with use_backend("reference"):
        np.testing.assert_allclose(value.numpy(), fn(params, x, labels).numpy(), rtol=1e-5)


def test_one_numba_thread_generates_no_parallel_kernel():
    """numba.set_num_threads(1) (the harness's --threads 1) leaves no thread to gain from: the
    plan's big loops are serial (and cache as a plan of their own)."""
    import numba

    from backplan.codegen.run.compiled import PARALLEL_LAUNCH

    rng = np.random.default_rng(4)
    w, x = floats(rng, 2048, 1024), floats(rng, 2048, 1024)  # parallel with 2 threads
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        with use_backend("numba"):
            serial, value, grad = joint(scaled_tanh, w, x)
    finally:
        numba.set_num_threads(previous)
    assert not any(k.parallel for k in serial.loop_kernels)
    assert not PARALLEL_LAUNCH.search(serial.source)
    with use_backend("reference"):
        expected_value, expected_grad = bp.value_and_grad(scaled_tanh)(w, x)
    np.testing.assert_allclose(value.numpy(), expected_value.numpy(), rtol=1e-4)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-4, atol=1e-6)


def test_driver_build_estimate_grows_with_statements_and_skips_twins_already_compiled(
    monkeypatch, tmp_path
):
    """The background build's "about N s" counts the driver's statements and the inlined twin
    of each kernel whose array-view form was never compiled: a plan whose twins are compiled
    is predicted cheaper by exactly their cost, a longer driver dearer."""
    from backplan.codegen.build import progress

    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BACKPLAN_DRIVER", "inline")  # compiles the twins in the first call
    rng = np.random.default_rng(5)

    def odd(w, x):  # loop bodies no other test compiles
        return bp.sum(bp.tanh(bp.abs(x * w) + 0.25) * (x - 1.5))

    with use_backend("numba"):
        compiled, _, _ = joint(odd, floats(rng, 3, 4), floats(rng, 3, 4))
    kernels = compiled.loop_kernels
    fresh = progress.fresh_twins(kernels)
    assert fresh == []  # the inline driver compiled every twin
    statements = compiled._driver_statements
    assert progress.driver_seconds(statements, fresh) + progress.SERIAL_SECONDS * len(
        kernels
    ) == pytest.approx(progress.driver_seconds(statements, list(kernels)))
    assert progress.driver_seconds(10 * statements, []) > progress.driver_seconds(statements, [])


def test_first_call_estimate_prices_a_loop_taking_addresses_apart(monkeypatch, tmp_path):
    """A first call compiles a kernel's loop taking addresses where it has one (optimised
    once, cheaper), any other kernel whole; the estimate prices each so."""
    from backplan.codegen.build import progress
    from backplan.codegen.render.kernel_source import KernelSource

    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))  # nothing cached
    address = KernelSource("a" * 64, "def kernel_at(a0):\n    pass\ndef kernel(a0):\n", False, ())
    plain = KernelSource("b" * 64, "def kernel(a0):\n    pass\n", False, ())
    parallel = KernelSource("c" * 64, "def kernel(a0):\n    pass\n", True, ())
    guess = progress.estimate([address, plain, parallel], driver_cached=True)
    assert guess.to_compile == 3
    assert guess.seconds == pytest.approx(
        progress.ADDRESS_LOOP_SECONDS + progress.SERIAL_SECONDS + progress.PARALLEL_SECONDS
    )
    assert progress.ADDRESS_LOOP_SECONDS < progress.SERIAL_SECONDS
