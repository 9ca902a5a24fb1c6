"""Fused attention works in a buffer of the plan's scratch arena (ir/kernel_workspace.py): its
probability tiles, the backward's dP/dS tiles, the key-tiled path's row statistics and, where
the kernel runs (batch, head) pairs in parallel, one slot of them per thread. Allocated inside
the kernels per pair on every call before, they were outside explain's peak and the checked
mode (15 allocations a call of a causal 256x32 step, 4 more per extra pair)."""

from __future__ import annotations

import contextlib

import numba
import numpy as np
import pytest

import backplan as bp
from backplan.codegen.kernels import attention
from backplan.codegen.kernels.gemm import vector_width
from backplan.codegen.kernels.views import as_read_only
from backplan.codegen.render.emit import generate
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.ir.kernel_workspace import attention_slot_elements
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend
from tests.test_kernel_workspace import _allocations_counted


def _qkv(shape, keys=None, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    b, h, t, d = shape
    s = t if keys is None else keys
    q = rng.standard_normal((b, h, t, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, h, s, d)).astype(np.float32) for _ in range(2))
    return [bp.tensor(x).astype(dtype) if dtype != np.float32 else bp.tensor(x) for x in (q, k, v)]


def _fused(q, k, v):
    return bp.sum(bp.scaled_dot_product_attention(q, k, v, is_causal=True).astype("float32") ** 2)


@contextlib.contextmanager
def _threads(count):
    """Numba's thread count set while inside (the plan's slots follow it when it lowers)."""
    if numba.config.NUMBA_NUM_THREADS < count:
        pytest.skip(f"fewer than {count} Numba threads")
    previous = numba.get_num_threads()
    numba.set_num_threads(count)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_tiles_are_a_buffer_of_the_arena_one_slot_a_thread(threads):
    """6 pairs of 37 queries and keys: one slot on one thread, two on two (the parallel
    kernel, its slot's elements passed), each slot the probabilities, dS and the scale."""
    q, k, v = _qkv((2, 3, 37, 8))
    with _threads(threads):
        plan = bp.value_and_grad(_fused, argnums=(0, 1, 2)).trace(q, k, v).plan
        lowered = lower(plan)
        source = generate(lowered).source
    found = {n.op: (offset, count) for n, (offset, count) in lowered.layout.workspaces.items()}
    per = {"attention": attention_slot_elements(37, 37, 8, False)}
    per["attention_grad"] = attention_slot_elements(37, 37, 8, True)
    assert per == {"attention": 1376, "attention_grad": 2768}  # 37 * 37 -> 1376: 64-byte pieces
    assert {op: count for op, (_, count) in found.items()} == {
        op: threads * n for op, n in per.items()
    }
    for op, fn in (("attention", "attention_forward"), ("attention_grad", "attention_backward")):
        offset, count = found[op]
        tail = f", {per[op]})" if threads > 1 else ")"
        suffix = "_par" if threads > 1 else ""
        assert f"{fn}{suffix}(" in source
        assert f"scratch_f32[{offset}:{offset + count}]{tail}" in source


def test_a_symbolic_plans_sizes_keep_the_first_sizes_slots():
    """One driver runs every batch size of a dynamic plan: its sizes' workspaces keep the
    first size's slot ceiling (at most one slot a pair), and each size's values are right."""
    f = bp.value_and_grad(_fused, argnums=(0, 1, 2))
    batch_axes = {name: {0: "n"} for name in ("q", "k", "v")}
    dynamic = bp.value_and_grad(bp.compile(_fused, dynamic=batch_axes), argnums=(0, 1, 2))
    with _threads(2), use_backend("numba"):
        for batch in (4, 1, 3):
            args = _qkv((batch, 2, 21, 8), seed=batch)
            value, grads = dynamic(*args)
            with use_backend("reference"):
                want, want_grads = f(*args)
            np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=1e-4)
            for got, expected in zip(grads, want_grads, strict=True):
                np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tile", [attention.KEYS, 4], ids=["one tile", "key-tiled"])
def test_the_kernels_allocate_nothing_but_their_arguments_boxes(tile):
    """Numba's allocation count of a direct call of each kernel (and its parallel variant on
    two slots) against a compiled function doing nothing with the same arrays: equal. Before,
    each pair allocated its probabilities (and dS, the scale; past the tile also its
    statistics and output rows) on every call."""
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((2, 3, 9, 5)).astype(np.float32) for _ in range(4))
    out, dq, dk, dv = (np.empty_like(q) for _ in range(4))
    # read-only, as a plan passes them: a writable variant would be one more compile, and
    # test_conv_variants checks that no compiled attention variant takes writable inputs
    q, k, v, g = (as_read_only(x) for x in (q, k, v, g))
    one = attention.slot_workspace(q, k, v, tile)
    two = attention.slot_workspace(q, k, v, tile, slots=2)
    per = one.shape[0]
    nothing = numba.njit(lambda *arrays: None)
    width = vector_width()
    calls = {
        "forward": (lambda: attention.attention_forward(width, q, k, v, out, 0.5, True, tile, one),
                    (q, k, v, out, one)),
        "backward": (lambda: attention.attention_backward(width, q, k, v, g, dq, dk, dv, 0.5,
                                                          True, tile, one),
                     (q, k, v, g, dq, dk, dv, one)),
        "forward_par": (lambda: attention.attention_forward_par(width, q, k, v, out, 0.5, True,
                                                                tile, two, per),
                        (q, k, v, out, two)),
        "backward_par": (lambda: attention.attention_backward_par(width, q, k, v, g, dq, dk, dv,
                                                                  0.5, True, tile, two, per),
                         (q, k, v, g, dq, dk, dv, two)),
    }  # fmt: skip
    with _allocations_counted() as allocated:

        def allocations(call) -> int:
            call()  # compiled
            before = allocated()
            call()
            return allocated() - before

        for name, (call, arrays) in calls.items():
            boxing = allocations(lambda a=arrays: nothing(*a))
            assert allocations(call) == boxing, name


