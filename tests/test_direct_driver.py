"""The direct driver (codegen/build/direct_driver.py): in the default background mode a plan
whose compiled driver is worth building runs its driver as Python in the first call and, from
the second, a driver emitted as LLVM IR directly from the same source; no background build
starts. Its values equal the Python-run driver's (the same kernels) and the reference
interpreter's within rounding, special values and odd sizes included; a bad label raises the
Python-run driver's error; a driver it does not read keeps the background build."""

import ast
import glob
import os
import textwrap
import threading

import numpy as np
import pytest
from helpers import only_plan, result_arrays, script_facts, tamper_signed_file

import backplan as bp
from backplan.codegen.build import direct_driver, driver_builder, driver_numbers
from backplan.runtime.backend import use_backend


@pytest.fixture
def direct(monkeypatch, tmp_path):
    """Background mode with the direct driver (the default outside tests), a cache folder of
    its own; builds of the compiled driver recorded instead of started."""
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("BACKPLAN_DRIVER", "background")
    monkeypatch.setenv("BACKPLAN_DIRECT_DRIVER", "1")
    submitted = []
    monkeypatch.setattr(driver_builder, "submit", submitted.append)
    return submitted


def classifier(w1, b1, w2, x, labels):
    h = bp.relu(x @ w1 + b1)
    return bp.cross_entropy(h @ w2, labels) + 0.01 * bp.sum(w1 * w1)


def classifier_arguments(labels=(0, 4, 2, 1, 3, 3, 0)):
    rng = np.random.default_rng(11)
    return (
        bp.tensor(rng.standard_normal((13, 9)).astype(np.float32)),
        bp.tensor(rng.standard_normal((1, 9)).astype(np.float32)),
        bp.tensor(rng.standard_normal((9, 5)).astype(np.float32)),
        bp.tensor(rng.standard_normal((len(labels), 13)).astype(np.float32)),  # odd sizes
        bp.tensor(np.array(labels)),
    )


def conv_loss(w, k, x):
    h = bp.relu(bp.conv2d(x, k))  # a library convolution on 4-D views, then loops
    return bp.mean(bp.tanh(h.reshape((x.shape[0], -1)) @ w) ** 2)


def conv_arguments():
    rng = np.random.default_rng(7)
    return (
        bp.tensor(rng.standard_normal((45, 5)).astype(np.float32)),
        bp.tensor(rng.standard_normal((3, 1, 3, 3)).astype(np.float32)),
        bp.tensor(rng.standard_normal((5, 1, 7, 5)).astype(np.float32)),
    )


def pool_loss(w, x):
    h = bp.max_pool2d(bp.relu(x * w), 2)  # windows of 2 x 2: loops with axes of two
    return bp.sum(h * h) + bp.sum(bp.max_pool2d(x, 2))


def pool_arguments():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 4, 8, 8)).astype(np.float32)  # 4,096 elements
    x[0, 0, :2, :2] = x[1, 1, 2:4, 2:4] = 0.75  # ties share their window's gradient
    x[2, 3, 4, 5] = np.nan  # taken by the max, spread to its window's gradient
    w = rng.standard_normal((1, 4, 1, 1)).astype(np.float32)
    return bp.tensor(w), bp.tensor(x)


def special(x, y):
    z = bp.exp(x) * bp.tanh(y) + bp.maximum(x, y)
    return bp.sum(z, axis=1), bp.max(z * 0.5 - y, axis=0)


def special_arguments():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 13)).astype(np.float32)
    y = rng.standard_normal((7, 13)).astype(np.float32)
    x[1, :4] = [np.inf, -np.inf, np.nan, 90.0]  # exp overflows to inf at 90
    y[2, 3:6] = [np.nan, np.inf, -np.inf]
    return bp.tensor(x), bp.tensor(y)


