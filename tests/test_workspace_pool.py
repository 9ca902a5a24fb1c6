"""codegen/run/workspace.py's pool: calls at once hold a workspace each; after they stop, a loop
in one thread goes back to holding one workspace (one arena and its kept outputs, what explain
counts), not every workspace the burst made."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.workspace import ALONE_BEFORE_TRIM, KEEP_IDLE, WorkspacePool


def _pool() -> WorkspacePool:
    return WorkspacePool([(np.dtype(np.float32), 1024)], [((256, 256), np.dtype(np.float32))])


def _burst(pool: WorkspacePool, calls: int) -> None:
    held = [pool.checkout() for _ in range(calls)]  # calls running at once
    assert len({id(w.arena) for w in held}) == calls  # never sharing bytes
    for workspace in held:
        pool.checkin(workspace)


def _alone(pool: WorkspacePool, calls: int) -> None:
    for _ in range(calls):
        pool.checkin(pool.checkout())


def test_after_a_burst_a_loop_in_one_thread_holds_one_workspace_again():
    pool = _pool()
    _burst(pool, 3)
    assert len(pool.idle_arenas()) == 3  # kept for the next burst
    _alone(pool, ALONE_BEFORE_TRIM - 1)
    assert len(pool.idle_arenas()) == 3
    _alone(pool, 1)
    assert len(pool.idle_arenas()) == 1
    _burst(pool, 2)  # a later burst makes what it needs again
    assert len(pool.idle_arenas()) == 2


def test_spares_stay_while_calls_overlap():
    pool = _pool()
    _burst(pool, 3)
    other = pool.checkout()  # a call in another thread, running throughout
    _alone(pool, 3 * ALONE_BEFORE_TRIM)
    assert len(pool.idle_arenas()) == 2  # the loop's and the spare: none let go
    pool.checkin(other)
    assert len(pool.idle_arenas()) == 3


def test_a_burst_beyond_the_kept_count_keeps_only_that_many():
    pool = _pool()
    _burst(pool, KEEP_IDLE + 2)
    assert len(pool.idle_arenas()) == KEEP_IDLE
    _alone(pool, ALONE_BEFORE_TRIM)
    assert len(pool.idle_arenas()) == 1


@pytest.mark.numba
def test_a_compiled_function_from_threads_then_one_thread_matches_serial():
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    xs = [np.random.default_rng(i).standard_normal((32, 64)).astype(np.float32) for i in range(4)]

    def loss(w, x):
        return bp.mean(bp.tanh(x @ w) ** 2)

    step = bp.compile(bp.value_and_grad(loss))
    serial = [step(w, x)[1].numpy().copy() for x in xs]
    barrier = threading.Barrier(len(xs))
    threaded = [None] * len(xs)

    def call(i):
        barrier.wait()
        threaded[i] = step(w, xs[i])[1].numpy().copy()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(ALONE_BEFORE_TRIM + 1):  # the spares go; the values stay right
        again = [step(w, x)[1].numpy().copy() for x in xs]
    for a, b, c in zip(serial, threaded, again, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
