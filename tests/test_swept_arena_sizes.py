"""A lowering sizes its scratch arena from the buffers' lifetimes where the placement provably
ends there (ir/memory_plan.py swept_arena_sizes), and places the offsets only when something
reads them (ir/layout.py): a memory frontier reads each row's size alone. The size must be
the placement's, to the element, wherever it is given; a layout placed later checks it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_frontier_saved_fused import arrays, chain

import backplan as bp
from backplan.ir.layout import BufferLayout
from backplan.ir.lowering import lower
from backplan.ir.memory_plan import (
    BufferRequest,
    MemoryPlanError,
    element_offsets,
    swept_arena_sizes,
)
from backplan.runtime.backend import use_backend


def _random_requests(rng, large: int) -> list[BufferRequest]:
    """Buffers of one large size, some with a buffer written over them at their last step
    (a GEMM's epilogue over its product, of its size or smaller), and a few smaller ones,
    some with a smaller one over them too, some living across many steps."""
    steps = int(rng.integers(8, 40))
    requests = []

    def add(key, nbytes, first, last):
        requests.append(BufferRequest(key, nbytes, "f32", first, last))
        if rng.random() < 0.2:  # a buffer written over it at its last step
            smaller = nbytes if rng.random() < 0.7 else 4 * int(rng.integers(1, nbytes // 4 + 1))
            over = BufferRequest(
                ("over", key), smaller, "f32", last, last + int(rng.integers(1, 6)), reuse=(key,)
            )
            requests.append(over)

    for i in range(int(rng.integers(4, 40))):
        first = int(rng.integers(0, steps))
        add(("big", i), large, first, first + int(rng.integers(0, 12)))
    for i in range(int(rng.integers(0, 7))):
        first = int(rng.integers(0, steps))
        size = 4 * int(rng.integers(large // 8, large // 4))
        add(("small", i), size, first, first + int(rng.integers(0, steps)))
    return requests


def _few_requests(rng, large: int) -> list[BufferRequest]:
    """A few buffers of one large size over a few steps and several smaller ones, some with
    a smaller one written over them: the small ones meet each other often."""
    steps = int(rng.integers(3, 10))
    requests = []
    for i in range(int(rng.integers(1, 8))):
        first = int(rng.integers(0, steps))
        requests.append(
            BufferRequest(("big", i), large, "f32", first, first + int(rng.integers(0, 4)))
        )
    for i in range(int(rng.integers(1, 6))):
        first, size = int(rng.integers(0, steps)), 4 * int(rng.integers(1, large // 4))
        last = first + int(rng.integers(0, steps))
        requests.append(BufferRequest(("small", i), size, "f32", first, last))
        if rng.random() < 0.4:
            smaller = 4 * int(rng.integers(1, size // 4 + 1))
            end = last + int(rng.integers(1, 4))
            over = BufferRequest(("over", i), smaller, "f32", last, end, reuse=(("small", i),))
            requests.append(over)
    return requests


@pytest.mark.parametrize("make, trials", [(_random_requests, 600), (_few_requests, 1500)])
def test_an_arena_sized_from_its_requests_is_the_one_they_are_placed_in(make, trials):
    rng = np.random.default_rng(0)
    given = above = 0
    for trial in range(trials):
        large = 64 * int(rng.integers(1, 4))
        requests = make(rng, large)
        sizes = swept_arena_sizes(requests)
        if sizes is None:
            continue
        _, placed, _ = element_offsets(requests, shared=True)
        assert list(sizes.items()) == list(placed.items()), (trial, requests)
        given += 1
        above += placed[("scratch", "f32")] * 4 % large != 0
    assert given > trials // 10 and above > trials // 40  # both ways of proving it exercised


def test_a_small_buffer_beside_every_slot_ends_the_arena_above_them():
    """Three large buffers live at step 1 with a 4-byte one: the arena is theirs and its 4."""
    requests = [
        BufferRequest("a", 256, "f32", 0, 1),
        BufferRequest("b", 256, "f32", 1, 2),
        BufferRequest("c", 256, "f32", 1, 3),
        BufferRequest("s", 4, "f32", 0, 3),
        BufferRequest("d", 256, "f32", 3, 4),
    ]
    assert swept_arena_sizes(requests) == {("scratch", "f32"): 3 * 64 + 1}
    assert element_offsets(requests, shared=True)[1] == {("scratch", "f32"): 3 * 64 + 1}


@pytest.mark.parametrize(
    "requests",
    [
        # sizes no multiple of the alignment: a slot is wider than a buffer
        [BufferRequest("a", 100, "f32", 0, 1), BufferRequest("b", 100, "f32", 2, 3)],
        # two small buffers that may both land above the slots
        [
            BufferRequest("a", 256, "f32", 0, 2),
            BufferRequest("s", 4, "f32", 0, 2),
            BufferRequest("t", 8, "f32", 0, 2),
        ],
        # two arenas
        [BufferRequest("a", 256, "f32", 0, 1), BufferRequest("b", 256, "f32", 0, 1, "other")],
    ],
)
def test_what_it_cannot_prove_is_left_to_the_placement(requests):
    assert swept_arena_sizes(requests) is None


def _lowered_chain():
    ws, x = arrays(8)
    with use_backend("numba"):
        planner = bp.value_and_grad(chain).trace(ws, x).planner
        return lower(planner.build().plan)


def test_a_lowering_places_its_offsets_when_they_are_read():
    lowered = _lowered_chain()
    layout = lowered.layout
    assert "_pending" in vars(layout) and "scratch_offsets" not in vars(layout)
    requests, workspaces, everything, sizes = layout._pending
    offsets, placed, _ = element_offsets(everything, shared=True)
    assert {d: n for (_, d), n in placed.items()} == layout.scratch_elements
    assert layout.scratch_offsets == {r.key: offsets[r.key] for r in requests}
    assert layout.workspaces == {r.key.node: (offsets[r.key], n) for r, n in workspaces}
    assert "_pending" not in vars(layout)


def test_an_arena_placed_other_than_it_was_sized_raises_naming_both():
    layout = _lowered_chain().layout
    requests, workspaces, everything, sizes = layout._pending
    wrong = {key: n + 1 for key, n in sizes.items()}
    layout._pending = (requests, workspaces, everything, wrong)
    with pytest.raises(MemoryPlanError, match="sized .* but placing them needs"):
        _ = layout.scratch_offsets
    with pytest.raises(MemoryPlanError):  # still pending: it raises again, never half placed
        _ = layout.workspaces


def test_two_threads_reading_a_pending_layout_get_one_placement():
    layout = _lowered_chain().layout
    found, start = [], threading.Barrier(4)

    def read():
        start.wait()
        found.append(layout.scratch_offsets)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 4 and all(f is found[0] for f in found)


def test_a_layout_with_no_such_attribute_still_says_so():
    with pytest.raises(AttributeError, match="no_such"):
        _ = BufferLayout().no_such
