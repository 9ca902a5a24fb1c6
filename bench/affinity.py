"""--threads N pins the whole benchmark process to N CPUs before any peer's library is imported.

Thread-count settings are not enough: XLA has no flag for its CPU pool and sizes it from the
CPUs the process may run on, and a pool created before a limit ignores it. Pinning holds every
peer to the same N CPUs whatever its library does: XLA and OpenMP read the affinity when they
start, and threads started later inherit it. Threads that exist already (NumPy's BLAS pool) are
pinned one by one. The CPU list in effect is recorded in the report.
"""

from __future__ import annotations

import os

from .errors import BenchError

TASKS = "/proc/self/task"


def current_affinity() -> list[int] | None:
    """The CPUs this process may run on, or None where the platform cannot say."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def pin_process(threads: int | None) -> dict:
    """Pin every thread of this process to the first `threads` CPUs it may use now; returns
    what was done, for the report's `set_by_harness`."""
    if threads is None:
        return {}
    if threads < 1:
        raise BenchError(f"--threads must be at least 1, got {threads}")
    allowed = current_affinity()
    if allowed is None or not hasattr(os, "sched_setaffinity"):
        return {"affinity": "not pinned: this platform has no os.sched_setaffinity"}
    if threads > len(allowed):
        raise BenchError(
            f"--threads {threads}, but this process may run on only {len(allowed)} CPUs "
            f"({cpu_list_text(allowed)}); use --threads {len(allowed)} or fewer"
        )
    chosen = allowed[:threads]
    for thread_id in _thread_ids():
        try:
            os.sched_setaffinity(thread_id, chosen)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return {"affinity": f"os.sched_setaffinity: CPUs {cpu_list_text(chosen)}"}


def _thread_ids() -> list[int]:
    """Every thread of this process (Linux); elsewhere just the calling one."""
    try:
        return [int(name) for name in os.listdir(TASKS)]
    except (OSError, ValueError):
        return [0]


def cpu_list_text(cpus: list[int] | None) -> str:
    """[0, 1, 2, 5] -> '0-2,5', as taskset and /sys write CPU lists."""
    if cpus is None:
        return "unknown"
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
