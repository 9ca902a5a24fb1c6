"""The disk cache of compiled plans: a second process starts warm, a corrupt or tampered entry
is rewritten (never run), concurrent compiles do not corrupt each other, a miss says why."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from backplan.codegen.build import cache

# The Numba-compiled driver's own disk cache (a plan's module and its driver's machine code).
pytestmark = pytest.mark.usefixtures("compiled_driver")

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import backplan as bp
    from backplan.runtime.backend import use_backend

    def loss(w, x):
        return bp.sum(bp.tanh(x @ w) * 2.0)

    w = bp.tensor(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
    x = bp.tensor(np.ones((2, 3), np.float32))
    with use_backend("numba"):
        vg = bp.value_and_grad(loss)
        value, grad = vg(w, x)
        compiled = vg.trace(w, x).runner().compiled
        run = compiled._run
    print(json.dumps({"value": float(value.item()), "grad": grad.numpy().tolist(),
                      "hit": compiled.cache_hit, "reason": compiled.miss_reason,
                      "numba_cache_hits": sum(run.stats.cache_hits.values()),
                      "path": run.py_func.__code__.co_filename}))
""")


def run_script(cache_dir, extra_env=None):
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(cache_dir), **(extra_env or {})}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_is_warm_and_results_are_identical(tmp_path):
    cold = run_script(tmp_path)
    warm = run_script(tmp_path)
    assert not cold["hit"] and cold["reason"] == "new plan: this IR was never compiled here"
    assert warm["hit"] and warm["numba_cache_hits"] >= 1
    assert warm["value"] == cold["value"] and warm["grad"] == cold["grad"]
    parts = json.loads(open(cold["path"].replace(".py", ".json")).read())
    assert set(parts) == {"ir", "codegen", "numba", "llvmlite", "numpy", "python", "cpu", "flags"}


def test_corrupt_or_tampered_entries_are_rewritten_never_run(tmp_path):
    first = run_script(tmp_path)
    marker = tmp_path / "tampered-code-ran"
    with open(first["path"], "a") as f:
        f.write(f"\nopen({str(marker)!r}, 'w').write('x')\n")
    again = run_script(tmp_path)
    assert not marker.exists()
    assert not again["hit"] and again["reason"] == "entry rewritten"
    assert again["value"] == first["value"]
    with open(first["path"], "w") as f:
        f.write("this is not python {")
    assert run_script(tmp_path)["value"] == first["value"]


def test_two_processes_compiling_the_same_plan_at_once(tmp_path):
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["value"] == results[1]["value"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert run_script(tmp_path)["hit"]


def test_a_miss_names_the_parts_of_the_key_that_changed(tmp_path, monkeypatch):
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    parts = cache.key_parts("graph text", "flags")
    source = "x = 1\n"
    module, hit, why = cache.load_module(source, parts)
    assert not hit and why().startswith("new plan") and module.x == 1
    assert cache.load_module(source, parts)[1:] == (True, None)
    changed = {**parts, "numba": "0.0.1", "flags": "other"}
    _, hit, why = cache.load_module(source, changed)
    assert not hit and why() == "changed: flags, numba"  # asked after its own entry was written


def test_a_miss_reads_the_other_entries_only_when_asked_why(tmp_path, monkeypatch):
    """Finding the closest entry reads every key file in the folder (7,000 plans: 0.3 s), so
    a plan's miss does it only when its reason is asked for."""
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    scans = []
    monkeypatch.setattr(cache, "miss_reason", lambda *args: scans.append(args) or "read")
    _, hit, why = cache.load_module("y = 2\n", cache.key_parts("other graph", "flags"))
    assert not hit and scans == []
    assert why() == "read" and len(scans) == 1
