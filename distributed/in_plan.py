"""The default data-parallel step on the compiled backend: the joint plan's driver starts each
bucket's allreduce itself, right after the statement that finishes the bucket, and tests the
started ones between the later kernels (driver_hooks.py, driver_mpi.py). The backward kernels
write the gradients straight into the bucket buffers (the driver's output arrays are views of
them: no pack copy), and the step waits for each bucket after the call.

A bucket starts inside the driver when each of its leaves is an output buffer of its own, of a
float dtype MPI sums (or bfloat16 and float16 on two ranks, summed by half_sum.py's operations);
the others (a gradient that is an input or a constant, 16-bit floats on more ranks) are packed
and started after the call as before. Ranks holding different numbers of rows scale
their gradients before the sum: those steps start every bucket after the call."""

from __future__ import annotations

import hashlib
import math
import sys
import threading
import warnings

import numpy as np

from backplan.codegen.build import cache, driver_builder, driver_tier
from backplan.codegen.jit import load_cached
from backplan.codegen.run.compiled import storage_dtype
from backplan.ir.types import np_dtype

from .buckets import Bucket
from .driver_hooks import HookedDriver, hook_driver
from .driver_mpi import BUCKET_SLOTS, ERROR, HEADER, IDLE, STATE, TableMaker, dp_test, dp_wait
from .errors import DistributedError
from .half_sum import half_op, sent_in_16_bits
from .half_wire import as_bits

FLOATS = ("f32", "f64")  # IR dtypes MPI sums as FLOAT, DOUBLE


