"""A loop that rebinds a compiled function's results (`p, s = update(g, s, p)`, `loss, grads =
step(params, x)`) holds the last call's while the next one runs; the next call writes into the
outputs of the call before, which the rebinding let go (codegen/run/workspace.py keeps two
generations), so it takes no fresh pages from the allocator: no page faults a call. A buffer
anyone still holds is never written: a caller keeping three generations gets three arrays."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np

import backplan as bp
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
import resource, sys
sys.path.insert(0, sys.argv[1])
import backplan as bp
from test_loop_output_reuse import _arguments, _loop, _update
step = bp.compile(_update)
p, g = _arguments()
results = _loop(step, p, g, 4)  # warm: compiled, both generations made
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    results = step(results[0], g)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def test_a_loop_that_rebinds_its_results_faults_in_no_pages():
    """In a fresh process whose allocator hands every block of 128 KiB or more back to the
    system when freed (glibc's fixed mmap threshold; by default it does so for blocks above
    32 MiB, and for smaller ones as its heap's top is trimmed): 771 minor faults a call when
    each call took fresh memory for its results."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "BACKPLAN_BACKEND": "numba"}
    child = [sys.executable, "-c", CHILD, os.path.dirname(__file__)]
    done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    per_call = float(done.stdout.split()[-1])
    pages = 3 * N * 4 // 4096
    assert per_call < pages / 16, f"{per_call} minor faults a call for {pages} pages of results"


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
