"""`python -m backplan bench compile`: how long a user waits for the first gradient.

Per round, model and peer: a FRESH Python process with an empty cache folder times the import,
the cold first call (forward + backward, compiling everything) and the second call; then a
second fresh process sharing that folder times the warm first call (what a user meets the next
time the program starts). Rounds are interleaved; the record keeps medians over rounds.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from .errors import BenchError

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_child.py")
PEERS = ("backplan", "backplan.background", "torch", "torch.compile", "jax")
CHILD_TIMEOUT_S = 1800
# The fields a child reports in seconds, each summarised by its median over rounds.
TIMES = (
    "import_s",
    "first_call_s",
    "second_call_s",
    "fast_after_s",
    "fast_call_s",
    "resized_first_call_s",
)


def cache_environment(folder: str, threads: int | None) -> dict[str, str]:
    """A child's environment: its caches in `folder` (backplan's kernels, inductor's FX graph,
    AOTAutograd and C++ caches), JAX's persistent cache off, and with --threads every pool
    sized by variable, so nothing is imported before the timed import."""
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": os.path.join(folder, "backplan"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "torchinductor"),
        "JAX_ENABLE_COMPILATION_CACHE": "false",
        # A driver build still running when a child ends would share the pinned CPU with the
        # next child; the child waits for its builds, and this stops any it did not wait for.
        "BACKPLAN_DRIVER_AT_EXIT": "kill",
    }
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env |= thread_variables(threads)
    return env


def thread_variables(threads: int | None) -> dict[str, str]:
    if threads is None:
        return {}
    counts = {
        name: str(threads)
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    }
    counts["NUMBA_NUM_THREADS"] = str(threads)
    if threads == 1:
        counts["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    return counts


def run_child(request: dict, env: dict[str, str]) -> dict:
    """One fresh process; its JSON line, or {"error": ...} when it failed or ran too long."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", CHILD, json.dumps(request)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {CHILD_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


def cold_and_warm(request: dict, threads: int | None) -> tuple[dict, dict]:
    """The cold process in an empty cache folder, then the warm one sharing it."""
    folder = tempfile.mkdtemp(prefix="backplan-compile-bench-")
    try:
        env = cache_environment(folder, threads)
        cold = run_child(request, env)
        warm = run_child(request, env) if "error" not in cold else {"error": "cold run failed"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return cold, warm


def measure_rounds(cells: list[tuple[str, str]], settings: dict, progress, on_round=None):
    """Every (model, peer) cell once per round, rounds outermost so load drifts hit all.
    After each round on_round(rows, rounds_done) sees the medians so far, so a long run that
    is stopped still leaves the rounds it finished."""
    samples: dict[tuple[str, str], list] = {cell: [] for cell in cells}
    rows: list[dict] = []
    for index in range(settings["rounds"]):
        for position, (model, peer) in enumerate(cells):
            progress.model(position, len(cells), f"{model} · {peer}")
            progress.phase(f"round {index + 1}/{settings['rounds']}", "cold, then warm process")
            request = {
                "model": model,
                "peer": peer,
                "small": settings["small"],
                "dtype": settings["dtype"],
            }
            samples[(model, peer)].append(cold_and_warm(request, settings["threads"]))
        rows = [summarise(model, peer, samples[(model, peer)]) for model, peer in cells]
        if on_round is not None:
            on_round(rows, index + 1)
    return rows


def summarise(model: str, peer: str, runs: list[tuple[dict, dict]]) -> dict:
    """Medians over the rounds that completed; the first error otherwise."""
    row = {"model": model, "peer": peer, "rounds": len(runs), "status": "ok", "note": None}
    errors = [r["error"] for pair in runs for r in pair if "error" in r]
    good = [(cold, warm) for cold, warm in runs if "error" not in cold and "error" not in warm]
    if errors:
        row["note"] = errors[0]
    if not good:
        row.update(status="error", cold=None, warm=None)
        return row
    row["cold"] = _medians([cold for cold, _ in good])
    row["warm"] = _medians([warm for _, warm in good])
    row["completed_rounds"] = len(good)
    row["load_average_1min"] = max(r["load_average_1min"] for pair in good for r in pair)
    row["driver_tier"] = good[0][0].get("driver_tier")
    checks = [r["check"] for pair in good for r in pair]
    row["check_ok"] = all(c["ok"] for c in checks)
    row["max_rel_error"] = max(max(c["value_rel_error"], c["grad_rel_error"]) for c in checks)
    if not row["check_ok"]:
        row["status"] = "wrong"
    return row


def _medians(results: list[dict]) -> dict:
    out = {}
    for field in TIMES:
        values = [r[field] for r in results if r.get(field) is not None]
        out[field] = statistics.median(values) if values else None
    return out


def check_rounds(rounds: int) -> int:
    if rounds < 1:
        raise BenchError(f"--rounds must be at least 1, got {rounds}")
    return rounds
