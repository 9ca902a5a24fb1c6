"""A value a row kernel keeps one row at a time (a stage stores it for later stages of the same
row) is reserved CHUNKS rows in the scratch arena, not its whole shape (ir/row_local.py): the
arena the plan prints is the arena the process touches. Before, ln_gelu's [4096, 1024] scratch
was reserved and counted whole while the kernel wrote one row of it (a fresh process grew half
the predicted peak). Serial kernels use the first row; parallel ones run their rows in CHUNKS
chunks, chunk c in row c. Values equal the reference interpreter either way.

A row's statistics (the layer norm's sums, mean and 1/std: (rows, 1) values) read only by
later stages of their row kernel are kept the same way, one element a row: the kernel stored
each into a row of the arena that nothing read back (its later stages read the row's value
from a local), at addresses 16 KiB apart."""

from __future__ import annotations

import re

import numba
import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen import flags
from backplan.codegen.run.memory_check import checked_memory
from backplan.ir.layout import plan_layout
from backplan.ir.lowering import lower
from backplan.ir.row_local import CHUNKS
from backplan.runtime.backend import use_backend


def _ln_gelu(x, g, b, up):
    y = bp.gelu(bp.layer_norm(x) * g + b, approximate="tanh") + x
    return bp.sum(y * up)


def _arrays(rows, cols, special=False):
    rng = np.random.default_rng(rows * 100 + cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if special:  # a row of inf and a nan: those rows' values are nan, the others finite
        x[3, 2], x[rows - 1, 0] = np.inf, np.nan
    g, b = (rng.standard_normal(cols).astype(np.float32) for _ in range(2))
    up = rng.standard_normal((rows, cols)).astype(np.float32)
    return [bp.tensor(a) for a in (x, g, b, up)]


def _step():
    return bp.value_and_grad(_ln_gelu, argnums=(0, 1, 2))


def _run(args, backend):
    with use_backend(backend):
        value, grads = _step()(*args)
    return [np.asarray(value.numpy())] + [g.numpy() for g in grads]


def test_the_arena_reserves_chunks_rows_for_a_value_kept_a_row_at_a_time():
    rows, cols = 200, 24
    with use_backend("numba"):
        compiled = _step().trace(*_arrays(rows, cols)).runner().compiled
    low = lower(compiled.plan)
    layout = low.layout
    assert layout.row_local, "dx's first term is kept one row at a time"
    saved = 0
    for value, reserved in layout.row_local.items():
        assert reserved == CHUNKS
        width = value.shape[1]  # a row statistic (rows, 1) keeps one element a row
        assert layout.reserved_bytes(value) == CHUNKS * width * 4 < value.type.nbytes
        saved += (rows - CHUNKS) * width * 4
    assert {v.shape[1] for v in layout.row_local} == {1, cols}
    whole = plan_layout(low.plan.graph, low.kernels, low.buffers, [], low.steps)
    assert layout.scratch_bytes <= whole.scratch_bytes - saved


def test_few_rows_keep_whole_buffers():
    with use_backend("numba"):
        compiled = _step().trace(*_arrays(CHUNKS, 24)).runner().compiled
    assert lower(compiled.plan).layout.row_local == {}


@pytest.mark.parametrize("rows,cols", [(17, 19), (33, 5), (200, 24)])
def test_serial_row_kernel_with_row_local_values_equals_the_reference(rows, cols):
    previous = numba.get_num_threads()
    numba.set_num_threads(1)  # no loop is parallel
    try:
        args = _arrays(rows, cols, special=True)
        got, ref = _run(args, "numba"), _run(args, "reference")
    finally:
        numba.set_num_threads(previous)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5, equal_nan=True)
    assert np.isnan(got[1][3]).all() and np.isfinite(got[1][4]).all()


@pytest.mark.parametrize("rows,cols", [(17, 19), (40, 24)])
def test_parallel_row_kernel_keeps_each_chunks_row_apart(rows, cols, monkeypatch):
    """Parallel chunks each write their own row of the reservation: a shared row would race."""
    if flags.threads() < 2:
        pytest.skip("a parallel kernel needs two threads")
    monkeypatch.setattr(flags, "PARALLEL_MIN_ELEMENTS", 64)
    args = _arrays(rows, cols, special=True)
    with use_backend("numba"):
        compiled = _step().trace(*args).runner().compiled
    (source,) = [k.source for k in compiled.loop_kernels]
    assert "for chunk in prange(16)" in source and "(16, " in source
    assert "[chunk, i1] = " in source
    got, ref = _run(args, "numba"), _run(args, "reference")
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_the_checked_mode_counts_what_explain_prints(backend):
    args = _arrays(64, 24)
    with use_backend(backend), checked_memory():
        step = _step()
        report = step.explain(*args)
        assert counted_calls(lambda: step(*args), 3) == printed_calls(report, 3)


def test_row_statistics_are_stored_one_element_per_chunk_not_per_row():
    """The serial kernel stores no value at [i0] (each statistic at its element 0; only dx's
    rows, [i0, i1]); the step's values equal the reference interpreter's."""
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        args = _arrays(200, 24, special=True)
        with use_backend("numba"):
            compiled = _step().trace(*args).runner().compiled
        got, ref = _run(args, "numba"), _run(args, "reference")
    finally:
        numba.set_num_threads(previous)
    statistics = [v for v in lower(compiled.plan).layout.row_local if v.shape[1] == 1]
    assert len(statistics) >= 6  # sum, mean, variance sum, 1/std, the two sums of the backward
    (source,) = [k.source for k in compiled.loop_kernels]
    assert re.search(r"\bw\d+\[i0\] = ", source) is None
    assert re.search(r"\bw\d+\[0\] = acc", source) is not None
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5, equal_nan=True)


def _centred(x, up):
    """x minus its row max (a row statistic), summed against up; and the max itself."""
    top = bp.max(x, axis=1, keepdims=True)
    return bp.sum((x - top) * up), top


@pytest.mark.parametrize("returned", [False, True])
def test_a_row_statistic_read_outside_its_row_kernel_keeps_its_whole_buffer(returned):
    """Returned (read by the caller), the row max needs every row; read only by the row
    kernel's later stage, one element a row. Either way the values equal the reference."""
    rng = np.random.default_rng(7)
    x = bp.tensor(rng.standard_normal((200, 24)).astype(np.float32))
    up = bp.tensor(rng.standard_normal((200, 24)).astype(np.float32))

    def step(x, up):
        value, top = _centred(x, up)
        return (value, top) if returned else value

    results = {}
    for backend in ("numba", "reference"):
        with use_backend(backend):
            fn = bp.compile(step)
            out = fn(x, up)
            results[backend] = [o.numpy() for o in out] if returned else [out.numpy()]
            if backend == "numba":
                layout = lower(fn.trace(x, up).program.plans.forward).layout
    kept = [v for v in layout.row_local if v.shape == (200, 1)]
    assert (kept == []) is returned
    for r, g in zip(results["reference"], results["numba"], strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)