def _worth_building(monkeypatch) -> None:
    """Every plan's compiled driver counts as worth building (small test plans are, the conv
    and the elementwise one may not be by the estimate)."""
    from backplan.codegen.build import driver_tier

    monkeypatch.setattr(driver_tier, "worth_compiling", lambda *_: True)


def _three_calls(make, arguments) -> tuple[list, object, list]:
    """(the results of three calls of make(bp.compile), the plan, its tiers after each)."""
    with use_backend("numba"):
        fn = make(bp.compile)
        results, tiers = [], []
        for _ in range(3):
            results.append(result_arrays(fn(*arguments)))
            tiers.append(only_plan(fn, arguments).driver_tier)
    return results, only_plan(fn, arguments), tiers


def _reference(make, arguments) -> list:
    with use_backend("reference"):
        return result_arrays(make(lambda f: f)(*arguments))


@pytest.mark.parametrize(
    "make, arguments",
    [
        (lambda c: bp.value_and_grad(c(classifier), argnums=(0, 1, 2)), classifier_arguments),
        (lambda c: bp.value_and_grad(c(conv_loss), argnums=(0, 1)), conv_arguments),
        (lambda c: c(special), special_arguments),
    ],
    ids=["classifier", "conv", "special_values"],
)
def test_the_second_call_runs_the_direct_driver_with_the_python_run_drivers_values(
    direct, monkeypatch, make, arguments
):
    _worth_building(monkeypatch)
    results, plan, tiers = _three_calls(make, arguments())
    assert tiers == ["python", "direct", "direct"], (tiers, plan.direct_error)
    assert plan.direct_error is None and plan.direct_seconds > 0
    assert direct == []  # no background build of the compiled driver
    first, second, third = results
    for python_run, built, again in zip(first, second, third, strict=True):
        # The same kernel entries; a small loop may run its quickly compiled form in the first
        # call and its full one after (rounding of a fused multiply-add apart).
        np.testing.assert_allclose(built, python_run, rtol=2e-6, atol=1e-7, equal_nan=True)
        np.testing.assert_array_equal(again, built)
    for got, expected in zip(second, _reference(make, arguments()), strict=True):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6, equal_nan=True)


