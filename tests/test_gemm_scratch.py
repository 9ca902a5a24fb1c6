"""The GEMM keeps its packing buffers between calls: a call allocates nothing once a buffer is
kept, concurrent calls from threads each get their own buffer and the right product, and no
slot stays taken after a call returns."""

import threading
import tracemalloc

import numpy as np
import pytest

from backplan.codegen.kernels.gemm import scratch
from backplan.codegen.kernels.gemm.api import gemm


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_repeated_gemm_allocates_nothing(dtype):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((130, 300)).astype(dtype), rng.standard_normal((300, 77))
    b = b.astype(dtype)
    c = np.empty((130, 77), dtype)
    gemm(512, False, False, 1.0, a, b, 0.0, c)  # compiles, keeps a buffer
    tracemalloc.start()
    try:
        for _ in range(3):
            gemm(512, False, False, 1.0, a, b, 0.0, c)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4096  # the panels alone are 2-4 MiB
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    assert scratch.slots_in_use() == 0
    assert scratch.buffers_kept() >= 1


def test_threads_calling_at_once_each_get_a_buffer_and_the_right_product():
    rng = np.random.default_rng(1)
    pairs = [(rng.standard_normal((150, 90)), rng.standard_normal((150, 110))) for _ in range(4)]
    errors, start = [], threading.Barrier(len(pairs))

    def work(x, y):
        out = np.empty((90, 110))
        start.wait()
        for _ in range(100):
            gemm(512, True, False, 1.0, x, y, 0.0, out)
            if not np.allclose(out, x.T @ y):
                errors.append(np.abs(out - x.T @ y).max())

    threads = [threading.Thread(target=work, args=pair) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert scratch.slots_in_use() == 0
    assert scratch.buffers_kept() <= scratch.SLOTS


def test_with_every_slot_taken_a_call_allocates_its_own_panels_and_is_right():
    from numba import njit

    @njit
    def take_all():
        taken = 0
        for slot in range(scratch.SLOTS):
            taken += scratch.try_take(slot)
        return taken

    @njit
    def give_back(slots):
        for slot in slots:
            scratch.give_back(slot)

    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((64, 40)), rng.standard_normal((40, 50))
    c = np.empty((64, 50))
    gemm(512, False, False, 1.0, a, b, 0.0, c)  # compiled before the slots are taken
    free_before = [slot for slot in range(scratch.SLOTS) if scratch._table[slot, 0] == 0]
    assert take_all() == len(free_before)
    try:
        tracemalloc.start()
        gemm(512, False, False, 1.0, a, b, 0.0, c)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        give_back(np.array(free_before, np.int64))
    assert peak > 1 << 20  # its own panels, freed again
    np.testing.assert_allclose(c, a @ b, rtol=1e-10)
    assert scratch.slots_in_use() == 0


def test_kept_buffers_start_on_a_cache_line():
    from numba import njit

    @njit
    def kept_address():
        for slot in range(scratch.SLOTS):
            if scratch.try_take(slot):
                address = scratch.buffer_of(slot)
                scratch.give_back(slot)
                return address
        return -1

    address = kept_address()
    assert address > 0 and address % scratch.ALIGN == 0


def test_one_kept_buffer_holds_the_largest_workspace_of_any_tile_and_dtype():
    from backplan.codegen.kernels.gemm.driver import KC, MC, NC, workspace_sizes

    largest = max(
        sum(workspace_sizes(width, itemsize, KC, MC, NC)) * itemsize
        for width in (256, 512)
        for itemsize in (4, 8)
    )
    assert scratch.BUFFER_BYTES == largest
