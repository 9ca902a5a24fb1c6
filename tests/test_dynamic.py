"""Dynamic axes (tracer/dynamic.py, ir/symbolic.py): one trace and one compiled plan for every
batch size, values equal to a plan of each size's own; sizes 0 and 1 planned on their own;
functions whose plans are not formulas of the size planned per size, saying why."""

import re

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import kernel_cache
from backplan.ir.verify import verify_plan
from backplan.runtime.backend import use_backend
from backplan.tracer.dynamic import DynamicEntry

RNG = np.random.default_rng(0)
W = bp.tensor(RNG.standard_normal((6, 4)).astype(np.float32), requires_grad=True)


def model(w, x):
    h = bp.tanh(x @ w) * 2.0
    return bp.mean(h.reshape(-1, 2)) + bp.sum(bp.softmax(h, axis=-1) * 3.0)


def batch(n: int):
    return bp.tensor(RNG.standard_normal((n, 6)).astype(np.float32))


def reference(fn, *args):
    """value and gradient from a plan traced for these sizes alone, on the interpreter."""
    with use_backend("reference"):
        value, grad = bp.value_and_grad(fn)(*args)
    return value.numpy(), grad.numpy()


def dynamic_entry(fn) -> DynamicEntry:
    (entry,) = [e for e in fn._entries.values() if isinstance(e, DynamicEntry)]
    return entry