def test_a_float16_product_read_as_its_bits_runs_the_direct_driver(direct, monkeypatch):
    """A float16 GEMM reads its operands' bits (`.view(np.int16)`, codegen/render/epilogue.py):
    the reader took that view for a statement it does not emit, so every float16 plan with a
    product kept the Python-run driver and its background build."""
    _worth_building(monkeypatch)
    arguments = [
        bp.tensor(a.numpy().astype(np.float16)) if a.dtype == np.float32 else a
        for a in classifier_arguments()
    ]
    make = lambda c: bp.value_and_grad(c(classifier), argnums=(0, 1, 2))  # noqa: E731
    results, plan, tiers = _three_calls(make, arguments)
    assert tiers == ["python", "direct", "direct"], (tiers, plan.direct_error)
    assert direct == []
    first, second, third = results
    for python_run, built, again in zip(first, second, third, strict=True):
        assert built.dtype == np.float16
        np.testing.assert_allclose(built, python_run, rtol=1e-3, atol=1e-4)
        np.testing.assert_array_equal(again, built)
    for got, expected in zip(second, _reference(make, arguments), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


def passes_through(x, y):
    return bp.sum(bp.tanh(x) * y), y.reshape((-1,))


def passes_through_arguments():
    rng = np.random.default_rng(5)
    return tuple(bp.tensor(rng.standard_normal((3, 7)).astype(np.float32)) for _ in range(2))


def test_a_plan_returning_a_view_of_an_argument_keeps_the_python_run_driver(direct, monkeypatch):
    """An output that is a view of an argument is returned by the driver, not written into a
    buffer; the direct driver returns nothing, so its second call read no such output (a
    TypeError). Such a plan keeps the Python-run driver and builds the compiled one."""
    _worth_building(monkeypatch)
    results, plan, tiers = _three_calls(lambda c: c(passes_through), passes_through_arguments())
    assert tiers == ["python", "python", "python"]
    assert "run returns 1 arrays" in plan.direct_error and len(direct) == 1
    expected = _reference(lambda c: c(passes_through), passes_through_arguments())
    for result in results:
        for got, want in zip(result, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_loops_with_axes_of_two_run_at_constant_sizes_with_the_python_run_drivers_values(
    direct, monkeypatch
):
    """A 2 x 2 max pool's loops (forward, counts, masked gradient: axes of two) are compiled
    at the driver's sizes and linked into it (codegen/build/direct_loops.py); ties, a NaN and
    the gradient they share come out as the Python-run driver and the reference have them."""
    from backplan.codegen.build import direct_loops

    _worth_building(monkeypatch)
    specialised = []
    original = direct_loops.specialised
    monkeypatch.setattr(
        direct_loops,
        "specialised",
        lambda call, sizes, *rest: specialised.append(sizes) or original(call, sizes, *rest),
    )
    make = lambda c: bp.value_and_grad(c(pool_loss), argnums=(0, 1))  # noqa: E731
    results, plan, tiers = _three_calls(make, pool_arguments())
    assert tiers == ["python", "direct", "direct"], (tiers, plan.direct_error)
    assert len(specialised) >= 3 and all(list(s.values())[-1] == 2 for s in specialised)
    both = np.concatenate([r.ravel() for r in results[1]])
    assert np.isnan(both).any()  # the NaN reaches the value and its window's gradient
    for python_run, built in zip(results[0], results[1], strict=True):
        np.testing.assert_array_equal(built, python_run)  # max, counts and shares: exact
    for got, want in zip(results[1], _reference(make, pool_arguments()), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, equal_nan=True)


def test_a_split_driver_is_read_part_by_part(direct, monkeypatch):
    """A driver split into parts (codegen/render/driver_split.py, above 600 statements: an
    unrolled LSTM's) is read with each part's calls in place."""
    from backplan.codegen.render import driver_split

    _worth_building(monkeypatch)
    monkeypatch.setattr(driver_split, "SPLIT_ABOVE", 4)
    monkeypatch.setattr(driver_split, "PART_STATEMENTS", 3)
    make = lambda c: bp.value_and_grad(c(classifier), argnums=(0, 1, 2))  # noqa: E731
    results, plan, tiers = _three_calls(make, classifier_arguments())
    assert "run_part2(" in plan.source
    assert tiers == ["python", "direct", "direct"], (tiers, plan.direct_error)
    for got, want in zip(results[1], results[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    for got, want in zip(results[1], _reference(make, classifier_arguments()), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_special_values_land_where_the_reference_puts_them(direct, monkeypatch):
    _worth_building(monkeypatch)
    results, _, tiers = _three_calls(lambda c: c(special), special_arguments())
    assert tiers[1] == "direct"
    expected = _reference(lambda c: c(special), special_arguments())
    both = np.concatenate([r.ravel() for r in results[1]])
    assert np.isnan(both).any() and np.isinf(both).any()  # the inputs reach the outputs
    for got, want in zip(results[1], expected, strict=True):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))


def test_a_bad_label_raises_the_python_run_drivers_error(direct, monkeypatch):
    _worth_building(monkeypatch)
    step = bp.value_and_grad(bp.compile(classifier), argnums=(0, 1, 2))
    arguments = classifier_arguments()
    with use_backend("numba"):
        step(*arguments)
        good = result_arrays(step(*arguments))
        assert only_plan(step, arguments).driver_tier == "direct"
        bad = classifier_arguments(labels=(0, 4, 2, 1, 3, 7, 0))
        with pytest.raises(bp.ExecutionError, match=r"label 7 at position 5 is out of range"):
            step(*bad)
        again = result_arrays(step(*arguments))  # the plan goes on, on the direct driver
        assert only_plan(step, arguments).driver_tier == "direct"
    for x, y in zip(good, again, strict=True):
        np.testing.assert_array_equal(x, y)


def test_waiting_for_the_driver_after_one_call_builds_it(direct, monkeypatch):
    _worth_building(monkeypatch)
    step = bp.value_and_grad(bp.compile(classifier), argnums=(0, 1, 2))
    arguments = classifier_arguments(labels=(1, 0, 2, 4, 3))  # a plan of its own
    with use_backend("numba"):
        step(*arguments)
        plan = only_plan(step, arguments)
        assert plan.driver_tier == "python"
        assert step.wait_until_compiled(timeout=120)
        assert plan.driver_tier == "direct" and step.driver_tier == "direct"


def test_calls_from_threads_while_it_builds_are_right(direct, monkeypatch):
    _worth_building(monkeypatch)
    step = bp.value_and_grad(bp.compile(classifier), argnums=(0, 1, 2))
    arguments = classifier_arguments()
    with use_backend("numba"):
        expected = result_arrays(step(*arguments))
        found, errors = {}, []

        def worker(key):
            try:
                found[key] = [result_arrays(step(*arguments)) for _ in range(3)]
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert only_plan(step, arguments).driver_tier == "direct"
    assert not errors, errors
    for calls in found.values():
        for call in calls:
            for got, want in zip(call, expected, strict=True):
                np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def _counting_builds(monkeypatch) -> list:
    """The names of the direct drivers compiled from here on (not those loaded)."""
    built: list = []
    compile_driver = direct_driver.compile_driver

    def counting(calls, arrays, name, *varying):
        built.append(name)
        return compile_driver(calls, arrays, name, *varying)

    monkeypatch.setattr(direct_driver, "compile_driver", counting)
    return built


def _conv_batch(n: int):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 1, 7, 5)).astype(np.float32)
    x[n // 2, 0, 3, :3] = [np.inf, -np.inf, np.nan]
    return conv_arguments()[:2] + (bp.tensor(x),)


def _pool_batch(n: int):
    w, x = pool_arguments()
    x = np.concatenate([x.numpy()] * 3)[: 4 * n]  # pool_arguments' ties and NaN; loops worth
    return w, bp.tensor(np.ascontiguousarray(x))  # binding (12 to 44 rows of 4 x 8 x 8)


def _classifier_batch(n: int):
    rng = np.random.default_rng(n)
    labels = rng.integers(0, 5, n)
    x = rng.standard_normal((n, 13)).astype(np.float32)
    x[n - 1, :2] = [1e30, -1e30]
    return classifier_arguments()[:3] + (bp.tensor(x), bp.tensor(labels))


PLAIN = ((1, "python"), (1, "direct"), (1, "direct"), (1, "direct"), (1, "direct"))
POOLING = ((1, "python"), (2, "python"), (2, "direct"), (2, "direct"), (2, "direct"))


@pytest.mark.parametrize(
    "loss, batch, axes, bind_all, expected",
    [
        (conv_loss, _conv_batch, {"x": {0: "batch"}}, False, PLAIN),
        (classifier, _classifier_batch, {"x": {0: "batch"}, "labels": {0: "batch"}}, False, PLAIN),
        (pool_loss, _pool_batch, {"x": {0: "batch"}}, False, POOLING),
        (pool_loss, _pool_batch, {"x": {0: "batch"}}, True, POOLING),
    ],
    ids=["conv", "classifier", "pool", "pool_sizes_bound"],
)
def test_one_direct_driver_serves_every_batch_size(
    direct, monkeypatch, loss, batch, axes, bind_all, expected
):
    """A symbolic plan's driver reads its sizes from lit_i / lit_f; its direct driver reads
    every number (literals and argument sizes) when it runs, so one serves every size, run by a
    new size from its first call with no build. It is made in the first size's second call
    where no loop is bound at that size's numbers (conv, classifier: a second size builds
    nothing); a plan with loops over axes of two (pooling) keeps a first driver with that size's
    numbers written in, and the one for every size is made at the second size, its pooling loops
    bound at the sizes that did not change between the sizes seen (checked when it runs;
    pool_sizes_bound binds every size, as if none had changed: at other sizes the checks fail
    and the loops' own forms run). Values as the reference interpreter's at each size (inf,
    nan, ties and huge inputs included), one trace, no background build."""
    from backplan.codegen.build import driver_numbers

    _worth_building(monkeypatch)
    built = _counting_builds(monkeypatch)
    monkeypatch.setattr(direct_driver, "_made", {})  # none made by another case in this process
    guarded = []
    if bind_all:
        monkeypatch.setattr(driver_numbers, "varying", lambda seen: frozenset())
        either = direct_driver._either
        monkeypatch.setattr(direct_driver, "_either", lambda *a: guarded.append(a[3]) or either(*a))
    step = bp.value_and_grad(bp.compile(loss, dynamic=axes))
    with use_backend("numba"):
        for n, (builds, first_tier) in zip((5, 8, 3, 11, 5), expected, strict=True):
            arguments = batch(n)
            first = result_arrays(step(*arguments))
            plan = only_plan(step, arguments)
            assert plan.driver_tier == first_tier, (n, plan.direct_error)
            second = result_arrays(step(*arguments))
            assert plan.driver_tier == "direct", (n, plan.direct_error)
            assert len(built) == builds, (n, built)
            with use_backend("reference"):
                expected = result_arrays(bp.value_and_grad(loss)(*arguments))
            for got in (first, second):
                for y, want in zip(got, expected, strict=True):
                    np.testing.assert_allclose(y, want, rtol=2e-5, atol=1e-6, equal_nan=True)
    assert step.cache_info().traces == 1
    assert direct == []  # no background build of the compiled driver
    assert bool(guarded) == bind_all  # pooling loops at bound sizes, their own forms beside


def test_threads_at_different_batch_sizes_share_the_driver_for_every_size(direct, monkeypatch):
    """Threads calling one dynamic step at four sizes at once, each size new: every call has the
    reference interpreter's values for its own size, and each size ends on the one direct
    driver made for every size (one build in all)."""
    from helpers import run_in_threads

    _worth_building(monkeypatch)
    built = _counting_builds(monkeypatch)
    monkeypatch.setattr(direct_driver, "_made", {})
    step = bp.value_and_grad(bp.compile(conv_loss, dynamic={"x": {0: "batch"}}))
    sizes = (4, 6, 9, 13)
    batches = {n: _conv_batch(n) for n in sizes}
    with use_backend("reference"):
        expected = {n: result_arrays(bp.value_and_grad(conv_loss)(*b)) for n, b in batches.items()}
    found, errors = {}, []

    def worker(n):
        try:
            found[n] = [result_arrays(step(*batches[n])) for _ in range(4)]
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with use_backend("numba"):
        for _ in range(2):
            step(*batches[4])  # the first size and its driver, before the threads
        run_in_threads(worker, sizes)
        tiers = {n: only_plan(step, batches[n]).driver_tier for n in sizes}
    assert not errors, errors
    assert tiers == dict.fromkeys(sizes, "direct") and len(built) == 1, (tiers, built)
    for n, calls in found.items():
        for call in calls:
            for got, want in zip(call, expected[n], strict=True):
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_a_driver_for_every_size_checks_its_views_when_it_runs(direct):
    """Views whose bounds are read when the driver runs are checked then: a slice past its
    array or a reshape of another count makes the call run as Python (which clips the slice,
    or raises the reshape's error); in bounds, the native code computes it."""
    import numba

    @numba.njit
    def total(a, out):
        out[0] = a.sum()

    source = textwrap.dedent(
        """
        def run(v0, out, lit_i):
            total(v0[lit_i[0]:lit_i[1]].reshape((lit_i[2], -1)), out)
        """
    )
    scope = {"total": total}
    exec(compile(source, "<driver>", "exec"), scope)
    ran_as_python = []

    def python_run(*args):
        ran_as_python.append(args[2].tolist())
        return scope["run"](*args)

    def arguments(length, lits):
        return [np.arange(float(length)), np.zeros(1), np.array(lits, dtype=np.intp)]

    made = arguments(10, [2, 8, 3])
    described = direct_driver.described(made, 1)
    places = driver_numbers.every_place(described)
    driver, why = direct_driver.build(source, scope, described, python_run, places)
    assert driver is not None, why
    for length, lits, expected in ((10, [2, 8, 3], 27.0), (20, [4, 16, 4], 114.0)):
        call = arguments(length, lits)
        driver(*call)
        assert call[1][0] == expected and ran_as_python == []
    past_the_end = arguments(20, [4, 30, 4])
    driver(*past_the_end)
    assert past_the_end[1][0] == sum(range(4, 20)) and ran_as_python == [[4, 30, 4]]
    with pytest.raises(ValueError, match="reshape"):
        driver(*arguments(20, [0, 10, 3]))
    assert ran_as_python[-1] == [0, 10, 3]
    # named by no value: another size's arguments find the same driver
    other = direct_driver.described(arguments(30, [1, 2, 1]), 1)
    assert direct_driver.cached(source, other, python_run, places) is not None


def test_a_driver_it_does_not_read_keeps_the_background_build(direct, monkeypatch):
    """A statement the reader refuses (here every lit_i read): the Python-run driver goes on
    and the compiled driver's background build starts, as without the direct driver."""
    _worth_building(monkeypatch)

    def refuse(self, view, index, node):
        raise direct_driver.Unsupported(f"line {node.lineno}: {ast.unparse(node)}")

    monkeypatch.setattr(direct_driver._Reader, "literal", refuse)
    step = bp.value_and_grad(bp.compile(conv_loss, dynamic={"x": {0: "batch"}}))
    w, k, _ = conv_arguments()  # a batch no other test's direct driver was made for
    x = np.random.default_rng(4).standard_normal((6, 1, 7, 5)).astype(np.float32)
    arguments = (w, k, bp.tensor(x))
    with use_backend("numba"):
        first = result_arrays(step(*arguments))
        second = result_arrays(step(*arguments))
        plan = only_plan(step, arguments)
    assert plan.driver_tier == "python" and "lit_i" in plan.direct_error
    assert len(direct) == 1  # the compiled driver's background build, as without it
    for x, y in zip(first, second, strict=True):
        np.testing.assert_array_equal(x, y)


def test_the_reader_refuses_what_it_does_not_emit():
    arrays = direct_driver.described([np.zeros(4, np.float32)])
    for body in ("for i in range(2):\n        pass", "x = v0 + 1", "k_missing(v0, 0)"):
        source = f"def run(v0):\n    {body}\n"
        with pytest.raises(direct_driver.Unsupported):
            direct_driver.plan(source, {}, arrays)
    with pytest.raises(direct_driver.Unsupported, match="C-contiguous"):
        direct_driver.described([np.zeros((4, 4), np.float32)[:, ::2]])


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("BACKPLAN_DIRECT_DRIVER", "yes")
    with pytest.raises(ValueError, match="BACKPLAN_DIRECT_DRIVER='yes'; use 1"):
        direct_driver.enabled()


NEXT_PROCESS = textwrap.dedent(
    """
    import json, sys, warnings
    sys.path.insert(0, sys.argv[1])
    import backplan as bp
    from backplan.runtime.backend import use_backend
    import test_direct_driver as models
    from test_direct_driver import result_arrays

    model = sys.argv[2] if len(sys.argv) > 2 else "classifier"
    with warnings.catch_warnings(record=True) as caught, use_backend("numba"):
        warnings.simplefilter("always")
        arguments = getattr(models, f"{model.removesuffix('_loss')}_arguments")()
        argnums = tuple(range(len(arguments) - (model == "classifier") * 2))
        step = bp.value_and_grad(bp.compile(getattr(models, model)), argnums=argnums)
        step(*arguments)
        values = result_arrays(step(*arguments))
        (runner,) = step.trace(*arguments).runners()
    plan = runner.compiled
    print(json.dumps({
        "tier": plan.driver_tier,
        "error": plan.direct_error,
        "cached": plan._run.cached if plan.driver_tier == "direct" else None,
        "warnings": [str(w.message) for w in caught],
        "values": [v.ravel().tolist() for v in values],
    }))
    """
)


def test_a_next_process_loads_the_direct_driver_and_a_tampered_one_is_built_again(tmp_path):
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels"),
        "BACKPLAN_DRIVER": "background",
        "BACKPLAN_DIRECT_DRIVER": "1",
    }
    tests = os.path.dirname(os.path.abspath(__file__))
    first = script_facts(NEXT_PROCESS, tests, env=env, timeout=600)
    second = script_facts(NEXT_PROCESS, tests, env=env, timeout=600)
    assert first["tier"] == second["tier"] == "direct", (first["error"], second["error"])
    assert (first["cached"], second["cached"]) == (False, True)
    assert second["values"] == first["values"] and second["warnings"] == []
    (stored,) = glob.glob(str(tmp_path / "kernels" / "__pycache__" / "bp_direct_*.o"))
    tamper_signed_file(stored)  # one hex digit of the signed payload changed
    third = script_facts(NEXT_PROCESS, tests, env=env, timeout=600)
    assert third["tier"] == "direct" and third["cached"] is False, third["error"]
    assert any("bp_direct_" in w for w in third["warnings"]), third["warnings"]
    assert third["values"] == first["values"]


def test_a_next_process_loads_a_driver_holding_loops_at_constant_sizes(tmp_path):
    """The loops compiled at the driver's sizes are in its object file: a next process loads
    it (nothing compiled again) and gets the same values."""
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels"),
        "BACKPLAN_DRIVER": "background",
        "BACKPLAN_DIRECT_DRIVER": "1",
    }
    tests = os.path.dirname(os.path.abspath(__file__))
    first = script_facts(NEXT_PROCESS, tests, "pool_loss", env=env, timeout=600)
    second = script_facts(NEXT_PROCESS, tests, "pool_loss", env=env, timeout=600)
    assert first["tier"] == second["tier"] == "direct", (first["error"], second["error"])
    assert (first["cached"], second["cached"]) == (False, True)
    assert second["warnings"] == []
    np.testing.assert_array_equal(
        np.concatenate([np.array(v, np.float32) for v in second["values"]]),
        np.concatenate([np.array(v, np.float32) for v in first["values"]]),
    )


