"""Compiled functions called from several threads at once give exactly the serial results:
each call works in its own scratch workspace, backward passes over distinct graphs run side by
side, and two passes that meet in one region run one after the other."""

import threading

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

THREADS, CALLS = 4, 25


def model(params, x):
    hidden = bp.tanh(x @ params["w1"] + params["b1"])
    return bp.sum(bp.softmax(hidden @ params["w2"], axis=-1) * hidden[:, :8])


def make_params(seed):
    rng = np.random.default_rng(seed)
    return {
        "w1": bp.tensor(
            (rng.standard_normal((64, 128)) * 0.1).astype(np.float32), requires_grad=True
        ),
        "b1": bp.tensor(rng.standard_normal(128).astype(np.float32), requires_grad=True),
        "w2": bp.tensor(rng.standard_normal((128, 8)).astype(np.float32), requires_grad=True),
    }


def inputs(thread, call):
    rng = np.random.default_rng(1000 * thread + call)
    return bp.tensor(rng.standard_normal((256, 64)).astype(np.float32))


def run_threads(work) -> dict:
    """work(thread, call) for every pair, THREADS threads at once; results keyed by the pair."""
    results, errors = {}, []
    start = threading.Barrier(THREADS)

    def worker(thread):
        start.wait()
        try:
            for call in range(CALLS):
                results[thread, call] = work(thread, call)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def serial(work) -> dict:
    return {(t, c): work(t, c) for t in range(THREADS) for c in range(CALLS)}


def assert_same(got: dict, expected: dict) -> None:
    wrong = [
        k
        for k in expected
        if not all(np.array_equal(a, b) for a, b in zip(got[k], expected[k], strict=True))
    ]
    assert not wrong, f"{len(wrong)} of {len(expected)} concurrent results differ, first {wrong[0]}"


@pytest.fixture(scope="module")
def params():
    return make_params(0)


def test_one_compiled_function_from_many_threads_matches_serial(params):
    forward = bp.compile(model)

    def work(thread, call):
        return [forward(params, inputs(thread, call)).numpy().copy()]

    with use_backend("numba"), bp.no_grad():
        expected = serial(work)
        assert_same(run_threads(work), expected)


def test_value_and_grad_from_many_threads_matches_serial(params):
    step = bp.value_and_grad(bp.compile(model))

    def work(thread, call):
        value, grads = step(params, inputs(thread, call))
        return [value.numpy().copy()] + [grads[k].numpy().copy() for k in sorted(grads)]

    with use_backend("numba"):
        expected = serial(work)
        assert_same(run_threads(work), expected)


def test_concurrent_backward_of_distinct_graphs_matches_serial():
    """Close, not equal: which calls run as one joint plan (runtime/joint_step.py) depends on
    the order calls come in, and the joint plan sums in another order (last bits differ)."""
    forward = bp.compile(model)

    def work(thread, call):
        own = make_params(thread)  # leaves of this graph only
        forward(own, inputs(thread, call)).backward()
        return [own[k].grad.numpy().copy() for k in sorted(own)]

    with use_backend("numba"):
        expected = serial(work)
        got = run_threads(work)
    for key, arrays in expected.items():
        for a, b in zip(got[key], arrays, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=str(key))


def test_concurrent_backward_into_a_shared_leaf_loses_no_gradient():
    """Every graph adds an integer-valued gradient into one leaf: the sum is exact in any order."""
    w = bp.tensor(np.zeros((16, 4), np.float32), requires_grad=True)
    forward = bp.compile(lambda w, x: bp.sum(x @ w))

    def work(thread, call):
        x = np.full((3, 16), float(thread + 1), np.float32)
        forward(w, bp.tensor(x)).backward()
        return []

    with use_backend("numba"):
        run_threads(work)
    expected = 3 * CALLS * sum(range(1, THREADS + 1))
    np.testing.assert_array_equal(w.grad.numpy(), np.full((16, 4), expected, np.float32))


