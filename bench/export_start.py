"""Cold and warm start of a loaded artifact: `python -m backplan.bench.export_start`.

Exports the demo MLP (32-64-64-10, batch 64) twice, as a compiled function (forward, then
backward) and as bp.value_and_grad (one joint plan), then starts fresh interpreters that load the
file and make the first call. Cold runs start with an empty kernel cache folder; warm runs reuse
the folder the runs before them filled. Reports medians of load time and first-call time and the
cold/warm ratio of their sum, per backend.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

import numpy as np

import backplan as bp
from backplan.examples.mlp import init_mlp, mlp_loss

from .child import child_result

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import backplan as bp
t1 = time.perf_counter()
fn = bp.load(sys.argv[1])
t2 = time.perf_counter()
args, kwargs = fn.example_args()
if sys.argv[2] == "compiled":
    fn(*args, **kwargs).backward()
else:
    fn(*args, **kwargs)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first_call": t3 - t2}))
"""


def export_demo(folder: str) -> dict[str, str]:
    params = init_mlp([32, 64, 64, 10])
    x, labels = np.zeros((64, 32), np.float32), np.zeros(64, np.int64)
    return {
        "compiled": bp.export(mlp_loss, params, x, labels, path=os.path.join(folder, "loss.bpz")),
        "value_and_grad": bp.export(
            bp.value_and_grad(mlp_loss), params, x, labels, path=os.path.join(folder, "step.bpz")
        ),
    }


def start_once(path: str, kind: str, backend: str, cache: str) -> dict:
    env = {**os.environ, "BACKPLAN_BACKEND": backend, "BACKPLAN_CACHE_DIR": cache}
    env["BACKPLAN_DRIVER_AT_EXIT"] = "kill"  # no build left compiling beside the next timed run
    return child_result([sys.executable, "-I", "-c", CHILD, path, kind], env, 600, "start child")


def measure(path: str, kind: str, backend: str, runs: int, folder: str) -> dict:
    cache = os.path.join(folder, f"cache-{kind}-{backend}")
    cold, warm = [], []
    for _ in range(runs):
        shutil.rmtree(cache, ignore_errors=True)
        cold.append(start_once(path, kind, backend, cache))
    for _ in range(runs):
        warm.append(start_once(path, kind, backend, cache))

    def median(samples, part):
        return statistics.median(s[part] for s in samples)

    row = {"kind": kind, "backend": backend}
    for label, samples in (("cold", cold), ("warm", warm)):
        for part in ("import", "load", "first_call"):
            row[f"{label}_{part}"] = median(samples, part)
    row["ratio"] = (row["cold_load"] + row["cold_first_call"]) / (
        row["warm_load"] + row["warm_first_call"]
    )
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| artifact | backend | cold: load + first call | warm: load + first call | cold/warm |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        cold = f"{_ms(r['cold_load'])} + {_ms(r['cold_first_call'])}"
        warm = f"{_ms(r['warm_load'])} + {_ms(r['warm_first_call'])}"
        lines.append(f"| {r['kind']} | {r['backend']} | {cold} | {warm} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.2f} ms"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.export_start")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per cold/warm cell")
    parser.add_argument("--backends", default="numba,reference")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bp-export-start-")
    try:
        paths = export_demo(folder)
        rows = [
            measure(path, kind, backend, args.runs, folder)
            for backend in args.backends.split(",")
            for kind, path in paths.items()
        ]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
