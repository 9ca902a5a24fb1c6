"""Predicted against measured peak memory of each bench model's step, measured from outside.

Each model runs in a fresh process with glibc told to map every block and return it when freed
(MALLOC_MMAP_THRESHOLD_=0, MALLOC_TRIM_THRESHOLD_=0). After a first step loads (or compiles) the
kernels and its outputs are dropped, the child writes 5 to /proc/self/clear_refs to reset the
peak, reads VmRSS, runs one step, and reads VmHWM: their difference is the memory the step newly
held. It should equal the predicted peak (ir/peak.py) less the arrays passed in and less what
the first step already allocated and keeps (arenas, constants), within 5% + 8 MiB (page
rounding, the GEMM's packing buffers and short-lived buffers inside kernels are not predicted).

    python -m backplan.bench.memory [--models mlp,mlp_deep] [--scale 8]

--scale multiplies the batch (and rows) so the step holds tens of MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SCALABLE = ("batch", "rows")


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(name: str, scale: int) -> dict:
    """Run in the fresh process: one warm step, then the measured one."""
    import numpy as np

    import backplan as bp
    from backplan.bench.internals import joint_calls, predicted_peak
    from backplan.bench.models import MODELS
    from backplan.bench.peers.backplan_peer import bench_function

    spec = MODELS[name]
    config = {k: v * scale if k in SCALABLE else v for k, v in spec.config.items()}
    inputs = spec.make_inputs(config, 0).cast(np.float32)
    params = {k: bp.tensor(v) for k, v in inputs.params.items()}
    batch = [bp.tensor(a) for a in inputs.batch(True)]
    step = bp.value_and_grad(bench_function(spec), background=False)
    first = step(params, *batch)  # loads or compiles the kernels, allocates the arena; held,
    # so the measured step's outputs are new buffers, not the first step's reused
    predicted = predicted_peak(joint_calls(step.trace(params, *batch).plan, 1), "numba")
    kept = predicted.at_peak().get("scratch", 0) + predicted.at_peak().get("constants", 0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as file:
        file.write("5")
    before = _status("VmRSS")
    result = step(params, *batch)
    growth = _status("VmHWM") - before
    del result, first
    return {
        "model": name,
        "scale": scale,
        "predicted_peak": predicted.peak_bytes,
        "inputs": predicted.input_bytes,
        "kept_from_first_step": kept,
        "expected_growth": predicted.peak_bytes - predicted.input_bytes - kept,
        "measured_growth": growth,
    }


def measure(name: str, scale: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="0", MALLOC_TRIM_THRESHOLD_="0")
    code = (
        "import json; from backplan.bench.memory import child; "
        f"print(json.dumps(child({name!r}, {scale})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.memory")
    parser.add_argument("--models", default="mlp,mlp_deep,transformer,ln_gelu,cnn")
    parser.add_argument("--scale", type=int, default=8)
    args = parser.parse_args(argv)
    print(
        "| model | scale | predicted peak | arrays passed in | expected growth | measured "
        "growth (VmHWM - VmRSS) | within 5% + 8 MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        row = measure(name, args.scale)
        expected, got = row["expected_growth"], row["measured_growth"]
        ok = abs(got - expected) <= 0.05 * expected + 8 * 2**20
        print(
            f"| {name} | {args.scale} | {row['predicted_peak']:,} | {row['inputs']:,} | "
            f"{expected:,} | {got:,} | {'yes' if ok else 'no'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
