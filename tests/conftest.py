import os

import pytest

# The verifier runs after every pass in tests.
os.environ.setdefault("BACKPLAN_VERIFY", "1")
# Semantics tests run plans on the reference interpreter; codegen tests opt into Numba with
# backplan.runtime.backend.use_backend("numba"), sharing compiled kernels via the disk cache.
os.environ.setdefault("BACKPLAN_BACKEND", "reference")
# Plans compile their driver in the first call, as before background builds: the codegen tests
# check compiled drivers, and count compiles, deterministically (tests/test_driver_tier.py covers
# the background default).
os.environ.setdefault("BACKPLAN_DRIVER", "inline")
# Tests of the background build exercise its child process; the direct driver that stands in for
# it by default (codegen/build/direct_driver.py) is tested in tests/test_direct_driver.py.
os.environ.setdefault("BACKPLAN_DIRECT_DRIVER", "0")
# Tests make many cache folders; the library's machine code (codegen/build/library_cache.py) is
# compiled once for all of them, in a folder of this checkout (tests/test_library_cache.py
# covers the default, the library inside each cache folder).
os.environ.setdefault(
    "BACKPLAN_LIBRARY_CACHE_DIR",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        ".pytest_cache",
        "backplan-library",
    ),
)

# A library built ahead of time in this checkout (`python -m backplan cache prebuild`) is not
# read: tests count compiles (tests/test_prebuilt_library.py covers it, with folders of its own).
os.environ.setdefault(
    "BACKPLAN_PREBUILT_LIBRARY_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "-"),
)

MAX_WORKERS = 4  # each worker imports Numba and compiles; more share one disk cache for little gain


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per CPU this process may use, at most
    MAX_WORKERS. Most of the suite's time is Numba compiling, one core per process; on 2 cores
    two workers halve the wall time. `-n 0` runs the suite in one process."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))
