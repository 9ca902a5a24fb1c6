import gc
import os
import sys
import tomllib

import pytest
from backend_intent import backends_run, unstated_intent
from cpu_per_test import CpuPerTest
from hypothesis import HealthCheck, settings
from long_first import long_first

# Hypothesis tests draw the same examples whatever the box's load, but its defaults time them:
# a 200 ms deadline per example and a health check failing a test whose drawing is slow. On a
# shared box one `st.lists(st.integers())` draw took 2.85 s (the worker descheduled) and failed
# tests/test_c_strides.py with FailedHealthCheck. Speed is measured in the harness, never here;
# a test's own @settings (max_examples, other checks) still applies over this profile.
settings.register_profile(
    "backplan-suite", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("backplan-suite")

# The verifier runs after every pass in tests.
os.environ.setdefault("BACKPLAN_VERIFY", "1")
# Semantics tests run plans on the reference interpreter; codegen tests opt into Numba with
# @pytest.mark.numba or backplan.runtime.backend.use_backend("numba"), sharing compiled kernels
# via the disk cache. A test named for the compiled path whose plans all ran on the interpreter
# fails unless marked @pytest.mark.reference (tests/backend_intent.py).
os.environ.setdefault("BACKPLAN_BACKEND", "reference")
# Plans run their driver as a user's program does (codegen/build/driver_tier.py): the first call
# runs it as Python, calling the compiled loops; a plan whose compiled driver is worth having runs
# the direct driver (codegen/build/direct_driver.py) from its second call, and builds the Numba
# driver in a child process only where the direct driver cannot be read. Tests of the Numba
# driver itself ask for it with the `compiled_driver` fixture below (BACKPLAN_DRIVER=inline),
# tests of the child build with `child_builds` (BACKPLAN_DIRECT_DRIVER=0).
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


def _package_bytecode_compiled() -> None:
    """The package's modules compiled to bytecode once, before the workers start. A box that
    sets PYTHONDONTWRITEBYTECODE=1 (this project's shared one does) otherwise compiles the whole
    package's source again in every process the suite starts: each worker, and each of the
    few hundred subprocesses and MPI ranks of its tests (0.68 -> 0.45 CPU s to `import
    backplan`). Python still reads .pyc files under that setting; a stale one (a source edited
    since) is written again here on the next run, and never read (Python checks the source's
    time and size)."""
    import compileall

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        folders = tomllib.load(f)["tool"]["setuptools"]["package-dir"].values()
    for folder in sorted(set(folders)):  # nested folders are compiled with their parents
        compileall.compile_dir(os.path.join(root, folder), quiet=2)


if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller, or a run in one process
    _package_bytecode_compiled()


def _rewrite_one(path: str) -> None:
    """Rewrite one test file's asserts and save its code where pytest's import hook looks
    (`__pycache__/<name>.<tag>-pytest-<version>.pyc`), unless a current one is there."""
    from pathlib import Path

    from _pytest.assertion import rewrite

    fn = Path(path)
    pyc = rewrite.get_cache_dir(fn) / (fn.name[:-3] + rewrite.PYC_TAIL)
    if rewrite._read_pyc(fn, pyc) is not None:
        return
    state = _REWRITING[0].stash[rewrite.assertstate_key]
    source_stat, code = rewrite._rewrite_test(fn, _REWRITING[0])
    if rewrite.try_makedirs(pyc.parent):
        rewrite._write_pyc(state, code, source_stat, pyc)


_REWRITING: list = []  # the controller's config, for the processes _tests_rewritten forks


def _files_asked_for(config, root: str) -> set[str]:
    """The test files of this folder the run collects: those named on the command line (a
    file, or a folder holding them), every one when none is named (testpaths)."""
    import glob

    named = [arg.split("::")[0] for arg in config.args] or [root]
    files = set()
    for arg in named:
        path = os.path.abspath(os.path.join(str(config.invocation_params.dir), arg))
        if os.path.isdir(path) and os.path.commonpath([path, root]) in (path, root):
            files.update(glob.glob(os.path.join(root, "test_*.py")))
        elif os.path.dirname(path) == root and os.path.basename(path).startswith("test_"):
            files.add(path)
    return {f for f in files if f.endswith(".py") and os.path.isfile(f)}


def _tests_rewritten(config) -> None:
    """The test files' asserts rewritten once, on every core, before the workers start. pytest
    rewrites each test module as it imports it and caches the result beside it, but not under
    PYTHONDONTWRITEBYTECODE=1 (this project's shared box sets it): each worker rewrote all ~250
    files in its collection, every run: half of a worker's collection CPU. A fresh clone's run
    of one test on two workers (all collected): 18.8 -> 12.8 CPU s, Zen 4 at load 9. Python's
    own bytecode flag is left as it is; pytest reads a cached file whatever the flag, checking
    the source's time and size. Any failure here (a pytest without these helpers) leaves the
    rewriting to the workers."""
    import concurrent.futures
    import multiprocessing

    root = os.path.dirname(os.path.abspath(__file__))
    files = sorted(_files_asked_for(config, root))
    if not files:
        return
    _REWRITING[:] = [config]
    try:
        processes = max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))
        context = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
            list(pool.map(_rewrite_one, files, chunksize=8))
    except Exception:
        pass
    finally:
        _REWRITING.clear()


