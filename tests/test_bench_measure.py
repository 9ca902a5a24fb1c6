"""The harness's timing (bench/measure.py) on a fake clock: samples of a batch of calls give ms
per call, interleaved rounds run every step in turn, fixed counts and the best-of statistic do
what they say, and the stand-alone scripts that time batches (mathlib, concurrent_calls) report
through it. No real time is asserted."""

from __future__ import annotations

import types

import pytest

from backplan.bench import concurrent_calls, measure


class FakeClock:
    """perf_counter for bench.measure: advances only when a step says it ran."""

    def __init__(self):
        self.now, self.calls = 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def step(self, name: str, seconds: float):
        def run():
            self.calls.append(name)
            self.now += seconds

        return run


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def test_a_sample_of_a_batch_is_ms_per_call(clock):
    assert measure.sample_ms(clock.step("a", 0.002), inner=5) == pytest.approx(2.0)
    assert clock.calls == ["a"] * 5


def test_interleaved_rounds_take_a_batch_per_sample_and_a_fixed_count(clock):
    steps = {"a": clock.step("a", 0.004), "b": clock.step("b", 0.001)}
    medians = measure.interleaved_medians(
        steps, rounds=3, seconds=0, inner={"a": 1, "b": 4}, count=2
    )
    assert medians == {"a": pytest.approx(4.0), "b": pytest.approx(1.0)}
    # each round: a's two samples of one call, then b's two samples of four calls
    assert clock.calls == (["a"] * 2 + ["b"] * 8) * 3


def test_without_a_count_a_turn_lasts_its_seconds_and_at_least_three_samples(clock):
    assert len(measure.samples_ms(clock.step("a", 0.01), seconds=0.05)) == 5
    assert len(measure.samples_ms(clock.step("a", 1.0), seconds=0.05)) == 3


def test_best_is_the_fastest_sample_and_the_batch_reaches_the_target(clock):
    costs = iter([0.003, 0.001, 0.002])
    assert measure.best_ms(lambda: clock.step("a", next(costs))(), samples=3) == pytest.approx(1.0)
    assert measure.batch_for(clock.step("b", 0.001), seconds=0.005) == 8  # 1, 2, 4 too short


def test_mathlib_reports_ns_per_element_from_the_harness(clock):
    mathlib = pytest.importorskip("backplan.bench.mathlib")
    n = 1000
    ours, theirs = mathlib.ns_per_element(
        n, clock.step("ours", 2e-9 * n), clock.step("numpy", 3e-9 * n), rounds=2, seconds=0
    )
    assert (ours, theirs) == (pytest.approx(2.0), pytest.approx(3.0))
    assert clock.calls[:2000] == ["ours"] * 2000  # 2,000,000 // n calls per sample


def test_a_gang_burst_runs_every_thread_s_calls_and_raises_their_error():
    import threading

    counts, lock = {}, threading.Lock()

    def step(fail):
        with lock:
            name = threading.current_thread().name
            counts[name] = counts.get(name, 0) + 1
        if fail and counts[name] == 2:
            raise ValueError("step failed")

    gang = concurrent_calls.Gang(step, (False,), threads=3, calls=4)
    try:
        gang.burst()
        gang.burst()
    finally:
        gang.close()
    assert sorted(counts.values()) == [8, 8, 8]
    failing = concurrent_calls.Gang(step, (True,), threads=1, calls=4)
    try:
        with pytest.raises(ValueError, match="step failed"):
            failing.burst()
    finally:
        failing.close()
