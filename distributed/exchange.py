"""The exchange of one step: each bucket packed and summed over all ranks by one non-blocking
allreduce, started as soon as its last leaf exists, waited on in bucket order at the end."""

from __future__ import annotations

import numpy as np

from backplan.ir.types import np_dtype
from backplan.tracer.tensor import Tensor

from .deadline import Arrivals, wait_or_raise
from .failure import check_ranks
from .half_sum import half_op, sent_in_16_bits
from .half_wire import summed_dtype
from .layout import Layout
from .rank_peak import counted
from .rows import average_in_place, scale_by_weight
from .world import World, mpi_module


class Exchange:
    """start_ready(step, array_of) starts every bucket whose leaves are all written by `step`;
    progress() lets MPI move started buckets along; finish() waits and unpacks."""

    def __init__(self, world: World, layout: Layout, average: bool, timeout=None):
        self.world = world
        self.layout = layout
        self.average = average
        self.started: list = []  # (bucket, buffer, request), in bucket order
        self.weight: float | None = None  # this rank's share of the rows, when ranks differ
        self.weights: list[float] | None = None  # every rank's (the node's 16-bit sums)
        self.timeout = timeout  # seconds each wait may take (data_parallel(timeout=...))
        # every rank posts Arrivals in finish() when the step has a timeout (decided here:
        # a failed rank's settle gives itself one, the others' steps may have none)
        self.arrivals = timeout is not None
        self.failure: str | None = None  # this rank's call raised: failure.settle
        self.windows: dict = {}  # the step's node windows (shared_exchange.node_window)
        self.step_name = "data_parallel()"  # what a deadline's error names (set by the step)
        self.accumulated = False  # set by data_parallel(accumulate=k): float32 sums travel
        self.averaged: set = set()  # buckets averaged by their MPI operation (half_sum.py)

    @property
    def mpi(self):
        """The mpi4py MPI module (looked up when MPI is called, not per step)."""
        return mpi_module()

    def start(self, array_of) -> None:
        """Start every bucket; array_of(leaf index) is this rank's array of that leaf."""
        for bucket in self.layout.buckets[len(self.started) :]:
            self._start(bucket, lambda leaf: array_of(leaf.index))

    def start_ready(self, step: float, array_of) -> None:
        for bucket in self.layout.buckets[len(self.started) :]:
            if bucket.ready_step > step:
                return
            self._start(bucket, array_of)

    def start_rest(self, array_of) -> None:
        """Start every bucket the compiled step did not start itself (in_plan.py);
        array_of(leaf index) is this rank's array of that leaf."""
        done = {bucket.index for bucket, _, _ in self.started}
        for bucket in self.layout.buckets:
            if bucket.index not in done:
                self._start(bucket, lambda leaf: array_of(leaf.index))

    def start_bucket(self, bucket, array_of) -> None:
        """Start one bucket; array_of(leaf index) is this rank's array of that leaf."""
        self._start(bucket, lambda leaf: array_of(leaf.index))

    def _start(self, bucket, array_of) -> None:
        buffer = np.concatenate([np.asarray(array_of(leaf)).ravel() for leaf in bucket.leaves])
        scaled = self.weight is not None
        if sent_in_16_bits(bucket.dtype, self.world.size, scaled, self.accumulated):
            buffer = buffer.astype(np_dtype(bucket.dtype), copy=False)
            counted(buffer, f"bucket {bucket.index}")
            op = half_op(bucket.dtype, self.average)
            if self.average:
                self.averaged.add(bucket.index)
            wire = [buffer.view(np.uint16), self.mpi.UINT16_T]
            request = self.world.comm.Iallreduce(self.mpi.IN_PLACE, wire, op=op)
            self.started.append((bucket, buffer, request))
            return
        buffer = buffer.astype(summed_dtype(buffer.dtype), copy=False)  # 16-bit: summed in f32
        counted(buffer, f"bucket {bucket.index}")
        if scaled:
            scale_by_weight(buffer, self.weight)
        request = self.world.comm.Iallreduce(self.mpi.IN_PLACE, buffer, op=self.mpi.SUM)
        self.started.append((bucket, buffer, request))

    def progress(self) -> None:
        """MPI moves non-blocking collectives along only inside MPI calls (without an
        asynchronous progress thread); a test between segments is such a call."""
        if self.started:
            self.mpi.Request.Testall([request for _, _, request in self.started])

    def _wait(self, bucket, request, arrivals, what: str | None = None) -> None:
        """Wait for request (bucket's), within the step's timeout; what: the deadline's name
        for it (the allreduce of the bucket by default)."""
        if self.timeout is None:
            request.Wait()
        else:
            what = what or f"the allreduce of bucket {bucket.index}"
            wait_or_raise(request, self.timeout, what, arrivals)

    def _readable(self, arrivals) -> None:
        """Wait for what must happen before the sums are read (nothing: a completed request's
        bucket is summed)."""

    def finish(self) -> list[Tensor]:
        """Wait for each bucket in order and unpack it; unpacking bucket k overlaps the transfer
        of the buckets after it. Returns the loss and gradients in leaf order."""
        results: list = [None] * self.layout.n_leaves
        arrivals = Arrivals(self.world.comm) if self.arrivals else None
        loss = None  # the loss's place, copied once every bucket can be read (_readable)
        for bucket, buffer, request in self.started:
            self._wait(bucket, request, arrivals)
            if self.average and self.weight is None and bucket.index not in self.averaged:
                average_in_place(buffer, self.world.size)
            buffer.flags.writeable = False
            dtype = np_dtype(bucket.dtype)  # every leaf's
            for index, start, stop, shape in bucket.unpacking:
                part = buffer[start:stop].reshape(shape)
                if part.dtype != dtype:  # a 16-bit bucket, rounded once
                    part = counted(part.astype(dtype), f"bucket {bucket.index}")
                    part.flags.writeable = False
                elif index == 0:
                    loss = part
                    continue
                results[index] = Tensor._from_array(part)
        self._readable(arrivals)
        if loss is not None:  # its own array, so that a loop keeping it does not keep the bucket
            loss = counted(loss.copy(), "loss")
            loss.flags.writeable = False
            results[0] = Tensor._from_array(loss)
        if arrivals is not None:
            arrivals.settle(self.timeout)
        check_ranks(self.world, results[0]._data, self.failure, self.layout.name)
        return results
