"""Step time of two backplan installations, A and B, in interleaved fresh processes: what a
"no step-time regression" claim rests on. Each process is pinned to --threads CPUs (one by
default) with as many threads everywhere (BLAS, OpenMP, Numba), builds the bench models
through backplan's value_and_grad peer (or, with --peer backplan.compile, @bp.compile and
.backward()), waits for their compiled drivers, then times every model in rounds; A and B
alternate, so drift in the box's speed hits both. Each installation keeps its own cache
folder, warmed by a first process that is not counted.

    python -m venv --system-site-packages /tmp/before && /tmp/before/bin/pip install \\
        --no-deps -e /path/to/an/older/checkout
    python -m backplan.bench.revisions --a /tmp/before/bin/python --b python \\
        --models mlp,transformer,lstm12 --processes 3

--clock cpu times each step by CPU time instead of the wall clock: on a box other processes
share, the only reading that means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(
    models: list[str], cpus: list[int], rounds: int, peer: str, clock: str = "wall"
) -> dict[str, float]:
    """Median step seconds per model, in this process (CPU seconds with clock "cpu")."""
    os.sched_setaffinity(0, set(cpus))
    import numba
    import numpy as np
    from threadpoolctl import threadpool_limits

    from backplan.bench.internals import driver_builder
    from backplan.bench.models import MODELS
    from backplan.bench.peers import PEERS

    numba.set_num_threads(len(cpus))
    threadpool_limits(len(cpus))
    runners = {}
    for name in models:
        spec = MODELS[name]
        runners[name] = PEERS[peer]().build(spec, spec.inputs(False, np.dtype("float32")))
        runners[name].step()
    driver_builder.wait_for_builds()
    steps = {name: runner.step for name, runner in runners.items()}
    if clock == "cpu":
        return cpu_medians(
            steps, rounds, 0.3, time.thread_time if len(cpus) == 1 else time.process_time
        )
    medians = this_checkouts_timing().interleaved_medians(steps, rounds, 0.3, settle=1)
    return {name: ms / 1e3 for name, ms in medians.items()}


def cpu_medians(steps: dict, rounds: int, seconds: float, clock) -> dict[str, float]:
    """{name: median over rounds of each round's median CPU seconds per call}, interleaved as
    measure.interleaved_medians (one untimed call before each turn). On a box whose CPUs other
    processes share, the wall clock counts their time slices: at load 4-6 the same install
    read 1.9-6.2 ms for the mlp's step from one process to the next."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            step()
            calls, end = [], time.perf_counter() + seconds
            while len(calls) < 3 or time.perf_counter() < end:
                start = clock()
                step()
                calls.append(clock() - start)
            samples[name].append(statistics.median(calls))
    return {name: statistics.median(values) for name, values in samples.items()}


def this_checkouts_timing():
    """bench/measure.py beside this file, loaded by path: the same timing for installation A,
    which may predate it (measure.py needs only the standard library)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measure.py")
    spec = importlib.util.spec_from_file_location("bench_measure_of_this_checkout", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def run(
    python: str,
    models: list[str],
    cpus: list[int],
    rounds: int,
    cache: str,
    peer: str,
    clock: str = "wall",
) -> dict:
    threads = str(len(cpus))
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": cache,
        "BACKPLAN_QUIET": "1",
        "OPENBLAS_NUM_THREADS": threads,
        "OMP_NUM_THREADS": threads,
        "NUMBA_NUM_THREADS": threads,
    }
    # This file by path: installation A need not have it.
    command = [python, "-I", os.path.abspath(__file__), "--child", ",".join(models)]
    command += ["--cpus", ",".join(map(str, cpus)), "--rounds", str(rounds), "--peer", peer]
    command += ["--clock", clock]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=1800, cwd=tempfile.gettempdir()
    )
    if done.returncode != 0:
        raise SystemExit(f"{python}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", help="the Python of installation A (the one before)")
    parser.add_argument("--b", default=sys.executable, help="the Python of installation B")
    parser.add_argument("--models", default="mlp,mlp_tiny,transformer,ln_gelu,lstm12,mlp_deep,cnn")
    parser.add_argument("--processes", type=int, default=3, help="timed processes per side")
    parser.add_argument("--rounds", type=int, default=5, help="rounds within a process")
    parser.add_argument(
        "--cpu", type=int, help="the first CPU to pin to (default: the first this process may use)"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPUs (and threads) per process")
    parser.add_argument(
        "--peer",
        choices=("backplan", "backplan.compile"),
        default="backplan",
        help="value_and_grad (backplan) or @bp.compile + .backward() (backplan.compile)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: each step's CPU time (the thread's on one CPU, the process's on more)",
    )
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        cpus = [int(cpu) for cpu in args.cpus.split(",")]
        print(json.dumps(child(args.child.split(","), cpus, args.rounds, args.peer, args.clock)))
        return 0
    usable = sorted(os.sched_getaffinity(0))
    if args.cpu is None:  # under `taskset -c 1` CPU 0 is not this process's to use
        args.cpu = usable[0]
    if not 1 <= args.threads <= len(usable) or args.cpu not in usable:
        parser.error(f"--cpu {args.cpu} --threads {args.threads}: this process may use {usable}")
    start = usable.index(args.cpu)
    cpus = (usable[start:] + usable[:start])[: args.threads]
    if not args.a:
        parser.error("--a is required: the Python of the installation to compare against")
    models = args.models.split(",")
    caches = {side: tempfile.mkdtemp(prefix=f"backplan-revision-{side}-") for side in "ab"}
    # children run in the temporary folder: a relative path (.venv/bin/python) must not
    # name a file there; a bare name (python) is still looked up on PATH
    pythons = {
        side: os.path.abspath(path) if os.sep in path else path
        for side, path in (("a", args.a), ("b", args.b))
    }
    for side in "ab":  # warm each cache: compile kernels and drivers once, not timed
        run(pythons[side], models, cpus, 1, caches[side], args.peer, args.clock)
    results: dict[str, list[dict]] = {"a": [], "b": []}
    for _ in range(args.processes):
        for side in "ab":
            results[side].append(
                run(pythons[side], models, cpus, args.rounds, caches[side], args.peer, args.clock)
            )
    clock = ", clock cpu" if args.clock == "cpu" else ""
    print(f"CPUs {cpus}, {len(cpus)} thread(s) per process, peer {args.peer}{clock}")
    print(f"{'model':12} {'A ms':>10} {'B ms':>10} {'B/A':>7}  (medians of {args.processes} each)")
    for name in models:
        a = statistics.median(r[name] for r in results["a"])
        b = statistics.median(r[name] for r in results["b"])
        print(f"{name:12} {a * 1e3:10.4f} {b * 1e3:10.4f} {b / a:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
