"""Static memory plan: every buffer of a schedule gets a fixed offset in one arena per
(arena name, dtype), so compiled code allocates a few arrays up front and none per step.
`shared=True` places every dtype of an arena in the same bytes (the runtime views one buffer
as each dtype): a bfloat16 buffer may reuse bytes a float32 one used earlier.

Two buffers share bytes only when their live ranges [first_step, last_step] are disjoint, or when
one takes over a dying buffer in place (an elementwise output written over the input it reads for
the last time). Placement is greedy best-fit by decreasing size over the interval graph, as in
TFLite's and tinygrad's planners, which keeps arenas close to `lower_bound_bytes`.
"""

import heapq
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from .errors import BackplanError
from .types import DTYPES


class MemoryPlanError(BackplanError, ValueError):
    """A buffer request that cannot be planned; names the buffer and the offending value."""


class BufferRequest(NamedTuple):
    """A buffer written at `first_step` (-1: on entry) and last read at `last_step`. `reuse` names
    buffers whose storage it may take over in place; a hint, honoured only when legal. A named
    tuple: a lowering makes one per buffer (~6,600 a row of a 10,000-node memory frontier),
    at a third of a frozen dataclass's cost."""

    key: object
    nbytes: int
    dtype: str
    first_step: int
    last_step: int
    arena: str = "scratch"
    reuse: tuple = ()
    # reuse may also name a buffer made and last read at this one's first step: the step
    # reads each element of it before writing this one's there (a GEMM's epilogue writing
    # over its product, ir/layout.py)
    in_step: bool = False


class Placement(NamedTuple):
    """Where one buffer lives (a named tuple, as BufferRequest)."""

    arena: str
    dtype: str
    offset: int  # in elements of dtype, aligned
    nbytes: int


_placement = tuple.__new__  # Placement(*fields), as its generated __new__ makes it


@dataclass
class MemoryAssignment:
    """Where each buffer lives. `in_place` maps a buffer to the buffer whose storage it took."""

    placements: dict
    arena_sizes: dict  # (arena, dtype) -> size in elements (shared: the whole arena's bytes)
    in_place: dict = field(default_factory=dict)
    shared: bool = False  # every dtype of an arena views the same bytes

    def arena_bytes(self) -> dict:
        return {key: size * DTYPES[key[1]].itemsize for key, size in self.arena_sizes.items()}

    @property
    def peak_bytes(self) -> int:
        """Bytes the runtime allocates: all arenas together (a shared arena counted once)."""
        if not self.shared:
            return sum(self.arena_bytes().values())
        per_arena: dict = {}
        for (arena, _), nbytes in self.arena_bytes().items():
            per_arena[arena] = max(per_arena.get(arena, 0), nbytes)
        return sum(per_arena.values())


def assign_memory(
    requests: list[BufferRequest], alignment_bytes: int = 64, shared: bool = False
) -> MemoryAssignment:
    """Place every buffer; deterministic for the same requests. shared: the dtypes of one
    arena share its bytes (offsets still in elements of each buffer's dtype).

    >>> x = BufferRequest("x", nbytes=256, dtype="f32", first_step=-1, last_step=0)
    >>> y = BufferRequest("y", nbytes=256, dtype="f32", first_step=1, last_step=2)
    >>> plan = assign_memory([x, y])
    >>> plan.placements["y"].offset, plan.arena_sizes
    (0, {('scratch', 'f32'): 64})
    """
    by_key = {r.key: r for r in requests}
    offsets, sizes, in_place = element_offsets(requests, alignment_bytes, shared, by_key)
    placements = {  # Placement(...) without its constructor's call
        key: _placement(Placement, (r.arena, r.dtype, offset, r.nbytes))
        for key, offset in offsets.items()
        for r in (by_key[key],)
    }
    return MemoryAssignment(placements, sizes, in_place, shared)


