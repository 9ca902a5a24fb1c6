"""A loop that rebinds a compiled function's results (`p, s = update(g, s, p)`, `loss, grads =
step(params, x)`) holds the last call's while the next one runs; the next call writes into the
outputs of the call before, which the rebinding let go (codegen/run/workspace.py keeps two
generations), so it takes no fresh pages from the allocator: no page faults a call. A buffer
anyone still holds is never written: a caller keeping three generations gets three arrays."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import counted_in_a_loop

import backplan as bp
from backplan.bench.internals import checked_memory
from backplan.codegen.run.workspace import Workspace
from backplan.runtime.backend import use_backend

N = 262_144  # 1 MiB of float32 a result: above the reuse threshold, and glibc returns such
# blocks to the system when three of them are freed a call (240 faults a call without reuse)


def _update(p, g):
    """Three results of 1 MiB, the first passed back in as a loop's parameters."""
    return p - 0.01 * g, p * g, p + g


def _arguments(seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)


def _loop(step, p, g, calls: int) -> tuple:
    results = step(p, g)
    for _ in range(calls - 1):
        results = step(results[0], g)  # the old results stay bound until this call returns
    return results


CHILD = """
import gc, json, resource, sys
sys.path.insert(0, sys.argv[1])
import backplan as bp
from test_loop_output_reuse import _arguments, _loop, _update

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

step = bp.compile(_update)
p, g = _arguments()
report = bp.explain(step, p, g)
results = _loop(step, p, g, 4)  # warm: compiled, both generations made
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    results = step(results[0], g)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # the loop started again from arrays it does not hold (a new epoch)
    results = None
    results = _loop(step, p, g, 3)
restarted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 30
looping = status("VmRSS")  # between calls: the results bound, the generation before kept
del results
for runner in step.trace(p, g).runners():  # the workspaces, their kept outputs with them
    runner.release_idle()
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM starts again from VmRSS
results = _loop(step, p, g, 6)
print(json.dumps({
    "faults": faults,
    "restarted": restarted,
    "between": looping - base,
    "peak": status("VmHWM") - base,
    "resident": report.loop_resident_bytes,
    "kept": report.compiled_reused_output_bytes,
    "printed_peak": report.peak.allocated_peak_bytes,
    "text": str(report),
}))
"""


@pytest.fixture(scope="module")
def child_loop() -> dict:
    """The loop in a fresh process whose allocator hands every block of 128 KiB or more back to
    the system when freed (glibc's fixed mmap threshold; by default it does so for blocks
    above 32 MiB, and for smaller ones as its heap's top is trimmed), so that its resident
    bytes are the arrays alive: faults a call and resident bytes, against explain."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "BACKPLAN_BACKEND": "numba"}
    child = [sys.executable, "-c", CHILD, os.path.dirname(__file__)]
    done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_loop_that_rebinds_its_results_faults_in_no_pages(child_loop):
    """771 minor faults a call when each call took fresh memory for its results."""
    pages = 3 * N * 4 // 4096
    per_call = child_loop["faults"]
    assert per_call < pages / 16, f"{per_call} minor faults a call for {pages} pages of results"


def test_a_loop_started_again_finds_both_generations(child_loop):
    """Ten loops of three calls, each from the arrays passed in at first: the last loop's two
    generations are unheld on the first call, and the older is still there on the second
    (256 faults a call when it was let go at once)."""
    pages = 3 * N * 4 // 4096
    per_call = child_loop["restarted"]
    assert per_call < pages / 16, f"{per_call} minor faults a call for {pages} pages of results"


def _near(measured: int, printed: int) -> bool:
    """Equal but for the allocator's page of header a block and the loop's few objects."""
    return abs(measured - printed) <= 64 * 1024


def test_what_the_loop_keeps_resident_is_what_explain_prints(child_loop):
    """Between calls: the results bound and the generation before them, which the next call
    writes into (3 MiB each); over the loop's calls: the peak explain prints for that loop."""
    assert child_loop["kept"] == 3 * N * 4
    assert child_loop["resident"] == 6 * N * 4
    assert _near(child_loop["between"], child_loop["resident"]), child_loop
    assert _near(child_loop["peak"], child_loop["printed_peak"]), child_loop
    text = " ".join(child_loop["text"].split())
    assert f"holds {child_loop['resident']:,} B" in text
    assert "(report.loop_resident_bytes)" in text


def test_the_loop_matches_the_reference_interpreter():
    p, g = _arguments(1)
    with use_backend("numba"):
        got = [r.numpy().copy() for r in _loop(bp.compile(_update), p, g, 6)]
    with use_backend("reference"):
        want = [r.numpy() for r in _loop(bp.compile(_update), p, g, 6)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # FMA contraction


@use_backend("numba")
def test_a_caller_holding_three_generations_gets_three_distinct_arrays():
    step = bp.compile(_update)
    g = _arguments()[1]
    ps = [_arguments(seed)[0] for seed in range(3)]
    kept = [step(p, g) for p in ps]
    for _ in range(3):  # later calls, results dropped, must write none of the kept ones
        step(ps[0] * 2, g)
    arrays = [r.numpy() for results in kept for r in results]
    for i, a in enumerate(arrays):
        assert not any(np.shares_memory(a, b) for b in arrays[i + 1 :])
    for p, results in zip(ps, kept, strict=True):
        for got, want in zip(results, _update(p, g), strict=True):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@use_backend("numba")
def test_two_threads_looping_on_one_function_each_get_their_own_results():
    step = bp.compile(_update)
    g = _arguments()[1]
    starts = [_arguments(seed)[0] for seed in (2, 3)]
    want = [[r.numpy().copy() for r in _loop(step, p, g, 12)] for p in starts]
    got = [None, None]
    barrier = threading.Barrier(2)

    def run(i):
        barrier.wait()
        got[i] = [r.numpy().copy() for r in _loop(step, starts[i], g, 12)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for mine, serial in zip(got, want, strict=True):
        for a, b in zip(mine, serial, strict=True):
            np.testing.assert_array_equal(a, b)


@use_backend("numba")
def test_the_checked_mode_counts_the_rebinding_loop_as_explain_prints_it():
    """Each call of `results = step(results[0], g)` holds the last results (one of them passed
    back in) and writes into the generation before: counted to the byte as explain prints it."""
    p, g = _arguments()
    with checked_memory():
        step = bp.compile(_update)
        report = bp.explain(step, p, g)
        last = [p]

        def call():
            results = step(last[0], g)
            last[0] = results[0]
            return results

        counted = counted_in_a_loop(call, 5)
    printed = [report.loop_peak_on_call(n).allocated_peak_bytes for n in range(1, 6)]
    assert counted == printed
    assert printed[1:] == [report.loop_resident_bytes] * 4  # the results and the generation kept


def test_a_loop_that_drops_its_results_keeps_one_generation():
    workspace = Workspace([((N,), np.dtype(np.float32))])
    first = workspace.output_arrays()[0]
    second = workspace.output_arrays()[0]  # the first still held: a new buffer
    assert not np.shares_memory(first, second)
    del first, second  # both generations unheld now
    workspace.output_arrays()  # results dropped at once: the older waits one call more
    assert workspace.older_outputs[0] is not None
    workspace.output_arrays()
    assert workspace.older_outputs[0] is None  # let go: one generation kept
