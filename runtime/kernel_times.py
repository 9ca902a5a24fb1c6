"""Measuring each kernel of the compiled plans a step calls (fn.profile, report.save_trace).

Inside `measuring()`, every call of a compiled plan that has run before (its kernels and
driver settled) runs its timed driver instead (codegen/run/kernel_times.py: the same kernels,
called from the driver's source run as Python, with a clock reading before each): the calls'
readings are recorded in order. Plans on their first call (compiling) run as always, and so
do other threads' calls: only the measuring thread's are timed and recorded (another thread
calling a plan while it is swapped runs the timed driver, unrecorded: same results)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from backplan.codegen.run.compiled import CompiledPlan
from backplan.codegen.run.kernel_times import timed_driver

_lock = threading.Lock()  # one measurement at a time: it swaps a class's method
_local = threading.local()  # .readings: the list the measuring thread's stamps append to


def _stamp() -> None:
    readings = getattr(_local, "readings", None)
    if readings is not None:  # None on any other thread
        readings.append(time.perf_counter())


@contextmanager
def measuring():
    """Yields the list of (plan name, [perf_counter readings]) of each compiled plan call."""
    calls: list[tuple[str, list[float]]] = []
    plain = CompiledPlan.__call__
    owner = threading.get_ident()

    def timed(self, args: list, donate=()) -> list:
        if (
            threading.get_ident() != owner
            or self.first_call_seconds is None
            or self.driver_tier == "reference"
        ):
            return plain(self, args, donate)
        driver = self.__dict__.get("_timed_driver")
        if driver is None:  # made once a plan: its first calls cost milliseconds
            driver = self._timed_driver = timed_driver(self, _stamp)
        readings = _local.readings = []
        run, self._run = self._run, driver
        try:
            return plain(self, args, donate)
        finally:
            _local.readings = None
            if self._run is driver:
                self._run = run
            calls.append((self.plan.graph.name, readings))

    with _lock:
        CompiledPlan.__call__ = timed
        try:
            yield calls
        finally:
            CompiledPlan.__call__ = plain
