"""What a compiled function's second call sees of the first call's results (tracer/loop_watch.py):
held by the caller (a name, or only a `.numpy()` of it), passed back in, or let go; the watch
itself holds them weakly, so a dropped result is freed at once; a call of another signature in
between leaves the observation to a later pair of calls."""

from __future__ import annotations

import gc
import weakref

import numpy as np

import backplan as bp


def f32(*shape):
    return bp.tensor(np.random.default_rng(1).standard_normal(shape).astype(np.float32))


def scaled(x):
    return bp.tanh(x * 1.5)


def test_the_watch_holds_no_result_alive():
    f = bp.compile(scaled)
    out = f(f32(16, 8))
    buffer = weakref.ref(out.numpy())
    del out
    gc.collect()
    assert buffer() is None


def test_results_let_go_are_not_held():
    f, x = bp.compile(scaled), f32(16, 8)
    f(x)  # the result is dropped at once
    f(x)
    seen = f.explain(x).loop_observed
    assert (seen.kept, seen.passed_back, seen.let_go) == (0, 0, x.numpy().nbytes)
    report = f.explain(x)
    assert report.observed_peak_bytes == report.call_peak_bytes < report.peak_bytes


def test_a_big_result_let_go_is_let_go_though_the_plan_reuses_its_buffer():
    """A compiled plan keeps an output of 64 KiB or more from its last call, to write the next
    call's output into it when nobody else holds it (codegen/run/workspace.py): the same bytes,
    not a result held beside the call. It counted as "stayed bound beside it", and the printed
    peak of a loop dropping its results was the every-result-kept one."""
    from backplan.runtime.backend import use_backend

    x = f32(256, 128)  # a 128 KiB result
    with use_backend("numba"):
        f, g = bp.compile(scaled), bp.compile(scaled)
        f(x)
        f(x)
        report = f.explain(x)
        kept = g(x).numpy()[1:]  # held through a view: the plan does not write it again
        g(x)
        held = g.explain(x)
    seen = report.loop_observed
    assert (seen.kept, seen.passed_back, seen.let_go) == (0, 0, x.numpy().nbytes)
    assert report.observed_peak_bytes == report.call_peak_bytes < report.peak_bytes
    assert held.loop_observed.kept == x.numpy().nbytes
    assert held.observed_peak_bytes == held.peak_bytes and kept.shape == (255, 128)


def test_a_kept_numpy_view_holds_the_result():
    f, x = bp.compile(scaled), f32(16, 8)
    kept = f(x).numpy()[2:]  # a view of the result's buffer: the buffer stays alive
    f(x)
    report = f.explain(x)
    assert report.loop_observed.kept == x.numpy().nbytes
    assert report.observed_peak_bytes == report.peak_bytes
    assert kept.shape == (14, 8)


def test_another_signature_between_leaves_it_unobserved():
    f, x, other = bp.compile(scaled), f32(16, 8), f32(4, 8)
    r = f(x)
    r2 = f(other)
    assert f.explain(x).loop_observed is None and f.explain(other).loop_observed is None
    r3 = f(other)
    assert f.explain(other).loop_observed.kept == other.numpy().nbytes
    assert f.explain(x).loop_observed is None
    assert r.shape != r2.shape == r3.shape


def test_a_loop_alternating_two_signatures_observes_each():
    """train / eval batches: A, B, A, B. Each signature's second call sees its own first call's
    results (before, B was never observed: A's second call cleared the watch)."""
    # two dtypes of one shape: two signatures (two sizes of one axis would make it dynamic,
    # one signature for both)
    f, a = bp.compile(scaled), f32(16, 8)
    b = bp.tensor(a.numpy().astype(np.float64))
    ra = f(a)  # kept: bound until the loop's next A call
    f(b)  # let go at once
    ra2 = f(a)
    f(b)
    seen_a, seen_b = f.explain(a).loop_observed, f.explain(b).loop_observed
    assert (seen_a.kept, seen_a.passed_back, seen_a.let_go) == (a.numpy().nbytes, 0, 0)
    assert (seen_b.kept, seen_b.passed_back, seen_b.let_go) == (0, 0, b.numpy().nbytes)
    assert ra.shape == ra2.shape


def test_a_call_from_another_thread_is_not_the_loops_next_call():
    """Thread 1 keeps its result; thread 2's calls of the same signature (each letting its
    result go) are observed as thread 2's loop, never as thread 1's second call."""
    import threading

    f, x = bp.compile(scaled), f32(16, 8)
    kept = f(x)

    def loop():
        f(x)
        f(x)

    other = threading.Thread(target=loop)
    other.start()
    other.join()
    seen = f.explain(x).loop_observed
    # thread 2's pair: its first result let go; thread 1's kept result is not its business
    assert (seen.kept, seen.passed_back, seen.let_go) == (0, 0, x.numpy().nbytes)
    assert kept.shape == (16, 8)


def test_a_signature_called_once_stops_being_watched():
    from backplan.tracer.loop_watch import WATCHED_CALLS

    f, x, once = bp.compile(scaled), f32(16, 8), f32(4, 8)
    f(once)
    for _ in range(WATCHED_CALLS + 1):
        f(x)
    assert not f._loop_watch.active  # nothing waits: one attribute read per call
    f(once)
    assert f.explain(once).loop_observed is None


def test_a_new_thread_with_an_ended_threads_ident_is_not_its_loop(monkeypatch):
    """An ended thread's ident is given to the next thread the OS starts (glibc reuses the
    stack): thread 1 keeps its result and ends; thread 2, with the same ident, calls once and
    lets its result go. Its call is no second call of thread 1's loop: nothing is observed
    (before, thread 1's result was taken as kept beside thread 2's call). The OS reuses an
    ident only when no other thread starts between (not so under a loaded test run), so both
    threads are given one ident here (they run one after the other)."""
    import threading

    from backplan.runtime import kernel_times
    from backplan.tracer import loop_watch, planned

    class OneIdent:
        """threading as backplan's modules see it: every thread given one ident. threading's
        own get_ident stays real (patching it makes join() take the ended thread for the
        current one)."""

        def __getattr__(self, name):
            return getattr(threading, name)

        @staticmethod
        def get_ident():
            return 424242

    one_ident = OneIdent()
    for module in (loop_watch, planned, kernel_times):
        monkeypatch.setattr(module, "threading", one_ident)
    f, x = bp.compile(scaled), f32(16, 8)
    kept, idents = [], []

    def first():
        idents.append(one_ident.get_ident())
        kept.append(f(x))

    def second():
        idents.append(one_ident.get_ident())
        f(x)

    for target in (first, second):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert idents == [424242, 424242]
    assert f.explain(x).loop_observed is None
    assert kept[0].shape == (16, 8)
