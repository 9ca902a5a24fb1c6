"""The exchange of ranks on one node through shared memory (node_window.py) in place of MPI's
allreduce: each rank's plan writes its bucket into its buffer in the window (or it is packed
there), then every rank sums the whole bucket straight from every rank's buffer, with the
averaging (or nothing, when ranks scaled by their rows) folded in. An allreduce through MPI's
shared-memory cells copies each bucket in and out of them and adds on the way; here each
element is read once from each rank and written once.

It is the Exchange of exchange.py with another request behind each bucket: the waits, the
deadlines (deadline.py tests the request), the unpacking and the failure paths (failure.py
starts NaN buckets through the same _start) are Exchange's. Every rank sums in rank order, so
every rank gets the same bits, and on two ranks the bits of MPI's sum."""

from __future__ import annotations

import math
import os

import numpy as np

from backplan.ir.types import np_dtype

from .exchange import Exchange
from .half_wire import as_bits, summed_dtype
from .in_plan import bucket_slots
from .node_agreement import agreement_window
from .node_sum import sum_into, sum_widened_into
from .node_window import READY, CounterRequest, NodeWindow, resident_bytes, segment_bytes, share
from .rank_peak import counted
from .rows import scale_by_weight

REDUCTION_VARIABLE = "BACKPLAN_DP_REDUCTION"  # "shared" or "mpi"; unset: shared on one node
_nodes: dict = {}  # id(comm) -> (comm, whether its ranks map each other's shared memory)
HALVES = ("bf16", "f16")  # IR dtypes whose buckets the window holds as bit patterns
PROBE = b"backplan node probe"  # written in each rank's probe segment, compared by the others


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


def _buckets(layout, accumulated: bool = False) -> tuple[list[int], list[np.dtype]]:
    """Elements and window dtype of each bucket: a 16-bit bucket's bit patterns (uint16: the
    plan writes them there, the sum widens them, node_sum.sum_widened_into), or float32 where
    it holds accumulated float32 sums; other dtypes their own."""
    counts = [b.nbytes // np_dtype(b.dtype).itemsize for b in layout.buckets]
    dtypes = [_window_dtype(b.dtype, accumulated) for b in layout.buckets]
    return counts, dtypes


def _window_dtype(dtype: str, accumulated: bool) -> np.dtype:
    if dtype in HALVES and not accumulated:
        return np.dtype(np.uint16)
    return summed_dtype(np_dtype(dtype))


def window_bytes(layout) -> int:
    """The memory one rank's segment of the window the layout's buckets are summed in holds
    (whole pages: what its rank holds of the window; it maps the others' segments too)."""
    return resident_bytes(segment_bytes(*_buckets(layout)))


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
    sizes = _buckets(exchange.layout, exchange.accumulated)
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
    completes once every rank has written the bucket, summing every rank's buffer in rank
    order into out (the summing is this rank's work, done when it tests). Every rank sums the
    whole bucket itself, so a rank waits for the others' writes only, not for their sums too
    (one meeting per bucket: on a busy machine each meeting is a wait for a rank off its core);
    the same bits on every rank, and on two ranks MPI's (a + b)."""

    def __init__(self, window: NodeWindow, k: int, call: int, out: np.ndarray, average: bool):
        self.window, self.index, self.call, self.out, self.average = window, k, call, out, average
        self.half: str | None = None  # a 16-bit bucket's IR dtype: its buffers hold bit patterns
        self.weights: list[float] | None = None  # every rank's, applied as the sum widens
        self.parity = call % 2
        self.complete = False

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name, so deadline.py waits on either
        if not self.complete:
            if not self.window.all_at(READY, self.index, self.call):
                return False
            self._sum()
            self.complete = True
        return True

    def _sum(self) -> None:
        w, k = self.window, self.index
        buffers = [w.buffer(q, k, self.parity) for q in range(w.size)]
        if self.half is not None:  # bit patterns, widened as they are added
            sum_widened_into(buffers, self.out, self.half, self.average, self.weights)
        else:
            sum_into(buffers, self.out, self.average)


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
        self.started.append((bucket, out, request))

    def progress(self) -> None:
        for _, _, request in self.started:
            request.Test()