def test_a_steps_allocations_do_not_grow_with_its_pairs(monkeypatch):
    """Numba's allocation count per call (calls 3..6) of a causal value-and-grad step is the
    same at 1 pair and at 8, untiled or past the key tile: what the driver's calls box (the
    driver run as Python, as a first call's is: no background build to wait for). Before, the
    kernels allocated 4 more a call per pair untiled, 14 past the tile (15 at one pair, 43 at
    eight, 115 at eight past the tile, the compiled driver's)."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")
    counts = {}
    with use_backend("numba"), _allocations_counted() as allocated:
        for shape, keys in (((1, 1, 40, 8), None), ((2, 4, 40, 8), None), ((2, 4, 3, 4), 1030)):
            args = _qkv(shape, keys)
            step = bp.value_and_grad(_fused, argnums=(0, 1, 2))
            for _ in range(2):
                step(*args)
            made = []
            for _ in range(4):
                before = allocated()
                step(*args)
                made.append(allocated() - before)
            counts[shape] = made
    assert len({c for made in counts.values() for c in made}) == 1, counts


def _masked(q, k, v):
    """An additive mask keeps the unfused form: softmax and both products in the plan."""
    t, s = q.shape[-2], k.shape[-2]
    mask = bp.tensor(np.triu(np.full((t, s), -1e9, np.float32), 1))
    scores = q @ k.swapaxes(-1, -2) * float(1.0 / np.sqrt(q.shape[-1])) + mask
    return bp.sum((bp.softmax(scores, axis=-1) @ v) ** 2)


def _dropped(q, k, v):
    """Dropout on the fused attention's output, its mask drawn from a key."""
    out = bp.scaled_dot_product_attention(q, k, v)
    return bp.sum(bp.dropout(out, 0.25, bp.random.key(7)) ** 2)


CASES = {  # name: (loss, (batch, heads, queries, features), keys, dtype, threads)
    "f32 causal odd lengths": (_fused, (2, 3, 37, 8), 53, np.float32, 1),
    "bf16 causal": (_fused, (2, 2, 19, 8), None, "bfloat16", 1),
    "past the key tile": (_fused, (1, 2, 5, 4), 1030, np.float32, 1),
    "additive mask": (_masked, (2, 2, 13, 8), 17, np.float32, 1),
    "dropout": (_dropped, (2, 2, 13, 8), None, np.float32, 1),
    "two threads": (_fused, (2, 3, 37, 8), 53, np.float32, 2),
    "two threads past the key tile": (_fused, (1, 2, 5, 4), 1030, np.float32, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_checked_mode_counts_what_explain_prints_to_the_byte(case):
    """Every byte the step allocates goes through the counting allocator, the tiles in the
    arena with the rest: measured on the third call, the second's results held as a loop
    holds them, equals explain's allocated peak, and the values equal the reference
    interpreter's."""
    loss, shape, keys, dtype, threads = CASES[case]
    args = _qkv(shape, keys, dtype)
    with use_backend("reference"):
        want, want_grads = bp.value_and_grad(loss, argnums=(0, 1, 2))(*args)
    with _threads(threads), use_backend("numba"), checked_memory():
        step = bp.value_and_grad(loss, argnums=(0, 1, 2))
        step(*args)  # compiled: a first call's results are copies, not the output buffers
        with measure() as measured:
            last = step(*args)
            measured.restart_at_next_use()
            last = step(*args)
        value, grads = last
        del last
        peak = step.explain(*args).peak
    assert measured.peak == peak.allocated_peak_bytes
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=tolerance)
    for got, expected in zip(grads, want_grads, strict=True):
        got, expected = (np.asarray(x.astype("float32").numpy()) for x in (got, expected))
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def test_two_threads_calling_one_step_each_work_in_their_own_arena():
    """Each concurrent call checks out an arena of its own (codegen/run/workspace.py), the
    attention tiles with it: two threads calling one step with different inputs get each
    input's own values and gradients on every call."""
    import threading

    inputs = [_qkv((2, 3, 37, 8), 53, seed=seed) for seed in (1, 2)]
    with use_backend("numba"):
        step = bp.value_and_grad(_fused, argnums=(0, 1, 2))
        want = [[x.numpy().copy() for x in [step(*a)[0], *step(*a)[1]]] for a in inputs]
        wrong = []

        def loop(which):
            for _ in range(15):
                value, grads = step(*inputs[which])
                got = [value.numpy(), *(g.numpy() for g in grads)]
                if not all(np.array_equal(a, b) for a, b in zip(got, want[which], strict=True)):
                    wrong.append(which)

        threads = [threading.Thread(target=loop, args=(w,)) for w in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not wrong
