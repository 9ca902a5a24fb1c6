"""The step as a Chrome trace / Perfetto JSON (`report.save_trace("step.json")`): one track per
kernel in the predicted order, and a counter track per memory category with the bytes held, so
a step opens in ui.perfetto.dev or chrome://tracing beside a PyTorch profile.

Without measured times each kernel gets one microsecond, in order: the picture shows order and
memory, not time. `times` (seconds per kernel, in the same order, or `fn.profile(*args)`, which
measures them: tracer/kernel_profile.py) gives each its measured length.
"""

from __future__ import annotations

import json
import math

from .loop_peak import HELD_CATEGORIES

PROCESS = 1


def trace_events(peak, times: list[float] | None = None) -> list[dict]:
    """Trace events: metadata, one complete ("X") event per step, counters ("C") per category."""
    steps = peak.steps
    times = getattr(times, "seconds", times)  # fn.profile(*args)'s KernelProfile
    if times is not None:
        times = _checked_times(times, len(steps))
    events = [
        {"ph": "M", "pid": PROCESS, "name": "process_name", "args": {"name": "backplan step"}}
    ]
    plans = list(dict.fromkeys(s.plan for s in steps))
    for tid, plan in enumerate(plans, start=1):
        events.append(
            {
                "ph": "M",
                "pid": PROCESS,
                "tid": tid,
                "name": "thread_name",
                "args": {"name": f"{plan} kernels"},
            }
        )
    start = 0.0
    for i, step in enumerate(steps):
        length = 1.0 if times is None else float(times[i]) * 1e6
        events.append(
            {
                "ph": "X",
                "pid": PROCESS,
                "tid": plans.index(step.plan) + 1,
                "ts": start,
                "dur": length,
                "name": step.what,
                "cat": step.plan,
                "args": {"line": step.line, "bytes_held": step.nbytes, "step": step.index},
            }
        )
        held = {c: step.held.get(c, 0) for c in HELD_CATEGORIES}
        events.append({"ph": "C", "pid": PROCESS, "ts": start, "name": "bytes held", "args": held})
        start += length
    events.append(
        {
            "ph": "C",
            "pid": PROCESS,
            "ts": start,
            "name": "bytes held",
            "args": dict.fromkeys(HELD_CATEGORIES, 0),
        }
    )
    return events


def _checked_times(times, n_steps: int) -> list[float]:
    """Seconds per kernel as floats; a string, a wrong count, or a time that is not a finite
    number >= 0 is refused: a negative or NaN duration would write a trace that tools draw
    wrongly or (NaN is not JSON) cannot open."""
    if isinstance(times, str | bytes) or not hasattr(times, "__len__"):
        raise TypeError(
            f"save_trace: times is a list of seconds, one per kernel, got {type(times).__name__}"
        )
    if len(times) != n_steps:
        raise ValueError(
            f"save_trace: {len(times)} times given for {n_steps} kernels; pass one per kernel "
            "in the order of report.peak.steps"
        )
    checked = []
    for i, value in enumerate(times):
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"save_trace: times[{i}] is {value!r}; each kernel's time is a finite number "
                "of seconds >= 0"
            )
        checked.append(seconds)
    return checked


def save_trace(peak, path, times: list[float] | None = None) -> None:
    events = trace_events(peak, times)  # refused times leave no file behind
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, file, allow_nan=False)
