"""A plan's cache key holds every thread count its code depends on. Numba's threads size
attention's workspace (a slot per thread), BLAS's threads choose BLAS or the own GEMM: where
the key said only "more than one thread", processes at 2 and 4 threads (or pinned to different
CPU counts) sharing a cache folder rewrote each other's generated file and compiled it again
on every start (4-5 s a start for a small attention step, alternated)."""

from __future__ import annotations

import numpy as np

import backplan as bp
from backplan.codegen import flags
from backplan.codegen.build import cache
from backplan.codegen.build.plan_facts import layout_hash
from backplan.codegen.kernels.gemm import choice
from backplan.codegen.run import compiled
from backplan.ir import kernel_workspace
from backplan.ir.lowering import lower


def _attention(q, k, v):
    return bp.sum(bp.scaled_dot_product_attention(q, k, v, is_causal=True) ** 2)


def _key_and_layout(plan, monkeypatch, threads: int, blas: int) -> tuple[str, str]:
    monkeypatch.setattr(flags, "threads", lambda: threads)
    monkeypatch.setattr(kernel_workspace, "thread_count", lambda: threads)
    monkeypatch.setattr(choice, "blas_threads", lambda: blas)
    plan.lowered.clear()  # lowered once per plan: again at this count
    lowered = lower(plan)
    _, parts, _ = compiled.rendering(lowered)
    return cache.entry_key(parts), layout_hash(lowered)


def test_plans_lowered_at_two_and_four_threads_have_keys_of_their_own(monkeypatch):
    """6 (batch, head) pairs: two workspace slots at 2 threads, four at 4, so the buffers sit
    elsewhere; each count gets its own key, and the same count the same key."""
    rng = np.random.default_rng(0)
    q, k, v = (bp.tensor(rng.standard_normal((2, 3, 37, 8)).astype(np.float32)) for _ in range(3))
    plan = bp.value_and_grad(_attention, argnums=(0, 1, 2)).trace(q, k, v).plan
    two = _key_and_layout(plan, monkeypatch, 2, 2)
    four = _key_and_layout(plan, monkeypatch, 4, 2)
    assert two[1] != four[1]  # the layouts differ ...
    assert two[0] != four[0]  # ... and so do the keys
    assert _key_and_layout(plan, monkeypatch, 2, 2) == two


def test_blas_threads_are_in_the_key(monkeypatch):
    """One BLAS thread or two choose different GEMM calls for one plan: different keys."""
    x = bp.tensor(np.ones((128, 256), np.float32))
    w = bp.tensor(np.ones((256, 128), np.float32))
    plan = bp.value_and_grad(lambda w, x: bp.sum(x @ w)).trace(w, x).plan
    one = _key_and_layout(plan, monkeypatch, 2, 1)
    two = _key_and_layout(plan, monkeypatch, 2, 2)
    assert one[0] != two[0]
