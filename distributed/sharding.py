"""ZeRO-1 over flat ranges: the parameters of one dtype, flattened and laid end to end in the
tree's order, are one flat vector of `total` elements; rank r owns its contiguous range
[r * block, min((r + 1) * block, total)), block = ceil(total / N) (the last ranks may own fewer
elements, or none), keeps the optimizer state of those elements only and updates those only.

Per dtype, a reduce-scatter gives each rank the sum of its range of the gradients: the send
buffer is the gradients end to end, in `block`-element slots (a slot of block + 1 when the loss
rides along: it is the last element of every rank's slot, so every rank receives its sum). The
optimizer updates the range, and an all-gather of the ranges gives every rank the flat vector of
updated parameters, parameter after parameter: the returned parameters are views of that one
buffer (no unpacking copy), and on the next call this rank's range of them is a view too. The
same bytes on the wire as one allreduce.

The ranges depend on the parameters alone (their shapes and dtypes, in flatten order), not on
the buckets, so step.init(params) needs no batch; the state is the optimizer's state of a tuple
with one 1-D share per dtype (in the order the dtypes first appear among the parameters)."""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from backplan.ir.types import np_dtype
from backplan.tracer.pytree import flatten
from backplan.tracer.tensor import Tensor

from .agreement import leaf_array
from .deadline import Arrivals, wait_or_raise
from .errors import DistributedError
from .failure import IN_UPDATE, check_ranks, raise_for_others, settle_seconds
from .half_wire import as_bits, summed_dtype
from .layout import Layout
from .rank_peak import counted
from .rows import average_in_place, scale_by_weight
from .shared_sharding import ShardedWindow
from .world import World, mpi_module

KEPT_GATHERED = 3  # all-gather buffers kept per dtype: the parameters passed in hold one


