"""Static memory plan: every buffer of a schedule gets a fixed offset in one arena per
(arena name, dtype), so compiled code allocates a few arrays up front and none per step.

Two buffers share bytes only when their live ranges [first_step, last_step] are disjoint, or when
one takes over a dying buffer in place (an elementwise output written over the input it reads for
the last time). Placement is greedy best-fit by decreasing size over the interval graph, as in
TFLite's and tinygrad's planners, which keeps arenas close to `lower_bound_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import BackplanError
from .types import DTYPES


class MemoryPlanError(BackplanError, ValueError):
    """A buffer request that cannot be planned; names the buffer and the offending value."""


@dataclass(frozen=True)
class BufferRequest:
    """A buffer written at `first_step` (-1: on entry) and last read at `last_step`. `reuse` names
    buffers whose storage it may take over in place; a hint, honoured only when legal."""

    key: object
    nbytes: int
    dtype: str
    first_step: int
    last_step: int
    arena: str = "scratch"
    reuse: tuple = ()


@dataclass(frozen=True)
class Placement:
    arena: str
    dtype: str
    offset: int  # in elements of dtype, aligned
    nbytes: int


@dataclass
class MemoryAssignment:
    """Where each buffer lives. `in_place` maps a buffer to the buffer whose storage it took."""

    placements: dict
    arena_sizes: dict  # (arena, dtype) -> size in elements
    in_place: dict = field(default_factory=dict)

    def arena_bytes(self) -> dict:
        return {key: size * DTYPES[key[1]].itemsize for key, size in self.arena_sizes.items()}

    @property
    def peak_bytes(self) -> int:
        """Bytes the runtime allocates: all arenas together."""
        return sum(self.arena_bytes().values())


@dataclass
class _Slot:
    """Storage of a chain of buffers, each taking over its predecessor in place."""

    members: list[int]
    nbytes: int
    first: int
    last: int
    offset: int = 0


def assign_memory(requests: list[BufferRequest], alignment_bytes: int = 64) -> MemoryAssignment:
    """Place every buffer; deterministic for the same requests.

    >>> x = BufferRequest("x", nbytes=256, dtype="f32", first_step=-1, last_step=0)
    >>> y = BufferRequest("y", nbytes=256, dtype="f32", first_step=1, last_step=2)
    >>> plan = assign_memory([x, y])
    >>> plan.placements["y"].offset, plan.arena_sizes
    (0, {('scratch', 'f32'): 64})
    """
    _check(requests, alignment_bytes)
    in_place = _resolve_in_place(requests)
    by_arena: dict[tuple, list[_Slot]] = {}
    for slot in _slots(requests, in_place):
        root = requests[slot.members[0]]
        by_arena.setdefault((root.arena, root.dtype), []).append(slot)
    placements, sizes = {}, {}
    for (arena, dtype), slots in by_arena.items():
        itemsize = DTYPES[dtype].itemsize
        sizes[(arena, dtype)] = _place_best_fit(slots, alignment_bytes) // itemsize
        for slot in slots:
            for index in slot.members:
                key, nbytes = requests[index].key, requests[index].nbytes
                placements[key] = Placement(arena, dtype, slot.offset // itemsize, nbytes)
    taken = {requests[new].key: requests[old].key for new, old in in_place.items()}
    return MemoryAssignment(placements, sizes, taken)


def lower_bound_bytes(requests: list[BufferRequest]) -> dict:
    """(arena, dtype) -> max over steps of the bytes live at that step, counting a buffer that
    takes over another in place only from the step after the takeover. No plan can do better."""
    _check(requests, alignment_bytes=None)
    in_place = _resolve_in_place(requests)
    events: dict[tuple, list[tuple[int, int]]] = {}
    for index, request in enumerate(requests):
        start = request.first_step + (index in in_place)
        if start <= request.last_step:
            arena_events = events.setdefault((request.arena, request.dtype), [])
            arena_events += [(start, request.nbytes), (request.last_step + 1, -request.nbytes)]
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
    chain of takeovers never makes two buffers that are not neighbours in it overlap."""
    return (
        new.arena == old.arena
        and new.dtype == old.dtype
        and new.nbytes <= old.nbytes
        and old.last_step == new.first_step
        and old.first_step < old.last_step
    )


def _resolve_in_place(requests: list[BufferRequest]) -> dict[int, int]:
    """Taker index -> taken index; earlier writers (then earlier requests) choose first."""
    index_of = {request.key: index for index, request in enumerate(requests)}
    taken: set[int] = set()
    in_place = {}
    for new in sorted(range(len(requests)), key=lambda i: (requests[i].first_step, i)):
        for key in requests[new].reuse:
            old = index_of.get(key)
            if old is not None and old not in taken and may_take_over(requests[new], requests[old]):
                taken.add(old)
                in_place[new] = old
                break
    return in_place


def _slots(requests: list[BufferRequest], in_place: dict[int, int]) -> list[_Slot]:
    taker_of = {old: new for new, old in in_place.items()}
    slots = []
    for index, request in enumerate(requests):
        if index in in_place:
            continue
        members = [index]
        while members[-1] in taker_of:
            members.append(taker_of[members[-1]])
        last = requests[members[-1]].last_step
        slots.append(_Slot(members, request.nbytes, request.first_step, last))
    return slots


def _place_best_fit(slots: list[_Slot], alignment: int) -> int:
    """Largest first, each into the tightest gap among placed slots live at the same time;
    returns the arena's end in bytes."""
    order = sorted(range(len(slots)), key=lambda i: (-slots[i].nbytes, slots[i].first, i))
    placed: list[_Slot] = []
    end = 0
    for slot in (slots[i] for i in order):
        if slot.nbytes == 0:
            continue  # occupies nothing; stays at offset 0
        neighbours = [p for p in placed if p.first <= slot.last and slot.first <= p.last]
        neighbours.sort(key=lambda p: p.offset)
        slot.offset = _tightest_gap(neighbours, slot.nbytes, alignment)
        placed.append(slot)
        end = max(end, slot.offset + slot.nbytes)
    return end


def _tightest_gap(neighbours: list[_Slot], nbytes: int, alignment: int) -> int:
    best_offset, best_gap, prev_end = None, None, 0
    for neighbour in neighbours:
        start = _align_up(prev_end, alignment)
        gap = neighbour.offset - start
        if gap >= nbytes and (best_gap is None or gap < best_gap):
            best_offset, best_gap = start, gap
        prev_end = max(prev_end, neighbour.offset + neighbour.nbytes)
    return _align_up(prev_end, alignment) if best_offset is None else best_offset


def _align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _check(requests: list[BufferRequest], alignment_bytes: int | None) -> None:
    seen: set = set()
    for r in requests:
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
    if alignment_bytes is not None and (alignment_bytes <= 0 or alignment_bytes % itemsize):
        return f"alignment {alignment_bytes} is not a positive multiple of {itemsize} bytes"
    return "key requested twice" if r.key in seen else None
