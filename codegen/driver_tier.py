"""A plan's first calls do not wait for its driver to compile.

The loop kernels a plan calls are shared and cached (codegen/kernel_cache.py), but its `run`
driver is new code for every plan, and Numba compiles it in seconds to minutes (an unrolled
LSTM's driver: 20 s for 4 steps). The driver's Python function calls exactly the same compiled
kernels, so until the compiled driver exists it runs as Python (the same kernels: the same
results, with a few microseconds of Python per call) while a separate process compiles it into
the disk cache; the plan then loads it and switches (a process, not a thread: a compile holds the
GIL, and every step's kernel call would wait on it).

BACKPLAN_DRIVER picks: `background` (default), `inline` (compile in the first call), `reference`
(first calls run on the reference interpreter while the child compiles the kernels too: a first
call that waits for no compiler at all) or `python` (never compile the driver: for debugging).
A function's own `background=` (bp.compile, bp.value_and_grad) overrides it for its plans:
True is `reference`, False is `inline`.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque

import numpy as np

MODES = ("background", "inline", "reference", "python")
TIERS = ("reference", "python", "compiled")  # what runs a plan's calls, slowest first


class DriverBuildWarning(UserWarning):
    """A plan's driver could not be compiled in the background: its calls stay correct and run
    the driver as Python."""


def driver_mode(background: bool | None = None) -> str:
    """The mode of a plan whose function asked for `background` (None: BACKPLAN_DRIVER's)."""
    if background is not None:
        return "reference" if background else "inline"
    mode = os.environ.get("BACKPLAN_DRIVER", "background")
    if mode not in MODES:
        raise ValueError(f"BACKPLAN_DRIVER={mode!r}; use one of {', '.join(MODES)}")
    return mode


def python_driver(source: str, path: str):
    """`run` of the generated source as a plain Python function whose parts are Python too;
    the kernels, GEMMs and library functions it calls stay compiled."""
    scope = {"__name__": "backplan_python_driver", "__file__": path}
    exec(compile(source, path, "exec"), scope)
    for name, value in list(scope.items()):
        if (name == "run" or name.startswith("run_part")) and hasattr(value, "py_func"):
            scope[name] = value.py_func
    return scope["run"]


def argument_types(arrays: list) -> list:
    """What the compiled driver is compiled for: each argument's dtype, rank, layout and
    whether it is read-only, as Numba types the argument."""
    import numba

    described = []
    for array in arrays:
        kind = numba.typeof(array)
        described.append([str(array.dtype), kind.ndim, kind.layout, not kind.mutable])
    return described


def numba_signature(described: list) -> tuple:
    import numba

    return tuple(
        numba.types.Array(numba.from_dtype(np.dtype(d)), ndim, layout, readonly=readonly)
        for d, ndim, layout, readonly in described
    )


def is_cached(dispatcher) -> bool:
    """Whether a compiled `run` for this driver is in Numba's (signed) cache: its index file
    exists (a prediction, as for kernels: the index may hold other argument types)."""
    cache = getattr(dispatcher, "_cache", None)
    index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
    return index is not None and os.path.exists(index)


class DriverBuild:
    """One plan's driver compiled in a child process; `on_ready(dispatcher)` is called from the
    waiting thread once the compiled driver is loaded, `on_failed(message)` if it never is."""

    def __init__(self, payload: dict, load, on_ready, on_failed, announced_as: str | None = None):
        self.payload = payload
        self.announced_as = announced_as  # the plan's label when a line said it is building
        self.load = load  # () -> the compiled dispatcher, loaded from the disk cache
        self.on_ready = on_ready
        self.on_failed = on_failed
        self.started = None
        self.seconds = None

    def run(self) -> None:
        """In the builder thread: one child at a time, so a burst of plans does not fork a
        compiler per plan."""
        self.started = time.perf_counter()
        try:
            child = _spawn(self.payload)
        except OSError as exc:
            self.on_failed(f"could not start the driver build ({exc})")
            return
        _running.append((self, child))
        try:
            _, err = child.communicate(json.dumps(self.payload).encode())
        finally:
            _running.remove((self, child))
        if child.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            self.on_failed(
                f"the driver build exited with status {child.returncode}: " + " | ".join(tail)
            )
            return
        try:
            dispatcher = self.load()
        except Exception as exc:  # noqa: BLE001 - reported, never raised into a user's step
            self.on_failed(f"loading the built driver failed ({type(exc).__name__}: {exc})")
            return
        self.seconds = time.perf_counter() - self.started
        self.on_ready(dispatcher)


def _spawn(payload: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "backplan.codegen.driver_build"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "BACKPLAN_DRIVER": "inline", "BACKPLAN_QUIET": "1"},
    )


_queue: deque[DriverBuild] = deque()
_running: list[tuple[DriverBuild, subprocess.Popen]] = []
_wake = threading.Condition()
_builder: list[threading.Thread] = []


def submit(build: DriverBuild) -> None:
    with _wake:
        _queue.append(build)
        if not _builder:
            thread = threading.Thread(target=_serve, name="backplan-driver-builder", daemon=True)
            _builder.append(thread)
            thread.start()
        _wake.notify()


_busy = [0]  # builds taken off the queue and not finished (started, loading, switching)


def _serve() -> None:
    while True:
        with _wake:
            while not _queue:
                _wake.wait()
            build = _queue.popleft()
            _busy[0] += 1
        try:
            build.run()
        finally:
            with _wake:
                _busy[0] -= 1
                _wake.notify_all()


def pending() -> int:
    """Builds queued or not yet finished in this process."""
    with _wake:
        return len(_queue) + _busy[0]


def wait_for_builds(timeout: float | None = None) -> bool:
    """Wait until every driver build of this process has finished (switched or failed): what a
    benchmark does before timing steps. False if builds are still going after `timeout`."""
    with _wake:
        return _wake.wait_for(lambda: not _queue and not _busy[0], timeout)


@atexit.register
def _stop_children() -> None:
    """A build still running when the program ends is stopped (it would only warm the cache for
    a next run, on a CPU the user may want back); queued ones never start. Builds a line
    announced get a line saying so."""
    stopped = [b for b in _queue if b.announced_as] + [b for b, _ in _running if b.announced_as]
    _queue.clear()
    for _, child in list(_running):
        child.kill()
    for build in stopped:
        print(
            f"backplan: {build.announced_as}: program ended before its compiled driver was built; "
            "none of its calls ran it",
            file=sys.stderr,
        )
