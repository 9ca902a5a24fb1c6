"""Measuring each kernel of the compiled plans a step calls (fn.profile, report.save_trace).

Inside `measuring()`, every call of a compiled plan that has run before (its kernels and
driver settled) runs its timed driver instead (codegen/run/kernel_times.py: the same kernels,
called from the driver's source run as Python, with a clock reading before each): the calls'
readings are recorded in order. Plans on their first call (compiling) run as always."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from backplan.codegen.run.compiled import CompiledPlan
from backplan.codegen.run.kernel_times import timed_driver

_lock = threading.Lock()  # one measurement at a time: it swaps a class's method


@contextmanager
def measuring():
    """Yields the list of (plan name, [perf_counter readings]) of each compiled plan call."""
    calls: list[tuple[str, list[float]]] = []
    plain = CompiledPlan.__call__

    def timed(self, args: list, donate=()) -> list:
        if self.first_call_seconds is None or self.driver_tier == "reference":
            return plain(self, args, donate)
        made = self.__dict__.get("_timed_driver")
        if made is None:  # made once a plan: its first calls cost milliseconds
            readings: list[float] = []
            made = self._timed_driver = (timed_driver(self, readings), readings)
        driver, readings = made
        readings.clear()
        run, self._run = self._run, driver
        try:
            return plain(self, args, donate)
        finally:
            if self._run is driver:
                self._run = run
            calls.append((self.plan.graph.name, list(readings)))

    with _lock:
        CompiledPlan.__call__ = timed
        try:
            yield calls
        finally:
            CompiledPlan.__call__ = plain
