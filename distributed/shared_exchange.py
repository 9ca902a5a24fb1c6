"""The exchange of ranks on one node through shared memory (node_window.py) in place of MPI's
allreduce: each rank's plan writes its bucket into its buffer in the window (or it is packed
there), then the ranks sum it straight from every rank's buffer, with the averaging (or
nothing, when ranks scaled by their rows) folded in. An allreduce through MPI's shared-memory
cells copies each bucket in and out of them and adds on the way; here each element is read
once from each rank and written once.

A bucket of window_views.IN_PLACE_BYTES or more is summed in place: each rank sums its pages
of it (NodeWindow.page_part) from every rank's buffer into its own buffer (a bfloat16 or
float16 bucket widened to float32 as it is added and rounded once into its 16 bits there:
node_sum.sum_widened_in_place, the bits of summing it whole, with no float32 buffer and no
16-bit copies unpacked from one),
and the whole sum is read through a stitched view (window_views.py) that maps every rank's
summed pages end to end: each rank reads (N-1)/N of the bucket to sum and as much to read the
results, and writes 1/N of it instead of all of it (the bench mlp on 2 ranks: the sums 0.41 ->
0.17-0.19 ms CPU a step). Its second meeting (every rank's parts summed) is one per call: the
last such bucket's (SharedExchange.finish). The returned gradients are views of the window, so
its buffers are used in turn by GENERATIONS calls, and a rank still holding a call's results
when their buffers come round again says so (publish_holds; read by free): every rank then
takes a new window (the old stays mapped while the results hold it).

On SPLIT_RANKS ranks or more another bucket of SPLIT_BYTES or more (16-bit) is summed in parts, as a
reduce-scatter then an all-gather: each rank sums its own part (NodeWindow.part) into its sums
and into a buffer of its own in the window, marks it, and copies the other ranks' summed parts
from theirs, reading 2 (N-1)/N of the bucket from the others instead of N-1 times it, for a
second meeting per bucket. On two ranks that moves about as many bytes through memory as the
whole sum (the copy that publishes a part, the other half read back) and measured slower (the
bench mlp: 5.62-5.68 ms CPU a step against 5.33-5.40), so two ranks, and smaller buckets, sum
them whole by every rank: one meeting.

It is the Exchange of exchange.py with another request behind each bucket: the waits, the
deadlines (deadline.py tests the request), the unpacking and the failure paths (failure.py
starts NaN buckets through the same _start) are Exchange's. Every element is summed in rank
order, whichever rank sums it, so every rank gets the same bits, and on two ranks the bits of
MPI's sum."""

from __future__ import annotations

import math
import os

import numpy as np

from backplan.ir.types import np_dtype

from .exchange import Exchange
from .half_wire import as_bits, summed_dtype
from .in_plan import bucket_slots
from .node_agreement import agreement_window
from .node_sum import sum_in_place, sum_into, sum_widened_in_place, sum_widened_into
from .node_window import (
    LINE,
    READY,
    CounterRequest,
    NodeWindow,
    resident_bytes,
    segment_bytes,
    share,
)
from .rank_peak import counted
from .rows import scale_by_weight
from .window_views import PAGE, summed_in_place

REDUCTION_VARIABLE = "BACKPLAN_DP_REDUCTION"  # "shared" or "mpi"; unset: shared on one node
_nodes: dict = {}  # id(comm) -> (comm, whether its ranks map each other's shared memory)
HALVES = ("bf16", "f16")  # IR dtypes whose buckets the window holds as bit patterns
PROBE = b"backplan node probe"  # written in each rank's probe segment, compared by the others
SPLIT_BYTES = 1 << 18  # summed bytes from which a bucket is summed in parts (see the module)
SPLIT_RANKS = 3  # ranks from which buckets are summed in parts
GENERATIONS = 3  # buffers per bucket in the window: results are read there for a call more


