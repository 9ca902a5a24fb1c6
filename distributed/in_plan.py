"""The default data-parallel step on the compiled backend: the joint plan's driver starts each
bucket's allreduce itself, right after the statement that finishes the bucket, and tests the
started ones between the later kernels (driver_hooks.py, driver_mpi.py). The backward kernels
write the gradients straight into the bucket buffers (the driver's output arrays are views of
them: no pack copy), and the step waits for each bucket after the call.

A bucket starts inside the driver when each of its leaves is an output buffer of its own, of a
float dtype MPI sums; the others (a gradient that is an input or a constant, half floats) are
packed and started after the call as before. Ranks holding different numbers of rows scale
their gradients before the sum: those steps start every bucket after the call."""

from __future__ import annotations

import hashlib
import math
import sys
import threading

import numpy as np

from backplan.codegen.build import cache
from backplan.ir.types import np_dtype

from .buckets import Bucket
from .driver_hooks import HookedDriver, hook_driver
from .driver_mpi import BUCKET_SLOTS, ERROR, HEADER, TableMaker, dp_test, dp_wait
from .errors import DistributedError

FLOATS = ("f32", "f64")  # IR dtypes MPI sums as FLOAT, DOUBLE


class TableRequest:
    """One in-driver allreduce, waited for like an mpi4py request (Test, Wait)."""

    def __init__(self, table: np.ndarray, k: int, bucket: Bucket):
        self.table, self.k, self.bucket = table, k, bucket

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name, so deadline.py waits on either
        done = dp_test(self.table, self.k)
        if done:
            self._check()
        return done

    def Wait(self) -> None:  # noqa: N802
        dp_wait(self.table, self.k)
        self._check()

    def _check(self) -> None:
        error = int(self.table[HEADER + self.k * BUCKET_SLOTS + ERROR])
        if error:
            raise DistributedError(
                f"MPI error {error} in the allreduce of bucket {self.bucket.index} (started "
                "inside the compiled step)"
            )


class InPlanExchange:
    """Per signature: which buckets start inside the driver, and the driver that starts them."""

    def __init__(self, compiled, layout, comm):
        self.compiled = compiled
        per_output, self.buffers = compiled.output_slots()
        self.buckets, self.slots = [], []  # the buckets started inside, their buffers' indices
        used: set[int] = set()
        for bucket in layout.buckets:
            slots = self._slots(bucket, per_output, layout.output_positions, used)
            if slots is not None:
                used.update(slots)
                self.buckets.append(bucket)
                self.slots.append(slots)
        names = [[self.buffers[j][2] for j in slots] for slots in self.slots]
        self.hooked: HookedDriver | None = (
            hook_driver(compiled.source, names) if self.buckets else None
        )
        self._maker: TableMaker | None = None  # None: explain's preview, which runs nothing
        if comm is not None and self.hooked is not None:
            try:
                self._maker = TableMaker(comm)
            except OSError:  # no libmpi to call into (not Linux, another MPI): after the call
                self.hooked = None
        self._run = None
        self._previous: list | None = None  # the last call's bucket buffers
        self._taking = threading.Lock()

    def _slots(self, bucket: Bucket, per_output, positions, used) -> list[int] | None:
        if bucket.dtype not in FLOATS:
            return None
        slots = []
        for leaf in bucket.leaves:
            j = per_output[positions[leaf.index]]
            if j is None or j in used or j in slots:
                return None
            shape, dtype, _ = self.buffers[j]
            if dtype != np_dtype(bucket.dtype) or math.prod(shape) != math.prod(leaf.shape):
                return None
            slots.append(j)
        return slots

    @property
    def active(self) -> bool:
        return self.hooked is not None

    def driver(self):
        """The hooked driver (compiled in its first call, then cached on disk like any)."""
        if self._run is None:
            parts = dict(self.compiled.key_parts)
            parts["ir"] = hashlib.sha256(self.hooked.source.encode()).hexdigest()[:24]
            self._run = cache.load_module(self.hooked.source, parts)[0].run
        return self._run

    def run(self, exchange, arrays: list) -> list:
        """Run the joint plan with the exchange inside it; adds the started buckets to
        `exchange` and returns the plan's outputs (the gradients are views of the buckets)."""
        flats, into = self._bucket_buffers(), {}
        for flat, slots in zip(flats, self.slots, strict=True):
            offset = 0
            for j in slots:
                shape = self.buffers[j][0]
                n = math.prod(shape)
                into[j] = flat[offset : offset + n].reshape(shape)
                offset += n
        table = self._maker.table(flats)
        outputs = self.compiled.call_into(arrays, into, self.driver(), (table,))
        for k, (bucket, flat) in enumerate(zip(self.buckets, flats, strict=True)):
            exchange.started.append((bucket, flat, TableRequest(table, k, bucket)))
        self._previous = flats  # taken again by the next call if nothing holds them then
        return outputs

    def _bucket_buffers(self) -> list[np.ndarray]:
        """The previous call's bucket buffers when no gradient it returned is held any more
        (then nobody can see them change), else new ones. The previous call's list is taken
        under a lock, so a call from another thread finds none and makes its own."""
        with self._taking:
            previous, self._previous = self._previous, None
        # 3 references: the list's, the loop variable's and getrefcount's argument
        if previous is not None and all(sys.getrefcount(f) == 3 for f in previous):
            for flat in previous:
                flat.flags.writeable = True
            return previous
        return [
            np.empty(b.nbytes // np_dtype(b.dtype).itemsize, np_dtype(b.dtype))
            for b in self.buckets
        ]

    def start_of(self, plan, bucket_index: int) -> tuple[int, int] | None:
        """(the plan step after which the bucket's allreduce starts, driver calls that run
        while it is in flight), or None when it starts after the call."""
        for k, bucket in enumerate(self.buckets):
            if bucket.index == bucket_index and self.hooked is not None:
                steps = _steps_of(plan, self.hooked.ir_names[k])
                return (max(steps) if steps else -1), self.hooked.calls_after[k]
        return None


def _steps_of(plan, ir_numbers) -> list[int]:
    """Plan steps of the IR values %N the driver statement computes."""
    from backplan.ir.text import value_names

    wanted = {f"%{n}" for n in ir_numbers}
    return [
        plan.first_write[v]
        for v, name in value_names(plan.graph).items()
        if name in wanted and v in plan.first_write
    ]
