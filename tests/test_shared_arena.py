"""A compiled function's forward and the backward() consuming it draw their scratch from one
arena (runtime/program.py, codegen/run/workspace.py ArenaPool): a step holds the larger plan's
scratch, not both, and explain's peak (ir/peak.py), the checked mode's count
(BACKPLAN_CHECK_MEMORY=1) and the arenas the process keeps all say so. A call holds the arena
only while its plan runs: a forward whose loss is never backward()ed returns it, calls from two
threads at once each get their own, and the values never depend on who held it before."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, model_arrays, printed_calls
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.codegen.run.memory_check import checked_memory
from backplan.codegen.run.workspace import ALONE_BEFORE_TRIM
from backplan.ir.lowering import BackwardMode, lower
from backplan.runtime.backend import use_backend

CALLS = 4


@pytest.fixture(autouse=True)
def numba_checked(monkeypatch):
    # two plans on every call, as a step above the joint step's size runs (runtime/joint_step.py)
    monkeypatch.setenv("BACKPLAN_JOINT_STEP", "0")
    with use_backend("numba"), checked_memory():
        yield


def _tanh_mlp(params, x):
    h = x
    for w in params:
        h = bp.tanh(h @ w)
    return bp.mean(h**2)


def _mlp_arrays(width=24, rows=12, layers=6, seed=0):
    rng = np.random.default_rng(seed)
    params = [
        bp.tensor(rng.standard_normal((width, width)).astype(np.float32) * 0.3, requires_grad=True)
        for _ in range(layers)
    ]
    return params, bp.tensor(rng.standard_normal((rows, width)).astype(np.float32))


def _arenas(fn, *args) -> tuple[int, int]:
    """(forward, consuming backward) scratch bytes of the plans fn's call runs."""
    plans = fn.trace(*args).program.plans
    forward, backward = plans.lowered(None), lower(plans.backward, plans.private_saved_inputs())
    return forward.layout.scratch_bytes, backward.layout.scratch_bytes


def _pool(fn, *args):
    return fn.trace(*args).program._arenas


def _grads(fn, params, *args) -> list:
    bp.zero_grad(params)
    fn(params, *args).backward()
    return [p.grad.numpy().copy() for p in params]


def _reference_grads(params, *args) -> list:
    with use_backend("reference"):
        return _grads(bp.compile(_tanh_mlp), params, *args)


def _every_call_holds_one_arena(loss, params, batch) -> None:
    """Calls 1..CALLS counted as printed, the printed scratch the larger plan's alone, and one
    arena of that size kept by the function between calls."""
    report = bp.explain(loss, params, *batch)
    forward, backward = _arenas(loss, params, *batch)
    assert forward > 0 and backward > 0  # the sum and the max differ

    def step():
        bp.zero_grad(list(params.values()) if isinstance(params, dict) else params)
        loss(params, *batch).backward()

    assert counted_calls(step, CALLS) == printed_calls(report, CALLS)
    assert report.peak_on_call(1).at_peak()["scratch"] == max(forward, backward)
    assert report.compiled_scratch_bytes == max(forward, backward)
    pool = _pool(loss, params, *batch)
    assert pool.nbytes == max(forward, backward)
    assert [a.nbytes for a in pool.idle_arenas()] == [max(forward, backward)]


def test_a_tanh_mlp_holds_one_arena_of_the_larger_plans_size():
    params, x = _mlp_arrays()
    _every_call_holds_one_arena(bp.compile(_tanh_mlp), params, [x])


def test_a_cnn_holds_one_arena_of_the_larger_plans_size():
    params, batch = model_arrays("cnn", requires_grad=True)
    _every_call_holds_one_arena(bp.compile(bench_function(MODELS["cnn"])), params, batch)


