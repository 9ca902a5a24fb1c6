"""New batch sizes of a seen model: `python -m backplan.bench.batch_sizes [--models mlp,cnn]`.

For each bench model, a fresh process against a warm cache folder (filled with the model's
documented batch size B) calls `bp.value_and_grad(bp.compile(loss, dynamic=...))` at B, then at
two sizes it has not seen (B + B/2 and 2B + 1), and reports each first call's wall time, the
loop kernels it compiled or loaded, and how many functions Numba compiled in it (counted at
numba.core.compiler.compile_extra, so loads from the disk cache do not count). Declared dynamic
batch axes against `dynamic=False` (a plan per size), each in a copy of the warm folder, rounds
interleaved, medians; the driver compiles in the call (BACKPLAN_DRIVER=inline) so that every
compile is counted where it happens, or with `--driver default` as a user's process runs (the
first call Python-run, the direct driver from the second: the direct drivers built at each size
are counted, and the second call's thread CPU given). Each first call's thread CPU time is given
too: on a shared box the wall clock of a 50 ms call is mostly other processes' time.

--against-path DIR: declared dynamic axes only, this installation against a package copy (as
`python -m backplan.bench.data_parallel_passes --copy REV DIR` lays one out), each with its own
warm folder, fresh processes alternated: a row a side (`--driver default` as a user's process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from .affinity import cpu_list_text, current_affinity
from .child import child_result
from .environment import cpu_name

# The batch axes of each kind's loss arguments (lstm: xs is (steps, batch, inputs)).
AXES = {
    "mlp": {"x": 0, "labels": 0},
    "cnn": {"x": 0, "labels": 0},
    "transformer": {"x": 0},
    "lstm": {"xs": 1, "target": 0},
}

CHILD = r"""
import json, sys, time
import numba.core.compiler as compiler
compiled = [0]
original = compiler.compile_extra
def counting(*args, **kwargs):
    compiled[0] += 1
    return original(*args, **kwargs)
compiler.compile_extra = counting
import numpy as np
import backplan as bp
from backplan.bench.batch_sizes import loss_of
from backplan.bench.models import MODELS
from backplan.bench.internals import direct_driver, kernel_cache
built = [0]
compile_driver = direct_driver.compile_driver
def counting_drivers(*args, **kwargs):
    built[0] += 1
    return compile_driver(*args, **kwargs)
direct_driver.compile_driver = counting_drivers
name, dynamic, sizes = sys.argv[1], sys.argv[2] == "dynamic", json.loads(sys.argv[3])
spec = MODELS[name]
loss, axes = loss_of(spec)
step = bp.value_and_grad(bp.compile(loss, dynamic=axes if dynamic else False))
rows = []
for n in sizes:
    data = spec.make_inputs({**spec.config, "batch": n}, 0).cast(np.float32)
    args = [{k: bp.tensor(v) for k, v in data.params.items()}]
    args += [bp.tensor(b) for b in data.batch(True)]
    kernels, numba_before, drivers = kernel_cache.counts().versions, compiled[0], built[0]
    start, cpu = time.perf_counter(), time.thread_time()
    step(*args)
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    numba, kernels = compiled[0] - numba_before, kernel_cache.counts().versions - kernels
    start, second_cpu = time.perf_counter(), time.thread_time()
    step(*args)
    rows.append({"size": n, "seconds": seconds, "cpu": cpu, "numba": numba, "kernels": kernels,
                 "step": time.perf_counter() - start, "step_cpu": time.thread_time() - second_cpu,
                 "drivers": built[0] - drivers, "numba_second": compiled[0] - numba_before - numba})
print(json.dumps({"calls": rows, "traces": step.cache_info().traces}))
"""


def loss_of(spec):
    """The model's loss with named data arguments (so dynamic= can name them), and its axes."""
    from .models import BACKPLAN_KINDS

    base, static = BACKPLAN_KINDS[spec.kind][0], spec.static or {}
    if spec.kind in ("mlp", "cnn"):

        def loss(params, x, labels):
            return base(params, x, labels, **static)
    elif spec.kind == "transformer":

        def loss(params, x):
            return base(params, x, **static)
    else:

        def loss(params, xs, target):
            return base(params, xs, target, **static)

    return loss, {name: {axis: "batch"} for name, axis in AXES[spec.kind].items()}


