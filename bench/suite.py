"""Running the suite: for each model, every peer builds it, is checked against the float64
reference, warms up, and is timed in interleaved rounds; then its memory facts and warm
compile time are taken. Each result is a plain dict (the JSON record's "results")."""

from __future__ import annotations

import gc
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np

from .check import check_output
from .limits import Limit, model_flops, rate
from .measure import Schedule, time_call, timed_rounds, traced_peak_bytes, warm_up
from .models import ModelSpec
from .peers import Peer, reference_output


@dataclass(frozen=True)
class Settings:
    dtype: str = "float32"
    small: bool = False
    schedule: Schedule = Schedule()
    warm_compile: bool = True
    measure_peak: bool = True  # the checked mode or tracemalloc per peer (--quick skips it)
    wait_for_drivers: bool = True  # time backplan once its compiled drivers run (not --quick)
    seed: int = 0
    limit: Limit | None = None  # the cores' measured FMA peak, for each row's % of peak


def run_suite(models: list[ModelSpec], peers: list[Peer], settings: Settings, progress) -> list:
    results = []
    for index, spec in enumerate(models):
        progress.model(index, len(models), spec.name)
        results += bench_model(spec, peers, settings, progress)
        gc.collect()
    return results


def bench_model(spec: ModelSpec, peers: list[Peer], settings: Settings, progress) -> list:
    inputs = spec.inputs(settings.small, np.dtype(settings.dtype), settings.seed)
    reference = reference_output(spec, inputs)
    rows, runners = {}, {}
    for peer in peers:
        row = rows[peer.name] = _new_row(spec, peer)
        reason = peer.missing() or peer.skip_reason(spec)
        if reason:
            row.update(status="skipped", note=reason)
            continue
        progress.phase(peer.name, "first call")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner = _guarded(row, lambda peer=peer: peer.build(spec, inputs))
            cold = _guarded(row, lambda runner=runner: time_call(runner.step)) if runner else None
        row["warnings"] = _distinct_messages(caught)
        if cold is None:
            continue
        if peer.family == "backplan" and settings.wait_for_drivers:
            _guarded(row, lambda row=row: _wait_for_compiled_drivers(row), what="driver build")
        elif peer.family == "backplan":
            row["note"] = _quick_driver_note()
        check = check_output(runner.output(), reference, settings.dtype)
        row.update(
            first_call_s={"cold": cold, "warm": None, **runner.first_call_parts()},
            check=check.to_dict(),
            status="ok" if check.ok else "wrong",
        )
        runners[peer.name] = runner
    _time_runners(runners, rows, settings.schedule, progress)
    for name, runner in runners.items():
        progress.phase(name, "memory facts")
        _guarded(
            rows[name],
            lambda runner=runner, row=rows[name]: _memory_facts(runner, row, settings),
            what="memory facts",
        )
    if settings.warm_compile:
        _warm_compiles(spec, inputs, [p for p in peers if p.name in runners], rows, progress)
    runners.clear()
    _add_ratios(list(rows.values()))
    _add_rates(list(rows.values()), _flops_or_none(spec, inputs), settings.limit)
    return list(rows.values())


QUICK_DRIVER_NOTE = (
    "--quick: steps timed without waiting for compiled drivers still building (some may run "
    "as Python)"
)
QUICK_PYTHON_DRIVER_NOTE = (
    "--quick: steps timed without waiting for compiled drivers: plan drivers run as Python, "
    "none is built (BACKPLAN_DRIVER=background builds them)"
)


def _quick_driver_note() -> str:
    """What a --quick row of backplan timed: drivers run as Python (--quick's own choice, see
    cli._quick_drivers) or whatever BACKPLAN_DRIVER asked for, not waited for."""
    if os.environ.get("BACKPLAN_DRIVER") == "python":
        return QUICK_PYTHON_DRIVER_NOTE
    return QUICK_DRIVER_NOTE


def _wait_for_compiled_drivers(row: dict) -> None:
    """backplan's first calls run plan drivers as Python while they compile in a background
    process: steps are timed once they run compiled (the wait is recorded)."""
    from backplan.bench.internals import wait_for_builds

    start = time.perf_counter()
    wait_for_builds()
    row["driver_build_wait_s"] = time.perf_counter() - start


IGNORED_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def _distinct_messages(caught, limit: int = 3) -> list[str]:
    """What a peer warned about on its first call (a fallback to a slower path, say); API
    deprecations inside the frameworks are left out."""
    messages = [
        str(w.message).splitlines()[0][:200]
        for w in caught
        if not issubclass(w.category, IGNORED_WARNINGS)
    ]
    return list(dict.fromkeys(messages))[:limit]


