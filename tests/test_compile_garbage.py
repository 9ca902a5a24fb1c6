"""A first call that compiles its plan in this process frees its outputs once the caller lets
go of them, even where the cyclic collector does not run.

Numba's type inference keeps the exceptions of the overloads it tried (reference cycles through
their tracebacks), and those tracebacks hold every frame up to the plan's first call, whose
frames held the call's arrays: with a large heap (PyTorch and JAX loaded) CPython ran no full
collection for many calls, the first call's outputs stayed alive, and the bench transformer,
cold, counted 3 MiB + 13 KiB more than explain's loop peak from its third call. The collector
is turned off here to be in that condition every time; the cache folder is new, so the plan
compiles (the sizes are this file's own: no plan of another test is reused)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run import compile_garbage
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend
from tests.helpers import counted_in_a_loop

BATCH, SEQ, HEADS, DIM = 2, 5, 2, 3  # sizes no other test compiles


def attention_loss(wq, wk, x):
    """Two-head self-attention (its fused kernel: the call whose typing leaves the cycles)."""

    def heads(t):
        return t.reshape(BATCH, SEQ, HEADS, DIM).transpose(0, 2, 1, 3)

    q, k = heads(x @ wq), heads(x @ wk)
    mixed = bp.softmax((q @ k.swapaxes(-1, -2)) * 0.5, axis=-1) @ q
    return bp.sum(mixed.transpose(0, 2, 1, 3).reshape(BATCH, SEQ, HEADS * DIM) ** 2)


def arrays():
    rng = np.random.default_rng(3)
    width = HEADS * DIM
    x = rng.standard_normal((BATCH, SEQ, width)).astype(np.float32)
    x[1, 4, :] = 0.0  # a zero row: softmax of equal scores
    wq, wk = (rng.standard_normal((width, width)).astype(np.float32) for _ in range(2))
    return wq, wk, x


@pytest.fixture
def collector_off():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_a_compiling_first_call_leaves_no_outputs_alive(
    compiled_driver, monkeypatch, tmp_path, collector_off
):
    """The driver compiled in the first call (BACKPLAN_DRIVER=inline); a Python-run driver
    whose loop kernels compile in the call is the same path (CompiledPlan._first_call)."""
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    wq, wk, x = arrays()
    with use_backend("reference"):
        want_value, want_grads = bp.value_and_grad(attention_loss, argnums=(0, 1))(wq, wk, x)
    step = bp.value_and_grad(attention_loss, argnums=(0, 1))
    with use_backend("numba"), checked_memory():
        report = bp.explain(step, wq, wk, x)
        before = compile_garbage.compiles()
        value, grads = step(wq, wk, x)
        assert compile_garbage.compiles() > before  # the condition: it compiled here
        np.testing.assert_allclose(value.numpy(), want_value.numpy(), rtol=1e-5)
        for got, want in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
        first = [weakref.ref(_buffer(t.numpy())) for t in (value, *grads)]
        del value, grads, got
        assert [r() for r in first] == [None] * len(first)  # freed with no collection
        counted = counted_in_a_loop(lambda: step(wq, wk, x), calls=3)
    # the loop's first call holds no earlier results, as a first call: explain's calls 1-3
    assert counted == [report.loop_peak_on_call(n).allocated_peak_bytes for n in (1, 2, 3)]


def _buffer(array: np.ndarray) -> np.ndarray:
    while array.base is not None:
        array = array.base
    return array


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def _compile_event(inside=lambda: None):
    from numba.core import event

    with event.trigger_event("numba:compile", data={"dispatcher": None}):
        inside()


def test_a_compile_collects_what_it_made_and_leaves_nothing_frozen(collector_off):
    """The objects older than the compile are frozen while it runs (its collection walks only
    what it made), unfrozen after; the cycles it left are freed as it ends."""
    before = compile_garbage.compiles()
    left = []

    def compiling():
        assert gc.get_freeze_count() > 0  # the older objects are out of the collection
        cycle = _Cycle()
        left.append(weakref.ref(cycle))

    older = _Cycle()
    kept_older = weakref.ref(older)
    _compile_event(lambda: _compile_event(compiling))  # a library compile inside a plan's
    assert left[0]() is None  # the compile's cycle went at its end, the collector off
    assert gc.get_freeze_count() == 0
    assert kept_older() is older  # a live object older than the compile is untouched
    assert compile_garbage.compiles() > before
    assert not compile_garbage.collect_if_compiled(before)  # nothing left for a full one


def test_objects_the_user_froze_stay_frozen_and_the_full_collection_runs(collector_off):
    before = compile_garbage.compiles()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        left = []
        _compile_event(lambda: left.append(weakref.ref(_Cycle())))
        assert gc.get_freeze_count() == frozen
        assert left[0]() is not None  # not collected at the compile's end
        assert compile_garbage.collect_if_compiled(before)
        assert left[0]() is None
    finally:
        gc.unfreeze()
