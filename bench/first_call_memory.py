"""A fresh process's very first step, nothing loaded before it: the growth of its peak
resident memory against the predicted peak less the arrays passed in, plus what the process
measured it loaded for compiled code on the way (`report.process_bytes`,
codegen/build/process_memory.py).

bench.memory loads a step's kernels and driver before measuring, so its growth is the step's
alone; a user's first call loads them inside the step, and before report.process_bytes that
memory (LLVM's own code pages, the kernels' machine code: 7-10 MB from a warm cache on one Zen 4
core) was in no figure, so a first step at bp.max_batch's batch for N bytes reached N plus it.
A warm-up child fills the disk cache first; the measured child runs under glibc settings that
map every block apart and return it when freed (MALLOC_MMAP_THRESHOLD_=0,
MALLOC_TRIM_THRESHOLD_=0: the README's way to check).

    python -m backplan.bench.first_call_memory [--models mlp,transformer] [--scale 8]
        [--steps train,vg]
"""

from __future__ import annotations

import argparse
import json
import sys

from .memory import _calls, _run_child, _step, high_water_growth

HERE = "backplan.bench.first_call_memory"
HEADER = (
    "| model | step | scale | predicted growth (peak - arrays passed in) | measured growth "
    "(VmHWM - VmRSS), first call | process_bytes, measured loading | not predicted | not "
    "predicted, process_bytes counted |\n|" + " --- |" * 8
)


def child(name: str, scale: int, kind: str) -> dict:
    """Run in the fresh process: the step's first call, its kernels loaded by it."""
    from backplan.bench.internals import predicted_peak, process_memory

    step, args = _step(name, scale, kind)
    predicted = predicted_peak(_calls(step, args), "numba")
    held = process_memory.code_bytes()
    growth = high_water_growth(step, args)
    resident = predicted.input_bytes + predicted.at_peak().get("constants", 0)
    return {
        "expected_growth": predicted.peak_bytes - resident,
        "measured_growth": growth,
        "process_bytes": process_memory.code_bytes() - held,
        "process_before": held,
    }


def measure(name: str, scale: int, kind: str) -> dict:
    _run_child("warm", name, scale, kind, module="backplan.bench.memory")
    found = json.loads(_run_child("child", name, scale, kind, module=HERE).splitlines()[-1])
    return dict(found, model=name, step=kind, scale=scale)


def row(found: dict) -> str:
    expected, growth = found["expected_growth"], found["measured_growth"]
    rest = growth - expected
    counted = rest - found["process_bytes"]
    share = lambda n: f"{n:+,} ({100 * n / max(expected, 1):+.1f}%)"  # noqa: E731
    return (
        f"| {found['model']} | {found['step']} | {found['scale']} | {expected:,} | {growth:,} | "
        f"{found['process_bytes']:,} | {share(rest)} | {share(counted)} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.first_call_memory")
    parser.add_argument("--models", default="mlp,mlp_deep,transformer,ln_gelu,cnn")
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--steps", default="train,vg")
    args = parser.parse_args(argv)
    print(HEADER)
    for name in args.models.split(","):
        for kind in args.steps.split(","):
            print(row(measure(name, args.scale, kind)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