@dataclass(frozen=True)
class FlatGroup:
    """The parameters of one dtype as one flat vector, and each rank's range of it."""

    dtype: np.dtype
    params: tuple[int, ...]  # positions among the parameters (flatten order)
    offsets: tuple[int, ...]  # where each starts in the flat vector
    shapes: tuple[tuple[int, ...], ...]
    total: int
    block: int  # elements each rank owns, the last ranks fewer
    size: int

    def owned(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the flat vector that rank owns."""
        lo = min(rank * self.block, self.total)
        return lo, min(lo + self.block, self.total)

    def parts(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """(k, start, stop, at): parameter k's flat elements [start, stop) lie at [lo, hi)'s
        offset `at`, for each parameter overlapping [lo, hi)."""
        found = []
        for k, offset in enumerate(self.offsets):
            n = _count(self.shapes[k])
            start, stop = max(lo, offset), min(hi, offset + n)
            if start < stop:
                found.append((k, start - offset, stop - offset, start - lo))
        return found


@lru_cache(maxsize=256)
def slots(group: FlatGroup, stride: int) -> tuple[tuple, tuple]:
    """The reduce-scatter's send buffer of `stride`-element slots (block, or block + 1 with the
    loss last): ((k, start, stop, at) copies, (lo, hi) ranges to zero). Worked out once."""
    copies, zeros = [], []
    for rank in range(group.size):
        lo, hi = group.owned(rank)
        base = rank * stride
        copies += [(k, a, b, base + at) for k, a, b, at in group.parts(lo, hi)]
        if hi - lo < group.block:
            zeros.append((base + hi - lo, base + group.block))
    return tuple(copies), tuple(zeros)


def _count(shape) -> int:
    return math.prod(shape)  # a Python int (np.prod: 5 us a call under load, 6 a step)


@lru_cache(maxsize=256)
def flat_groups(signature: tuple, size: int) -> tuple[FlatGroup, ...]:
    """signature: (shape, dtype) per parameter, flatten order. One group per dtype, in the
    order the dtypes first appear."""
    by_dtype: dict = {}
    for position, (shape, dtype) in enumerate(signature):
        by_dtype.setdefault(np.dtype(dtype), []).append((position, tuple(shape)))
    groups = []
    for dtype, members in by_dtype.items():
        offsets, at = [], 0
        for _, shape in members:
            offsets.append(at)
            at += _count(shape)
        groups.append(
            FlatGroup(
                dtype,
                tuple(p for p, _ in members),
                tuple(offsets),
                tuple(s for _, s in members),
                at,
                max(1, -(-at // size)),
                size,
            )
        )
    return tuple(groups)


def param_signature(arrays) -> tuple:
    return tuple((a.shape, a.dtype) for a in arrays)  # not dtype.str: bfloat16's is '<V2'


def groups_of(params, size: int) -> tuple[tuple[FlatGroup, ...], list[np.ndarray]]:
    """(the flat groups of params over size ranks, params' arrays in flatten order)."""
    arrays = [leaf_array(leaf) for leaf in flatten(params)[0]]
    return flat_groups(param_signature(arrays), size), arrays


def range_of(group: FlatGroup, arrays: list, rank: int) -> np.ndarray:
    """This rank's range of the group's parameters (arrays: all parameters, flatten order): a
    view where they are the views of one buffer a sharded step returned, else a copy."""
    lo, hi = group.owned(rank)
    members = [arrays[p] for p in group.params]
    base = _common_base(group, members)
    if base is not None:
        return base[lo:hi]
    parts = group.parts(lo, hi)
    if not parts:
        return np.empty(0, group.dtype)
    return np.concatenate([members[k].reshape(-1)[a:b] for k, a, b, _ in parts])


def _common_base(group: FlatGroup, members: list) -> np.ndarray | None:
    """The buffer holding the group's parameters end to end, in order, when they are views
    of one (what gather returned), else None."""
    base = members[0].base
    if not isinstance(base, np.ndarray) or base.ndim != 1 or base.dtype != group.dtype:
        return None
    if not base.flags.c_contiguous or base.size < group.total:
        return None
    start, item = base.__array_interface__["data"][0], base.itemsize
    for member, offset in zip(members, group.offsets, strict=True):
        if member.base is not base or not member.flags.c_contiguous:
            return None
        if member.__array_interface__["data"][0] != start + offset * item:
            return None
    return base


def flat_shares(params, rank: int, size: int) -> tuple[Tensor, ...]:
    """This rank's range of each dtype's parameters: the tree the sharded state is made for."""
    groups, arrays = groups_of(params, size)
    return tuple(Tensor._fresh(range_of(g, arrays, rank)) for g in groups)


def _unused(kept: list):
    """The buffers of `kept` nothing outside it holds (by reference count: a returned
    parameter is a view, which holds its buffer)."""
    for buffer in kept:
        if sys.getrefcount(buffer) <= _FREE:
            yield buffer


def _free_count() -> int:
    for buffer in [np.empty(1)]:
        return sys.getrefcount(buffer)  # the same frame shape as _unused's check
    raise AssertionError


_FREE = _free_count()


class ShardedExchange:
    """One step's exchange for ZeRO-1: start(array_of) starts each dtype's reduce-scatter (and
    the loss's allreduce when it travels alone); finish() waits and returns the loss and this
    rank's summed (averaged) range of every dtype's gradients; gather(ranges) all-gathers the
    updated parameters."""

    def __init__(self, world: World, layout: Layout, average: bool, timeout=None, pool=None):
        self.world = world
        # receive buffers kept between calls (by the training step): MPICH's reduce-scatter
        # into fresh buffers made the bench mlp's ZeRO-1 step 74-82 ms against 60-64 ms
        # reusing them (interleaved pairs, 2 ranks); the all-gather's, which the returned
        # parameters are views of, are reused once nothing holds them (_unused)
        self.pool = pool if pool is not None else {}
        self.layout = layout
        self.average = average
        self.timeout = timeout
        self.weight: float | None = None
        self.weights: list[float] | None = None
        self.mpi = mpi_module()
        key = ("groups", layout.fingerprint, world.size)
        if key not in self.pool:  # the same for every call of the signature
            self.pool[key] = flat_groups(_layout_signature(layout), world.size)
        self.groups: tuple[FlatGroup, ...] = self.pool[key]
        self._loss = None
        self._loss_dtype = None  # the loss's own dtype (a 16-bit loss is summed in float32)
        self._loss_in_bucket = False
        self._started: list = []
        self._arrivals = None  # deadline.Arrivals of the waits in progress (with a timeout)
        self.arrivals = timeout is not None  # as Exchange.arrivals
        self.failure: str | None = None  # this rank's call raised: failure.settle
        self.node = False  # set by the step: reduce-scatter and all-gather in the node window
        self._window = None  # shared_sharding.ShardedWindow, when node
        self.windows: dict = {}  # the step's node windows (shared_exchange.node_window)
        # parameter positions whose gradients the plan wrote into this call's send buffers
        # (sharded_outputs.ShardedWindowOutputs, set by the step): nothing to pack
        self.in_window: frozenset = frozenset()
        self.step_name = "data_parallel()"  # what a deadline's error names (set by the step)

    def start_rest(self, array_of) -> None:
        """Start the exchange unless part of it started (failure.settle): a reduce-scatter
        packs every gradient of its dtype, so a partly started one cannot be completed."""
        if self._started or self._loss is not None:
            raise DistributedError("the ZeRO-1 exchange had partly started")
        self.start(array_of)

    def start(self, array_of) -> None:
        """array_of(leaf index) -> this rank's array of the loss (0) or a gradient (parameter
        position + 1). The loss rides in the first dtype's reduce-scatter when it has that
        dtype: one more element at the end of every rank's slot, so every rank receives the
        sum (one collective less per step: each is a point where both ranks must be running)."""
        comm, size = self.world.comm, self.world.size
        loss = counted(np.array(array_of(0), copy=True).reshape(1), "loss sent")
        # the layout's dtype, not the array's: accumulated 16-bit sums arrive as float32
        self._loss_dtype = np_dtype(self.layout.loss_dtype)
        loss = loss.astype(summed_dtype(loss.dtype), copy=False)  # 16-bit: summed in float32
        self._loss_in_bucket = bool(self.groups) and self.groups[0].dtype == self._loss_dtype
        if not self._loss_in_bucket:
            if self.weight is not None:
                scale_by_weight(loss, self.weight)
            self._loss = (loss, comm.Iallreduce(self.mpi.IN_PLACE, loss, op=self.mpi.SUM))
        if self.node:
            self._window = self._sharded_window()
        for k, group in enumerate(self.groups):
            with_loss = k == 0 and self._loss_in_bucket
            stride = group.block + with_loss
            flats = [np.asarray(array_of(p + 1)).reshape(-1) for p in group.params]
            if self._window is not None:
                send, call = self._window.send_buffer(k)
                _pack_flat(send, group, flats, loss if with_loss else None, self.in_window)
            else:
                send = self._buffer("send", k, stride * size, summed_dtype(group.dtype))
                copies, zeros = slots(group, stride)
                for j, a, b, at in copies:
                    send[at : at + b - a] = flats[j][a:b]
                for lo, hi in zeros:
                    send[lo:hi] = 0
                if with_loss:
                    send[group.block :: stride] = loss[0]
            if self.weight is not None:
                scale_by_weight(send, self.weight)
            mine = self._buffer("share", k, stride, summed_dtype(group.dtype))
            averaged = False  # by the sum itself (the window's)
            if self._window is not None:
                averaged = self.average and self.weight is None
                request = self._window.scatter(k, call, mine, averaged)
            else:
                request = comm.Ireduce_scatter_block(send, mine, op=self.mpi.SUM)
            self._started.append((mine, request, averaged))

    def _sharded_window(self) -> ShardedWindow:
        """The layout's ShardedWindow, made once and kept while its node window is the
        step's (a lookup instead of working out the buffers' sizes on every call)."""
        key = ("window", self.layout.fingerprint, self._loss_in_bucket)
        found = self.pool.get(key)
        if found is None or self.windows.get(found.key) is not found.window:
            found = ShardedWindow(self, (self.layout.fingerprint,), self.groups, key[2])
            self.pool[key] = found
        return found

    def owned_range(self, k: int, arrays: list) -> np.ndarray:
        """This rank's range of group k's parameters (arrays: all parameters, flatten order):
        a view of the buffer the last call's gather returned when arrays hold its very views
        (the loop `params, state, loss = step(params, state, *batch)`: checked by identity,
        and those arrays are read-only), else range_of's."""
        group = self.groups[k]
        last = self.pool.get(("returned", self.layout.fingerprint, k))
        if last is not None:
            full = last[0]()
            if full is not None and all(
                ref() is arrays[p] for ref, p in zip(last[1], group.params, strict=True)
            ):
                lo, hi = group.owned(self.world.rank)
                return full[lo:hi]
        return range_of(group, arrays, self.world.rank)

    def same_groups(self, arrays: list) -> bool:
        """Whether the parameters (arrays, flatten order) have their gradients' shapes and
        dtypes: then their flat groups are this exchange's (compared member by member, not
        by making and hashing their signature on every call)."""
        if len(arrays) != sum(len(g.params) for g in self.groups):
            return False
        for group in self.groups:
            for p, shape in zip(group.params, group.shapes, strict=True):
                if arrays[p].dtype != group.dtype or arrays[p].shape != shape:
                    return False
        return True

    def finish(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """(the summed loss, 0-d; this rank's summed range of each dtype's gradients, 1-D, in
        group order), averaged over the ranks unless average=False (weighted by rows when
        ranks hold different numbers)."""
        loss = None
        self._arrivals = Arrivals(self.world.comm) if self.arrivals else None
        if not self._loss_in_bucket:
            loss, request = self._loss
            self._wait(request, "the allreduce of the loss")
        ranges = []
        for group, (mine, request, averaged) in zip(self.groups, self._started, strict=True):
            self._wait(request, f"the reduce-scatter of the {group.dtype} gradients")
            mine = mine if averaged else self._averaged(mine)
            if loss is None:
                loss = counted(mine[group.block : group.block + 1].copy(), "loss")
            lo, hi = group.owned(self.world.rank)
            ranges.append(mine[: hi - lo].astype(group.dtype, copy=False))  # 16-bit: rounded
        if not self._loss_in_bucket:
            loss = self._averaged(loss)
        loss = loss.astype(self._loss_dtype, copy=False)
        self._settle_arrivals()
        check_ranks(self.world, loss, self.failure, self.layout.name)
        return loss.reshape(()), ranges

    def _buffer(self, kind: str, k: int, n: int, dtype) -> np.ndarray:
        key = (kind, self.layout.fingerprint, k)
        found = self.pool.get(key)
        if found is None or found.size != n or found.dtype != dtype:
            found = self.pool[key] = np.empty(n, dtype)
        return counted(found, f"ZeRO-1 {kind} {k}")

    def _averaged(self, buffer: np.ndarray) -> np.ndarray:
        if self.average and self.weight is None:
            average_in_place(buffer, self.world.size)
        return buffer

    def _wait(self, request, what: str) -> None:
        if self.timeout is None:
            request.Wait()
        else:
            wait_or_raise(request, self.timeout, what, self._arrivals)

    def _settle_arrivals(self) -> None:
        if self._arrivals is not None:
            self._arrivals.settle(self.timeout)
            self._arrivals = None

    def gather(self, ranges: list[np.ndarray], failure: str | None = None) -> list[np.ndarray]:
        """Every parameter whole again from every rank's updated range (ranges: this rank's,
        group order); returns the parameters' arrays by position: views of one buffer per
        dtype, which nothing else writes while they are held. failure: this rank's update
        raised (ranges are then ignored): it sends NaN in place of its ranges, every rank
        finds a NaN at the start of that rank's block (a check of one element per rank, no
        collective more), and the ranks then gather what failed where (failure.py): the
        others raise RankFailedError. A real NaN there costs that one gather, nothing else."""
        if failure is not None:
            self.timeout = settle_seconds(self.timeout)
            ranges = [np.full(g.block, np.nan, g.dtype) for g in self.groups]
        started = []
        self._arrivals = Arrivals(self.world.comm) if self.arrivals else None
        for k, (group, mine) in enumerate(zip(self.groups, ranges, strict=True)):
            mine = np.asarray(mine).reshape(-1)
            if self._window is not None:  # written into the window, padded with zeros
                sent, call = self._window.range_buffer(k)
                sent[: mine.size] = mine
                sent[mine.size :] = 0
                full = self._gathered(k, group)
                started.append((group, full, self._window.gather(k, call, full, group.block)))
                continue
            if mine.size != group.block or mine.dtype != group.dtype:
                padded = self._buffer("range sent", k, group.block, group.dtype)
                padded[: mine.size] = mine
                padded[mine.size :] = 0
                mine = padded
            full = self._gathered(k, group)
            request = self.world.comm.Iallgather(as_bits(mine), as_bits(full))
            started.append((group, full, request))
        arrays: list = [None] * sum(len(g.params) for g in self.groups)
        said_nan = failure is not None
        for group, full, request in started:
            self._wait(request, f"the all-gather of the {group.dtype} parameters")
            starts = full[:: group.block]  # each rank's first element: NaN from a failed rank
            said_nan = said_nan or bool((starts != starts).any())
        self._settle_arrivals()
        if said_nan:
            raise_for_others(self.world, failure, self.layout.name, IN_UPDATE)
        for k, (group, full, _) in enumerate(started):
            for p, offset, shape in zip(group.params, group.offsets, group.shapes, strict=True):
                arrays[p] = full[offset : offset + _count(shape)].reshape(shape)
            views = tuple(weakref.ref(arrays[p]) for p in group.params)
            self.pool[("returned", self.layout.fingerprint, k)] = (weakref.ref(full), views)
        return arrays

    def _gathered(self, k: int, group: FlatGroup) -> np.ndarray:
        """A buffer for the all-gather: one kept that no returned parameter still holds, else
        a new one (kept while fewer than KEPT_GATHERED are)."""
        kept = self.pool.setdefault(("gathered", self.layout.fingerprint, k), [])
        n = group.block * self.world.size
        for buffer in _unused(kept):
            if buffer.size == n and buffer.dtype == group.dtype:
                return counted(buffer, f"ZeRO-1 gathered {k}")
        buffer = np.empty(n, group.dtype)
        if len(kept) < KEPT_GATHERED:
            kept.append(buffer)
        return counted(buffer, f"ZeRO-1 gathered {k}")


def _pack_flat(send: np.ndarray, group: FlatGroup, flats: list, loss, written=frozenset()) -> None:
    """The node window's send buffer of a group (shared_sharding.py): each gradient at its
    flat offset (left where the plan wrote it there: sharded_outputs.py, `written` the
    positions of those parameters), zeros to N blocks, then the loss when it rides along."""
    for p, flat, offset in zip(group.params, flats, group.offsets, strict=True):
        if p in written:
            continue
        place = send[offset : offset + flat.size]
        if flat.ctypes.data != place.ctypes.data:  # not written there by the plan
            place[...] = flat  # 16-bit values widen to float32 here
    end = group.block * group.size
    send[group.total : end] = 0
    if loss is not None:
        send[end] = loss[0]


def bytes_sent(groups: tuple[FlatGroup, ...], size: int, loss_dtype) -> int:
    """Bytes one rank sends in a ZeRO-1 step as ShardedExchange posts it, counted as ring
    algorithms send them: of each dtype's reduce-scatter and all-gather, N - 1 of the N slots;
    the loss's allreduce when it travels alone, 2 (N - 1) / N of its bytes."""
    if size <= 1:
        return 0
    loss = np.dtype(loss_dtype)
    sent = 0
    for k, group in enumerate(groups):  # a 16-bit reduce-scatter is summed in float32
        stride = group.block + (k == 0 and group.dtype == loss)
        sent += (size - 1) * stride * summed_dtype(group.dtype).itemsize
        sent += (size - 1) * group.block * group.dtype.itemsize
    if not groups or groups[0].dtype != loss:
        sent += 2 * (size - 1) * summed_dtype(loss).itemsize // size
    return sent


def _layout_signature(layout: Layout) -> tuple:
    """(shape, dtype) of each gradient, by parameter position: the parameters' own, as
    gradients have their parameter's shape and dtype."""
    leaves = sorted(
        (leaf for bucket in layout.buckets for leaf in bucket.leaves if leaf.index != 0),
        key=lambda leaf: leaf.index,
    )
    return tuple((tuple(leaf.shape), np_dtype(leaf.dtype)) for leaf in leaves)
