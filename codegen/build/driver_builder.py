"""Child processes that compile plans' drivers into the disk cache (codegen/build/driver_tier.py
says
when a plan wants one; codegen/build/driver_build.py is the child).

One builder thread per process runs one child at a time, so a burst of plans does not fork a
compiler per plan; the child takes every build queued when it starts (one Numba import for all)
and reports each driver as it is cached, so the first plan switches without waiting for the rest.
The child reads its work from a file and writes its errors to one, and runs in a session of its
own: it never holds the program's stdout or stderr. When the program ends, the child is stopped
and queued builds are dropped: no process outlives the program (the child also stops by itself
when its parent is gone, killed or crashed). Under BACKPLAN_DRIVER_AT_EXIT=finish a running
child finishes and caches its drivers for the next run, queued builds go to one last child, and
a line at exit gives its process id.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

from backplan.codegen.build import driver_tier


class DriverBuild:
    """One plan's driver to compile in a child process; `on_ready(dispatcher)` is called from
    the builder thread once the compiled driver is loaded, `on_failed(message)` if it never is."""

    def __init__(
        self, payload: dict, load, on_ready, on_failed, label: str, announced=False, on_stopped=None
    ):
        self.payload = payload  # source, key parts, kernels, signature, folder of the cache
        self.load = load  # () -> the compiled dispatcher, loaded from the disk cache
        self.on_ready = on_ready
        self.on_failed = on_failed
        self.on_stopped = on_stopped  # () when stop_builds() ended it: no warning, no switch
        self.label = label
        self.announced = announced  # a line said it is building: its end is a line too
        # Taken now: the program may change its environment (a test its cache folder) before
        # the build starts, and the child must write where this plan's module lives.
        self.env = {
            **os.environ,
            "BACKPLAN_CACHE_DIR": payload["folder"],
            "BACKPLAN_DRIVER": "inline",
            "BACKPLAN_QUIET": "1",
            "BACKPLAN_BUILD_PARENT": str(os.getpid()),  # the child stops when it is gone
        }
        self.started = None
        self.seconds = None
        self.compiled = None  # whether the child compiled it (not: another process had)

    def finish(self, error: str | None, compiled: bool = False) -> None:
        """In the builder thread, when the child has cached this driver (error None) or not."""
        self.compiled = compiled
        if error is not None:
            self.on_failed(error)
            return
        try:
            dispatcher = self.load()
        except Exception as exc:  # noqa: BLE001 - reported, never raised into a user's step
            self.on_failed(f"loading the built driver failed ({type(exc).__name__}: {exc})")
            return
        self.seconds = time.perf_counter() - self.started
        self.on_ready(dispatcher)


class _Child:
    """A running child process and the builds it was given."""

    def __init__(self, builds: list[DriverBuild]):
        self.builds = builds
        self.finished: set[int] = set()
        self.stopped = False  # by stop_builds(): its unfinished builds end quietly
        self.read_by_builder = False  # else started at exit: nobody reads its reports
        work = tempfile.TemporaryFile()  # unnamed: nothing is left behind, whoever exits first
        work.write(json.dumps([b.payload for b in builds]).encode())
        work.seek(0)
        self.errors = tempfile.TemporaryFile()
        try:
            self.process = subprocess.Popen(
                _command(),
                stdin=work,
                stdout=subprocess.PIPE,
                stderr=self.errors,
                env=builds[0].env,
                start_new_session=True,  # Ctrl-C and the end of the program leave it running
            )
        except BaseException:
            self.errors.close()
            raise
        finally:
            work.close()

    def unfinished_labels(self) -> list[str]:
        return [b.label for i, b in enumerate(self.builds) if i not in self.finished]

    def error_tail(self) -> str:
        self.errors.seek(0)
        lines = self.errors.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:])


_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from backplan.codegen.build.driver_build import main; main()"
)


def _command() -> list[str]:
    """This program's interpreter with its flags (-I, -E, -s...) and its import path: the child
    must import the very backplan whose code it compiles (another one keys the cache apart)."""
    flags = subprocess._args_from_interpreter_flags()
    return [sys.executable, *flags, "-c", _BOOT, json.dumps(sys.path)]


_queue: deque[DriverBuild] = deque()
_running: list[_Child] = []
_wake = threading.Condition()
_builder: list[threading.Thread] = []
_busy = [0]  # builds taken off the queue and not finished (started, loading, switching)
_exiting = [False]


def submit(build: DriverBuild) -> None:
    with _wake:
        _queue.append(build)
        if not _builder:
            thread = threading.Thread(target=_serve, name="backplan-driver-builder", daemon=True)
            _builder.append(thread)
            thread.start()
        _wake.notify()


def _serve() -> None:
    while True:
        with _wake:
            while not _queue or _exiting[0]:
                _wake.wait()
            batch = _take_batch()
            _busy[0] += len(batch)
            child = _start(batch)  # under the lock: the exit handler sees every child started
            if child is not None:
                child.read_by_builder = True
        try:
            if child is not None:
                _collect(child)
        finally:
            with _wake:
                _busy[0] -= len(batch)
                _wake.notify_all()


def _take_batch() -> list[DriverBuild]:
    """The first queued build and every other queued one with the same environment."""
    first = _queue.popleft()
    batch = [first] + [b for b in _queue if b.env == first.env]
    for build in batch[1:]:
        _queue.remove(build)
    return batch


def _start(batch: list[DriverBuild]) -> _Child | None:
    started = time.perf_counter()
    for build in batch:
        build.started = started
    try:
        child = _Child(batch)
    except Exception as exc:  # noqa: BLE001 - the builder thread must live on for later builds
        for build in batch:
            build.finish(f"could not start the driver build ({exc})")
        return None
    _running.append(child)
    return child


def _collect(child: _Child) -> None:
    """Each driver is loaded as soon as the child reports it cached (one JSON line each)."""
    for line in child.process.stdout:
        try:
            report = json.loads(line)
            index, error, compiled = int(report["index"]), report["error"], report["compiled"]
            build = child.builds[index]
        except (ValueError, KeyError, TypeError, IndexError):
            continue
        if _exiting[0]:
            child.process.stdout.close()  # the exit handler lets the child go: none will read
            return
        child.finished.add(index)
        build.finish(error, bool(compiled))
    status = child.process.wait()
    with _wake:
        _running.remove(child)
        if _exiting[0]:
            return  # the exit handler has it (it took _running as _exiting became True)
    child.process.stdout.close()
    if child.stopped:
        child.errors.close()
        for index, build in enumerate(child.builds):
            if index not in child.finished:
                _stopped(build)
        return
    why = f"the driver build exited with status {status}: {child.error_tail()}"
    child.errors.close()
    for index, build in enumerate(child.builds):
        if index not in child.finished:
            build.finish(why if status else "the driver build ended without reporting it")


def pending() -> int:
    """Builds queued or not yet finished in this process."""
    with _wake:
        return len(_queue) + _busy[0]


def wait_for_builds(timeout: float | None = None) -> bool:
    """Wait until every driver build of this process has finished (switched or failed): what a
    benchmark does before timing steps. False if builds are still going after `timeout`."""
    with _wake:
        return _wake.wait_for(lambda: not _queue and not _busy[0], timeout)


def stop_builds(timeout: float = 30.0) -> int:
    """Drop the queued builds and stop the running children; each plan stays on the driver it
    runs now, quietly (no DriverBuildWarning). For a test suite between tests: a build left
    running compiles, beside the next tests, a driver no later test calls. Returns how many
    builds were stopped; waits up to `timeout` seconds for the builder thread to let go."""
    with _wake:
        dropped = list(_queue)
        _queue.clear()
        running = list(_running)
        for child in running:
            child.stopped = True
    for build in dropped:
        _stopped(build)
    for child in running:
        child.process.kill()
    wait_for_builds(timeout)
    return len(dropped) + sum(len(child.builds) - len(child.finished) for child in running)


def _stopped(build: DriverBuild) -> None:
    if build.on_stopped is not None:
        build.on_stopped()


@atexit.register
def _at_exit() -> None:
    """The running child is stopped and queued builds never start; under
    BACKPLAN_DRIVER_AT_EXIT=finish a running child finishes and caches its drivers for the next
    run, and builds still queued (a short script ends right after its first call) go to one
    last child, each left running a line on stderr (BACKPLAN_QUIET=1 turns them off). A build
    stopped says so only where its start did (BACKPLAN_VERBOSE=1)."""
    try:
        kill = driver_tier.at_exit_mode() == "kill"
    except ValueError:
        kill = True  # refused when the plan was made; the default here
    with _wake:
        _exiting[0] = True
        if _queue and not kill:
            _start(_take_batch())
        dropped = [b for b in _queue if b.announced]
        _queue.clear()
        running = list(_running)
    lines = [
        f"{b.label}: program ended before its compiled driver was built; none of its calls ran it"
        for b in dropped
    ]
    for child in running:
        lines.append(_stop(child) if kill else _left_running(child))
        _let_go(child)
    if os.environ.get("BACKPLAN_QUIET", "") in ("", "0"):
        for line in filter(None, lines):
            print(f"backplan: {line}", file=sys.stderr, flush=True)


def _let_go(child: _Child) -> None:
    """The program is ending: close this process's end of the child's error file, and tell
    Popen the child is meant to outlive it (it would warn `subprocess ... is still running`
    under -W default). The child's stdout pipe closes with the process; the child takes a
    broken pipe as the end of its reports (driver_build.report) and goes on caching."""
    child.errors.close()
    if not child.read_by_builder:  # the builder thread closes its own (it may be reading)
        child.process.stdout.close()
    child.process._child_created = False  # noqa: SLF001 - Popen has no public way to disown


def _stop(child: _Child) -> str | None:
    child.process.kill()
    child.process.wait()
    announced = [b.label for b in child.builds if b.announced]
    if not announced:
        return None
    return (
        f"{', '.join(announced)}: program ended before the compiled driver was built; none of "
        "its calls ran it"
    )


def _left_running(child: _Child) -> str | None:
    pid = child.process.pid
    labels = child.unfinished_labels()
    if not labels:
        return None  # every driver is cached; the child is only exiting
    what = "compiled driver" if len(labels) == 1 else "compiled drivers"
    return (
        f"{', '.join(labels)}: the {what} still building in process {pid} will be cached for the "
        f"next run (`kill {pid}` stops it; BACKPLAN_DRIVER_AT_EXIT=kill stops builds at exit)"
    )