MAX_WORKERS = 4  # each worker imports Numba and compiles; more share one disk cache for little gain


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-per-test",
        metavar="PATH",
        help="write each test's CPU seconds (own + children) to PATH (tests/cpu_per_test.py)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "numba: run the test's plans compiled by Numba")
    config.addinivalue_line(
        "markers", "reference: the test means the reference interpreter (tests/backend_intent.py)"
    )
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        _tests_rewritten(config)  # the controller of a run with workers
    path = config.getoption("--cpu-per-test")
    if path:
        worker = getattr(config, "workerinput", {}).get("workerid")
        config.pluginmanager.register(CpuPerTest(os.path.abspath(path), worker), "cpu-per-test")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per CPU this process may use, at most
    MAX_WORKERS. Most of the suite's time is Numba compiling, one core per process; on 2 cores
    two workers halve the wall time. `-n 0` runs the suite in one process."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    """Under xdist (the README's command), the files holding the longest tests run first, so
    that the run ends on short tests on both workers (tests/long_first.py). A run in one
    process (`-n 0`, a single file) keeps pytest's order."""
    if hasattr(config, "workerinput"):
        items[:] = long_first(items)


def pytest_sessionfinish(session):
    """A worker's run ends with its objects frozen out of the collector's generations, after
    one last collection (unraisable errors of the garbage are still reported). pytest collects
    five times more as it unconfigures, after the worker told the controller it finished;
    execnet gives it 5 s, then sends the worker SIGINT. Five full collections of a worker's
    heap (every plan and Numba object the tests made) take longer on a loaded box: the
    interrupt landed in hypothesis's gc callback and ended the run with a
    PytestUnraisableExceptionWarning (KeyboardInterrupt). Frozen, those collections walk only
    what unconfiguring makes. This hook runs inside xdist's, before it reports the end."""
    if hasattr(session.config, "workerinput"):
        gc.collect()
        gc.freeze()


@pytest.fixture
def compiled_driver(monkeypatch):
    """The plan's driver compiled by Numba in its first call (BACKPLAN_DRIVER=inline), as
    bp.compile(fn, background=False) does: for tests of that driver (its source, its compile
    count, the loops' view forms it inlines)."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "inline")


@pytest.fixture
def child_builds(monkeypatch):
    """The compiled driver built in a child process from the second call on, with no direct
    driver standing in for it (BACKPLAN_DIRECT_DRIVER=0): for tests of that build."""
    monkeypatch.setenv("BACKPLAN_DIRECT_DRIVER", "0")


@pytest.fixture(autouse=True)
def _driver_builds_stopped_after_each_test():
    """A child driver build a test left running (most tests call a plan twice and never use
    its compiled driver) is stopped when the test ends, quietly: else it compiles beside the
    next tests for nothing (driver_builder.stop_builds)."""
    yield
    builder = sys.modules.get("backplan.codegen.build.driver_builder")
    if builder is not None and builder.pending():
        builder.stop_builds()


@pytest.fixture(autouse=True)
def _backend_as_meant(request):
    """@pytest.mark.numba runs the test's plans compiled; a test named for the compiled path
    that ran plans only on the interpreter fails unless marked reference (backend_intent.py)."""
    from backplan.runtime.backend import use_backend

    node = request.node
    if node.get_closest_marker("numba") is not None:
        with use_backend("numba"):
            yield
        return
    with backends_run() as made:
        yield
    if node.get_closest_marker("reference") is None:
        why = unstated_intent(node, made)
        if why is not None:
            pytest.fail(why, pytrace=False)
