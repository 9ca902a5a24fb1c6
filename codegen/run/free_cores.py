"""How many of the process's CPUs are free now: the thread count a step's BLAS should use
(codegen/run/workspace.SizedLaunch).

On a small shared machine a second thread only pays when its core is free. A parallel region
(a prange loop, the own GEMM's blocks, OpenBLAS's threaded GEMM) ends at a barrier; when
another process holds the other core, the barrier waits for a descheduled thread, one
scheduler slice (milliseconds) per region. Measured on a 2-vCPU AMD EPYC at load 6-7: the
digits CNN example stepped in 1.2-2 ms on one thread and 17-216 ms (median) on two, and a
prange region with no work cost 50 us (median; 130-220 us mean) against 0.4 us serial.

The estimate: every SAMPLE_SECONDS, the busy time of the process's CPUs (/proc/stat, in clock
ticks) less this process's own CPU time, over the wall time between samples, is what the rest
of the machine used; the free cores are the CPUs less that, rounded down after a slack of
SLACK. Until the first window closes every CPU counts as free. Where /proc/stat is missing (not
Linux) the answer is always every CPU. BACKPLAN_ADAPT_THREADS=0 turns the estimate off (read
when a window closes, as the CPUs the process may use are: a call between windows costs one
clock read, not an environment lookup, which raised and caught two KeyErrors per call when
the variable was unset).
"""

from __future__ import annotations

import math
import os
import threading
import time

SAMPLE_SECONDS = 0.25  # the window: long enough for ~50 ticks on 2 CPUs at 100 Hz
SLACK = 0.3  # another process using under 0.3 of a CPU leaves that CPU counted as free
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def adapting() -> bool:
    return os.environ.get("BACKPLAN_ADAPT_THREADS", "1").strip() not in ("0", "off", "no")


def process_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def busy_ticks(cpus: list[int], stat_text: str) -> int | None:
    """Clock ticks the CPUs in `cpus` spent busy (user, nice, system, irq, softirq, steal:
    everything but idle and iowait), from /proc/stat's text; None when a CPU is not listed."""
    wanted = {f"cpu{c}" for c in cpus}
    total, seen = 0, 0
    for line in stat_text.splitlines():
        if not line.startswith("cpu"):
            break  # the CPU lines come first; the next (intr) holds hundreds of numbers
        fields = line.split()
        if fields[0] not in wanted:
            continue
        numbers = [int(x) for x in fields[1:9]]
        total += sum(numbers) - numbers[3] - numbers[4]  # less idle and iowait
        seen += 1
    return total if seen == len(wanted) else None


def free_count(cpus: int, others_busy: float) -> int:
    """CPUs left when other processes use `others_busy` CPUs of them: at least 1."""
    return max(1, min(cpus, math.floor(cpus - others_busy + SLACK)))


class FreeCores:
    """The sampler: `now()` answers from the last closed window and closes a new one when
    SAMPLE_SECONDS have passed. Threads share one; a thread that finds another sampling keeps
    the last answer (the count is a guess for speed, never for a result)."""

    def __init__(self, stat_path="/proc/stat", clock=time.monotonic, cpu_clock=time.process_time):
        self._stat_path = stat_path
        self._clock, self._cpu_clock = clock, cpu_clock
        self._lock = threading.Lock()
        self._last = None  # (wall, busy ticks, own CPU seconds, cpus) at the window's start
        self._count = len(process_cpus())
        self._next = 0.0

    def now(self) -> int:
        if self._clock() < self._next or not self._lock.acquire(blocking=False):
            return self._count
        try:
            self._sample()
        finally:
            self._lock.release()
        return self._count

    def _sample(self) -> None:
        wall, own, cpus = self._clock(), self._cpu_clock(), process_cpus()
        self._next = wall + SAMPLE_SECONDS
        busy = self._busy_ticks(cpus) if adapting() else None
        if busy is None:  # turned off, or no /proc/stat: every CPU
            self._last, self._count = None, len(cpus)
            return
        last, self._last = self._last, (wall, busy, own, cpus)
        if last is None or last[3] != cpus or wall <= last[0]:
            self._count = len(cpus) if last is None or last[3] != cpus else self._count
            return
        used = (busy - last[1]) / _TICK - (own - last[2])
        self._count = free_count(len(cpus), max(0.0, used) / (wall - last[0]))

    def _busy_ticks(self, cpus: list[int]) -> int | None:
        try:
            with open(self._stat_path) as file:
                return busy_ticks(cpus, file.read())
        except OSError:
            return None


FREE_CORES = FreeCores()


def free_cores() -> int:
    """The CPUs of this process that no other process is using now (see the module text)."""
    return FREE_CORES.now()
