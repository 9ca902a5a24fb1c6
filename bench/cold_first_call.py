"""Cold first call of backplan and JAX, interleaved, each in a fresh process pinned to one CPU.

    python -m backplan cache prebuild                       # once per installation
    python -m backplan.bench.cold_first_call mlp_infer mlp transformer --rounds 3 --cpu 1

Each round runs, per model, backplan then JAX in fresh interpreters (empty plan and library
cache folders, so backplan compiles the plan's loops and loads the prebuilt library; JAX's
persistent cache off, one XLA thread). Per run: process CPU seconds of building the peer's
runner and of its first step apart, because the two peers split them differently: JAX's build
(`jax.numpy.asarray` of the inputs) starts its CPU backend, 0.4-0.5 s, while backplan's build
does almost nothing and its first step traces, plans and compiles. The table gives medians.

`--collect full,end-of-compile` runs backplan's children both ways in each round, interleaved:
`end-of-compile` is the default (codegen/run/compile_garbage.py: each compile's garbage collected
as it ends, the older objects frozen), `full` the behaviour before it (no collection at a
compile's end, one full collection after a compiling call), so the A/B that the change was
measured with is one command:

    taskset -c 1 python -m backplan.bench.cold_first_call mlp_infer --rounds 5 \
        --collect full,end-of-compile

The figure assumes the library built ahead of time: without `cache prebuild` (or with one made
before the library's source changed) backplan's first call compiles library kernels too, 4-5 s
instead of well under one. The run says so in a warning line, before the rounds when no
prebuilt folder is found and after them when a child compiled library functions anyway.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PEER_NAMES = ("backplan", "jax")
COLLECTS = ("end-of-compile", "full")


@contextlib.contextmanager
def library_compiles():
    """Yields the names of the library functions Numba compiles (not loads) inside the block:
    the prebuilt folder had no entry for them."""
    from numba.core import event

    from backplan.bench.internals import library_cache

    compiled: list[str] = []

    class Listener(event.Listener):
        def on_start(self, event_) -> None:
            func = getattr(event_.data.get("dispatcher"), "py_func", None)
            code = getattr(func, "__code__", None)
            if (
                code is not None
                and library_cache.is_library_file(code.co_filename)
                and func.__module__.startswith("backplan.")  # not a plan's loop batch
            ):
                compiled.append(func.__qualname__)

        def on_end(self, event_) -> None:
            pass

    with event.install_listener("numba:compile", Listener()):
        yield compiled


def prebuilt_missing() -> str | None:
    """Why this installation has no prebuilt library to load (None when it has one)."""
    from backplan.bench.internals import prebuilt_library

    folder = prebuilt_library.prebuilt_folder()
    if not os.path.isdir(folder) or not any(files for _, _, files in os.walk(folder)):
        return f"no prebuilt library in {folder}"
    if not prebuilt_library.usable(folder):
        return f"the prebuilt library in {folder} is not usable (owner or permissions)"
    return None


def warning_lines(runs: list[dict]) -> list[str]:
    """What a reader must know before trusting backplan's column: library functions compiled in
    the children (the prebuilt library missing or older than the source)."""
    compiled = [r for r in runs if r.get("library_compiles")]
    if not compiled:
        return []
    names = sorted({name for r in compiled for name in r["library_compiles"]})
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return [
        f"warning: {len(compiled)} of {sum(r['peer'] == 'backplan' for r in runs)} backplan "
        f"runs compiled library functions ({shown}): their first call counts library compiles "
        "a prebuilt installation does not pay; run `python -m backplan cache prebuild`"
    ]


def full_collection_after_call() -> None:
    """The collection before compile garbage was collected at each compile's end: the compile
    counter only counts, and a call that compiled runs one full collection after it."""
    import gc

    from backplan.bench.internals import compile_garbage as garbage

    def on_start(self, event_) -> None:
        garbage._compiles[0] = next(garbage._count) + 1

    def collect_if_compiled(before: int) -> bool:
        if garbage._compiles[0] == before:
            return False
        gc.collect()
        return True

    garbage._CompileCounter.on_start = on_start
    garbage._CompileCounter.on_end = lambda self, event_: None
    garbage.collect_if_compiled = collect_if_compiled


def child(peer_name: str, model: str, collect: str = "end-of-compile") -> dict:
    """One cold first call in this (fresh) process; collect: how backplan collects its
    compiles' garbage (COLLECTS)."""
    if peer_name == "backplan" and collect == "full":
        full_collection_after_call()
    if peer_name == "jax":
        os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    import numpy as np

    from backplan.bench.models import MODELS
    from backplan.bench.peers import PEERS

    spec, peer = MODELS[model], PEERS[peer_name]()
    inputs = spec.inputs(False, np.dtype("float32"))
    with library_compiles() as compiled:
        start = time.process_time()
        runner = peer.build(spec, inputs)
        built = time.process_time() - start
        runner.step()
        total = time.process_time() - start
    return {
        "peer": peer_name,
        "model": model,
        **({"collect": collect} if peer_name == "backplan" else {}),
        "build_cpu_s": built,
        "step_cpu_s": total - built,
        "first_call_cpu_s": total,
        "library_compiles": compiled,
        "load_average_1min": os.getloadavg()[0],
    }