NEXT_SIZE = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import backplan as bp
    from backplan.codegen.build import direct_driver
    from backplan.runtime.backend import use_backend
    from test_direct_driver import _conv_batch, conv_loss, result_arrays

    built = []
    compile_driver = direct_driver.compile_driver
    direct_driver.compile_driver = lambda *a: built.append(a[2]) or compile_driver(*a)
    step = bp.value_and_grad(bp.compile(conv_loss, dynamic={"x": {0: "batch"}}))
    arguments = _conv_batch(int(sys.argv[2]))
    with use_backend("numba"):
        first = result_arrays(step(*arguments))
        (runner,) = step.trace(*arguments).runners()
        plan = runner.compiled
        tier, cached = plan.driver_tier, getattr(plan._run, "cached", None)
        second = result_arrays(step(*arguments))
    with use_backend("reference"):
        expected = result_arrays(bp.value_and_grad(conv_loss)(*arguments))
    for got in (first, second):
        for y, want in zip(got, expected, strict=True):
            np.testing.assert_allclose(y, want, rtol=2e-5, atol=1e-6)
    print(json.dumps({"tier": tier, "cached": cached, "built": len(built),
                      "error": plan.direct_error, "after": plan.driver_tier}))
    """
)


def test_a_next_process_runs_the_driver_for_every_size_at_a_size_it_never_saw(tmp_path):
    """A process that ran one batch size leaves the direct driver for every size in the cache
    folder: a later process at another size runs it from its first call (loaded, nothing built),
    with the reference interpreter's values."""
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels"),
        "BACKPLAN_DRIVER": "background",
        "BACKPLAN_DIRECT_DRIVER": "1",
    }
    tests = os.path.dirname(os.path.abspath(__file__))
    first = script_facts(NEXT_SIZE, tests, "5", env=env, timeout=600)
    assert (first["tier"], first["after"], first["built"]) == ("python", "direct", 1), first
    later = script_facts(NEXT_SIZE, tests, "9", env=env, timeout=600)
    assert (later["tier"], later["cached"], later["built"]) == ("direct", True, 0), later


