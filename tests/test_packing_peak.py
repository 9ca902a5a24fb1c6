"""backplan's GEMM packing buffers are in the printed peak, the planner's figure and the checked
mode's count, and the pages a call really writes there are the ones its plan counts.

Before, the packing buffers (about 4 MiB per thread, kept for the process, codegen/kernels/
gemm/scratch.py) and the narrow GEMM's panels (allocated inside its kernel every call) lived
beside the printed peak: a fresh process's first step grew by their pages, which no figure
explained. Now each plan counts the pages its products write (codegen/kernels/gemm/packing.py),
the checked mode holds that count and reads the pages back (mincore, codegen/run/
packing_check.py): a page written outside the count raises MemoryCheckError."""

from __future__ import annotations

import os

import ml_dtypes
import numba
import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.kernels.gemm import scratch
from backplan.codegen.kernels.gemm.narrow import narrow_gemm_at
from backplan.codegen.kernels.gemm.packing import PackingPlan, narrow_parts, planned_packing
from backplan.codegen.run import packing_check
from backplan.codegen.run.memory_check import MemoryCheckError, check_packing, checked_memory
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend

pytestmark = pytest.mark.skipif(not packing_check.available(), reason="needs mincore/madvise")


def _written(step) -> dict:
    """slot -> pages the step's GEMMs wrote in the kept buffers (as the checked mode reads)."""
    before = packing_check.kept_slots()
    dropped = packing_check.drop()
    step()
    return {s: p for s, p in packing_check.written(dropped, before).items() if p}


def _layer_step(dtype, shape):
    m, k, n = shape
    rng = np.random.default_rng(0)
    w = bp.tensor((rng.standard_normal((k, n)) * 0.05).astype(dtype), requires_grad=True)
    v = bp.tensor((rng.standard_normal((n, 7)) * 0.05).astype(dtype), requires_grad=True)
    x = bp.tensor(rng.standard_normal((m, k)).astype(dtype))
    f = bp.value_and_grad(lambda w, v, x: (bp.tanh(x @ w) @ v).sum(), argnums=(0, 1))
    return f, (w, v, x)


CASES = [
    ("f32", np.float32, (128, 512, 512)),
    ("f32-odd", np.float32, (37, 70, 45)),
    ("f32-tall", np.float32, (300, 64, 1000)),
    ("f64", np.float64, (65, 130, 99)),
    ("bf16", ml_dtypes.bfloat16, (40, 96, 72)),
]


@pytest.mark.parametrize("label,dtype,shape", CASES, ids=[c[0] for c in CASES])
def test_the_checked_mode_counts_the_packing_explain_prints(label, dtype, shape, monkeypatch):
    """backplan's GEMM for every product (BACKPLAN_GEMM=own; bfloat16 always), one thread:
    calls 1-3 counted equal explain's figure to the byte, packing in it, and the pages
    written are inside the plan's count (the checked call raises otherwise)."""
    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with use_backend("numba"), checked_memory():
            f, args = _layer_step(dtype, shape)
            report = f.explain(*args)
            counted = counted_calls(lambda: f(*args), 3)
            pages = _written(lambda: f(*args))
    finally:
        numba.set_num_threads(previous)
    assert counted == printed_calls(report, 3)
    packing = report.peak.at_peak().get("packing", 0)
    assert packing == report.packing_bytes > 0
    assert 0 < sum(len(p) for p in pages.values()) * scratch.PAGE <= packing
    assert len(pages) == 1  # one thread: one buffer
    if label in ("f32", "f32-odd"):  # the pages the blocked GEMM's rules write, all of them
        # (f32-tall's 300 rows run row block by row block under the tanh epilogue, B in place:
        # fewer pages than the plan's count, which packs B for more than one row block)
        assert sum(len(p) for p in pages.values()) * scratch.PAGE == packing


