"""Warm start of a bench model: `python -m backplan.bench.warm_start [--model mlp] [--runs 5]`.

One process fills a kernel cache folder (or `--cache-dir` names a long-lived one, e.g. a copy of
a real user's `~/.cache/backplan/kernels`); then fresh interpreters import backplan and make the
model's first `bp.value_and_grad(bp.compile(loss))` call against that warm folder. Reports the
medians (and ranges) of `import backplan` and of the first call, wall and CPU seconds apart, with
the CPU and the load average around the runs: on a shared machine wall time moves with the load,
CPU time much less. The first call includes one step; the second call's time is that step alone.

--against-path DIR: the same first call of another installation, a package copy (DIR/backplan,
as `python -m backplan.bench.data_parallel_passes --copy REV DIR` lays one out), each side with
its own warm folder filled the same way, fresh processes of the two sides alternated
(`--runs` rounds): both sides' process CPU s of the first call (its step included), their
medians and the ratio. Pin the command (`taskset -c 0`) to pin every child.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from .child import child_result
from .environment import cpu_name

CHILD = r"""
import json, sys, time
w0, c0 = time.perf_counter(), time.process_time()
import backplan as bp
w1, c1 = time.perf_counter(), time.process_time()
from backplan.bench.models import value_and_grad_step
step, args = value_and_grad_step(sys.argv[1])
w2, c2 = time.perf_counter(), time.process_time()
step(*args)
w3, c3 = time.perf_counter(), time.process_time()
step(*args)
w4, c4 = time.perf_counter(), time.process_time()
print(json.dumps({"import": w1 - w0, "import_cpu": c1 - c0,
                  "first_call": w3 - w2, "first_call_cpu": c3 - c2,
                  "second_call": w4 - w3, "second_call_cpu": c4 - c3,
                  "where": bp.__file__}))
"""

PARTS = ("import", "import_cpu", "first_call", "first_call_cpu", "second_call", "second_call_cpu")


def start_once(model: str, cache: str, path: str | None = None, **variables: str) -> dict:
    """One fresh interpreter (-I: no user site, no PYTHON* variables) against `cache`; path:
    a package copy's folder, put first on its sys.path (-I ignores PYTHONPATH)."""
    env = {**os.environ, "BACKPLAN_CACHE_DIR": cache, "BACKPLAN_QUIET": "1", **variables}
    source = CHILD if path is None else f"import sys; sys.path.insert(0, {path!r})\n" + CHILD
    return child_result([sys.executable, "-I", "-c", source, model], env, 900, "warm-start child")


def measure_against(model: str, rounds: int, path: str, caches: dict) -> dict:
    """{"this"/"other": [first-call process CPU s per round]}: each side's folder (caches[side])
    filled by one default-mode process of that side, then one fresh process a side per round,
    the order flipped every round."""
    paths = {"this": None, "other": path}
    for side in ("this", "other"):
        start_once(model, caches[side], paths[side])
    found: dict = {"this": [], "other": []}
    for r in range(rounds):
        for side in ("this", "other") if r % 2 == 0 else ("other", "this"):
            sample = start_once(model, caches[side], paths[side])
            found[side].append(sample["first_call_cpu"])
            found[f"{side}_where"] = sample["where"]
    return found


def against_text(model: str, found: dict) -> str:
    this, other = statistics.median(found["this"]), statistics.median(found["other"])
    lower = sum(t < o for t, o in zip(found["this"], found["other"], strict=True))
    return (
        f"{model}: first call, process CPU s, fresh warm processes alternated: other "
        f"{other:.4f} ({', '.join(f'{s:.4f}' for s in found['other'])}), this {this:.4f} "
        f"({', '.join(f'{s:.4f}' for s in found['this'])}): {this / other:.3f}x, this lower in "
        f"{lower} of {len(found['this'])} rounds; CPU {cpu_name()}; other imported from "
        f"{found['other_where']}, this from {found['this_where']}"
    )


def measure(model: str, runs: int, cache: str, fill: str = "default") -> dict:
    """Fill `cache` with one process (not counted), then `runs` fresh warm ones. fill "default":
    the filling process runs as a user's process does, its second call building the direct
    driver the warm processes load (what a user's second process starts with); "inline": it
    compiles the plan's Numba driver in the call (BACKPLAN_DRIVER=inline), the default of rows
    recorded before 2026-11-29, kept to compare with them."""
    if fill == "inline":
        start_once(model, cache, BACKPLAN_DRIVER="inline")
    else:
        start_once(model, cache)
    load_before = os.getloadavg()
    samples = [start_once(model, cache) for _ in range(runs)]
    load_after = os.getloadavg()
    row: dict = {"model": model, "runs": runs, "cache_entries": _entries(cache), "fill": fill}
    for part in PARTS:
        values = [s[part] for s in samples]
        row[part] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    row["load"] = [round(load_before[0], 2), round(load_after[0], 2)]
    row["samples"] = samples
    row["cpu"] = cpu_name()
    return row


def _entries(cache: str) -> int:
    """Files in the cache folder and Numba's `__pycache__` beside them."""
    count = 0
    for _, _, files in os.walk(cache):
        count += len(files)
    return count


def markdown(row: dict) -> str:
    def cell(part: str) -> str:
        s = row[part]
        return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"

    return "\n".join(
        [
            "| model | cache files | import s | import CPU s | first call s | first call CPU s "
            "| second call s |",
            "|---|---|---|---|---|---|---|",
            f"| {row['model']} | {row['cache_entries']} | {cell('import')} | "
            f"{cell('import_cpu')} | {cell('first_call')} | {cell('first_call_cpu')} | "
            f"{cell('second_call')} |",
            "",
            f"medians (min-max) of {row['runs']} fresh processes; CPU {row['cpu']}; "
            f"load average {row['load'][0]} before, {row['load'][1]} after",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.warm_start")
    parser.add_argument("--model", default="mlp", help="a bench model name (default mlp)")
    parser.add_argument("--runs", type=int, default=5, help="fresh warm processes")
    parser.add_argument(
        "--cache-dir",
        help="a kernel cache folder to use and keep (default: a new temporary one)",
    )
    parser.add_argument(
        "--fill",
        choices=("inline", "default"),
        default="default",
        help="how the filling process runs: default (as a user's process: the direct driver "
        "built in its second call) or inline (its Numba driver compiled in the call; the "
        "harness's default before 2026-11-29, to compare with rows recorded then)",
    )
    parser.add_argument("--json", action="store_true", help="print the row as JSON")
    parser.add_argument("--against-path", help="a package copy's folder: an A/B of first calls")
    args = parser.parse_args(argv)
    if args.against_path:
        with tempfile.TemporaryDirectory() as this, tempfile.TemporaryDirectory() as other:
            found = measure_against(
                args.model, args.runs, args.against_path, {"this": this, "other": other}
            )
        print(against_text(args.model, found))
        return 0
    folder = args.cache_dir or tempfile.mkdtemp(prefix="bp-warm-start-")
    try:
        row = measure(args.model, args.runs, folder, args.fill)
    finally:
        if not args.cache_dir:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(row) if args.json else markdown(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
