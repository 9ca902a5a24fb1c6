"""A new batch size's scratch arena grows over the previous size's pages
(codegen/run/arena_memory.py): the reservation keeps what was written below the old end, gives
back what lies past a smaller new end, is offered only when nothing views it, and offers a call
does not take are gone when it ends. End to end, with every arena reserved: each size's first
call runs in the bytes the last size's arena held, its results equal the reference
interpreter's (odd sizes, 1 and 0 rows included) and each call holds what explain prints."""

from __future__ import annotations

import gc
import threading
import tracemalloc
import weakref

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run import arena_memory, workspace
from backplan.codegen.run.arena_memory import HUGE_PAGE, Reservation, offer, take_offer
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

pytestmark = pytest.mark.skipif(not arena_memory.RESERVING, reason="Linux reservations only")
MB = 1 << 20
RNG = np.random.default_rng(34)
W1 = RNG.standard_normal((6, 16)).astype(np.float32)
W2 = RNG.standard_normal((16, 3)).astype(np.float32)


@pytest.fixture(autouse=True)
def no_offers_left():
    arena_memory.withdraw_offers()
    yield
    assert arena_memory.OFFERED == []  # every test's calls and takes leave none behind


def test_an_arena_starts_on_a_huge_page_and_grows_keeping_its_bytes():
    reservation = Reservation(5 * MB)
    arena = reservation.arena(5 * MB)
    assert arena.nbytes == 5 * MB and arena.ctypes.data % HUGE_PAGE == 0
    arena[:] = 7
    start = arena.ctypes.data
    del arena
    grown = reservation.arena(9 * MB)
    assert grown.ctypes.data == start
    assert (grown[: 5 * MB] == 7).all()  # the pages already held, not fresh ones
    assert (grown[5 * MB :] == 0).all()


def test_a_smaller_arena_gives_back_the_pages_past_its_end():
    reservation = Reservation(8 * MB)
    arena = reservation.arena(8 * MB)
    arena[:] = 255
    del arena
    end = 5 * MB + 100  # not on a page boundary: the page it ends in is kept
    smaller = reservation.arena(end)
    assert (smaller == 255).all()
    del smaller
    again = reservation.arena(6 * MB - 1)  # within the same 2 MiB block: nothing mapped anew
    kept = -(-end // arena_memory.mmap.PAGESIZE) * arena_memory.mmap.PAGESIZE
    assert (again[:kept] == 255).all()
    assert (again[kept:] == 0).all()  # given back (MADV_DONTNEED): zero pages when touched


def _numpy_traced() -> int:
    """Bytes tracemalloc holds in NumPy's domain now."""
    traces = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]
    )
    return sum(stat.size for stat in traces.statistics("filename"))


def test_tracemalloc_sees_an_arena_as_it_saw_np_empty():
    tracemalloc.start()
    try:
        before = _numpy_traced()
        reservation = Reservation(5 * MB)
        arena = reservation.arena(5 * MB)
        assert _numpy_traced() - before == 5 * MB
        del arena
        grown = reservation.arena(8 * MB)  # the trace follows the arena's length
        assert _numpy_traced() - before == 8 * MB
        del grown, reservation
        gc.collect()
        assert _numpy_traced() == before  # untracked with the mapping
    finally:
        tracemalloc.stop()