def _new_row(spec: ModelSpec, peer: Peer) -> dict:
    return {
        "model": spec.name,
        "peer": peer.name,
        "peer_description": peer.description,
        "status": None,
        "note": None,
        "step_ms": None,
        "ratio_to_fastest": None,
        "first_call_s": None,
        "saved_bytes": None,
        "peak_bytes": None,
        "check": None,
        "plan": None,
        "warnings": [],
    }


def _guarded(row: dict, fn, what: str | None = None):
    """Run fn. A failure marks the row as an error with the exception's message, or, when
    `what` names an optional measurement, only notes that it failed."""
    try:
        return fn()
    except Exception as exc:  # a peer failing must not stop the others
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if what is None:
            row.update(status="error", note=message)
        else:
            row["note"] = f"{what} failed: {message}"
        return None


def _time_runners(runners: dict, rows: dict, schedule: Schedule, progress) -> None:
    steps = {}
    for name, runner in list(runners.items()):
        progress.phase(name, "warm-up")
        estimate = _guarded(rows[name], lambda r=runner: warm_up(r, schedule.warmup_steps))
        if estimate is None:
            del runners[name]
            continue
        steps[name] = schedule.steps_per_round(estimate)

    def on_round(r, name):
        progress.phase(name, f"round {r + 1}/{schedule.rounds}, {steps[name]} steps")

    timings = timed_rounds(runners, steps, schedule, on_round)
    for name, timing in timings.items():
        rows[name]["step_ms"] = timing.to_dict()


def _memory_facts(runner, row: dict, settings: Settings) -> None:
    saved = runner.saved_bytes()
    if saved is not None:
        row["saved_bytes"] = {
            "excluding_inputs": saved.excluding_inputs,
            "including_inputs": saved.including_inputs,
            "source": saved.source,
        }
    planned = runner.planned_peak_bytes()
    row["plan"] = runner.plan_facts()
    row["peak_bytes"] = {
        "measured": None,
        "measured_by": None,
        "planned": planned[0] if planned else None,
        "planned_by": planned[1] if planned else None,
    }
    row["peak_bytes"].update(_measured_peak(runner, settings))  # may fail: the rest is kept


def _measured_peak(runner, settings: Settings) -> dict:
    """The step's measured peak: counted by the compiler's checked mode where it has one
    (backplan's compiled plans: every buffer they allocate; tracemalloc sees none of it),
    else tracemalloc's NumPy allocations (the NumPy peer), else nothing (torch, XLA)."""
    if not settings.measure_peak:
        return {"measured": None, "measured_by": None}
    counted = runner.counted_peak_bytes()
    if counted is not None:
        return {
            "measured": counted["bytes"],
            "measured_by": CHECKED_MODE,
            "counted": counted["counted"],
            "counted_predicted": counted["predicted"],
            "counted_held": counted.get("held"),
            "left_alive": counted.get("left_alive"),
        }
    measured = traced_peak_bytes(runner)
    return {"measured": measured, "measured_by": "tracemalloc" if measured is not None else None}


CHECKED_MODE = (
    "checked mode (BACKPLAN_CHECK_MEMORY=1): every buffer the compiled step allocates, counted, "
    "plus the arrays passed in"
)


def _warm_compiles(spec, inputs, peers: list[Peer], rows: dict, progress) -> None:
    """First call of a freshly built runner after the peer drops its in-process caches: what a
    second compile costs once imports, kernels and disk caches are warm."""
    for peer in peers:
        progress.phase(peer.name, "first call (warm)")
        row = rows[peer.name]

        def first_call(peer=peer):
            peer.clear_caches()
            return time_call(peer.build(spec, inputs).step)

        warm = _guarded(row, first_call, what="warm first call")
        if warm is not None:
            row["first_call_s"]["warm"] = warm
        gc.collect()


def _add_ratios(rows: list) -> None:
    timed = [r for r in rows if r["step_ms"] is not None and r["status"] == "ok"]
    if not timed:
        return
    fastest = min(r["step_ms"]["median"] for r in timed)
    for row in rows:
        if row["step_ms"] is not None:
            row["ratio_to_fastest"] = row["step_ms"]["median"] / fastest


def _flops_or_none(spec, inputs) -> int | None:
    """The model's FLOPs per step (bench/limits.py), or None when backplan cannot count them."""
    try:
        return model_flops(spec, inputs)
    except Exception:  # noqa: BLE001 - a missing rate must not lose the step times
        return None


def _add_rates(rows: list, flops: int | None, limit: Limit | None) -> None:
    """Each timed row's GFLOP/s and share of the peak: the same FLOPs for every peer."""
    for row in rows:
        row["flops_per_step"] = flops
        step = row["step_ms"]
        row["rate"] = rate(flops, step["median"] if step else None, limit)
