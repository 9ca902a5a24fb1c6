"""Where a cold first call's seconds go: every Numba compile in the call, by function.

    BACKPLAN_CACHE_DIR=$(mktemp -d) taskset -c 1 python -m backplan.bench.compile_profile mlp

One model's first forward + backward call (the bench's backplan peer) in this process, with a
listener on Numba's compile events: the CPU seconds of the call, then per compiled function its
exclusive CPU seconds (its compiles less the compiles nested in them: a library function
compiled inside a kernel counts for itself), how many variants were compiled, and which
function first asked for it; and the compiles that the call itself started, with everything
nested in them. CPU seconds of this thread, not wall time: on a shared machine the wall time
of a compile stretches with the load, its CPU time much less. With an empty cache folder
(BACKPLAN_CACHE_DIR) the library compiles too, as after a fresh install; a function loaded
from the cache is no compile and is not listed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from numba.core import event


class CompileTimes(event.Listener):
    """Exclusive and top-level inclusive CPU seconds per compiled function."""

    def __init__(self):
        self.stack: list[list] = []  # [start, name, seconds of nested compiles]
        self.exclusive: dict[str, float] = {}
        self.variants: dict[str, int] = {}
        self.asked_by: dict[str, str] = {}
        self.top_level: dict[str, float] = {}

    def on_start(self, ev):
        function = ev.data["dispatcher"].py_func
        name = f"{function.__module__.removeprefix('backplan.')}.{function.__qualname__}"
        self.stack.append([time.thread_time(), name, 0.0])

    def on_end(self, ev):
        start, name, nested = self.stack.pop()
        total = time.thread_time() - start
        self.exclusive[name] = self.exclusive.get(name, 0.0) + total - nested
        self.variants[name] = self.variants.get(name, 0) + 1
        if self.stack:
            self.stack[-1][2] += total
            self.asked_by.setdefault(name, self.stack[-1][1])
        else:
            self.top_level[name] = self.top_level.get(name, 0.0) + total


# The stages of a first call, each the functions that do it (module, attribute path); a stage's
# time is exclusive: a stage inside another (the library loaded while the loops compile)
# counts for itself.
STAGES = {
    "trace": [("backplan.tracer.compile", "trace_function")],
    "plan (lowering, layout, memory)": [
        ("backplan.ir.pipeline", "plan_choices"),
        ("backplan.ir.lowering", "lower"),
    ],
    "render (driver and loop sources)": [("backplan.codegen.run.compiled", "rendering")],
    "load the plan's modules": [
        ("backplan.codegen.build.kernel_cache", "load"),
        ("backplan.codegen.build.cache", "load_module"),
    ],
    "compile the loops": [("backplan.codegen.build.loop_batch", "compile_together")],
    "load library functions": [("backplan.codegen.jit", "SignedCacheOnDemand.load_overload")],
}


class StageTimes:
    """Exclusive thread CPU seconds per stage, by wrapping each stage's functions where they
    are defined and where other backplan modules imported them by name (undone by `restore`)."""

    def __init__(self, compiles: CompileTimes | None = None):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._compiles = compiles  # a stage inside a compile (a library function loaded while
        # a loop is typed) is not that compile's own time either
        self._stack: list[list] = []  # [stage, start, seconds of nested stages]
        self._undo: list[tuple] = []

    def install(self) -> None:
        import importlib
        import sys

        for stage, functions in STAGES.items():
            for module_name, path in functions:
                owner = importlib.import_module(module_name)
                *outer, name = path.split(".")
                for part in outer:
                    owner = getattr(owner, part)
                original = getattr(owner, name)
                wrapped = self._wrap(stage, original)
                places = [owner]
                if not outer:  # a module function: every module that imported it too
                    places += [
                        m
                        for m in list(sys.modules.values())
                        if getattr(m, "__name__", "").startswith("backplan")
                        and m is not owner
                        and getattr(m, name, None) is original
                    ]
                for place in places:
                    self._undo.append((place, name, original))
                    setattr(place, name, wrapped)

    def restore(self) -> None:
        for place, name, original in reversed(self._undo):
            setattr(place, name, original)
        self._undo.clear()

    def _wrap(self, stage: str, function):
        import functools

        @functools.wraps(function)
        def timed(*args, **kwargs):
            self._stack.append([stage, time.thread_time(), 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                _, start, nested = self._stack.pop()
                total = time.thread_time() - start
                self.seconds[stage] += total - nested
                if self._stack:
                    self._stack[-1][2] += total
                if self._compiles is not None and self._compiles.stack:
                    self._compiles.stack[-1][2] += total

        return timed


def profile(model: str, small: bool) -> dict:
    import numpy as np

    from backplan.bench.models import MODELS
    from backplan.bench.peers import PEERS

    spec, peer = MODELS[model], PEERS["backplan"]()
    inputs = spec.inputs(small, np.dtype("float32"))
    times = CompileTimes()
    stages = StageTimes(times)
    stages.install()
    try:
        cpu, wall = time.thread_time(), time.perf_counter()
        with event.install_listener("numba:compile", times):
            peer.build(spec, inputs).step()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    finally:
        stages.restore()
    return {
        "model": model,
        "first_call_cpu_s": cpu,
        "first_call_wall_s": wall,
        "stages": stage_breakdown(stages.seconds, times, cpu),
        "compile_cpu_s": sum(times.exclusive.values()),
        "load_average_1min": os.getloadavg()[0],
        "functions": [
            {
                "name": name,
                "cpu_s": seconds,
                "variants": times.variants[name],
                "asked_by": times.asked_by.get(name),
            }
            for name, seconds in sorted(times.exclusive.items(), key=lambda item: -item[1])
        ],
        "top_level": sorted(times.top_level.items(), key=lambda item: -item[1]),
    }


def stage_breakdown(seconds: dict, times: CompileTimes, total: float) -> dict:
    """The stages' CPU seconds, the loops' compile split into Numba's typing and lowering (the
    first loop's includes Numba's one-time set-up) and LLVM's optimisation and machine code of
    the batch (bench/one_module.py; a plan of one loop compiles it alone, LLVM included in
    its typing and lowering); library functions compiled (not found prebuilt) apart from
    the stage that asked for them; the rest of the call: running the step, imports."""
    stages = dict(seconds)
    exclusive = times.exclusive
    batch = sum(t for name, t in exclusive.items() if name.startswith(BATCH))
    loops = sum(t for name, t in exclusive.items() if name.startswith(LOOPS)) - batch
    batched = stages.pop("compile the loops")
    stages["loops: Numba typing and lowering"] = loops
    stages["loops: LLVM optimisation and machine code"] = batch
    stages["loops: the rest (dispatchers, saving the batch)"] = batched - loops - batch
    stages["library functions compiled"] = sum(exclusive.values()) - loops - batch
    stages["the rest (the step, imports)"] = total - sum(stages.values())
    return stages


BATCH, LOOPS = "backplan_kernel_batch", "backplan_kernel_"


def report(facts: dict, rows: int) -> str:
    lines = [
        f"{facts['model']}: first call {facts['first_call_cpu_s']:.2f} CPU s "
        f"({facts['first_call_wall_s']:.2f} s wall, load {facts['load_average_1min']:.1f}), "
        f"of which compiling {facts['compile_cpu_s']:.2f} CPU s in "
        f"{sum(f['variants'] for f in facts['functions'])} compiles",
        "stages (exclusive CPU s):",
        *(f"  {seconds:7.3f}  {stage}" for stage, seconds in facts["stages"].items()),
        "compiles the call started (with everything nested in them):",
        *(f"  {seconds:7.2f}  {name}" for name, seconds in facts["top_level"][:rows]),
        "per function (exclusive CPU s, variants, first asked by):",
    ]
    for function in facts["functions"][:rows]:
        asked = f"  <- {function['asked_by']}" if function["asked_by"] else ""
        lines.append(
            f"  {function['cpu_s']:7.2f}  x{function['variants']:<2} {function['name']}{asked}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--small", action="store_true", help="the model's small shapes")
    parser.add_argument("--rows", type=int, default=25, help="functions listed")
    parser.add_argument("--json", metavar="PATH", help="write every fact here too")
    args = parser.parse_args(argv)
    facts = profile(args.model, args.small)
    print(report(facts, args.rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(facts, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