def _resident(reservation: Reservation) -> int:
    """Bytes of the reservation's mapping in memory now (/proc/self/smaps, its VMAs' Rss)."""
    start = np.frombuffer(reservation._map, np.uint8, count=1).ctypes.data
    end, total, inside = start + len(reservation._map), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low < end and high > start
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def test_the_process_holds_the_arenas_bytes_not_its_last_huge_page():
    """Huge pages for the arena's whole 2 MiB blocks only: its last, partial one mapped as a
    huge page held up to 2 MiB more than the arena (np.empty's array never did)."""
    page = arena_memory.mmap.PAGESIZE
    for nbytes in (5 * MB + page, 9_000_000):
        reservation = Reservation(nbytes)
        arena = reservation.arena(nbytes)
        arena[:] = 1
        assert _resident(reservation) == -(-nbytes // page) * page, nbytes
        del arena
        grown = reservation.arena(12_000_000)
        grown[:] = 1
        assert _resident(reservation) == -(-12_000_000 // page) * page, nbytes
        del grown
        reservation.arena(nbytes)  # shrunk again: the pages past its end given back
        assert _resident(reservation) == -(-nbytes // page) * page, nbytes


def test_an_arena_beyond_the_reservation_is_refused():
    reservation = Reservation(4 * MB)
    with pytest.raises(ValueError, match="reservation of"):
        reservation.arena(reservation.capacity + 1)


def test_only_unviewed_reservations_are_offered_and_one_is_taken():
    held, small, big = Reservation(4 * MB), Reservation(4 * MB), Reservation(8 * MB)
    view = held.arena(4 * MB)
    small.arena(4 * MB)[:] = 1  # 4 MB of pages held
    big.arena(6 * MB)[:] = 1  # 6 MB of pages held
    offer([held, small, big])
    assert arena_memory.OFFERED == [small, big]  # a reservation still viewed stays out
    assert take_offer(1024) is None  # too small to reserve: the offers stay
    assert take_offer(5 * MB) is big  # fits, and holds the most of the 5 MB already
    assert arena_memory.OFFERED == []  # the rest dropped: one call takes one offer
    del view


def test_a_pool_released_at_one_size_lends_its_pages_to_the_next():
    first = workspace.WorkspacePool([(np.dtype(np.float32), 2 * MB)], [])
    arena = first.checkout()
    address = arena.arena.ctypes.data
    first.checkin(arena)
    del arena
    freed = first.release_idle()
    assert len(freed) == 1 and freed[0].unviewed()
    offer(freed)
    second = workspace.WorkspacePool([(np.dtype(np.float32), 3 * MB)], [])  # 12 MB
    grown = second.checkout()
    assert grown.reservation is freed[0] and grown.arena.ctypes.data == address
    assert grown.arena.nbytes == 12 * MB and grown.scratch[0].shape == (3 * MB,)


def mlp_loss(w1, w2, x):
    return bp.sum(bp.tanh(bp.tanh(x @ w1) @ w2) ** 2)


def _arena_reservations(monkeypatch) -> list:
    """Every arena reserved; the reservation of each checked-out workspace's arena (held: no
    later mapping takes its place or its id)."""
    monkeypatch.setattr(arena_memory, "RESERVE_FROM", 1)
    seen = []
    checkout = workspace.WorkspacePool.checkout

    def recording(pool):
        taken = checkout(pool)
        seen.append(taken.reservation)
        return taken

    monkeypatch.setattr(workspace.WorkspacePool, "checkout", recording)
    return seen


# 1 and 0 rows are signatures of their own (traced apart): a switch to or from them frees the
# dynamic plan's arenas without offering them; between dynamic sizes each grows in place.
SIZES = (8, 12, 17, 8, 1, 0, 33, 12)


def test_each_new_size_runs_in_the_last_sizes_pages_with_the_interpreters_results(monkeypatch):
    seen = _arena_reservations(monkeypatch)
    step = bp.value_and_grad(bp.compile(mlp_loss, dynamic={"x": {0: "batch"}}), argnums=(0, 1))
    grew = []
    with use_backend("numba"):
        for previous, n in zip((None, *SIZES), SIZES, strict=False):
            x = RNG.standard_normal((n, 6)).astype(np.float32)
            before = len(seen)
            value, (g1, g2) = step(W1, W2, x)
            assert len(seen) > before and arena_memory.OFFERED == []
            if before and min(n, previous) > 1:
                grew.append(seen[before] is seen[before - 1])
            with use_backend("reference"):
                expected = bp.value_and_grad(mlp_loss, argnums=(0, 1))(W1, W2, x)
            np.testing.assert_allclose(value.numpy(), expected[0].numpy(), rtol=1e-4, atol=1e-5)
            for got, want in zip((g1, g2), expected[1], strict=True):
                np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
    assert grew == [True] * 4  # 8 -> 12 -> 17 -> 8, 33 -> 12: the last size's reservation
    assert step.cache_info().traces == 3  # the dynamic plan, 1 row, 0 rows


def test_each_size_in_reused_pages_holds_what_explain_prints(monkeypatch):
    _arena_reservations(monkeypatch)
    step = bp.value_and_grad(bp.compile(mlp_loss, dynamic={"x": {0: "batch"}}), argnums=(0, 1))
    with use_backend("numba"), checked_memory():
        for n in SIZES:
            x = bp.tensor(RNG.standard_normal((n, 6)).astype(np.float32))
            report = bp.explain(step, W1, W2, x)
            assert counted_calls(lambda x=x: step(W1, W2, x), 3) == printed_calls(report, 3), n


def test_an_offer_the_call_does_not_take_is_unmapped_when_it_ends(monkeypatch):
    """A size whose arena is too small to reserve leaves the last size's offer untaken: it is
    unmapped at the end of that call, not held until some later call takes or drops it."""
    monkeypatch.setattr(arena_memory, "RESERVE_FROM", 1)
    made = []
    original = arena_memory.Reservation.__init__

    def noting(self, nbytes):
        original(self, nbytes)
        made.append(weakref.ref(self._map))

    monkeypatch.setattr(arena_memory.Reservation, "__init__", noting)
    offered_at_checkout = []
    checkout = workspace.WorkspacePool.checkout

    def noting_offers(pool):
        offered_at_checkout.append(len(arena_memory.OFFERED))
        return checkout(pool)

    monkeypatch.setattr(workspace.WorkspacePool, "checkout", noting_offers)
    step = bp.compile(mlp_loss, dynamic={"x": {0: "batch"}})
    with use_backend("numba"):
        for n in (64, 80):  # the second size's arena grows over the first's
            step(W1, W2, RNG.standard_normal((n, 6)).astype(np.float32))
        assert any(ref() is not None for ref in made)
        monkeypatch.setattr(arena_memory, "RESERVE_FROM", 1 << 40)  # nothing reserves now
        x = RNG.standard_normal((3, 6)).astype(np.float32)
        value = step(W1, W2, x)
    assert offered_at_checkout[-1] == 1  # 80 rows' freed arena, offered and not taken
    gc.collect()
    assert [ref() for ref in made] == [None] * len(made)  # every reservation unmapped
    with use_backend("reference"):
        np.testing.assert_allclose(value.numpy(), mlp_loss(W1, W2, x).numpy(), rtol=1e-5)


def test_threads_switching_sizes_get_the_serial_results(monkeypatch):
    """Calls at different sizes from several threads: offers made by one thread's switch may
    be taken by another's checkout, never by two (two arenas over one reservation would mix
    their bytes)."""
    monkeypatch.setattr(arena_memory, "RESERVE_FROM", 1)
    step = bp.value_and_grad(bp.compile(mlp_loss, dynamic={"x": {0: "batch"}}), argnums=(0, 1))
    sizes = (8, 12, 17, 9, 33)
    xs = {n: RNG.standard_normal((n, 6)).astype(np.float32) for n in sizes}
    with use_backend("numba"):
        serial = {n: step(W1, W2, xs[n]) for n in sizes}
        wrong = []

        def calls(k):
            for r in range(15):
                n = sizes[(k + r) % len(sizes)]
                value, grads = step(W1, W2, xs[n])
                for got, want in zip((value, *grads), (serial[n][0], *serial[n][1]), strict=True):
                    if not np.allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6):
                        wrong.append((k, r, n))

        threads = [threading.Thread(target=calls, args=(k,)) for k in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert wrong == []
