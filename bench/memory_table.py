"""The `memory` table of BENCHMARKS.md: per bench model, its value_and_grad step's predicted peak
(explain's `peak:`), the peak measured two ways, and the memory frontier's rows with measured
step times.

- checked mode: the step compiled with BACKPLAN_CHECK_MEMORY's counting allocator (every arena,
  output and constant its compiled plans allocate or use), its second call's peak, plus the
  arrays passed in; equal to the prediction to the byte, or the call raises.
- fresh process: bench/memory.py's growth of peak resident memory over the first step (VmHWM
  after it less VmRSS before it, glibc returning freed memory), against the prediction less the
  arrays passed in and the constants (resident before the step); issue 30 allows 5% + 8 MiB.
  Measured at a size holding tens of MiB (`SCALES`: batch or rows times k), where pages and
  allocator rounding are small beside it; the other columns are at the bench size.
- frontier: `fn.memory_frontier`'s rows (what max_peak_bytes picks from), up to N of them
  spread along it, each plan compiled and timed in interleaved rounds (one pinned CPU).

    python -m backplan.bench.memory_table [--models mlp,transformer] [--rounds 5] [--frontier 4]
        [--no-fresh] [--clock cpu]

--clock cpu times the frontier's steps by the process's CPU time (bench.memory_budget).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import backplan as bp
from backplan.bench.internals import checked_memory, measure

from .affinity import pin_process
from .environment import cpu_name
from .memory import _step
from .memory import measure as fresh_measure
from .memory_budget import CLOCK, time_plans

# batch (or rows) multiplier for the fresh-process column: each step then holds >= ~60 MiB
SCALES = {
    "mlp": 16,
    "mlp_tiny": 4096,
    "transformer": 2,
    "ln_gelu": 1,
    "mlp_deep": 8,
    "cnn": 64,
    "lstm12": 1024,
    "lstm48": 256,
}


def checked_peak(name: str) -> tuple[int, int]:
    """(the checked mode's peak plus the arrays passed in, the prediction it must equal: the
    printed peak, every byte of it the step's own buffers or the arrays passed in). Measured
    on the second call of the loop users write, the first call's results bound until it
    returns (what the printed peak counts)."""
    with checked_memory():
        step, args = _step(name, 1, "vg")
        with measure() as measured:
            last = step(*args)  # compiles; a buffer the plan does not predict raises here
            measured.restart_at_next_use()
            last = step(*args)  # the old results go once the call has returned
        del last
    peak = step.explain(*args).peak
    inputs = peak.input_bytes
    return measured.peak + inputs, peak.allocated_peak_bytes + inputs


def frontier_times(name: str, rounds: int, count: int) -> list[dict]:
    """Up to count rows of the step's memory frontier, spread along it, each plan's step time
    (median of interleaved rounds) and its ratio to the first row's (the default plan)."""
    step, args = _step(name, 1, "vg")
    traced = step.trace(*args)
    planner = traced.planner
    frontier = planner.frontier()
    picked = sorted({round(k * (len(frontier) - 1) / max(count - 1, 1)) for k in range(count)})
    chosen = [frontier[k] for k in picked]
    arrays = bp.tree.map(lambda t: np.asarray(t), args)
    times = time_plans([e.plans.plan for e in chosen], arrays, rounds)
    flops = planner.step_flops()
    return [
        dict(peak=e.peak_bytes, added=e.added_flops / flops, ms=ms, ratio=ms / times[0])
        for e, ms in zip(chosen, times, strict=True)
    ]


def fresh_cells(name: str, scale: int) -> str:
    """'expected growth | fresh growth (+x%) | primed growth (+y%)' at the model's scale."""
    found = fresh_measure(name, scale, "vg")
    expected = found["expected_growth"]

    def cell(run: dict) -> str:
        growth = run["measured_growth"]
        within = abs(growth - expected) <= 0.05 * expected + 8 * 2**20
        mark = "" if run["driver_loaded_before"] else ", driver compiled in the step"
        mark += "" if within else ", OUTSIDE 5% + 8 MiB"
        return f"{growth:,} ({100 * (growth / expected - 1):+.1f}%{mark})"

    return f"x{scale}: {expected:,} | {cell(found)} | {cell(found['primed'])}"


def model_row(name: str, rounds: int, count: int, fresh: bool) -> str:
    step, args = _step(name, 1, "vg")
    predicted = step.explain(*args).peak_bytes
    counted, must = checked_peak(name)
    verdict = "=" if counted == must else f"MISMATCH ({must:,} predicted)"
    if predicted != must:
        verdict += f", printed {predicted:,} B"
    rows = frontier_times(name, rounds, count)
    points = "; ".join(
        f"{r['peak']:,} +{100 * r['added']:.1f}% {r['ms']:.2f} ms {r['ratio']:.2f}x" for r in rows
    )
    fresh_text = fresh_cells(name, SCALES[name]) if fresh else "- | - | -"
    return (
        f"| {name} | {predicted:,} | {counted:,} {verdict} | {fresh_text} | {len(rows)} of "
        f"{len(step.trace(*args).planner.frontier())}: {points} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.memory_table")
    parser.add_argument("--models", default=",".join(SCALES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--frontier", type=int, default=4, help="frontier rows timed per model")
    parser.add_argument("--no-fresh", action="store_true", help="skip the fresh processes")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="step times")
    args = parser.parse_args(argv)
    CLOCK[0] = args.clock
    print(f"CPU: {cpu_name()}; {pin_process(1)['affinity']}; clock: {args.clock}")
    print(
        "| model | predicted peak | checked mode (+ arrays passed in) | fresh process: scale, "
        "predicted growth | fresh growth | primed growth | frontier rows timed: peak B, added "
        "FLOPs, step, vs default |"
    )
    print("|" + " --- |" * 7)
    for name in args.models.split(","):
        print(model_row(name, args.rounds, args.frontier, not args.no_fresh), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