def reduction(comm, seconds: float | None = None, step: str = "data_parallel") -> str:
    """ "shared" when every rank of comm can map every other's shared memory (one node) and
    BACKPLAN_DP_REDUCTION is not "mpi", else "mpi"; decided once per communicator by probing
    (node_window.share, with the deadline `seconds` at `step`): call it on every rank alike."""
    found = _nodes.get(id(comm))
    if found is None or found[0] is not comm:  # every rank probes, whatever it asks for
        probed = share(comm, 0, seconds, f"the shared-memory probe of {step}", check=PROBE)
        agreeing = None
        if probed is not None:  # the steps' agreements on this communicator go through it
            agreeing = agreement_window(comm, seconds, f"the agreement window of {step}")
        found = _nodes[id(comm)] = (comm, probed is not None, agreeing)
    wanted = os.environ.get(REDUCTION_VARIABLE, "shared")
    if wanted not in ("shared", "mpi"):
        raise ValueError(f"{REDUCTION_VARIABLE} must be 'shared' or 'mpi', got {wanted!r}")
    return "shared" if wanted == "shared" and found[1] else "mpi"


def node_agreement(comm):
    """The communicator's agreement window (node_agreement.py), or None when its ranks do not
    map each other's memory or reduction() has not probed them yet (every rank alike)."""
    found = _nodes.get(id(comm))
    return found[2] if found is not None and found[0] is comm else None


def previewed(decided: str | None, size: int) -> str:
    """What a step's reduction is (decided) or will be (None: before its first exchanging call,
    which asks the ranks whether they share one node; previewed as if they do)."""
    if decided is not None:
        return decided
    wanted = os.environ.get(REDUCTION_VARIABLE, "shared")
    return "shared" if wanted == "shared" and size > 1 else "mpi"


