"""`python -m backplan cache prebuild`: compile backplan's library functions once, ahead of time.

A cold first call spends most of its time compiling the library (GEMM, convolution, attention,
row kernels: 3-13 CPU s on the bench models) and the rest (0.5-2 s) on its own plan. This
command, run once after installing (or after upgrading backplan, Numba or the CPU), compiles
the library variants that the bench models use (each model's first value_and_grad or inference
call, in each dtype asked for) into the
prebuilt folder (codegen/build/prebuilt_library.py), from which every later process of this
user loads them instead of compiling. A model that needs a variant the build did not make still
compiles it, into the user's own library folder, as without the build.

Each pass runs in a child process whose library folder is the prebuilt folder and whose kernel
cache is a temporary folder (the models' own plans and loop kernels are not kept). On a machine
of several CPUs every pass runs twice, on all of them and pinned to one: the CPUs a process may
use choose variants (a large matmul shares its rows out among threads, own_gemm_at_par, or runs
as one, own_gemm_at; BLAS or the own GEMM, gemm/choice.py), and a process pinned to one CPU
(`taskset`, a one-CPU container) otherwise compiled the one-thread variants in its first call:
0.10 CPU s of the bench transformer's 1.3 (BENCHMARKS.md, 31).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

DTYPES = ("float32", "float64")
# How the plan runs could decide the argument types the library sees: from Python (the first
# calls) or from the compiled driver (later calls, and its background build). Measured on
# mlp_tiny, mlp, cnn and transformer: a compiled driver asks for no library variant the
# Python-run first calls did not make (only a local lambda, which is never cached), and passes
# with it took 3/4 of the build (the plans' drivers compile too), so "inline" is optional.
DRIVERS = ("python",)
DRIVER_CHOICES = ("python", "inline")


def default_models() -> list[str]:
    from backplan.bench.models import MODELS

    return list(MODELS)


def cpu_sets() -> list[set[int] | None]:
    """The CPUs each pass's child may use: all of this process's (None), then one of them when
    there are several."""
    if not hasattr(os, "sched_getaffinity"):
        return [None]
    cpus = sorted(os.sched_getaffinity(0))
    return [None] if len(cpus) < 2 else [None, {cpus[0]}]


def build(folder: str, models: list[str], dtypes=DTYPES, drivers=DRIVERS, echo=print) -> int:
    """Run every pass into folder; 0 when all passed, else the number of failed passes."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    failed = 0
    for driver in drivers:
        for dtype in dtypes:
            for cpus in cpu_sets():
                started = time.perf_counter()
                error = _pass(folder, models, dtype, driver, cpus)
                took = time.perf_counter() - started
                where = "all CPUs" if cpus is None else "one CPU"
                outcome = "ok" if not error else "FAILED"
                echo(f"  {dtype}, {driver} driver, {where}: {outcome} ({took:.0f} s)")
                if error:
                    failed += 1
                    echo(error)
    return failed


def _pass(folder: str, models: list[str], dtype: str, driver: str, cpus=None) -> str:
    """One child process, on the CPUs in `cpus` (None: this process's): the models' first
    calls; '' when it succeeded, else its error."""
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    with tempfile.TemporaryDirectory(prefix="backplan-prebuild-") as plans:
        env = dict(os.environ, BACKPLAN_LIBRARY_CACHE_DIR=folder, BACKPLAN_CACHE_DIR=plans)
        env["BACKPLAN_DRIVER"] = driver
        # The build's library folder is its prebuilt folder: it compiles, reads no other one.
        env["BACKPLAN_PREBUILT_LIBRARY_DIR"] = folder
        command = [sys.executable, "-m", "backplan.prebuild", dtype, *models]
        done = subprocess.run(command, env=env, capture_output=True, text=True, preexec_fn=pin)
    if done.returncode == 0:
        return ""
    return f"    {' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}"


def first_calls(dtype: str, models: list[str]) -> None:
    """The child's work: each model's first call at its full size (the size picks some
    variants: the parallel GEMM, the tiled attention)."""
    import numpy as np

    from backplan.bench.models import MODELS
    from backplan.bench.peers import PEERS

    peer = PEERS["backplan"]()
    for name in models:
        spec = MODELS[name]
        peer.build(spec, spec.inputs(False, np.dtype(dtype))).step()


if __name__ == "__main__":
    first_calls(sys.argv[1], sys.argv[2:])