def test_two_threads_consuming_one_graph_one_gets_graph_freed_error(params):
    forward = bp.compile(model)
    with use_backend("numba"):
        loss = forward(params, inputs(0, 0))
        outcomes = []

        def consume():
            try:
                loss.backward()
                outcomes.append("ran")
            except bp.GraphFreedError:
                outcomes.append("freed")

        threads = [threading.Thread(target=consume) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(outcomes) == ["freed", "ran"]


def test_parallel_kernels_from_two_threads_do_not_abort():
    """Numba's workqueue layer aborts the process when two threads enter it at once; plans that
    launch parallel kernels take turns for that part."""
    fn = bp.compile(lambda x: bp.sum(bp.tanh(x) * x, axis=1))
    x = bp.tensor(np.linspace(-2, 2, 1 << 21, dtype=np.float32).reshape(2048, 1024))
    with use_backend("numba"):
        expected = fn(x).numpy().copy()
        results = run_threads(lambda t, c: [fn(x).numpy().copy()] if c < 3 else [expected])
    assert_same(results, {k: [expected] for k in results})


@pytest.mark.filterwarnings("ignore::backplan.RetraceWarning")  # retracing is the point here
def test_misses_from_many_threads_are_traced_and_explained():
    """Threads calling with shapes no other thread has seen yet: every call misses or hits while
    others insert and move cache entries, and each result is right."""
    double = bp.compile(lambda x: x * 2.0 + 1.0, cache_size=64, dynamic=False)

    def work(thread, call):
        x = np.full((1 + (thread * CALLS + call) % 7, 3), float(thread), np.float32)
        return [double(bp.tensor(x)).numpy().copy()]

    with use_backend("reference"):
        got = run_threads(work)
    for (thread, call), (result,) in got.items():
        assert result.shape == (1 + (thread * CALLS + call) % 7, 3)
        assert np.all(result == 2.0 * thread + 1.0)
    info = double.cache_info()
    assert info.traces >= 7 and info.last_miss_reason is not None


def test_threads_missing_one_signature_at_once_trace_it_once():
    """The first calls of every thread arrive together (the trace is slowed, so all of them miss
    before one finishes): one traces, the others wait and run its plans."""
    import time

    def slow_to_trace(w, x):
        time.sleep(0.2)  # runs while tracing only: the plan has no Python in it
        return bp.tanh(x @ w).sum()

    step = bp.compile(bp.value_and_grad(slow_to_trace))
    w, x = make_params(1)["w1"].detach(), inputs(0, 0)

    def work(thread, call):
        loss, grad = step(w, x)
        return [loss.numpy().copy(), grad.numpy().copy()]

    with use_backend("reference"):
        got = run_threads(work)
        expected = work(0, 0)
    assert all(
        all(np.array_equal(a, b) for a, b in zip(r, expected, strict=True)) for r in got.values()
    )
    info = step.cache_info()
    assert (info.traces, info.misses, info.entries) == (1, 1, 1)
    assert info.hits == THREADS * CALLS  # every other call, and the serial one after


def test_a_trace_that_fails_fails_in_every_waiting_thread():
    calls = []

    def broken(x):
        calls.append(1)
        raise ValueError("broken model")

    fn = bp.compile(broken)
    errors = []
    start = threading.Barrier(THREADS)

    def worker():
        start.wait()
        try:
            fn(bp.tensor(np.ones(3, np.float32)))
        except ValueError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == THREADS and fn.cache_info().entries == 0


@pytest.mark.reference
def test_a_signature_evicted_while_its_call_ran_gets_no_fast_path():
    """cache_size=1: thread A's call traced its signature, and thread B's call of another
    evicted it before A's call had returned. A then registered its fast path all the same, so
    the evicted signature kept running (its plans and arenas alive, beyond cache_size) without
    a trace; now a call registers a fast path only to a signature still cached, and A's
    signature is traced again."""
    w = np.ones((4, 4), np.float32)
    fn = bp.compile(lambda w, x: bp.tanh(x @ w), cache_size=1)
    running, evicted = threading.Event(), threading.Event()
    run = fn._run

    def held_run(entry, bound):  # A's call waits, between its lookup and its return, for B
        result = run(entry, bound)
        if threading.current_thread().name == "A":
            running.set()
            assert evicted.wait(60)
        return result

    fn._run = held_run
    a = threading.Thread(target=fn, args=(w, np.ones((2, 4), np.float32)), name="A")
    a.start()
    assert running.wait(60)
    fn(w.astype(np.float64), np.ones((2, 4)))  # B's signature evicts A's
    evicted.set()
    a.join()
    del fn._run
    assert fn.cache_info().entries == 1
    traces = fn.cache_info().traces
    out = fn(w, np.ones((2, 4), np.float32))
    assert fn.cache_info().traces == traces + 1  # evicted: traced again
    np.testing.assert_allclose(out.numpy(), np.tanh(np.full((2, 4), 4.0)), rtol=1e-6)