def _buckets(layout, size: int, accumulated: bool = False) -> tuple[list[int], list[np.dtype]]:
    """Elements and window dtype of each bucket's buffer: a 16-bit bucket's bit patterns
    (uint16: the plan writes them there, the sum widens them, node_sum.sum_widened_into), or
    float32 where it holds accumulated float32 sums; other dtypes their own. Then, per bucket,
    the buffer of this rank's summed part (parts_of: none for a bucket summed whole)."""
    counts = [b.nbytes // np_dtype(b.dtype).itemsize for b in layout.buckets]
    dtypes = [_window_dtype(b.dtype, accumulated) for b in layout.buckets]
    summed = [summed_dtype(np_dtype(b.dtype)) for b in layout.buckets]
    parts = [parts_of(n, d, s, size) for n, d, s in zip(counts, dtypes, summed, strict=True)]
    for i, b in enumerate(layout.buckets):  # summed in place: no buffer, a counter only
        if summed_in_place(b.dtype, b.nbytes, size, accumulated):
            parts[i] = 0
    return counts + parts, dtypes + summed


def parts_of(count: int, dtype: np.dtype, summed: np.dtype, size: int) -> int:
    """The elements of the largest rank's part of a bucket of `count` elements (window dtype
    `dtype`, summed in `summed`) on `size` ranks (NodeWindow.part's split), or 0 when the
    bucket is summed whole (under SPLIT_BYTES, or one rank)."""
    if size < SPLIT_RANKS or count * summed.itemsize < SPLIT_BYTES:
        return 0
    per_line = max(1, LINE // dtype.itemsize)
    lines = -(-count // per_line)
    return min(count, -(-lines // size) * per_line)


def bytes_read(bucket, size: int, accumulated: bool = False) -> int:
    """What one rank reads of the other ranks' window buffers to sum `bucket` on `size` ranks,
    in the dtype the window holds it in (a 16-bit bucket's 16 bits; float32 sums when the step
    accumulates): every other rank's whole bucket; summed in place, its share of theirs and
    then their summed pages (2 (N-1)/N of the bucket); summed in parts, its share of theirs
    and their summed parts, which are float32 for a 16-bit bucket."""
    dtype = np_dtype(bucket.dtype)
    count = bucket.nbytes // dtype.itemsize
    held = count * _window_dtype(bucket.dtype, accumulated).itemsize
    if summed_in_place(bucket.dtype, bucket.nbytes, size, accumulated):  # summing, then reading
        return 2 * (size - 1) * held // size
    summed = summed_dtype(dtype)
    if parts_of(count, _window_dtype(bucket.dtype, accumulated), summed, size):
        return (size - 1) * held // size + (size - 1) * count * summed.itemsize // size
    return (size - 1) * held


def _window_dtype(dtype: str, accumulated: bool) -> np.dtype:
    if dtype in HALVES and not accumulated:
        return np.dtype(np.uint16)
    return summed_dtype(np_dtype(dtype))


def window_bytes(layout, size: int) -> int:
    """The memory one rank's segment of the window the layout's buckets are summed in on
    `size` ranks holds (whole pages: what its rank holds of the window; it maps the others'
    segments too)."""
    return resident_bytes(segment_bytes(*_buckets(layout, size), GENERATIONS, PAGE))


def node_window(
    exchange, key: tuple, counts: list[int], dtypes: list[np.dtype], **shape
) -> NodeWindow:
    """The window of these buffers under key in exchange.windows (its step's: freed with the
    step), made on first use by every rank alike, with the exchange's deadline. shape:
    NodeWindow's generations and align."""
    found = exchange.windows.get(key)
    if found is None:
        step = f"the allocation of the node window of {exchange.step_name}"
        window = NodeWindow(exchange.world.comm, counts, dtypes, exchange.timeout, step, **shape)
        found = exchange.windows[key] = window
    return found


def _window(exchange, k: int) -> NodeWindow:
    """The window of this call: a new one when a rank held, at its last call, results of the
    generation this call rewrites (every rank reads the same holds, so all make it together;
    the old one stays mapped while its results are held)."""
    key = (exchange.layout.fingerprint,)
    found = exchange.windows.get(key)  # no sizes to work out
    if found is not None:
        if free(found, found.written[k] + 1):  # (k's call: every bucket is written every call)
            return found
        del exchange.windows[key]
    layout, size = exchange.layout, exchange.world.size
    window = node_window(
        exchange,
        key,
        *_buckets(layout, size, exchange.accumulated),
        generations=GENERATIONS,
        align=PAGE,
    )
    window.in_place = [
        b.index
        for b in layout.buckets
        if summed_in_place(b.dtype, b.nbytes, size, exchange.accumulated)
    ]
    window.published = 0  # the last call publish_holds spoke for
    return window


def free(window: NodeWindow, call: int) -> bool:
    """Whether `call` may rewrite its generation of the window: no rank said, at its call
    before, that it still held results of the call before that (which this call's
    generation holds; published by publish_holds before that call marked anything)."""
    if call < 2 or not window.in_place:
        return True
    slot = (call - 1) % 2
    return all(int(holds[slot]) == 0 for holds in window.holds)


def publish_holds(window: NodeWindow, call: int) -> None:
    """Say, before this call marks anything, whether this rank still holds results of call
    - 2 (stitched views of their generation: the arrays the loop was given then). The other
    ranks read it at their next call, whose generation holds them (free)."""
    if call <= window.published:
        return
    window.published = call
    held = 0
    if call > 2:
        generation = (call - 2) % window.generations
        held = int(any(window.held(k, generation) for k in window.in_place))
    window.holds[window.rank][call % 2] = held


class WindowOutputs:
    """Per compiled joint plan: the float32, float64, bfloat16 and float16 buckets (16-bit ones
    as their bit patterns) whose every leaf is an output buffer of its own (in_plan.
    bucket_slots), which a call has the plan write straight into this rank's window buffers of
    the call, so that _start has nothing to copy (used by steps that do not accumulate)."""

    def __init__(self, compiled, layout):
        self.compiled = compiled
        self.buckets, self.slots, self.buffers = bucket_slots(
            compiled, layout, lambda dtype: dtype in ("f32", "f64", *HALVES)
        )
        self.written = frozenset(bucket.index for bucket in self.buckets)  # by a run()
        self._into: dict = {}  # the buckets' parities -> (window, the views run() passes)

    def run(self, windows: dict, layout, arrays: list) -> list | None:
        """The plan's outputs, its buckets' leaves written into the window; None when there is
        no window yet (the first call that exchanges makes it) or the plan cannot be called
        so (compiled.call_own_into)."""
        window = windows.get((layout.fingerprint,))  # _window's key
        if window is None or not self.buckets:
            return None
        if not free(window, window.written[self.buckets[0].index] + 1):
            return None  # a rank holds what this call's buffers hold: a new window (_window)
        parities = tuple(  # the next call's generations
            (window.written[b.index] + 1) % window.generations for b in self.buckets
        )
        found = self._into.get(parities)
        if found is None or found[0] is not window:
            found = self._into[parities] = (window, self._views(window, parities))
        return self.compiled.call_own_into(arrays, found[1])

    def _views(self, window: NodeWindow, parities: tuple[int, ...]) -> dict:
        """{output buffer: its place in this rank's window buffer of the parity}."""
        into = {}
        for bucket, slots, parity in zip(self.buckets, self.slots, parities, strict=True):
            flat = window.buffer(window.rank, bucket.index, parity)
            offset = 0
            for j in slots:
                shape = self.buffers[j][0]
                n = math.prod(shape)
                into[j] = flat[offset : offset + n].reshape(shape)
                offset += n
        return into


class PartsSummed(CounterRequest):
    """Every rank's counter `index` (a bucket's parts) at `call`: every part summed in place
    up to that bucket's (SharedExchange.finish)."""

    def __init__(self, window: NodeWindow, index: int, call: int):
        self.window, self.index, self.call = window, index, call

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name, so deadline.py waits on either
        return self.window.all_at(READY, self.index, self.call)


class SharedRequest(CounterRequest):
    """One bucket's sum over the node, tested and waited for like an mpi4py request: Test()
    completes once every rank has written the bucket (and, for a bucket summed in parts, once
    every rank has summed its part), summing every rank's buffer in rank order into out (the
    summing is this rank's work, done when it tests). A bucket summed whole: every rank sums
    all of it, so a rank waits for the others' writes only (one meeting per bucket: on a busy
    machine each meeting is a wait for a rank off its core). Summed in parts (parts_index: the
    window's buffer of this rank's summed part): each rank sums its part, publishes it, and
    copies the others' once they have marked theirs. The same bits on every rank, and on two
    ranks MPI's (a + b)."""

    def __init__(self, window: NodeWindow, k: int, call: int, out: np.ndarray, average: bool):
        self.window, self.index, self.call, self.out, self.average = window, k, call, out, average
        self.half: str | None = None  # a 16-bit bucket's IR dtype: its buffers hold bit patterns
        self.weights: list[float] | None = None  # every rank's, applied as the sum widens
        self.parity = call % window.generations
        self.parts_index: int | None = None  # set for a bucket summed in parts (or in place)
        self.in_place = False  # each rank sums its page_part into its own buffer; out: stitched
        self.deferred = False  # in place, its parts' meeting is the step's (finish)
        self.summed = False  # this rank's sum (of its part, or of the whole bucket) is done
        self.complete = False

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name, so deadline.py waits on either
        if self.complete:
            return True
        w = self.window
        if not self.summed:
            if not w.all_at(READY, self.index, self.call):
                return False
            self._sum()
            self.summed = True
            if self.parts_index is None:
                self.complete = True
                return True
            w.mark(READY, self.parts_index, self.call)
            if self.deferred:
                self.complete = True
                return True
        if not w.all_at(READY, self.parts_index, self.call):
            return False
        self._gather()
        self.complete = True
        return True

    def block(self, seconds: float) -> None:
        """Wait up to `seconds` for what Test waits for now: every rank's write of the
        bucket, then (summed in parts) every rank's summed part."""
        index = self.index if not self.summed else self.parts_index
        self.window.wait_at(READY, index, self.call, seconds)

    def _sum(self) -> None:
        w, k = self.window, self.index
        buffers = [w.buffer(q, k, self.parity) for q in range(w.size)]
        if self.in_place:  # this rank's part, into its own buffer: the others read it there
            mine = w.page_part(w.rank, k)
            parts = [b[mine] for b in buffers]
            if self.half is not None:  # widened, summed in float32, rounded once into 16 bits
                sum_widened_in_place(parts, w.rank, self.half, self.average, self.weights)
            else:
                sum_in_place(parts, w.rank, self.average)
            return
        out = self.out
        if self.parts_index is not None:  # this rank's part only
            mine = w.part(w.rank, k)
            buffers, out = [b[mine] for b in buffers], out[mine]
        if self.half is not None:  # bit patterns, widened as they are added
            sum_widened_into(buffers, out, self.half, self.average, self.weights)
        else:
            sum_into(buffers, out, self.average)
        if self.parts_index is not None:  # published for the other ranks
            w.buffer(w.rank, self.parts_index, self.parity)[: out.size] = out

    def _gather(self) -> None:
        """Copy every other rank's summed part into out (summed in place: read there)."""
        w = self.window
        if self.in_place:
            return
        for q in range(w.size):
            if q != w.rank:
                part = w.part(q, self.index)
                theirs = w.buffer(q, self.parts_index, self.parity)
                self.out[part] = theirs[: part.stop - part.start]


def _pack(bucket, array_of, mine: np.ndarray, bits: bool) -> None:
    """Copy the bucket's leaves into this rank's window buffer, but for those already there."""
    offset = 0
    for leaf in bucket.leaves:
        value = np.asarray(array_of(leaf)).ravel()
        place = mine[offset : offset + value.size]
        if value.ctypes.data != place.ctypes.data:  # not written there by the plan
            place[...] = as_bits(value) if bits else value  # accumulated: f32 sums
        offset += value.size


class SharedExchange(Exchange):
    """Exchange with each bucket summed through the node's shared window (see the module).
    in_window: the buckets the plan wrote into this call's window buffers (WindowOutputs)."""

    in_window: frozenset = frozenset()

    def _start(self, bucket, array_of) -> None:
        k = bucket.index
        window = _window(self, k)
        window.written[k] += 1
        call = window.written[k]
        publish_holds(window, call)  # before this call marks anything
        mine = window.buffer(window.rank, k, call % window.generations)
        bits = mine.dtype == np.uint16  # a 16-bit bucket's bit patterns (_window_dtype)
        if k not in self.in_window:  # the plan wrote it there (WindowOutputs): nothing to pack
            _pack(bucket, array_of, mine, bits)
        if self.weight is not None and not bits:  # (16-bit: every rank's, in the sum)
            scale_by_weight(mine, self.weight)
        window.mark(READY, k, call)
        if k in window.in_place:  # the whole sum read through every rank's buffers
            reserved = window.stitched(k, call % window.generations)
            dtype = np_dtype(bucket.dtype) if bits else mine.dtype  # 16-bit: rounded there
            out = np.frombuffer(reserved, dtype, mine.size)  # holds reserved (holders)
        else:
            out = counted(np.empty(mine.size, np.float32 if bits else mine.dtype), f"bucket {k}")
        average = self.average and self.weight is None
        if average:
            self.averaged.add(k)  # folded into the sum
        request = SharedRequest(window, k, call, out, average)
        if bits:
            request.half, request.weights = bucket.dtype, self.weights
        if window.counts[len(self.layout.buckets) + k] or k in window.in_place:  # two meetings
            request.parts_index = len(self.layout.buckets) + k
            request.in_place = k in window.in_place
        self.started.append((bucket, out, request))

    def progress(self) -> None:
        for _, _, request in self.started:
            request.Test()

    def finish(self):
        """Exchange.finish, with the buckets summed in place meeting once, after their views
        are made (no reads) and before anything reads them (the loss's copy, the caller): a
        rank marks each part it summed in bucket order, so every rank's mark of the last says
        every earlier part is summed too (one wait for the slower rank, not one a bucket, with
        the unpacking's Python done meanwhile)."""
        in_place = [(bucket, request) for bucket, _, request in self.started if request.in_place]
        for _, request in in_place:
            request.deferred = True
        self.meeting = None
        if in_place:
            bucket, last = in_place[-1]
            self.meeting = bucket, PartsSummed(last.window, last.parts_index, last.call)
        return super().finish()

    def _readable(self, arrivals) -> None:
        if self.meeting is not None:
            bucket, request = self.meeting
            what = f"the node's sums in place (every rank's parts of buckets up to {bucket.index})"
            self._wait(bucket, request, arrivals, what)
