"""The checked mode (BACKPLAN_CHECK_MEMORY=1): every buffer a compiled call allocates or uses
goes through one counting allocator, and each call's measured buffers must equal the plan's
predicted ones (ir/plan_buffers.py) to the byte; a mismatch raises MemoryCheckError naming the
buffer.

Numba's own allocations inside jitted code (NRT) never pass here; the compiled plans make none
that outlive a kernel (arenas and output buffers are passed in), and the outside measurement
(bench/memory.py: peak resident memory of a fresh process) covers the short-lived ones. A
driver statement that allocates (a copy of a strided view, a literal operand made with np.full)
is refused when the plan is built (refuse_uncounted, naming the line): every copy a plan needs
is a buffer its memory planner places (ir/strided_copies.py).

`measure()` records, across calls, the bytes of every buffer a step allocates or uses, from
its first use to its free (a weakref finalizer), and the peak of their sum: tests compare it
with ir.peak.predicted_peak.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref

import numpy as np

from backplan.codegen.render.driver_allocations import uncounted_allocations
from backplan.ir.errors import BackplanError

_enabled = [os.environ.get("BACKPLAN_CHECK_MEMORY", "") == "1"]


class MemoryCheckError(BackplanError, AssertionError):
    """A compiled call held other buffers than its plan predicts (BACKPLAN_CHECK_MEMORY=1)."""


def checking() -> bool:
    return _enabled[0]


@contextlib.contextmanager
def checked_memory(on: bool = True):
    """Turn the checked mode on (or off) for plans compiled inside the block."""
    was = _enabled[0]
    _enabled[0] = on
    try:
        yield
    finally:
        _enabled[0] = was


class Measurement:
    """Buffers allocated or used while it is open (this thread), their bytes, and the peak."""

    def __init__(self):
        self.held: dict[int, tuple[str, int]] = {}  # token -> (name, bytes)
        self.live = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}

    def _add(self, token: int, name: str, nbytes: int) -> None:
        """A buffer used: counted once while it lives, and the peak read again (after
        restart_at_next_use, a call whose every buffer an earlier call made, a workspace's
        kept outputs and arena, holds them all)."""
        if token not in self.held:
            self.held[token] = (name, nbytes)
            self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = {}
            for held_name, held_bytes in self.held.values():
                self.at_peak[held_name] = self.at_peak.get(held_name, 0) + held_bytes

    def _grow(self, token: int, name: str, nbytes: int) -> None:
        """A buffer the process keeps, counted at the most bytes any call asked of it."""
        held = self.held.get(token)
        if held is not None and held[1] >= nbytes:
            return
        if held is not None:
            self.live -= held[1]
            del self.held[token]
        self._add(token, name, nbytes)

    def restart_peak(self) -> None:
        """Measure a new peak from what is held now: one measurement open across calls keeps
        the buffers earlier calls left alive (arenas of plans not run since) in `live`."""
        self.peak = self.live
        self.at_peak = {}
        for name, nbytes in self.held.values():
            self.at_peak[name] = self.at_peak.get(name, 0) + nbytes

    def restart_at_next_use(self) -> None:
        """Measure a new peak from the next buffer a call allocates or uses: what earlier calls
        left alive counts where it is still held then (a dynamic axis's call at another size
        frees the other sizes' idle arenas before it allocates anything)."""
        self.peak = 0
        self.at_peak = {}

    def _remove(self, token: int) -> None:
        found = self.held.pop(token, None)
        if found is not None:
            self.live -= found[1]


class CountingAllocator:
    """np.empty with a name, and a record of which open measurements hold each buffer."""

    def __init__(self):
        self._lock = threading.RLock()  # a finalizer may run inside use()
        self._tokens = itertools.count()
        self._token_of: dict[int, int] = {}  # id(array) -> token, while the array lives
        self._open: list[Measurement] = []
        self._local = threading.local()
        self._kept_tokens: dict[str, int] = {}

    def empty(self, shape, dtype, name: str) -> np.ndarray:
        array = np.empty(shape, dtype)
        self.use(array, name)
        return array

    def use(self, array: np.ndarray, name: str) -> None:
        """Count `array` (allocated here or earlier) in this thread's open measurements."""
        with self._lock:
            token = self._token_of.get(id(array))
            if token is None:
                token = self._token_of[id(array)] = next(self._tokens)
                weakref.finalize(array, self._freed, id(array), token)
            for measurement in getattr(self._local, "open", ()):
                measurement._add(token, name, int(array.nbytes))

    def _freed(self, array_id: int, token: int) -> None:
        with self._lock:
            if self._token_of.get(array_id) == token:
                del self._token_of[array_id]
            for measurement in self._open:
                measurement._remove(token)

    def hold_kept(self, name: str, nbytes: int) -> None:
        """Count, in this thread's open measurements, `nbytes` of memory the process keeps for
        every compiled call under `name` (backplan's GEMM packing buffers: the plans of a step
        share them, so a measurement holds the most any of its calls counts, never freed)."""
        with self._lock:
            token = self._kept_tokens.setdefault(name, next(self._tokens))
            for measurement in getattr(self._local, "open", ()):
                measurement._grow(token, name, int(nbytes))

    @contextlib.contextmanager
    def measuring(self):
        measurement = Measurement()
        local = getattr(self._local, "open", None)
        if local is None:
            local = self._local.open = []
        with self._lock:
            self._open.append(measurement)
            local.append(measurement)
        try:
            yield measurement
        finally:
            with self._lock:
                self._open.remove(measurement)
                local.remove(measurement)


ALLOCATOR = CountingAllocator()


def measure():
    """`with measure() as m: step()`: m.peak is the most bytes the step's compiled calls held
    at once (buffers they allocated or used: arenas, constants, outputs), m.at_peak names them.
    Counts only plans compiled with the checked mode on."""
    return ALLOCATOR.measuring()


def count_held(arrays, name: str = "previous outputs") -> None:
    """Count arrays allocated before this thread's open measurements in them from now, under
    name: a loop's last results, which its names keep bound while the next call runs
    (explain's loop peak counts them so, report/loop_peak.py)."""
    for array in arrays:
        ALLOCATOR.use(array, name)


def refuse_uncounted(plan_name: str, source: str) -> None:
    """Raise if the plan's driver allocates an array itself: the counting allocator cannot see
    it (inside a compiled driver it is Numba's), so the call would hold more than is counted."""
    allocating = uncounted_allocations(source)
    if allocating:
        raise MemoryCheckError(
            f"@{plan_name}: the compiled driver allocates arrays no plan places or counts "
            f"(BACKPLAN_CHECK_MEMORY=1): {'; '.join(allocating)}. A copy the driver needs must "
            "be a node the memory planner places (ir/strided_copies.py)"
        )


PACKING = "packing"  # the key and name of the GEMM's kept packing buffers in a measurement


def packing_buffer(packing):
    """The PlannedBuffer a checked call compares its packing with (a PackingPlan's bytes)."""
    from backplan.ir.plan_buffers import PlannedBuffer

    first, shared = packing.per_thread
    threads = f", {first:,} B the calling thread's + {packing.helpers} x {shared:,} B"
    return PlannedBuffer(
        PACKING,
        "backplan's GEMM packing buffers (kept by the process"
        + (threads if packing.helpers else "")
        + ")",
        "packing",
        packing.nbytes,
    )


def check_packing(plan_name: str, packing, pages: dict) -> None:
    """Raise unless the pages the call's GEMMs wrote in the kept buffers (slot -> page
    indices, codegen/run/packing_check.py) are ones `packing` (a PackingPlan) counts."""
    from backplan.codegen.run.packing_check import problems

    found = problems(packing, pages)
    if found:
        raise MemoryCheckError(
            f"@{plan_name}: backplan's GEMM packing buffers differ from the plan's count "
            f"({packing.nbytes:,} B, codegen/kernels/gemm/packing.py): " + "; ".join(found)
        )


def compare(plan_name: str, predicted: list, measured: dict[str, int], why=None) -> None:
    """Raise unless the call held exactly the predicted buffers (name -> bytes). why: key ->
    the likely cause, added to the message."""
    expected = {b.key: b.nbytes for b in predicted}
    names = {b.key: b.name for b in predicted}
    problems = []
    for key in sorted(set(expected) | set(measured)):
        want, got = expected.get(key), measured.get(key)
        if want == got:
            continue
        what = names.get(key, key)
        if want is None:
            cause = (why or {}).get(key)
            problems.append(
                f"{key} ({got} B) was allocated but is not in the plan's prediction"
                + (f" ({cause})" if cause else "")
            )
        elif got is None:
            problems.append(f"{what} ({want} B) was predicted but not held by the call")
        else:
            problems.append(f"{what}: predicted {want} B, held {got} B")
    if problems:
        raise MemoryCheckError(
            f"@{plan_name}: the call's memory differs from its prediction: " + "; ".join(problems)
        )
