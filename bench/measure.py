"""Timing and memory measurement of runners: first calls, interleaved timed rounds, and the
peak of one step under tracemalloc."""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from dataclasses import dataclass, field


@dataclass
class Timing:
    """Step times in seconds."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def to_dict(self) -> dict:
        ms = [s * 1e3 for s in self.samples]
        return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms)}


@dataclass(frozen=True)
class Schedule:
    """How many steps to time. Each round runs every peer in turn (the order rotates), each
    for a number of steps chosen from its warm-up time so a round takes about round_seconds.
    settle_steps untimed steps precede each peer's turn: the previous peer's thread pools may
    still be spinning, and the first step after a switch pays for it."""

    warmup_steps: int = 3
    settle_steps: int = 1
    rounds: int = 5
    round_seconds: float = 0.4
    min_steps: int = 2
    max_steps: int = 50

    def steps_per_round(self, step_seconds: float) -> int:
        wanted = round(self.round_seconds / max(step_seconds, 1e-9))
        return max(self.min_steps, min(self.max_steps, wanted))


QUICK = Schedule(
    warmup_steps=1, settle_steps=0, rounds=2, round_seconds=0.0, min_steps=2, max_steps=2
)
FULL = Schedule()


def time_call(fn) -> float:
    return timed(fn)[0]


def timed(fn) -> tuple[float, object]:
    """(seconds, result) of one call of fn: a first call, an import, whatever runs once."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def warm_up(runner, steps: int) -> float:
    """Runs warm-up steps; returns the median of their times (at least one step runs)."""
    return statistics.median(time_call(runner.step) for _ in range(max(1, steps)))


def timed_rounds(runners: dict, steps: dict, schedule: Schedule, on_round=None) -> dict:
    """Interleaved timing: round r runs the runners in an order rotated by r. Returns a Timing
    per runner name."""
    timings = {name: Timing() for name in runners}
    names = list(runners)
    for r in range(schedule.rounds):
        shift = r % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            if on_round is not None:
                on_round(r, name)
            for _ in range(schedule.settle_steps):
                runners[name].step()
            for _ in range(steps[name]):
                timings[name].samples.append(time_call(runners[name].step))
    return timings


def traced_peak_bytes(runner) -> int | None:
    """Peak bytes allocated during one step, as tracemalloc sees them (NumPy reports its array
    memory to it). None for runners that allocate elsewhere (PyTorch, XLA)."""
    if not runner.numpy_allocations:
        return None
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        runner.step()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def median_ms(step, seconds: float) -> float:
    """The median of as many calls of step as fit in `seconds` (at least three), in ms."""
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def max_relative_error(got, want) -> float:
    """The largest of each array's max |got - want| over max |want|."""
    import numpy as np

    return max(
        float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))
        for a, b in zip(got, want, strict=True)
    )


def interleaved_medians(steps: dict, rounds: int, seconds: float) -> dict[str, float]:
    """{name: median over rounds of each round's median ms}; every round runs every step."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name].append(median_ms(step, seconds))
    return {name: statistics.median(values) for name, values in samples.items()}
