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


def sample_ms(step, inner: int = 1) -> float:
    """One sample: `inner` calls of step in a row, in ms per call. A step too short to time
    alone (nanoseconds per element of a cached array) runs in batches."""
    start = time.perf_counter()
    for _ in range(inner):
        step()
    return (time.perf_counter() - start) * 1e3 / inner


def samples_ms(step, seconds: float, inner: int = 1, count: int | None = None) -> list[float]:
    """As many samples as fit in `seconds` (at least three), or exactly `count` of them where
    every process must make the same calls (ranks whose collectives pair up)."""
    if count is not None:
        return [sample_ms(step, inner) for _ in range(count)]
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        times.append(sample_ms(step, inner))
    return times


def median_ms(step, seconds: float, inner: int = 1, count: int | None = None) -> float:
    """The median of samples_ms, in ms per call."""
    return statistics.median(samples_ms(step, seconds, inner, count))


def best_ms(step, samples: int, inner: int = 1) -> float:
    """The fastest of `samples` samples, in ms per call: for a machine's limit (an FMA peak, a
    GEMM's rate), where a sample no neighbour preempted is the one that measures it."""
    return min(sample_ms(step, inner) for _ in range(max(1, samples)))


def batch_for(step, seconds: float) -> int:
    """The calls per sample (a power of two) that make a sample last at least `seconds`."""
    inner = 1
    while sample_ms(step, inner) * inner < seconds * 1e3:
        inner *= 2
    return inner


def max_relative_error(got, want) -> float:
    """The largest of each array's max |got - want| over max |want|."""
    import numpy as np

    return max(
        float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))
        for a, b in zip(got, want, strict=True)
    )


def interleaved_medians(
    steps: dict,
    rounds: int,
    seconds: float,
    inner: int | dict = 1,
    count: int | None = None,
    settle: int = 0,
) -> dict[str, float]:
    """{name: median over rounds of each round's median ms per call}; every round runs every
    step, so drift in the machine's speed hits all alike. inner: calls per sample (one count,
    or one per name); count: a fixed number of samples per turn instead of `seconds`; settle:
    untimed calls before each turn (the previous step's thread pools may still spin)."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(settle):
                step()
            calls = inner[name] if isinstance(inner, dict) else inner
            samples[name].append(median_ms(step, seconds, calls, count))
    return {name: statistics.median(values) for name, values in samples.items()}