def test_a_loop_whose_source_cannot_be_read_is_called_by_address(direct, monkeypatch):
    """No source to compile at constant sizes (inspect raises): the loop is called by its
    address as before, and the driver's values are the same."""
    import inspect

    def unreadable(function):
        raise OSError("no source")

    from backplan.codegen.build import direct_loops

    _worth_building(monkeypatch)
    monkeypatch.setattr(inspect, "getsource", unreadable)
    monkeypatch.setattr(direct_driver, "_made", {})
    monkeypatch.setattr(direct_loops, "_compiled", {})  # none compiled earlier in the process
    returned = []
    original = direct_loops.specialised
    monkeypatch.setattr(
        direct_loops, "specialised", lambda *a: returned.append(original(*a)) or returned[-1]
    )
    make = lambda c: bp.value_and_grad(c(pool_loss), argnums=(0, 1))  # noqa: E731
    results, plan, tiers = _three_calls(make, pool_arguments())
    assert tiers == ["python", "direct", "direct"], (tiers, plan.direct_error)
    assert returned and all(r is None for r in returned)
    for python_run, built in zip(results[0], results[1], strict=True):
        np.testing.assert_array_equal(built, python_run)


def gemm_bound_loss(w, x):
    return bp.mean(bp.tanh(x @ w) ** 2)