def run_one(peer_name: str, model: str, cpu: int | None, collect: str = "end-of-compile") -> dict:
    with tempfile.TemporaryDirectory() as plans, tempfile.TemporaryDirectory() as library:
        env = {**os.environ, "BACKPLAN_CACHE_DIR": plans, "BACKPLAN_LIBRARY_CACHE_DIR": library}
        module = "backplan.bench.cold_first_call"
        command = [sys.executable, "-m", module, "--child", peer_name, model]
        command += ["--collect", collect]
        if cpu is not None:
            command = ["taskset", "-c", str(cpu), *command]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"peer": peer_name, "model": model, "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(runs: list[dict], models: list[str]) -> str:
    """One row per model and backplan collection mode run (COLLECTS), against JAX."""

    def median(model, peer, key, collect=None):
        values = [
            r[key]
            for r in runs
            if r["model"] == model
            and r["peer"] == peer
            and key in r
            and (collect is None or r.get("collect") == collect)
        ]
        return statistics.median(values) if values else float("nan")

    collects = [c for c in COLLECTS if any(r.get("collect") == c for r in runs)]
    lines = [
        "| model | backplan first call | JAX step | JAX build + step | backplan / JAX step "
        "| backplan / JAX build + step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for model in models:
        step = median(model, "jax", "step_cpu_s")
        whole = median(model, "jax", "first_call_cpu_s")
        for collect in collects or [None]:
            ours = median(model, "backplan", "first_call_cpu_s", collect)
            label = model if len(collects) < 2 else f"{model} (collect {collect})"
            lines.append(
                f"| {label} | {ours:.3f} | {step:.3f} | {whole:.3f} | {ours / step:.2f}x "
                f"| {ours / whole:.2f}x |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["mlp_infer", "mlp", "transformer"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", type=int, help="pin every process to this CPU")
    parser.add_argument("--json", metavar="PATH", help="write every run here too")
    parser.add_argument(
        "--collect",
        default="end-of-compile",
        help="how backplan collects its compiles' garbage, one or both, comma-separated: "
        "end-of-compile (the default: at each compile's end) or full (before: a full "
        "collection after the compiling call); both are run in each round, alternating order",
    )
    parser.add_argument("--child", nargs=2, metavar=("PEER", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    collects = args.collect.split(",")
    if not collects or any(c not in COLLECTS for c in collects):
        parser.error(
            f"--collect takes {' or '.join(COLLECTS)} (comma-separated), got {args.collect!r}"
        )
    if args.child:
        print(json.dumps(child(*args.child, collects[0])))
        return 0
    missing = prebuilt_missing()
    if missing:
        print(
            f"warning: {missing}: backplan's first call will compile the library (seconds: "
            "4-5 s for mlp_infer), which an installation pays once at `python -m backplan "
            "cache prebuild`",
            file=sys.stderr,
            flush=True,
        )
    runs = []
    for i in range(args.rounds):
        for model in args.models:
            order = collects if i % 2 == 0 else collects[::-1]
            for peer_name, collect in [("backplan", c) for c in order] + [("jax", collects[0])]:
                run = run_one(peer_name, model, args.cpu, collect)
                print(json.dumps(run), flush=True)
                runs.append(run)
    print(table(runs, args.models))
    for line in warning_lines(runs):
        print(line, file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(runs, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
