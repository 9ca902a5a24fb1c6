"""The exchange of ranks on one node through shared memory (node_window.py) in place of MPI's
allreduce: each rank's plan writes its bucket into its buffer in the window (or it is packed
there), then the ranks sum it straight from every rank's buffer, with the averaging (or
nothing, when ranks scaled by their rows) folded in. An allreduce through MPI's shared-memory
cells copies each bucket in and out of them and adds on the way; here each element is read
once from each rank and written once.

On SPLIT_RANKS ranks or more a bucket of SPLIT_BYTES or more is summed in parts, as a
reduce-scatter then an all-gather: each rank sums its own part (NodeWindow.part) into its sums
and into a buffer of its own in the window, marks it, and copies the other ranks' summed parts
from theirs, reading 2 (N-1)/N of the bucket from the others instead of N-1 times it, for a
second meeting per bucket. On two ranks that moves about as many bytes through memory as the
whole sum (the copy that publishes a part, the other half read back) and measured slower (the
bench mlp: 5.62-5.68 ms CPU a step against 5.33-5.40), so two ranks, and smaller buckets, are
summed whole by every rank: one meeting.

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
from .half_wire import as_bits, summed_bytes, summed_dtype
from .in_plan import bucket_slots
from .node_agreement import agreement_window
from .node_sum import sum_into, sum_widened_into
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

REDUCTION_VARIABLE = "BACKPLAN_DP_REDUCTION"  # "shared" or "mpi"; unset: shared on one node
_nodes: dict = {}  # id(comm) -> (comm, whether its ranks map each other's shared memory)
HALVES = ("bf16", "f16")  # IR dtypes whose buckets the window holds as bit patterns
PROBE = b"backplan node probe"  # written in each rank's probe segment, compared by the others
SPLIT_BYTES = 1 << 18  # summed bytes from which a bucket is summed in parts (see the module)
SPLIT_RANKS = 3  # ranks from which buckets are summed in parts


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


def bytes_read(bucket, size: int) -> int:
    """What one rank reads of the other ranks' window buffers to sum `bucket` on `size` ranks:
    every other rank's whole bucket, or, summed in parts, its share of theirs and their
    summed parts (2 (N-1)/N of the bucket; in the dtype it is summed in, as explain says)."""
    dtype = np_dtype(bucket.dtype)
    whole = summed_bytes(bucket.nbytes, dtype)
    count = bucket.nbytes // dtype.itemsize
    if parts_of(count, _window_dtype(bucket.dtype, False), summed_dtype(dtype), size):
        return 2 * (size - 1) * whole // size
    return (size - 1) * whole


def _window_dtype(dtype: str, accumulated: bool) -> np.dtype:
    if dtype in HALVES and not accumulated:
        return np.dtype(np.uint16)
    return summed_dtype(np_dtype(dtype))


def window_bytes(layout, size: int) -> int:
    """The memory one rank's segment of the window the layout's buckets are summed in on
    `size` ranks holds (whole pages: what its rank holds of the window; it maps the others'
    segments too)."""
    return resident_bytes(segment_bytes(*_buckets(layout, size)))


def node_window(exchange, key: tuple, counts: list[int], dtypes: list[np.dtype]) -> NodeWindow:
    """The window of these buffers under key in exchange.windows (its step's: freed with the
    step), made on first use by every rank alike, with the exchange's deadline."""
    found = exchange.windows.get(key)
    if found is None:
        step = f"the allocation of the node window of {exchange.step_name}"
        window = NodeWindow(exchange.world.comm, counts, dtypes, exchange.timeout, step)
        found = exchange.windows[key] = window
    return found


def _window(exchange) -> NodeWindow:
    found = exchange.windows.get((exchange.layout.fingerprint,))  # no sizes to work out
    if found is not None:
        return found
    sizes = _buckets(exchange.layout, exchange.world.size, exchange.accumulated)
    return node_window(exchange, (exchange.layout.fingerprint,), *sizes)


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
        parities = tuple((window.written[b.index] + 1) % 2 for b in self.buckets)  # next call's
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
        self.parity = call % 2
        self.parts_index: int | None = None  # set for a bucket summed in parts
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
        """Copy every other rank's summed part into out."""
        w = self.window
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
        window = _window(self)
        k = bucket.index
        window.written[k] += 1
        call = window.written[k]
        mine = window.buffer(window.rank, k, call % 2)
        bits = mine.dtype == np.uint16  # a 16-bit bucket's bit patterns (_window_dtype)
        if k not in self.in_window:  # the plan wrote it there (WindowOutputs): nothing to pack
            _pack(bucket, array_of, mine, bits)
        if self.weight is not None and not bits:  # (16-bit: every rank's, in the sum)
            scale_by_weight(mine, self.weight)
        window.mark(READY, k, call)
        out = counted(np.empty(mine.size, np.float32 if bits else mine.dtype), f"bucket {k}")
        average = self.average and self.weight is None
        if average:
            self.averaged.add(k)  # folded into the sum
        request = SharedRequest(window, k, call, out, average)
        if bits:
            request.half, request.weights = bucket.dtype, self.weights
        if window.counts[len(self.layout.buckets) + k]:  # summed in parts (parts_of)
            request.parts_index = len(self.layout.buckets) + k
        self.started.append((bucket, out, request))

    def progress(self) -> None:
        for _, _, request in self.started:
            request.Test()