def test_every_batch_size_runs_one_trace_with_each_sizes_values():
    compiled = bp.compile(model, dynamic={"x": {0: "batch"}})
    step = bp.value_and_grad(compiled)
    for n in (5, 7, 12, 5):
        x = batch(n)
        loss = compiled(W, x)
        loss.backward()
        value, grad = step(W, x)
        expected_value, expected_grad = reference(model, W, x)
        np.testing.assert_allclose(loss.numpy(), expected_value, rtol=1e-5)
        np.testing.assert_allclose(W.grad.numpy(), expected_grad, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(value.numpy(), expected_value, rtol=1e-5)
        np.testing.assert_allclose(grad.numpy(), expected_grad, rtol=1e-4, atol=1e-6)
        W.grad = None
    for fn in (compiled, step):
        assert fn.cache_info().traces == 1
        assert fn.cache_info().entries == 1
        entry = dynamic_entry(fn)
        assert entry.reason is None and sorted(entry.sizes()) == [5, 7, 12]
    for n in (7, 12):
        verify_plan(step.trace(W, batch(n)).plan)
        plans = compiled.trace(W, batch(n)).program.plans
        verify_plan(plans.forward)
        verify_plan(plans.backward)
        assert plans.forward.graph.inputs[1].shape == (n, 6)


def test_sizes_0_and_1_are_planned_on_their_own():
    """A size-1 axis broadcasts: it is never taken for the symbol (torch specialises 0 and 1)."""
    compiled = bp.compile(lambda w, x: bp.sum(x @ w + bp.sum(x)), dynamic={"x": {0: "batch"}})
    for n in (4, 1, 6):
        x = batch(n)
        expected = reference(lambda w, x: bp.sum(x @ w + bp.sum(x)), W, x)[0]
        np.testing.assert_allclose(compiled(W, x).numpy(), expected, rtol=1e-5)
    assert compiled.cache_info().entries == 2  # batch, and 1
    assert sorted(dynamic_entry(compiled).sizes()) == [4, 6]


def test_a_scale_computed_from_the_size_is_a_formula_of_it():
    """x.shape[0] in the user's arithmetic: 1 / n is fitted as 1 / batch, not baked in."""

    def by_hand_mean(w, x):
        return bp.sum(x @ w) * (1.0 / x.shape[0])

    compiled = bp.compile(by_hand_mean, dynamic={"x": {0: "batch"}})
    for n in (3, 8):
        x = batch(n)
        np.testing.assert_allclose(
            compiled(W, x).numpy(), reference(by_hand_mean, W, x)[0], rtol=1e-5
        )
    assert compiled.cache_info().traces == 1


def test_a_function_whose_plan_is_not_a_formula_of_the_size_is_planned_per_size():
    def squared_size(w, x):
        return bp.sum(x @ w) * float(x.shape[0] ** 2)

    compiled = bp.compile(squared_size, dynamic={"x": {0: "batch"}})
    for n in (3, 4, 5):
        x = batch(n)
        np.testing.assert_allclose(
            compiled(W, x).numpy(), reference(squared_size, W, x)[0], rtol=1e-5
        )
    entry = dynamic_entry(compiled)
    assert entry.fitted is None
    assert "full at test_dynamic.py:" in entry.reason and "9.0 at size 3" in entry.reason
    assert compiled.cache_info().traces == 3  # each size its own trace, as without dynamic


def test_integer_arithmetic_the_first_sizes_multiples_hide_is_planned_per_size():
    """x[: n // 4 * 4] at 8, then probed at multiples of 16, is n at every probe: a probe at
    2 * 16 + 1 rows (no common divisor with 16) shows it is not one formula. Before it, the one
    plan returned 9 rows at 9 (eager 8), 7 at 7 (eager 4)."""

    def whole_fours(w, x):
        return x[: x.shape[0] // 4 * 4] @ w

    compiled = bp.compile(whole_fours, dynamic={"x": {0: "batch"}})
    for n in (16, 9, 7, 3, 13):
        x = batch(n)
        got = compiled(W, x).numpy()
        assert got.shape[0] == n // 4 * 4
        np.testing.assert_allclose(got, (x.numpy()[: n // 4 * 4]) @ W.numpy(), rtol=1e-5)
    assert dynamic_entry(compiled).fitted is None


def test_an_array_made_from_the_size_is_made_at_each_size_not_read_from_the_first():
    """A NumPy array the function builds from the size is a captured input, not a graph
    constant: one plan for every size read the first size's array at each size, past its
    end at a larger one (garbage at 24 and 40 rows after 8 and 16)."""

    def positions(w, x):
        return (x + np.arange(x.shape[0], dtype=np.float32)[:, None]) @ w

    def same_array_every_size(w, x):  # a new tensor of equal values at each trace: one plan
        return (x + np.ones((1, 6), np.float32)) @ w

    compiled = bp.compile(bp.value_and_grad(lambda w, x: bp.sum(positions(w, x) ** 2)))
    same = bp.compile(same_array_every_size)
    for n in (8, 16, 24, 40, 5):
        x = batch(n)
        value, grad = compiled(W, x)
        want_value, want_grad = reference(lambda w, x: bp.sum(positions(w, x) ** 2), W, x)
        np.testing.assert_allclose(value.numpy(), want_value, rtol=1e-5)
        np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-5)
        expected = (x.numpy() + 1.0) @ W.numpy()
        np.testing.assert_allclose(same(W, x).numpy(), expected, rtol=1e-5, atol=1e-6)
    entry = dynamic_entry(compiled)
    assert entry.fitted is None and "captured array 0 (shape (16, 1), f32) changes" in entry.reason
    assert dynamic_entry(same).fitted is not None


def run_against_reference(step, sizes) -> None:
    """The step's value and gradient at each batch size equal the reference interpreter's."""
    for n in sizes:
        x = batch(n)
        value, grad = step(W, x)
        expected_value, expected_grad = reference(model, W, x)
        np.testing.assert_allclose(value.numpy(), expected_value, rtol=1e-5)
        np.testing.assert_allclose(grad.numpy(), expected_grad, rtol=1e-4, atol=1e-6)


def test_a_second_batch_size_compiles_nothing_and_runs_the_same_driver(compiled_driver):
    compiled = bp.compile(model, dynamic={"x": {0: "batch"}})
    step = bp.value_and_grad(compiled)
    with use_backend("numba"):
        step(W, batch(5))
        first = step.trace(W, batch(5)).runner().compiled
        before = kernel_cache.counts()
        run_against_reference(step, (9, 13))
        after = kernel_cache.counts()
        later = step.trace(W, batch(13)).runner().compiled
    assert after.versions == before.versions  # no loop kernel compiled or loaded
    assert later.source == first.source  # one size-generic driver module ...
    assert later._compiled_run is first._compiled_run  # ... the same compiled function
    assert len(first._compiled_run.overloads) == 1  # compiled once, for the first size
    assert step.cache_info().traces == 1


def test_two_processes_first_called_at_other_sizes_render_one_driver_source():
    """A size-generic driver's file is its cache entry: the text rendered at one process's
    first size must be the text another process renders at its own, or each rewrites the file
    and Numba, whose index is stamped with it, compiles the driver again. Two functions (each
    its own symbolic plan, as two processes have) first called at 5 and 11 rows."""
    from backplan.codegen.render.emit import generate
    from backplan.ir.lowering import lower

    sources = []
    for n in (5, 11):
        step = bp.value_and_grad(bp.compile(model, dynamic={"x": {0: "batch"}}))
        sources.append(generate(lower(step.trace(W, batch(n)).plan)).source)
    assert sources[0] == sources[1]
    assert "[n," in sources[0]  # the IR lines above the statements show no size


def test_an_axis_made_dynamic_by_a_second_size_compiles_no_loop_kernel_then_nothing(
    compiled_driver,
):
    """Without dynamic=: the second size traces the symbolic plan, whose driver is new (the
    first size's plan was traced for its size) but whose loop kernels are the first size's;
    every later size, the first one's included, runs that plan, compiling nothing. In a fresh
    process (the Numba-compiled driver, BACKPLAN_DRIVER=inline, passed on to it): the counts are
    the process's, not what other tests left loaded in this worker."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_dynamic as t; t.second_size()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def second_size():
    step = bp.value_and_grad(bp.compile(model))
    with use_backend("numba"):
        step(W, batch(5))
        before = kernel_cache.counts()
        step(W, batch(9))
        second = kernel_cache.counts()
        driver = step.trace(W, batch(9)).runner().compiled
        run_against_reference(step, (13, 5))
        after = kernel_cache.counts()
        later = [step.trace(W, batch(n)).runner().compiled for n in (13, 5)]
    # the symbolic plan's loop kernels: none new imported or compiled (a driver found in the
    # disk cache may load another form of a kernel already imported: a load, not a compile)
    assert (second.loaded, second.compiled) == (before.loaded, before.compiled)
    assert after == second  # sizes 13 and 5: no kernel loaded or compiled
    assert all(plan._compiled_run is driver._compiled_run for plan in later)
    assert len(driver._compiled_run.overloads) == 1
    assert step.cache_info().traces == 2


def test_dynamic_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="does not take"):
        bp.compile(model, dynamic={"y": {0: "batch"}})
    with pytest.raises(ValueError, match="one symbol"):
        bp.compile(model, dynamic={"w": {0: "a"}, "x": {0: "b"}})
    with pytest.raises(ValueError, match="memory budget"):
        bp.compile(model, dynamic={"x": {0: "batch"}}, max_peak_bytes=1 << 20)
    with pytest.raises(TypeError, match=r"dynamic=True \(torch.compile's .*second size seen"):
        bp.compile(model, dynamic=True)
    shared = bp.compile(lambda x, y: bp.sum(x) + bp.sum(y), dynamic={"x": {0: "n"}, "y": {0: "n"}})
    with pytest.raises(
        bp.TracingError, match=r"share one size \(the call at .*test_dynamic.py:\d+"
    ):
        shared(batch(3), batch(4))
    with pytest.raises(bp.TracingError, match="no axis 2"):
        bp.compile(model, dynamic={"x": {2: "batch"}})(W, batch(3))


def test_an_axis_becomes_dynamic_at_the_second_size_seen_on_it():
    compiled = bp.compile(model)
    for n in (5, 7, 9, 12, 5):
        x = batch(n)
        np.testing.assert_allclose(compiled(W, x).numpy(), reference(model, W, x)[0], rtol=1e-5)
    # the first size's plan, then one for every size, the first one's again at the end
    assert compiled.cache_info().traces == 2
    assert dynamic_entry(compiled).symbol == "x.shape[0]"
    assert sorted(dynamic_entry(compiled).sizes()) == [5, 7, 9, 12]


def test_the_first_size_runs_the_plan_lookup_gives_once_its_axis_is_dynamic():
    """explain() and data_parallel run what lookup() gives; a call must run the same plan: after
    a second size makes the axis dynamic, the first size's own plan and its fast path go."""
    for fn in (bp.compile(model), bp.value_and_grad(bp.compile(model))):
        x5 = batch(5)
        fn(W, x5)
        own = fn.trace(W, x5)
        fn(W, batch(7))
        fn(W, x5)
        assert sorted(dynamic_entry(fn).sizes()) == [5, 7]  # the call at 5 went through it
        ran = fn.trace(W, x5)
        assert ran is not own and ran.runners()  # lookup's entry at 5 is the one that ran
        assert fn.cache_info().entries == 1  # the first size's own plan is not kept alive
        assert fn.cache_info().traces == 2


def test_automatic_dynamic_axes_can_be_turned_off_and_need_one_changed_axis():
    off = bp.compile(model, dynamic=False)
    for n in (5, 7, 9):
        off(W, batch(n))
    assert off.cache_info().traces == 3
    total = bp.compile(lambda x: bp.sum(x * x))
    for shape in [(5, 8), (7, 9), (6, 10)]:  # two axes change at once: no single symbol
        total(bp.tensor(np.ones(shape, np.float32)))
    assert total.cache_info().traces == 3
    assert not any(isinstance(e, DynamicEntry) for e in total._entries.values())


def test_a_memory_budget_plans_each_size_and_the_retrace_reason_says_so():
    """Without a budget a second size makes the axis dynamic; under one, each size traces, and
    cache_info's reason says why instead of looking like automatic dynamic axes failed."""
    cases = [
        (bp.compile(model, saved_bytes_budget=1 << 20), "saved_bytes_budget"),
        (bp.compile(model, max_peak_bytes=1 << 20), "max_peak_bytes"),
        (bp.value_and_grad(model, max_peak_bytes=1 << 20), "max_peak_bytes"),
    ]
    for fn, option in cases:
        with use_backend("reference"):
            fn(W, batch(5))
            fn(W, batch(7))
        reason = fn.cache_info().last_miss_reason
        assert fn.cache_info().traces == 2
        assert reason.startswith("x: shape (5, 6) -> (7, 6)")
        assert f"no axis becomes dynamic under {option}" in reason
    off = bp.compile(model, dynamic=False)  # asked for: nothing to explain
    off(W, batch(5))
    off(W, batch(7))
    assert "dynamic" not in off.cache_info().last_miss_reason


def test_explain_gives_the_bytes_as_formulas_of_the_symbol_or_says_why_not():
    compiled = bp.compile(model, dynamic={"x": {0: "batch"}})
    report = compiled.explain(W, batch(5))
    saved = [compiled.explain(W, batch(n)).saved_bytes for n in (5, 9)]
    slope = (saved[1] - saved[0]) // 4
    assert saved[0] - 5 * slope == 0  # model saves only batch-sized buffers
    assert f"saved = {slope}·batch bytes" in report.dynamic
    assert "one plan for every size, traced once at batch=5" in report.dynamic
    assert "Dynamic axis batch" in str(report)

    def squared_size(w, x):
        return bp.sum(x @ w) * float(x.shape[0] ** 2)

    text = bp.compile(squared_size, dynamic={"x": {0: "batch"}}).explain(W, batch(3)).dynamic
    assert text.startswith("Dynamic axis batch: each size is planned on its own")
    assert "full at test_dynamic.py:" in text


@pytest.mark.filterwarnings("ignore::backplan.Float64PromotionWarning")  # float64 meant here
def test_the_peak_formula_explain_prints_gives_the_peak_it_reports_at_every_size():
    """Fitted at 32, 64 and 96 rows, the numba peak is a formula there, but below some size
    another step holds the peak (here with float64 batches): explain must not print a formula
    its own peak_bytes contradicts."""
    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((16, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 4)).astype(np.float32)

    def mlp(w1, w2, x, y):
        return bp.mse_loss(bp.tanh(x @ w1) @ w2, y)

    step = bp.value_and_grad(bp.compile(mlp, dynamic={"x": {0: "n"}, "y": {0: "n"}}), (0, 1))
    pattern = r"peak = ([\d,]+) \+ ([\d,]+)·n bytes;|peak = ([\d,]+) bytes at n=(\d+) \(about"
    seen = set()
    with use_backend("numba"):  # explain generates the numba plans' layout; nothing compiles
        for n in (32, 2, 3, 100):
            x, y = rng.standard_normal((n, 16)), rng.standard_normal((n, 4))
            report = step.explain(w1, w2, x, y)
            match = re.search(pattern, report.dynamic)
            if match[1]:
                a, c = (int(g.replace(",", "")) for g in match.group(1, 2))
                assert a + c * n == report.peak_bytes, (n, report.dynamic)
            else:
                assert (int(match[3].replace(",", "")), int(match[4])) == (report.peak_bytes, n)
            seen.add(bool(match[1]))
    assert seen == {True, False}  # both cases met: exact at 32 and 100, padded below


def test_size_dependent_choices_are_those_of_the_first_size(monkeypatch):
    """backplan's GEMM or BLAS, parallel loops or serial ones: chosen by size, each right at
    every size; the sizes of one symbolic plan make the first size's choices, so they render
    one driver (codegen/render/choices.py)."""
    from backplan.codegen.render import opaque
    from backplan.codegen.render.emit import generate
    from backplan.ir.lowering import lower

    def own_below_8(m, n, k, tb, dtype, trans_a=False):
        return m < 8 and k < 8

    monkeypatch.setattr(opaque, "use_own_gemm", own_below_8)
    step = bp.value_and_grad(bp.compile(model, dynamic={"x": {0: "batch"}}))
    sources = [generate(lower(step.trace(W, batch(n)).plan)).source for n in (5, 11)]
    assert sources[0] == sources[1]
    assert own_below_8(5, 4, 6, False, "f32") != own_below_8(11, 4, 6, False, "f32")
    assert "gemm_at_f32" not in sources[1]
    assert "own_gemm_at" in sources[1]  # chosen at batch 5, kept at 11
    fixed = bp.value_and_grad(bp.compile(model, dynamic=False))
    assert "own_gemm_at" not in generate(lower(fixed.trace(W, batch(11)).plan)).source


def test_a_training_step_whose_cheaper_update_order_changes_with_the_size_is_one_plan():
    """A compiled step runs each update right after its gradient where that holds fewer bytes
    (ir/update_order.py), which changes with the batch: here the bias's update runs early at
    7 and 14 rows and in the traced order at 21. The probes follow the first size's order, so
    the step is one plan (it was planned per size: "full is transpose on other operands at
    another size"), and each size's values are the reference interpreter's."""
    p = {"w": RNG.standard_normal((16, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}

    def sgd_step(p, x):
        loss, g = bp.value_and_grad(lambda p: bp.mean(bp.tanh(x @ p["w"] + p["b"])))(p)
        return {k: p[k] - 0.1 * g[k] for k in p}, loss

    step = bp.compile(sgd_step)
    with use_backend("numba"):
        for n in (64, 7, 33, 2, 21):  # dynamic at 7: planned at 7, 14 and 21
            x = RNG.standard_normal((n, 16)).astype(np.float32)
            new, loss = step(p, x)
            with use_backend("reference"):
                want, want_loss = bp.compile(sgd_step, dynamic=False)(p, x)
            np.testing.assert_allclose(loss.item(), want_loss.item(), rtol=1e-5)
            for k in p:
                np.testing.assert_allclose(new[k].numpy(), want[k].numpy(), rtol=1e-5, atol=1e-6)
        assert step.cache_info().traces == 1 + 1  # the first size, then the one plan
        assert dynamic_entry(step).reason is None
        assert "one plan for every size" in step.explain(p, x).dynamic


def test_many_batch_sizes_keep_a_bounded_number_of_plans_alive():
    """Each size's plan holds its arenas: a dynamic entry keeps the 16 most recent sizes, and the
    fast paths (one per size) are started afresh past 256, so old sizes' plans can be freed."""
    from backplan.tracer import dynamic, planned

    compiled = bp.compile(lambda x: bp.sum(x * 2.0), dynamic={"x": {0: "batch"}})
    for n in range(2, 2 + planned.FAST_PATHS_KEPT + 10):
        assert compiled(np.ones((n, 2), np.float32)).item() == 4.0 * n
    assert len(dynamic_entry(compiled).sizes()) == dynamic.SIZES_KEPT
    assert len(compiled._fast) <= planned.FAST_PATHS_KEPT
    assert compiled.cache_info().traces == 1


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("kind", ["value_and_grad", "compile"])
def test_calls_alternating_sizes_hold_what_explain_prints_for_each_size(backend, kind):
    """Each size of a dynamic axis keeps its own compiled plans and scratch arenas; a call at 6
    rows after one at 4 held 4's arenas too, beyond explain's per-size peak. A call that
    switches size now frees the other sizes' idle arenas first: the checked mode's count of
    every call (one measurement open across the calls, as the process holds them) equals the
    peak explain prints for that call at that size."""
    from backplan.codegen.run.memory_check import checked_memory, measure

    rng = np.random.default_rng(2)
    w = bp.tensor(rng.standard_normal((5, 7)).astype(np.float32), requires_grad=True)

    def loss(w, x):
        return bp.mean(bp.tanh(x @ w) * x.sum())

    compiled = bp.compile(loss, dynamic={"x": {0: "n"}})
    if kind == "value_and_grad":
        step = bp.value_and_grad(compiled)
        run = step
    else:
        step = compiled

        def run(w, x):
            w.grad = None
            compiled(w, x).backward()

    xs = {n: bp.tensor(rng.standard_normal((n, 5)).astype(np.float32)) for n in (4, 6, 9)}
    sizes = [4, 6, 4, 6, 9, 4, 4, 4, 6]
    counted, printed, calls = [], [], {}
    with use_backend(backend), checked_memory(), measure() as held:
        for n in sizes:
            held.restart_at_next_use()  # what earlier calls left alive counts while held
            run(w, xs[n])
            counted.append(held.peak)
            calls[n] = calls.get(n, 0) + 1
            report = step.explain(w, xs[n])
            printed.append(report.peak_on_call(calls[n]).allocated_peak_bytes)
    assert len(set(printed)) > 1  # the sizes' peaks differ: each call is its own size's
    assert counted == printed
    if backend == "numba":
        assert "first frees the scratch arenas the other sizes keep idle (4: " in report.dynamic


def test_sizes_no_longer_kept_free_their_arenas_on_a_switch_too(monkeypatch):
    """A size that left the DynamicEntry's kept sizes lives on in the caller's fast path and
    runs again with its arenas; a switch away from it freed only the kept sizes' arenas, so a
    later call held the evicted sizes' too, beyond explain's peak. Every call now holds what
    explain prints for its size."""
    from backplan.codegen.run.memory_check import checked_memory, measure
    from backplan.tracer import dynamic

    monkeypatch.setattr(dynamic, "SIZES_KEPT", 2)
    rng = np.random.default_rng(2)
    w = bp.tensor(rng.standard_normal((5, 7)).astype(np.float32), requires_grad=True)

    def loss(w, x):
        return bp.mean(bp.tanh(x @ w) * x.sum())

    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "n"}}))
    sizes = [2, 3, 4, 5, 2, 3, 4, 2, 5]  # 2 and 3 leave the kept sizes, then run again
    xs = {n: bp.tensor(rng.standard_normal((n, 5)).astype(np.float32)) for n in sizes}
    counted = []
    with use_backend("numba"), checked_memory(), measure() as held:
        for n in sizes:
            held.restart_at_next_use()  # what earlier calls left alive counts while held
            step(w, xs[n])
            counted.append(held.peak)
    other = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "n"}}))  # explain's own
    with use_backend("numba"):
        other(w, xs[2])
        printed = [other.explain(w, xs[n]).peak_on_call(2).allocated_peak_bytes for n in sizes]
    assert len(set(printed)) > 1
    assert counted == printed


