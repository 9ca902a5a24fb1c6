"""Would compiling a plan's loop kernels in one LLVM module make its cold first call cheaper?
`python -m backplan.bench.one_module MODEL [--rounds 3] [--cpu 1]`

A cold first call with the library built ahead of time spends most of its CPU compiling the
plan's address loops (codegen/render/kernel_source.py), one Numba compile each: one LLVM module
optimised and emitted per loop. This measures the lever of compiling them together. A first
child runs MODEL's first call into an empty kernel folder and lists the address loops it
compiled (file and form). Then, in fresh processes pinned to one CPU, interleaved by round:

- `separate`: each loop compiled as a first call does (`dispatcher.compile`), one module each;
- `one module`: the same loops typed and lowered one by one into one library per LLVM
  optimisation level (`compile_extra(..., library=shared)` without finalising), then that
  library optimised and emitted once.

Both run after Numba's one-time typing set-up (a trivial function compiled first) and cache
nothing (the loops are run from their source under a name with no file), so what differs is
the per-module cost alone. Reported: thread CPU seconds per mode, and per Numba phase
(bytecode, type inference, Python lowering, LLVM passes, machine code emission), medians
over the rounds.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time

from .child import child_result

MODES = ("separate", "one module")


def _fill(model: str) -> list[list[str]]:
    """In a child: MODEL's first call; the address loops it compiled as [file, form]."""
    import numpy as np

    from backplan.bench.internals import kernel_cache
    from backplan.bench.models import MODELS
    from backplan.bench.peers import PEERS

    spec = MODELS[model]
    PEERS["backplan"]().build(spec, spec.inputs(False, np.dtype("float32"))).step()
    listed = []
    for call in kernel_cache._PYTHON_CALLS.values():
        full, small = call._entries
        for loop in [call.loop(False)] * bool(full) + [call.loop(True)] * bool(small and not full):
            listed.append([loop.py_func.__globals__["__file__"], loop.py_func.__name__])
    return sorted(listed)


def _phase_clock() -> collections.Counter:
    """Exclusive thread CPU per Numba phase from now on (nested phases subtracted)."""
    from llvmlite.binding import newpassmanagers
    from numba.core import codegen, lowering, typed_passes, untyped_passes

    totals, stack = collections.Counter(), []

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            stack.append([time.thread_time(), 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                start, nested = stack.pop()
                took = time.thread_time() - start
                totals[label] += took - nested
                if stack:
                    stack[-1][1] += took

        setattr(owner, name, timed)

    wrap(untyped_passes.TranslateByteCode, "run_pass", "bytecode")
    wrap(typed_passes.NopythonTypeInference, "run_pass", "type inference")
    wrap(lowering.Lower, "lower", "Python lowering")
    wrap(newpassmanagers.ModulePassManager, "run", "LLVM passes")
    wrap(codegen.JITCodeLibrary, "_finalize_specific", "machine code")
    return totals


def _one_module(loops: list) -> None:
    """Every loop lowered into one library per optimisation level, each finalised once: what
    a plan's first call does (codegen/build/loop_batch.py), less its cache files."""
    from numba.core.compiler_lock import global_compiler_lock

    from backplan.bench.internals import loop_batch

    with global_compiler_lock:
        libraries, lowered = loop_batch._lower(loops)
        for library in libraries.values():
            library.finalize()
        missing = [name for library, name in lowered if not library.get_pointer_to_function(name)]
        if missing:
            raise RuntimeError(f"one module: no native entry for {missing[:3]}")


def _compile(mode: str, listed: list[list[str]]) -> dict:
    """In a fresh child: the listed loops compiled as `mode` says; thread CPU seconds."""
    import types
    import warnings

    import numba

    warnings.simplefilter("ignore")  # no file to cache to, by design: said once per loop
    numba.njit(lambda x: x + 1)(1)  # Numba's typing set-up, paid by neither mode
    loops = []
    for index, (path, form) in enumerate(listed):
        with open(path) as source:
            text = source.read()
        module = types.ModuleType(f"backplan_one_module_{index}")
        exec(compile(text, f"<backplan_one_module_{index}>", "exec"), module.__dict__)
        loops.append(getattr(module, form))
    phases = _phase_clock()
    cpu = time.thread_time()
    if mode == "separate":
        from backplan.bench.internals import loop_batch

        for loop in loops:
            loop.compile(loop_batch.signature(loop))
    else:
        _one_module(loops)
    return {"mode": mode, "cpu_s": time.thread_time() - cpu, "phases": dict(phases)}


def _child(arguments: list[str], cpu: int | None, env: dict | None = None) -> dict:
    command = [sys.executable, "-m", "backplan.bench.one_module", "--child", *arguments]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    return child_result(command, env or dict(os.environ), 900, "one-module child")


def measure(model: str, rounds: int, cpu: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="backplan-one-module-") as folder:
        env = dict(os.environ, BACKPLAN_CACHE_DIR=folder)
        listed = _child(["fill", model], cpu, env)["loops"]
        listing = os.path.join(folder, "loops.json")
        with open(listing, "w") as out:
            json.dump(listed, out)
        runs = collections.defaultdict(list)
        for _ in range(rounds):
            for mode in MODES:
                runs[mode].append(_child(["compile", mode, listing], cpu))
    return {
        "model": model,
        "loops": len(listed),
        "rounds": rounds,
        "load_average_1min": os.getloadavg()[0],
        "runs": runs,
    }


def report(facts: dict) -> str:
    runs = facts["runs"]
    median = {mode: statistics.median(r["cpu_s"] for r in runs[mode]) for mode in MODES}
    lines = [
        f"{facts['model']}: {facts['loops']} address loops, {facts['rounds']} interleaved "
        f"rounds, load {facts['load_average_1min']:.1f} (thread CPU s, median)",
        *(f"  {mode:10s} {median[mode]:.3f}  ({_each(runs[mode])})" for mode in MODES),
        f"  one module / separate: {median['one module'] / median['separate']:.3f}x",
        "  by phase (separate -> one module):",
    ]
    for phase in runs["separate"][0]["phases"]:
        a, b = (statistics.median(r["phases"].get(phase, 0.0) for r in runs[m]) for m in MODES)
        lines.append(f"    {phase:16s} {a:.3f} -> {b:.3f}")
    return "\n".join(lines)


def _each(runs: list) -> str:
    return ", ".join(f"{run['cpu_s']:.3f}" for run in runs)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        kind, *rest = argv[1:]
        if kind == "fill":
            result = {"loops": _fill(rest[0])}
        else:
            with open(rest[1]) as listing:
                result = _compile(rest[0], json.load(listing))
        print(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=None, help="pin every child to this CPU")
    parser.add_argument("--json", metavar="PATH", help="write every run here too")
    args = parser.parse_args(argv)
    facts = measure(args.model, args.rounds, args.cpu)
    print(report(facts))
    _keep(facts, args.json)
    return 0


def _keep(facts: dict, path: str | None) -> None:
    """Every run's figures as JSON, when a path is given."""
    if path:
        with open(path, "w") as out:
            json.dump(facts, out, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