def test_bf16_saved_buffers_hold_one_arena_of_the_larger_plans_size():
    params, x = _mlp_arrays(seed=1)
    loss = bp.compile(_tanh_mlp, saved_dtype=bp.bfloat16)
    _every_call_holds_one_arena(loss, params, [x])
    got = _grads(loss, params, x)
    want = _grads(bp.compile(_tanh_mlp, saved_dtype=bp.bfloat16), params, x)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_forward_never_backwarded_returns_the_arena_and_the_next_backward_is_right():
    params, x = _mlp_arrays(seed=2)
    x2 = bp.tensor(np.asarray(x.numpy()[::-1]) * 0.5)
    loss = bp.compile(_tanh_mlp)
    want_1, want_2 = _reference_grads(params, x), _reference_grads(params, x2)
    _grads(loss, params, x)  # both plans made: the arena has the larger size
    pool = _pool(loss, params, x)
    first = loss(params, x)
    assert len(pool.idle_arenas()) == 1  # handed back when the forward returned
    second = loss(params, x2)  # a second forward before the first loss's backward
    assert len(pool.idle_arenas()) == 1 and pool._made == 1
    bp.zero_grad(params)
    first.backward()
    got_1 = [p.grad.numpy().copy() for p in params]
    bp.zero_grad(params)
    second.backward()
    got_2 = [p.grad.numpy().copy() for p in params]
    for got, want in ((got_1, want_1), (got_2, want_2)):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    del first, second
    for _ in range(3):  # forwards alone, their losses dropped: still one arena
        loss(params, x)
    assert len(pool.idle_arenas()) == 1 and pool._made == 1


def test_two_threads_calling_at_once_each_hold_their_own_arena():
    """Each thread's calls are checked (the counting allocator raises on a byte differing from
    the prediction) and give the serial gradients; afterwards a loop in one thread keeps one
    arena again."""
    inputs = [_mlp_arrays(seed=s) for s in (3, 4)]
    loss = bp.compile(_tanh_mlp)
    serial = [_grads(loss, params, x) for params, x in inputs]
    barrier = threading.Barrier(2)
    got, errors = [None, None], []

    def worker(i):
        params, x = inputs[i]
        try:
            barrier.wait()
            for _ in range(5):
                got[i] = _grads(loss, params, x)
        except Exception as exc:  # raised in the thread: reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for a, b in zip(got, serial, strict=True):
        for ga, gb in zip(a, b, strict=True):
            np.testing.assert_array_equal(ga, gb)
    params, x = inputs[0]
    for _ in range(ALONE_BEFORE_TRIM + 1):
        _grads(loss, params, x)
    pool = _pool(loss, params, x)
    assert len(pool.idle_arenas()) == 1 and pool._made == 1


def test_backward_with_retain_graph_keeps_an_arena_of_its_own():
    """backward(retain_graph=True)'s plan is not in the shared pool (the next call frees its
    arena alone): a step with it holds the shared arena and that one, as retain_peak counts."""
    params, x = _mlp_arrays(seed=5)
    loss = bp.compile(_tanh_mlp)
    report = bp.explain(loss, params, x)
    forward, backward = _arenas(loss, params, x)

    def step():
        bp.zero_grad(params)
        value = loss(params, x)
        value.backward(retain_graph=True)
        value.backward()

    step()
    counted = counted_calls(step, 1)[0]
    assert counted == report.retain_peak.allocated_peak_bytes
    retain = loss.trace(params, x).program.plans.lowered(BackwardMode.RETAIN).layout.scratch_bytes
    assert report.retain_peak.at_peak()["scratch"] == max(forward, backward) + retain


def test_a_forward_nothing_differentiates_keeps_its_own_arena():
    """No backward to share with: the forward keeps its arena in its workspace (no pool on each
    call), and explain and the checked mode count it as before."""
    params, x = _mlp_arrays(seed=6)
    frozen = [bp.tensor(p.numpy()) for p in params]
    loss = bp.compile(_tanh_mlp)
    report = bp.explain(loss, frozen, x)
    program = loss.trace(frozen, x).program
    assert program.plans.backward is None
    counted = counted_calls(lambda: loss(frozen, x), 3)
    assert counted == printed_calls(report, 3)
    assert program._arenas is None
    pool = program.runner(None).compiled._workspaces
    assert [a.nbytes for a in pool.idle_arenas()] == [report.peak.at_peak()["scratch"]]
