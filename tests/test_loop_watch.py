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