def run_child(
    model: str, mode: str, sizes: list[int], cache: str, driver: str = "inline", path=None
) -> dict:
    """path: a package copy's folder, first on the child's PYTHONPATH (started outside any
    checkout, so `import backplan` finds the copy, not the folder it was started in)."""
    env = {**os.environ, "BACKPLAN_CACHE_DIR": cache, "BACKPLAN_QUIET": "1"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([path, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("BACKPLAN_DRIVER", None)
    if driver == "inline":
        env["BACKPLAN_DRIVER"] = "inline"
    env.pop("BACKPLAN_BACKEND", None)
    command = [sys.executable, "-c", CHILD, model, mode, json.dumps(sizes)]
    cwd = tempfile.gettempdir() if path is not None else None
    return child_result(command, env, 1800, f"{model} {mode} child", cwd=cwd)


def measure(model: str, rounds: int, driver: str = "inline", new_sizes=None) -> list[dict]:
    """Per mode: the median of each call's numbers over `rounds` fresh processes, each in a
    copy of one warm folder (filled at the documented size in both modes). new_sizes: the two
    sizes after B (default B + B/2 and 2B + 1)."""
    from .models import MODELS

    batch = MODELS[model].config["batch"]
    sizes = [batch, *(new_sizes or (batch + max(1, batch // 2), 2 * batch + 1))]
    warm = tempfile.mkdtemp(prefix="bp-batch-sizes-")
    try:
        for mode in ("dynamic", "fixed"):
            run_child(model, mode, sizes[:1], warm, driver)
        samples: dict[str, list] = {"dynamic": [], "fixed": []}
        for _ in range(rounds):
            for mode in samples:
                copy = tempfile.mkdtemp(prefix="bp-batch-sizes-")
                shutil.rmtree(copy)
                shutil.copytree(warm, copy)
                try:
                    samples[mode].append(run_child(model, mode, sizes, copy, driver))
                finally:
                    shutil.rmtree(copy, ignore_errors=True)
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    return [_row(model, mode, runs) for mode, runs in samples.items()]


def measure_against(
    model: str, rounds: int, path: str, driver: str = "default", new_sizes=None
) -> list[dict]:
    """Declared dynamic batch axes, this installation against a package copy (path): each
    side's warm folder filled at B by its own process, then per round one fresh process a side
    (the order flipped every round), each in a copy of its side's folder; one row a side."""
    from .models import MODELS

    batch = MODELS[model].config["batch"]
    sizes = [batch, *(new_sizes or (batch + max(1, batch // 2), 2 * batch + 1))]
    paths = {"this": None, "other": path}
    warm = {side: tempfile.mkdtemp(prefix="bp-batch-sizes-") for side in paths}
    samples: dict[str, list] = {side: [] for side in paths}
    try:
        for side in paths:
            run_child(model, "dynamic", sizes[:1], warm[side], driver, paths[side])
        for r in range(rounds):
            for side in ("this", "other") if r % 2 == 0 else ("other", "this"):
                copy = tempfile.mkdtemp(prefix="bp-batch-sizes-")
                shutil.rmtree(copy)
                shutil.copytree(warm[side], copy)
                try:
                    samples[side].append(
                        run_child(model, "dynamic", sizes, copy, driver, paths[side])
                    )
                finally:
                    shutil.rmtree(copy, ignore_errors=True)
    finally:
        for folder in warm.values():
            shutil.rmtree(folder, ignore_errors=True)
    return [_row(model, f"dynamic, {side}", samples[side]) for side in ("other", "this")]


def _row(model: str, mode: str, runs: list[dict]) -> dict:
    calls = []
    for i in range(len(runs[0]["calls"])):
        each = [r["calls"][i] for r in runs]
        calls.append(
            {
                "size": each[0]["size"],
                "seconds": statistics.median(c["seconds"] for c in each),
                "cpu": statistics.median(c.get("cpu", float("nan")) for c in each),
                "numba": statistics.median(c["numba"] for c in each),
                "kernels": statistics.median(c["kernels"] for c in each),
                "step": statistics.median(c.get("step", float("nan")) for c in each),
                "step_cpu": statistics.median(c.get("step_cpu", float("nan")) for c in each),
                "drivers": max(c.get("drivers", 0) for c in each),
                "numba_second": max(c.get("numba_second", 0) for c in each),
                # what being a new size costs beyond the size's step, per process
                "beyond": statistics.median(
                    c.get("cpu", float("nan")) - c.get("step_cpu", float("nan")) for c in each
                ),
            }
        )
    return {"model": model, "mode": mode, "calls": calls, "traces": runs[0]["traces"]}


def markdown(rows: list[dict], command: str, rounds: int) -> str:
    lines = [
        "Command:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"- CPU: {cpu_name()}; CPUs {cpu_list_text(current_affinity())}; {rounds} round(s), "
        f"medians; load average {os.getloadavg()[0]:.1f} at the end",
        "",
        "| model | batch axes | 1st call at B s | new size 1st call ms [thread CPU] (2nd call "
        "[CPU]) | Numba compiles (direct drivers built) | loop kernels | 3rd size 1st call ms "
        "[thread CPU] (2nd call [CPU]) | Numba compiles (direct drivers built) | traces "
        "| 1st call beyond its step, CPU ms (new size / 3rd size) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        first, second, third = row["calls"]
        mode = "dynamic=False" if row["mode"] == "fixed" else row["mode"]
        lines.append(
            f"| {row['model']} (B={first['size']}, then {second['size']}, {third['size']}) "
            f"| {mode} | {first['seconds']:.2f} | {_ms(second)} | {_compiles(second)} | "
            f"{second['kernels']:g} | {_ms(third)} | {_compiles(third)} | {row['traces']} "
            f"| {_beyond(second)} / {_beyond(third)} |"
        )
    return "\n".join(lines)


def _compiles(call: dict) -> str:
    """Numba compiles in the size's two calls, and the direct drivers built (default mode)."""
    numba = call["numba"] + call.get("numba_second", 0)
    return f"{numba:g} ({call.get('drivers', 0):g})"


def _beyond(call: dict) -> str:
    """The first call's thread CPU less the second's (the step): planning, lowering and
    rendering the size, its first run's page faults; the target's 50 ms for a model whose
    step alone nears or passes 50 ms (BENCHMARKS 31)."""
    beyond = call.get("beyond")
    if call.get("drivers", 0) or call.get("numba_second", 0):
        return "-"  # the second call built a driver: not the step
    return f"{beyond * 1e3:.1f}" if beyond is not None and beyond == beyond else "-"


def _ms(call: dict) -> str:
    step, step_cpu = call.get("step"), call.get("step_cpu")
    after = f" ({step * 1e3:.1f})" if step is not None and step == step else ""
    if after and step_cpu is not None and step_cpu == step_cpu:
        after = f" ({step * 1e3:.1f} [{step_cpu * 1e3:.1f}])"
    cpu = call.get("cpu")
    used = f" [{cpu * 1e3:.0f}]" if cpu is not None and cpu == cpu else ""
    return f"{call['seconds'] * 1e3:.0f}{used}{after}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.batch_sizes")
    parser.add_argument("--models", default="mlp,cnn,transformer,lstm12")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--driver",
        choices=("inline", "default"),
        default="inline",
        help="inline: every driver compiled in its call (counted there); default: as a user's "
        "process runs (direct drivers from the second call, counted)",
    )
    parser.add_argument(
        "--sizes",
        help="the two new sizes after each model's B, e.g. 10,12 (default B + B/2, 2B + 1)",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--against-path",
        help="a package copy's folder: its dynamic rows against this installation's, alternated",
    )
    args = parser.parse_args(argv)
    new_sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else None
    if new_sizes is not None and (len(new_sizes) != 2 or min(new_sizes) < 1):
        parser.error(f"--sizes takes two sizes of at least 1, got {args.sizes!r}")
    rows = [
        row
        for model in args.models.split(",")
        for row in (
            measure_against(model, args.rounds, args.against_path, args.driver, new_sizes)
            if args.against_path
            else measure(model, args.rounds, args.driver, new_sizes)
        )
    ]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    command = "python -m backplan.bench.batch_sizes " + " ".join(argv or sys.argv[1:])
    print(markdown(rows, command.strip(), args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