def bucket_slots(compiled, layout, eligible) -> tuple[list, list, list]:
    """(the buckets of an eligible(IR dtype) dtype whose every leaf is an output buffer of its
    own of the compiled plan, each bucket's buffer indices in leaf order, every output
    buffer's (shape, dtype, parameter name)): the buckets a call can have the plan write
    straight into bucket buffers (call_into)."""
    per_output, buffers = compiled.output_slots()
    positions, used = layout.output_positions, set()
    buckets, slots = [], []
    for bucket in layout.buckets:
        if not eligible(bucket.dtype):
            continue
        mine = []
        for leaf in bucket.leaves:
            j = per_output[positions[leaf.index]]
            if j is None or j in used or j in mine:
                break
            shape, dtype, _ = buffers[j]
            # a 16-bit buffer is its bit patterns (uint16) to the driver: storage_dtype
            if dtype != storage_dtype(bucket.dtype) or math.prod(shape) != math.prod(leaf.shape):
                break
            mine.append(j)
        else:
            used.update(mine)
            buckets.append(bucket)
            slots.append(mine)
    return buckets, slots, buffers


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

    def __init__(self, compiled, layout, comm, size: int | None = None):
        self.compiled = compiled
        self.size = comm.Get_size() if comm is not None else size  # ranks (size: a preview)
        # the buckets started inside, their buffers' indices
        self.buckets, self.slots, self.buffers = bucket_slots(
            compiled, layout, lambda dtype: dtype in FLOATS or sent_in_16_bits(dtype, self.size)
        )
        names = [[self.buffers[j][2] for j in slots] for slots in self.slots]
        self._maker: TableMaker | None = None  # None: explain's preview, which runs nothing
        if comm is not None and self.buckets:
            try:
                self._maker = TableMaker(comm)
            except OSError:  # no libmpi to call into (not Linux, another MPI): after the call
                self.buckets, self.slots = [], []
        start = self._maker.start if self._maker is not None else "dp_start"
        self.hooked: HookedDriver | None = (
            hook_driver(compiled.source, names, start) if self.buckets else None
        )
        self._run = None  # the hooked driver, once compiled or loaded
        self._build = None  # its build in a background process, once submitted
        self.build_error: str | None = None  # why that build failed: buckets start after
        self._built = threading.Event()
        self._building = threading.Lock()
        self._previous: list | None = None  # the last call's bucket buffers
        self._taking = threading.Lock()

    @property
    def active(self) -> bool:
        return self.hooked is not None and self.build_error is None

    @property
    def loaded(self) -> bool:
        """Whether the hooked driver is compiled (or loaded from the disk cache)."""
        return self._run is not None

    def _parts(self) -> dict:
        parts = dict(self.compiled.key_parts)
        parts["ir"] = hashlib.sha256(self.hooked.source.encode()).hexdigest()[:24]
        return parts

    def driver(self):
        """The hooked driver (compiled in its first call, then cached on disk like any)."""
        if self._run is None:
            self._run = cache.load_module(self.hooked.source, self._parts())[0].run
        return self._run

    def ready(self, inputs) -> bool:
        """Whether this call may run the hooked driver; inputs() gives the plan's input arrays.
        Under BACKPLAN_DRIVER=inline it may: its first call compiles it, as the plan's own
        driver. Otherwise it is compiled once in a background process (as plans' drivers are,
        codegen/build/driver_builder.py), also when the plan's own driver stays Python because
        a compiled one would save it little: this one starts the allreduces. Until it is
        loaded (at once when the disk cache has it) the step starts every bucket after the
        call, and no call stalls for the compile."""
        if self._run is not None:
            return True
        if driver_tier.driver_mode() == "inline":
            return True
        with self._building:
            if self._build is not None:
                return False
            table = np.zeros(HEADER, np.int64)  # the exchange table's type: 1-D int64
            types = self.compiled.call_types(inputs(), (table,))
            signature = driver_tier.numba_signature(types)
            parts = self._parts()
            run = cache.load_module(self.hooked.source, parts)[0].run
            if load_cached(run, signature):
                self._run = run
                self._built.set()
                return True
            self._build = driver_builder.DriverBuild(
                self.compiled.build_payload(types, self.hooked.source, parts),
                lambda: _loaded(run, signature),
                self._switch,
                self._failed,
                f"the data-parallel driver of {self.compiled.plan.graph.name}",
            )
            driver_builder.submit(self._build)
        return False

    def _switch(self, dispatcher) -> None:
        self._run = dispatcher
        self._built.set()

    def _failed(self, message: str) -> None:
        self.build_error = message
        self._built.set()
        warnings.warn(
            f"the data-parallel step's driver with the allreduces inside was not built "
            f"({message}); every bucket's allreduce starts after the call returns",
            driver_tier.DriverBuildWarning,
            stacklevel=1,
        )

    def wait_built(self, timeout: float | None = None) -> bool:
        """Wait for a background build submitted by ready(); True once the driver is loaded."""
        if self._build is None and self._run is None:
            return False
        self._built.wait(timeout)
        return self._run is not None

    def run(self, exchange, arrays: list) -> list:
        """Run the joint plan with the exchange inside it; adds the started buckets to
        `exchange` and returns the plan's outputs (the gradients are views of the buckets)."""
        flats, into = self._bucket_buffers(), {}
        for flat, slots in zip(flats, self.slots, strict=True):
            offset = 0
            for j in slots:
                shape = self.buffers[j][0]
                n = math.prod(shape)
                into[j] = as_bits(flat[offset : offset + n]).reshape(shape)
                offset += n
        ops = {
            np_dtype(b.dtype): half_op(b.dtype, exchange.average)
            for b in self.buckets
            if b.dtype not in FLOATS
        }
        table = exchange.table = self._maker.table(flats, ops)  # failure.py reads it
        outputs = self.compiled.call_into(arrays, into, self.driver(), (table,))
        for k, (bucket, flat) in enumerate(zip(self.buckets, flats, strict=True)):
            exchange.started.append((bucket, flat, TableRequest(table, k, bucket)))
            if exchange.average and bucket.dtype not in FLOATS:  # halved by its operation
                exchange.averaged.add(bucket.index)
        self._previous = flats  # taken again by the next call if nothing holds them then
        return outputs

    def unstarted(self, table: np.ndarray | None) -> list[Bucket] | None:
        """The buckets the driver starts, in the order it starts them, when a call that raised
        had started none of them (table: the call's exchange table, None if never made), so
        that the rank can post them itself in that order (failure.settle); None when some had
        started: what the rank then posted cannot be completed."""
        states = [] if table is None else table[HEADER + STATE :: BUCKET_SLOTS][: len(self.buckets)]
        if any(state != IDLE for state in states):
            return None
        order = sorted(range(len(self.buckets)), key=lambda k: (self.hooked.start_after[k], k))
        return [self.buckets[k] for k in order]

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


def _loaded(dispatcher, signature):
    """The dispatcher with the version a build process compiled loaded from the disk cache."""
    if not load_cached(dispatcher, signature):
        raise RuntimeError(f"the build left no compiled driver in the cache for {signature}")
    return dispatcher


def _steps_of(plan, ir_numbers) -> list[int]:
    """Plan steps of the IR values %N the driver statement computes."""
    from backplan.ir.text import value_names

    wanted = {f"%{n}" for n in ir_numbers}
    return [
        plan.first_write[v]
        for v, name in value_names(plan.graph).items()
        if name in wanted and v in plan.first_write
    ]