@pytest.mark.parametrize("kind", ["value_and_grad", "compile"])
def test_the_first_size_plans_free_their_arenas_when_the_axis_becomes_dynamic(kind):
    """An axis learned dynamic at the second size seen drops the first size's plans from the
    cache, but their arenas stayed allocated while anything held the plans: during that call
    on every driver, and under BACKPLAN_DRIVER=background until the first size's driver build
    ended (32 rows, then 8: 45,060 B counted at 8 rows against 16,388 printed, the 32-row
    arena of 28,672 B besides). The dropped plans now free their idle arenas at once: every
    call holds the peak explain prints for its size."""
    from backplan.codegen.run.memory_check import checked_memory, measure

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 32)).astype(np.float32) * 0.3
    xs = {n: rng.standard_normal((n, 32)).astype(np.float32) for n in (64, 16)}

    def loss(w, x):
        return bp.mean(bp.tanh(bp.tanh(x @ w) @ w) ** 2)

    if kind == "value_and_grad":
        step = run = bp.value_and_grad(loss)
    else:
        w = bp.tensor(w, requires_grad=True)
        step = bp.compile(loss)

        def run(w, x):
            w.grad = None
            step(w, x).backward()

    sizes = [64, 16, 16, 64, 16]
    counted, printed, calls = [], [], {}
    with use_backend("numba"), checked_memory(), measure() as held:
        for n in sizes:
            held.restart_at_next_use()
            run(w, xs[n])
            counted.append(held.peak)
            calls[n] = calls.get(n, 0) + 1
            printed.append(step.explain(w, xs[n]).peak_on_call(calls[n]).allocated_peak_bytes)
    assert step.cache_info().last_miss_reason.endswith("one plan for every size")
    assert counted == printed
