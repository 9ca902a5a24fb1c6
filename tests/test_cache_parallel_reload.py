"""A plan loaded from disk whose parallel kernel another process compiled runs correctly.

The crash this guards against: process 1 compiles a parallel loop kernel; process 2 builds a
second plan calling that kernel (loaded from disk) and caches its driver; process 3 loads that
driver from disk and calls it before Numba's parallel runtime was started, which crashed."""

import os

import numpy as np
from helpers import script_facts

SCRIPT = """
import json, sys
import numpy as np
import backplan as bp
from backplan.runtime.backend import use_backend

def first(x):
    return bp.sum(bp.tanh(x) * x, axis=1)

def second(x):
    return bp.sum(bp.tanh(x) * x, axis=1)

fn = bp.compile(first if sys.argv[1] == "first" else second)
x = bp.tensor(np.linspace(-2, 2, 1 << 21, dtype=np.float32).reshape(2048, 1024))
with use_backend("numba"):
    out = fn(x).numpy()
print(json.dumps(out[:4].tolist()))
"""


def run(tmp_path, which: str) -> list:
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels"),
        "NUMBA_NUM_THREADS": "2",  # the loop is parallel only when there are threads to use
    }
    return script_facts(SCRIPT, which, env=env, timeout=300)


def test_a_driver_cached_against_a_shared_parallel_kernel_loads_and_runs(tmp_path):
    x = np.linspace(-2, 2, 1 << 21, dtype=np.float32).reshape(2048, 1024)
    expected = (np.tanh(x.astype(np.float64)) * x).sum(axis=1)[:4]
    run(tmp_path, "first")  # compiles the shared parallel kernel
    run(tmp_path, "second")  # loads it from disk, compiles and caches its own driver
    loaded = run(tmp_path, "second")  # loads that driver from disk
    np.testing.assert_allclose(loaded, expected, rtol=1e-5)