@pytest.mark.parametrize(("rows", "runs_direct"), [(128, True), (4096, False)])
def test_a_gemm_bound_step_skips_the_compiled_driver_but_runs_the_direct_one(
    direct, rows, runs_direct
):
    # A 512-wide GEMM step's Python-run driver costs under 5% of it (no compiled driver
    # build) but over 1% (driver_tier.DIRECT_WORTH_FRACTION) at 128 rows: the second call
    # emits the direct driver in the process; at 4,096 rows Python's share is under 1% and
    # calls stay Python. Either way nothing is built beside the steps, the values the same.
    rng = np.random.default_rng(2)
    w = bp.tensor((0.05 * rng.standard_normal((512, 512))).astype(np.float32))
    x = bp.tensor(rng.standard_normal((rows, 512)).astype(np.float32))
    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(gemm_bound_loss))
        results, tiers = [], []
        for _ in range(3):
            results.append(result_arrays(step(w, x)))
            tiers.append(only_plan(step, (w, x)).driver_tier)
        plan = only_plan(step, (w, x))
    assert direct == [] and "under 5% of a step" in plan.driver_skipped
    assert tiers == ["python"] + ["direct" if runs_direct else "python"] * 2
    assert plan.wait_for_driver(timeout=0) is runs_direct  # nothing is coming either way
    for later in results[1:]:
        for got, first in zip(later, results[0], strict=True):
            np.testing.assert_array_equal(got, first)
    with use_backend("reference"):
        expected = result_arrays(bp.value_and_grad(gemm_bound_loss)(w, x))
    for got, want in zip(results[-1], expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