def test_a_page_written_outside_the_count_is_named():
    plan = PackingPlan(frozenset({0, 1}), frozenset(), 0, 0)
    check_packing("f", plan, {0: {0, 1}})  # inside: nothing raised
    with pytest.raises(MemoryCheckError, match=r"buffer 0 wrote 12,288 B, 4,096 B of it"):
        check_packing("f", plan, {0: {0, 1, 40}})
    with pytest.raises(MemoryCheckError, match="2 buffers written, the plan counts 1"):
        check_packing("f", plan, {0: {0}, 3: {1}})


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or numba.config.NUMBA_NUM_THREADS < 2,
    reason="needs two CPUs and two Numba threads",
)
def test_two_threads_count_a_helpers_buffer_and_explain_says_so(monkeypatch):
    """A bfloat16 product is shared between the threads BLAS would get (two here): its pages
    are counted once more for the helper, explain names the threads, and the figure at one
    thread is the calling thread's alone."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    previous = numba.get_num_threads()
    found = {}
    try:
        for threads in (1, 2):
            numba.set_num_threads(threads)
            with use_backend("numba"), checked_memory():
                f, args = _layer_step(ml_dtypes.bfloat16, (256, 192, 160))
                report = f.explain(*args)
                counted = counted_calls(lambda f=f, args=args: f(*args), 2)
            assert counted == printed_calls(report, 2)
            found[threads] = report
    finally:
        numba.set_num_threads(previous)
    one, two = found[1], found[2]
    first, each, helpers = two.packing_threads
    assert one.packing_threads == (one.packing_bytes, 0, 0)
    assert helpers == 1 and two.packing_bytes == first + each > one.packing_bytes
    assert "on 2 threads:" in str(two) and "on one thread" in str(one)


def test_the_narrow_gemm_packs_into_a_kept_buffer_on_the_pages_counted():
    """The narrow GEMM (C at most 16 wide) works in a kept buffer, at narrow_parts' places:
    the pages it writes are those, and it allocates nothing (Numba's allocation count)."""
    from numba.core.runtime import _nrt_python, rtsys

    _nrt_python.memsys_enable_stats()
    rng = np.random.default_rng(3)
    for m, n, k, tb in ((37, 14, 300, False), (64, 10, 512, False), (19, 16, 33, True)):
        a = rng.standard_normal(m * k).astype(np.float32)
        b = rng.standard_normal(n * k).astype(np.float32)
        out = np.empty(m * n, np.float32)

        def call(a=a, b=b, out=out, m=m, n=n, k=k, tb=tb):
            narrow_gemm_at(False, tb, m, n, k, a, 0, b, 0, out, 0)

        call()
        stats = rtsys.get_allocation_stats()
        pages = _written(call)
        allocated = rtsys.get_allocation_stats().alloc - stats.alloc
        op_b = b.reshape((n, k)).T if tb else b.reshape((k, n))
        np.testing.assert_allclose(out.reshape(m, n), a.reshape(m, k) @ op_b, rtol=1e-4, atol=1e-4)
        counted = {
            p
            for start, length in narrow_parts(m, n, k, tb)
            if length
            for p in range(start // scratch.PAGE, -(-(start + length) // scratch.PAGE))
        }
        assert len(pages) == 1 and next(iter(pages.values())) <= counted, (m, n, k)
        assert allocated == 3, allocated  # the three arrays a Python call boxes; before: 4-6


def test_a_refused_budget_names_the_packing_it_counts(monkeypatch):
    """A budget below the floor is refused naming the numbers, the packing buffers among
    the holders of the peak."""
    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with use_backend("numba"):
            f, args = _layer_step(np.float32, (256, 512, 512))
            report = f.explain(*args)
            packing = report.peak.at_peak()["packing"]
            budget = report.peak.input_bytes + 100_000  # above your arrays, below any plan
            g = bp.value_and_grad(
                lambda w, v, x: (bp.tanh(x @ w) @ v).sum(), argnums=(0, 1), max_peak_bytes=budget
            )
            with pytest.raises(bp.MemoryBudgetError) as refused:
                g(*args)
    finally:
        numba.set_num_threads(previous)
    said = str(refused.value)
    assert f"{budget:,}" in said and f"packing {packing:,} B" in said, said


def test_the_plan_counts_nothing_where_blas_runs_every_product(monkeypatch):
    monkeypatch.setenv("BACKPLAN_GEMM", "blas")
    with use_backend("numba"):
        f, args = _layer_step(np.float32, (64, 64, 64))
        report = f.explain(*args)
    assert report.packing_bytes == 0 and "packing" not in report.peak.at_peak()
    lowered = [lower(c.plan, c.private_saved) for c in report.peak_calls]
    assert all(planned_packing(low).nbytes == 0 for low in lowered)


def _conv_step():
    rng = np.random.default_rng(5)
    w1 = bp.tensor((rng.standard_normal((16, 3, 3, 3)) * 0.1).astype(np.float32))
    w2 = bp.tensor((rng.standard_normal((8, 16, 3, 3)) * 0.1).astype(np.float32))
    x = bp.tensor(rng.standard_normal((4, 3, 20, 20)).astype(np.float32))

    def loss(w1, w2, x):
        hidden = bp.relu(bp.conv2d(x, w1, padding=(1, 1)))
        return bp.sum(bp.conv2d(hidden, w2, padding=(1, 1)) ** 2)

    return bp.value_and_grad(loss, argnums=(0, 1)), (w1, w2, x)


def _attention_step():
    """Causal, 300 queries (three row blocks, each seeing other keys), f32."""
    rng = np.random.default_rng(6)
    q, k, v = (
        bp.tensor((rng.standard_normal((1, 2, 300, 24)) * 0.3).astype(np.float32)) for _ in range(3)
    )

    def loss(q, k, v):
        return bp.sum(bp.scaled_dot_product_attention(q, k, v, is_causal=True) ** 2)

    return bp.value_and_grad(loss, argnums=(0, 1, 2)), (q, k, v)


def _strided_step():
    """A weight read in place, every other column of a deeper array (ir/strided_copies.py)."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((1000, 80)) * 0.05).astype(np.float32)[:, ::2]
    x = rng.standard_normal((37, 1000)).astype(np.float32)
    return bp.value_and_grad(lambda w, x: bp.sum(bp.tanh(x @ w) ** 2)), (w, x)


STEPS = {"conv": _conv_step, "causal attention": _attention_step, "strided": _strided_step}


@pytest.mark.parametrize("name", list(STEPS))
def test_conv_attention_and_strided_products_count_the_pages_they_write(name, monkeypatch):
    """Their products are counted as their GEMM packs them, not as packed whole: at one
    thread, on backplan's GEMM, the pages a call writes are the plan's count, every one
    (before: the bench cnn 331,776 B counted, 65,536 written; transformer 1,126,400 /
    1,048,576)."""
    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with use_backend("numba"), checked_memory():
            f, args = STEPS[name]()
            report = f.explain(*args)
            counted = counted_calls(lambda: f(*args), 2)
            pages = _written(lambda: f(*args))
            source = f.trace(*args).runner().compiled.source
    finally:
        numba.set_num_threads(previous)
    assert counted == printed_calls(report, 2)
    assert len(pages) == 1  # one thread: one buffer
    assert sum(len(p) for p in pages.values()) * scratch.PAGE == report.packing_bytes > 0
    if name == "strided":  # read where it lies, not copied: deeper than the k block
        assert "own_gemm_strided_at" in source
