"""ln_gelu_fused's two steps, this installation against a package copy of another revision
(DIR/backplan, as `python -m backplan.bench.data_parallel_passes --copy REV DIR` lays one out):
fresh processes alternated, the order flipped every round, each pinned as the parent is and
timing both of its installation's steps interleaved; each side keeps its own cache folder,
warmed by a first process that is not counted. Both sides' hand-fused loops import their own
tanh_f32, so each side's row states that tanh's error beside its times: the largest, in
float32 ulps against float64's tanh, over every 64th float32 in [0, 10] (tanh is odd; above
10 it rounds to 1). A revision's tanh that is cheaper and less accurate moves both of its
steps; the B/A ratio of the backplan steps is the A/B.

    python -m backplan.bench.ln_gelu_fused --against-path DIR --processes 3 --rounds 5 \\
        [--clock cpu]

--clock cpu times each call by the process's CPU time (all its threads'): on a box other
processes share, the reading that means anything; the default is the wall clock.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile

from .child import child_result

# Runs in a fresh process started outside any checkout, so `import backplan` finds the side's
# package: the installation's, or DIR's when it is first on PYTHONPATH.
CHILD = r"""
import json, statistics, sys, time
import numba
import numpy as np
from backplan.bench import ln_gelu_fused as lg
from backplan.bench.affinity import pin_process
from backplan.bench.measure import interleaved_medians
from backplan.bench.threads import apply_threads
from backplan.bench.internals import tanh_f32

threads, rounds, seconds, rows, cols, clock = json.loads(sys.argv[1])
pin_process(threads)
apply_threads(threads)
rng = np.random.default_rng(0)
params = {
    "x": rng.standard_normal((rows, cols)),
    "g": 1.0 + 0.1 * rng.standard_normal(cols),
    "b": 0.1 * rng.standard_normal(cols),
}
upstream = rng.standard_normal((rows, cols)) / np.sqrt(rows * cols)
steps = {
    "backplan": lg.backplan_step(params, upstream),
    "hand": lg.hand_fused(params, upstream, threads),
}


def cpu_ms(step):  # the process's CPU ms a call, over calls lasting `seconds` of CPU time
    calls, began = 0, time.process_time()
    while time.process_time() - began < seconds or calls < 3:
        step()
        calls += 1
    return (time.process_time() - began) * 1e3 / calls


if clock == "cpu":
    samples = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name].append(cpu_ms(step))
    medians = {name: statistics.median(v) for name, v in samples.items()} if rounds else {}
else:
    medians = interleaved_medians(steps, rounds, seconds) if rounds else {}

@numba.njit
def loop(xs, out):
    for i in range(xs.size):
        out[i] = tanh_f32(xs[i])

bits = np.arange(0, int(np.float32(10).view(np.int32)) + 1, 64, dtype=np.int32)
xs = bits.view(np.float32)
got = np.empty_like(xs)
loop(xs, got)
exact = np.tanh(xs.astype(np.float64))
rounded = exact.astype(np.float32)
ulps = np.abs(got - exact) / np.spacing(rounded).astype(np.float64)
ulps[got == rounded] = 0
print(json.dumps({**medians, "tanh_ulp": float(ulps.max()), "where": lg.__file__}))
"""


def against(
    path: str, threads: int, processes: int, rounds: int, seconds: float, shape, clock="wall"
) -> dict:
    """{"this"/"other": [each process's {"backplan", "hand", "tanh_ulp", "where"}]}; clock
    "cpu": each step's process CPU time a call (all its threads'), "wall": the wall clock."""
    sides = {"this": dict(os.environ), "other": dict(os.environ)}
    sides["other"]["PYTHONPATH"] = os.pathsep.join(
        [path, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    folders = {side: tempfile.mkdtemp(prefix="bp-ln-gelu-") for side in sides}
    found: dict[str, list] = {side: [] for side in sides}
    try:
        for side, env in sides.items():
            env.update(BACKPLAN_CACHE_DIR=folders[side], BACKPLAN_QUIET="1")
            env.pop("BACKPLAN_BACKEND", None)
            _run(env, [threads, 0, seconds, *shape, clock], f"ln_gelu warm-up ({side})")
        for r in range(processes):
            for side in ("this", "other") if r % 2 == 0 else ("other", "this"):
                what = f"ln_gelu process {r} ({side})"
                settings = [threads, rounds, seconds, *shape, clock]
                found[side].append(_run(sides[side], settings, what))
    finally:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
    return found


def _run(env: dict, settings: list, what: str) -> dict:
    command = [sys.executable, "-c", CHILD, json.dumps(settings)]
    return child_result(command, env, 1800, what, cwd=tempfile.gettempdir())


def against_text(found: dict) -> str:
    """One line a side (medians over its processes, each process's in brackets), then B/A."""
    lines = []
    medians = {}
    for side in ("other", "this"):
        runs = found[side]
        step = {k: statistics.median(run[k] for run in runs) for k in ("backplan", "hand")}
        medians[side] = step
        each = ", ".join(f"{run['backplan']:.2f}/{run['hand']:.2f}" for run in runs)
        lines.append(
            f"{side:5} backplan {step['backplan']:.2f} ms, hand-fused {step['hand']:.2f} ms, "
            f"{step['backplan'] / step['hand']:.3f}x hand-fused; tanh_f32 max "
            f"{max(run['tanh_ulp'] for run in runs):.2f} ulp; per process backplan/hand "
            f"[{each}]; {runs[0]['where']}"
        )
    a, b = medians["other"], medians["this"]
    lines.append(
        f"this / other: backplan {b['backplan'] / a['backplan']:.3f}x, hand-fused "
        f"{b['hand'] / a['hand']:.3f}x"
    )
    return "\n".join(lines)