def element_offsets(
    requests: list[BufferRequest],
    alignment_bytes: int = 64,
    shared: bool = False,
    by_key: dict | None = None,
) -> tuple[dict, dict, dict]:
    """(key -> offset in elements of its dtype, arena sizes, in_place) of assign_memory's
    placement, without a Placement made for each buffer: a lowering reads the offsets alone
    (ir/layout.py), ~5,500 a row of a 10,000-node memory frontier. by_key: each request by
    its key, where the caller made it."""
    _check(requests, alignment_bytes)
    by_key = {r.key: r for r in requests} if by_key is None else by_key
    in_place = _resolve_in_place(requests, by_key)
    chains = _chains(requests, in_place, by_key)
    by_arena: dict[tuple, list[list[BufferRequest]]] = {}
    if shared and len({r.arena for r in requests}) == 1:  # one arena (a plan's scratch)
        by_arena[(requests[0].arena,)] = chains
    else:
        for chain in chains:
            group = (chain[0].arena,) if shared else (chain[0].arena, chain[0].dtype)
            by_arena.setdefault(group, []).append(chain)
    placed, sizes = {}, {}
    for chains in by_arena.values():
        offsets, end = _place_best_fit(chains, alignment_bytes)
        if _worth_other_orders(chains, end):
            offsets, end = _best_of_other_orders(chains, alignment_bytes, offsets, end)
        itemsizes: dict[str, int] = {}  # of this arena's dtypes, each looked up once
        for chain, offset in zip(chains, offsets, strict=True):
            for r in chain:
                key, _, dtype, _, _, arena, _, _ = r  # its fields, unpacked at once
                itemsize = itemsizes.get(dtype)
                if itemsize is None:
                    itemsize = itemsizes[dtype] = DTYPES[dtype].itemsize
                    sizes[(arena, dtype)] = -(-end // itemsize)
                placed[key] = offset // itemsize
    return placed, sizes, in_place


def swept_arena_sizes(requests: list[BufferRequest], alignment_bytes: int = 64) -> dict | None:
    """element_offsets(requests, alignment_bytes, shared=True)'s arena sizes without placing a
    buffer, where they follow from the requests alone; None where they do not (the caller
    places them). A memory frontier reads a row's arena size and never its offsets: the
    placement was ~12 ms of each of a 10,000-node chain's 22 rows.

    Exact where the largest size's chains are single buffers (or chains of equal ones) whose
    size is a multiple of the alignment: the placement sweeps them first, in order of first
    step, each into one slot of that size, opening a new slot only when every slot below the
    top is held (_largest_by_sweep), so they end at that size times the most of them live at
    one step. Each smaller chain then fits below that end when the slots it may not use (one
    per large chain whose life meets its own, two per other small chain meeting it: a small
    one may straddle two slots) are fewer than the slots: a whole free slot is a gap it fits
    in, or lies above every buffer live with it. One small buffer may fail that test where it
    lives at a step beside as many large ones as there are slots: the tightest gap puts it at
    worst at the slots' end, and no placement ends below them and it, so the end is exactly
    that. Either end is at most the bytes live at once: no other order is tried. One arena
    only (shared, as a lowering's scratch)."""
    if not requests:
        return None
    arena = requests[0].arena
    _check(requests, alignment_bytes)
    by_key = {r.key: r for r in requests}
    in_place = _resolve_in_place(requests, by_key)
    taker_of = {old: new for new, old in in_place.items()}
    nbytes = max(r.nbytes for r in requests)  # a chain's first is its largest
    if nbytes == 0 or nbytes % alignment_bytes:
        return None
    firsts, lasts, small = [], [], []
    for r in requests:
        if r.arena != arena:
            return None
        if r.key in in_place:
            continue  # in the chain of the buffer it takes over
        tail = r
        while tail.key in taker_of:
            tail = by_key[taker_of[tail.key]]
            if r.nbytes == nbytes and tail.nbytes != nbytes:
                return None  # the sweep stops at such a chain
        if r.nbytes == nbytes:
            firsts.append(r.first_step)
            lasts.append(tail.last_step)
        elif r.nbytes:
            small.append((r.first_step, tail.last_step, r.nbytes, tail is r))
    if len(small) > SMALL_CHAINS_PROVED:
        return None
    first, last = np.sort(np.array(firsts, np.int64)), np.sort(np.array(lasts, np.int64))
    # large chains live at each one's first step: begun by then, not ended before it
    live = np.searchsorted(first, first, "right") - np.searchsorted(last, first, "left")
    slots = int(live.max())
    above = 0  # the bytes of the one small buffer that may land above the slots
    for begin, end, size, single in small:
        meeting = int(np.searchsorted(first, end, "right") - np.searchsorted(last, begin, "left"))
        others = sum(1 for b, e, _, _ in small if b <= end and e >= begin) - 1
        if meeting + 2 * others < slots:
            continue  # a whole slot stays free through its life
        if above or not single or _most_large_live(first, last, live, begin, end) < slots:
            return None
        above = size
    end = slots * nbytes + above
    dtypes = dict.fromkeys(r.dtype for r in requests)
    if len(dtypes) > 1:  # in element_offsets' order: each chain's buffers after its first
        chains = _chains(requests, in_place, by_key)
        dtypes = dict.fromkeys(r.dtype for chain in chains for r in chain)
    return {(arena, d): -(-end // DTYPES[d].itemsize) for d in dtypes}


SMALL_CHAINS_PROVED = 64  # beyond, placing them is cheaper than the pairwise test


def _most_large_live(first, last, live, begin: int, end: int) -> int:
    """The most of swept_arena_sizes's large chains live at one step of [begin, end]: at begin,
    or at the first step of one beginning inside it (first, last: their steps sorted; live:
    how many are live at each first step)."""
    at_begin = int(np.searchsorted(first, begin, "right") - np.searchsorted(last, begin, "left"))
    inside = live[np.searchsorted(first, begin, "right") : np.searchsorted(first, end, "right")]
    return max(at_begin, int(inside.max()) if len(inside) else 0)


def lower_bound_bytes(requests: list[BufferRequest]) -> dict:
    """(arena, dtype) -> max over steps of the bytes live at that step, counting a buffer that
    takes over another in place only from the step after the takeover. No plan can do better."""
    _check(requests, alignment_bytes=None)
    in_place = _resolve_in_place(requests)
    events: dict[tuple, list[tuple[int, int]]] = {}
    for r in requests:
        start = r.first_step + 1 if r.key in in_place else r.first_step
        if start <= r.last_step:
            arena_events = events.setdefault((r.arena, r.dtype), [])
            arena_events += [(start, r.nbytes), (r.last_step + 1, -r.nbytes)]
    bounds = {}
    for key, arena_events in events.items():
        live = peak = 0
        for _, delta in sorted(arena_events):  # frees sort before allocations at the same step
            live += delta
            peak = max(peak, live)
        bounds[key] = peak
    return bounds


def may_take_over(new: BufferRequest, old: BufferRequest) -> bool:
    """Whether `new` may be written over `old` in place. `old` must outlive its first step, so a
    chain of takeovers never makes two buffers that are not neighbours in it overlap; or, for
    a new one `in_step`, be made and last read at new's first step while taking over nothing
    itself."""
    return (
        new.arena == old.arena
        and new.dtype == old.dtype
        and new.nbytes <= old.nbytes
        and old.last_step == new.first_step
        and (old.first_step < old.last_step or (new.in_step and not old.reuse))
    )


def _resolve_in_place(requests: list[BufferRequest], by_key: dict | None = None) -> dict:
    """Taker key -> taken key; earlier writers (then earlier requests) choose first. by_key:
    each request by its key, where the caller made it."""
    by_key = {r.key: r for r in requests} if by_key is None else by_key
    in_place, taken = {}, set()
    for new in sorted([r for r in requests if r.reuse], key=_first_step):  # stable: as all
        for key in new.reuse:
            old = by_key.get(key)
            if old is not None and key not in taken and may_take_over(new, old):
                in_place[new.key] = key
                taken.add(key)
                break
    return in_place


_first_step = attrgetter("first_step")  # a request's, as sort keys (no lambda call each)


def _chains(
    requests: list[BufferRequest], in_place: dict, by_key: dict | None = None
) -> list[list[BufferRequest]]:
    """Buffers grouped into chains that share one offset, each taking over its predecessor.
    by_key: each request by its key, where the caller made it."""
    if not in_place:  # no takeovers: each buffer a chain of its own
        return [[r] for r in requests]
    by_key = {r.key: r for r in requests} if by_key is None else by_key
    taker_of = {old: new for new, old in in_place.items()}
    chains = []
    for r in requests:
        if r.key not in in_place:
            chain = [r]
            while chain[-1].key in taker_of:
                chain.append(by_key[taker_of[chain[-1].key]])
            chains.append(chain)
    return chains


def _most_live(chains: list[list[BufferRequest]]) -> int:
    """The most bytes the chains hold at one step (each chain its first size throughout, as
    placed): no placement of them ends lower."""
    if not chains:
        return 0
    first = np.fromiter((c[0].first_step for c in chains), np.int64, len(chains))
    last = np.fromiter((c[-1].last_step for c in chains), np.int64, len(chains))
    size = np.fromiter((c[0].nbytes for c in chains), np.int64, len(chains))
    low = int(first.min())
    delta = np.zeros(int(last.max()) - low + 2, np.int64)
    np.add.at(delta, first - low, size)
    np.add.at(delta, last - low + 1, -size)
    return int(np.cumsum(delta).max())


# The other orders are placed element by element (the sweep serves largest-first only): three
# more placements of an unrolled LSTM's 1,700 chains cost each new batch size's first call
# 11-12 ms (35 -> 47) for an arena a few KiB above the bound. They are tried where the gap is
# worth that: over 5% of the bound, and either few chains or at least 64 KiB to win.
RETRY_ABOVE = 1.05
FEW_CHAINS = 256
RETRY_BYTES = 64 * 1024


def _worth_other_orders(chains: list[list[BufferRequest]], end: int) -> bool:
    bound = _most_live(chains)
    if end <= bound * RETRY_ABOVE:
        return False
    return len(chains) <= FEW_CHAINS or end - bound >= RETRY_BYTES


# Orders tried after the largest-first one when it ends above the most bytes live at once:
# longest-lived first (a value saved from the forward to the backward beside short-lived ones
# of another size), then the largest area of bytes by steps, then by first step.
OTHER_ORDERS = (
    lambda c: (c[0].first_step - c[-1].last_step, -c[0].nbytes, c[0].first_step),
    lambda c: (-c[0].nbytes * (c[-1].last_step - c[0].first_step + 1), c[0].first_step),
    lambda c: (c[0].first_step, -c[0].nbytes),
)


def _best_of_other_orders(chains, alignment: int, offsets: list[int], end: int):
    """The lowest-ending of the largest-first placement (offsets, end) and the same best fit
    in each of OTHER_ORDERS, stopping at one that reaches the most bytes live at once (the
    first of equals: the largest-first placement where no other order does better)."""
    bound = _most_live(chains)
    for key in OTHER_ORDERS:
        order = sorted(range(len(chains)), key=lambda i: key(chains[i]))
        other, other_end = _place_best_fit(chains, alignment, order)
        if other_end < end:
            offsets, end = other, other_end
        if end <= bound:
            break
    return offsets, end


def _place_best_fit(
    chains: list[list[BufferRequest]], alignment: int, order: list[int] | None = None
) -> tuple[list[int], int]:
    """Largest chain first, each into the tightest gap left by the buffers placed so far that are
    live at the same time (a chain reserves its first, largest size throughout). Returns byte
    offsets and the arena's end in bytes. The placed buffers are kept as arrays: an unrolled
    48-step LSTM places 1,700 chains over as many buffers, and a Python scan of every placed
    buffer per chain cost its first call half a second. order: the chains' indices in the
    order they are placed (default largest first, then by first step)."""
    swept_order = order is None
    if order is None:
        keys = [(-chain[0].nbytes, chain[0].first_step) for chain in chains]  # one pass
        order = sorted(range(len(chains)), key=keys.__getitem__)
    members = sum(len(chain) for chain in chains)
    first_steps, last_steps = np.empty(members, np.int64), np.empty(members, np.int64)
    starts, ends = np.empty(members, np.int64), np.empty(members, np.int64)
    offsets, end = [0] * len(chains), 0
    swept = _largest_by_sweep(chains, order, alignment, offsets) if swept_order else 0
    if swept:  # single buffers of one size: filled as whole arrays, not element by element
        run = [chains[i][0] for i in order[:swept]]
        first_steps[:swept] = [r.first_step for r in run]
        last_steps[:swept] = [chains[i][-1].last_step for i in order[:swept]]  # a chain: one
        starts[:swept] = [offsets[i] for i in order[:swept]]
        ends[:swept] = starts[:swept] + run[0].nbytes
        end = int(ends[:swept].max())
    placed = swept
    for i in order[swept:]:
        nbytes, first, last = chains[i][0].nbytes, chains[i][0].first_step, chains[i][-1].last_step
        if nbytes == 0:
            continue  # occupies nothing; stays at offset 0
        live = (first_steps[:placed] <= last) & (last_steps[:placed] >= first)
        offsets[i] = _tightest_gap(starts[:placed][live], ends[:placed][live], nbytes, alignment)
        for r in chains[i]:
            first_steps[placed], last_steps[placed] = r.first_step, r.last_step
            starts[placed], ends[placed] = offsets[i], offsets[i] + r.nbytes
            placed += 1
        end = max(end, offsets[i] + nbytes)
    return offsets, end


def _largest_by_sweep(chains: list, order: list[int], alignment: int, offsets: list) -> int:
    """Place the leading run of `order` whose chains are single buffers of its first (the
    largest) size, as _tightest_gap would, one after another; returns how many were placed.
    They come in order of first step, so the placed buffers live at a new one's first step
    are exactly those live at the same time as it. Each takes one slot of its aligned size
    (every offset is a multiple of it, from 0), so the tightest gap is the shortest run of
    free slots below the highest slot in use (the first of equals by address), else the slot
    above it: a heap of (run length, first slot), stale entries skipped, and the runs by
    their first and past-the-last slot, so that a freed slot joins its neighbours at once
    (a deep uniform MLP's backward places thousands of equal activations, each beside
    hundreds of held values; a sorted free list kept by bisection took 2.5x as long). The
    other sizes, and chains of unequal buffers taking over one another in place, follow the
    general scan (a chain of equal ones, a GEMM's epilogue result over its product, is one
    buffer from its first's first step to its last's last: 22% of a 10,000-node frontier
    went to scanning them)."""
    nbytes = chains[order[0]][0].nbytes if order else 0
    if nbytes == 0:
        return 0
    run, count = 0, len(order)
    while run < count:  # a chain of equal buffers, each taking over the one before at its
        chain = chains[order[run]]  # last step, holds one slot from its first's first step
        if chain[0].nbytes != nbytes:  # to its last's last: one buffer
            break
        if len(chain) > 1 and any(r.nbytes != nbytes for r in chain):
            break
        run += 1
    aligned = -(-nbytes // alignment) * alignment  # a buffer's aligned extent: one slot
    runs: dict[int, int] = {}  # first free slot of a run below the top -> its length
    ends: dict[int, int] = {}  # one past a run's last slot -> its first slot
    gaps: list[tuple[int, int]] = []  # heap of (length, first slot); stale entries skipped
    expiry: list[tuple[int, int]] = []  # heap of (last step, slot)
    top = 0  # one past the highest slot in use
    push, pop = heapq.heappush, heapq.heappop
    for i in order[:run]:
        r = chains[i][0]
        while expiry and expiry[0][0] < r.first_step:
            slot = pop(expiry)[1]
            start = ends.pop(slot, slot)  # the run ending at the freed slot joins it
            if start != slot:
                del runs[start]
            after = runs.pop(slot + 1, 0)  # and the run starting after it
            if after:
                del ends[slot + 1 + after]
            stop = slot + 1 + after
            if stop == top:  # nothing in use above it: the top comes down
                top = start
            else:
                runs[start], ends[stop] = stop - start, start
                push(gaps, (stop - start, start))
        while gaps and runs.get(gaps[0][1]) != gaps[0][0]:
            pop(gaps)
        if gaps:
            length, slot = pop(gaps)
            del runs[slot], ends[slot + length]
            if length > 1:
                runs[slot + 1], ends[slot + length] = length - 1, slot + 1
                push(gaps, (length - 1, slot + 1))
        else:
            slot, top = top, top + 1
        offsets[i] = slot * aligned
        push(expiry, (chains[i][-1].last_step, slot))
    return run


def _tightest_gap(starts: np.ndarray, ends: np.ndarray, nbytes: int, alignment: int) -> int:
    """Offset of the smallest free gap (the first of equals, in address order) that fits between
    the byte ranges [starts, ends) taken; offsets round up to the alignment."""
    if not len(starts):
        return 0
    by_address = np.lexsort((ends, starts))
    starts, ends = starts[by_address], ends[by_address]
    before = np.empty_like(ends)  # the furthest end of the ranges before each one
    before[0] = 0
    np.maximum.accumulate(ends[:-1], out=before[1:])  # ends are >= 0: no clamp needed
    aligned = -(-before // alignment) * alignment
    gaps = starts - aligned
    fits = np.flatnonzero(gaps >= nbytes)
    if not len(fits):
        return int(-(-int(ends.max()) // alignment) * alignment)
    return int(aligned[fits[np.argmin(gaps[fits])]])


def _check(requests: list[BufferRequest], alignment_bytes: int | None) -> None:
    seen: set = set()
    itemsizes: dict[str, int] = {}  # dtype -> its itemsize, for dtypes known and aligned
    for r in requests:
        itemsize = itemsizes.get(r.dtype)
        if itemsize is None and _problem_of_dtype(r.dtype, alignment_bytes) is None:
            itemsize = itemsizes[r.dtype] = DTYPES[r.dtype].itemsize
        if (  # the usual request, asked inline: a lowering checks ~5,500 a row of a frontier
            itemsize is not None
            and r.nbytes >= 0
            and not r.nbytes % itemsize
            and r.last_step >= r.first_step
            and r.key not in seen
        ):
            seen.add(r.key)
            continue
        problem = _problem(r, alignment_bytes, seen)
        if problem:
            steps = f"steps {r.first_step}..{r.last_step}"
            raise MemoryPlanError(
                f"buffer {r.key!r} ({r.nbytes} bytes of {r.dtype}, {steps}): {problem}"
            )
        seen.add(r.key)


def _problem(r: BufferRequest, alignment_bytes: int | None, seen: set) -> str | None:
    if r.dtype not in DTYPES:
        return f"unknown dtype; use one of {', '.join(DTYPES)}"
    itemsize = DTYPES[r.dtype].itemsize
    if r.nbytes < 0 or r.nbytes % itemsize:
        return f"size is not a whole number of {itemsize}-byte items"
    if r.last_step < r.first_step:
        return "last read before it is written"
    problem = _problem_of_dtype(r.dtype, alignment_bytes)
    if problem:
        return problem
    return "key requested twice" if r.key in seen else None


def _problem_of_dtype(dtype: str, alignment_bytes: int | None) -> str | None:
    """What is wrong with placing buffers of dtype at that alignment, or None."""
    if dtype not in DTYPES:
        return f"unknown dtype; use one of {', '.join(DTYPES)}"
    itemsize = DTYPES[dtype].itemsize
    if alignment_bytes is not None and (alignment_bytes <= 0 or alignment_bytes % itemsize):
        return f"alignment {alignment_bytes} is not a positive multiple of {itemsize} bytes"
    return None
