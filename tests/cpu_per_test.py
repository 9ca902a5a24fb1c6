"""CPU seconds per test, the process's own and its children's: where the suite's time goes.

`python -m pytest --cpu-per-test=cpu.json` (tests/conftest.py adds the option) records, for
each test (setup, call and teardown), the CPU its process used (getrusage self) and the CPU of
the children it waited for (mpiexec ranks, fresh interpreters, driver builds). Each process
appends its rows to `cpu.json.<worker>.jsonl` as it goes; the process that ends the run (the
xdist controller, or the only process with `-n 0`) reads them back, writes `cpu.json` (rows, per
file totals, each worker's whole-process CPU) and prints the largest files and tests.
Wall time says little on a shared box; CPU seconds compare across loads. Each row keeps its
wall seconds too: on an idle box a test whose wall time exceeds its CPU (own + children) left a
core idle for the difference (a sleep, a timeout waited out, a lock), the part of the suite's
wall time no CPU cut shortens; the report lists the largest such waits.

Each row also keeps the seconds Numba spent compiling in the test's own process, per function
(`compiled`: the function's own thread CPU, the compiles it set off inside it not counted; a
plan's generated driver is `<driver>.run`, a loop kernel `<loop>.<form>`), and the report
lists the functions whose compiles cost the run the most: where a fresh clone's suite spends its
CPU on compiling, and on which kernels (children's compiles are in children_s, not named).

`python tests/cpu_per_test.py before.json after.json` prints the files' CPU side by side.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import sys
import threading
import time

import pytest


def _cpu() -> tuple[float, float]:
    """(self, children) user + system CPU seconds of this process so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def compiled_name(dispatcher) -> str:
    """What a compile is reported as: the function's module and name; the modules backplan
    generates (one per plan's driver, one per loop kernel, named by hashes) by their kind."""
    function = getattr(dispatcher, "py_func", None)
    module = getattr(function, "__module__", None) or "?"
    name = getattr(function, "__qualname__", None) or "?"
    if module.startswith("backplan_kernels_"):
        return f"<driver>.{name}"
    if module.startswith("backplan_kernel_"):
        return f"<loop>.{name}"
    return f"{module}.{name}"


class CompileTimes:
    """Numba's compile events ("numba:compile", one per function and signature compiled, a
    driver's around its loops'), each function's own thread CPU seconds added up by name until
    taken: the compiles a test set off in this process."""

    def __init__(self):
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # this thread's open compiles: [start, nested seconds]

    def on_start(self, event) -> None:
        self._open().append([time.thread_time(), 0.0])

    def on_end(self, event) -> None:
        opened = self._open()
        if not opened:
            return  # started before this listener was: never raise inside Numba's compile
        start, nested = opened.pop()
        spent = time.thread_time() - start
        if opened:
            opened[-1][1] += spent
        name = compiled_name((event.data or {}).get("dispatcher"))
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + spent - nested

    def _open(self) -> list:
        if not hasattr(self._local, "open"):
            self._local.open = []
        return self._local.open

    def take(self) -> dict[str, float]:
        """The seconds by function since the last take, largest first (rounded)."""
        with self._lock:
            taken, self._seconds = self._seconds, {}
        rounded = ((name, round(s, 3)) for name, s in taken.items())
        return dict(sorted(((n, s) for n, s in rounded if s > 0), key=lambda kv: -kv[1]))


def listen(times: CompileTimes):
    """times hears every compile in this process from now on (Numba's event API); the
    listener, for numba.core.event.unregister, or None without Numba."""
    try:
        from numba.core import event
    except ImportError:
        return None

    class Listener(event.Listener):
        def on_start(self, e):
            times.on_start(e)

        def on_end(self, e):
            times.on_end(e)

    listener = Listener()
    event.register("numba:compile", listener)
    return listener


class CpuPerTest:
    """The plugin object: one per process of the run."""

    def __init__(self, path: str, worker: str | None):
        self.path = path
        self.worker = worker
        self._rows = open(f"{path}.{worker or 'main'}.jsonl", "a")
        self._compiles = CompileTimes()
        listen(self._compiles)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        own0, kids0 = _cpu()
        wall0 = time.perf_counter()
        self._compiles.take()  # what compiled between tests (collection, fixtures' teardown)
        yield
        wall1 = time.perf_counter()
        own1, kids1 = _cpu()
        row = {
            "test": item.nodeid,
            "file": item.path.name,
            "self_s": round(own1 - own0, 3),
            "children_s": round(kids1 - kids0, 3),
            "wall_s": round(wall1 - wall0, 3),
            "worker": self.worker or "main",
            "compiled": self._compiles.take(),
        }
        self._rows.write(json.dumps(row) + "\n")
        self._rows.flush()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        own, kids = _cpu()
        self._rows.write(
            json.dumps(
                {
                    "process": self.worker or "main",
                    "self_s": round(own, 3),
                    "children_s": round(kids, 3),
                }
            )
            + "\n"
        )
        self._rows.close()
        if self.worker is None:  # the controller (or the only process): after every worker
            summary = _summary(self.path)
            with open(self.path, "w") as f:
                json.dump(summary, f, indent=1)
            sys.stdout.write("\n" + _report(summary))


def _summary(path: str) -> dict:
    rows, processes = [], []
    for name in sorted(glob.glob(f"{path}.*.jsonl")):
        with open(name) as f:
            for line in f:
                row = json.loads(line)
                (processes if "process" in row else rows).append(row)
        os.unlink(name)
    files: dict[str, dict] = {}
    for row in rows:
        total = files.setdefault(row["file"], {"tests": 0, "self_s": 0.0, "children_s": 0.0})
        total["tests"] += 1
        total["self_s"] += row["self_s"]
        total["children_s"] += row["children_s"]
    for total in files.values():
        total["cpu_s"] = round(total["self_s"] + total["children_s"], 2)
        total["self_s"] = round(total["self_s"], 2)
        total["children_s"] = round(total["children_s"], 2)
    compiled: dict[str, list] = {}  # function -> [seconds, tests compiling it]
    for row in rows:
        for name, seconds in row.get("compiled", {}).items():
            total = compiled.setdefault(name, [0.0, 0])
            total[0] += seconds
            total[1] += 1
    return {
        "tests_cpu_s": round(sum(t["cpu_s"] for t in files.values()), 1),
        "compiled_s": round(sum(s for s, _ in compiled.values()), 1),
        "compiled": {
            name: {"seconds": round(s, 2), "tests": n}
            for name, (s, n) in sorted(compiled.items(), key=lambda kv: -kv[1][0])
        },
        "processes": processes,
        "files": dict(sorted(files.items(), key=lambda kv: -kv[1]["cpu_s"])),
        "tests": sorted(rows, key=lambda r: -(r["self_s"] + r["children_s"])),
    }


def _report(summary: dict, top: int = 15) -> str:
    procs = summary["processes"]
    lines = [
        f"CPU per test: the tests' own {summary['tests_cpu_s']:.1f} s; "
        + "processes (self + children): "
        + ", ".join(f"{p['process']} {p['self_s']:.1f} + {p['children_s']:.1f}" for p in procs)
    ]
    lines.append("largest files (self + children CPU s, tests):")
    for name, t in list(summary["files"].items())[:top]:
        lines.append(
            f"  {t['cpu_s']:8.1f}  ({t['self_s']:.1f} + {t['children_s']:.1f})"
            f"  {t['tests']:4d}  {name}"
        )
    lines.append("largest tests:")
    for row in summary["tests"][:top]:
        lines.append(
            f"  {row['self_s'] + row['children_s']:8.1f}"
            f"  ({row['self_s']:.1f} + {row['children_s']:.1f})  {row['test']}"
        )
    if summary.get("compiled"):
        lines.append(
            f"Numba compiling in the tests' own processes: {summary['compiled_s']:.1f} CPU s; "
            "the largest functions (own CPU s, tests compiling them):"
        )
        for name, c in list(summary["compiled"].items())[:top]:
            lines.append(f"  {c['seconds']:8.1f}  {c['tests']:4d}  {name}")
    waits = sorted(summary["tests"], key=lambda r: -_waited(r))[:top]
    if waits and _waited(waits[0]) > 0:
        lines.append("largest waits (wall - CPU s: a core idle there on an idle box; wall):")
        lines.extend(f"  {_waited(r):8.1f}  ({r['wall_s']:.1f})  {r['test']}" for r in waits)
    return "\n".join(lines) + "\n"


def _waited(row: dict) -> float:
    """Wall seconds a test spent beyond its CPU (rows written before wall_s was kept: 0)."""
    return row.get("wall_s", 0.0) - row["self_s"] - row["children_s"]


def _compare(before: str, after: str) -> str:
    with open(before) as f:
        a = json.load(f)["files"]
    with open(after) as f:
        b = json.load(f)["files"]
    names = sorted(
        set(a) | set(b),
        key=lambda n: -max(a.get(n, {}).get("cpu_s", 0), b.get(n, {}).get("cpu_s", 0)),
    )
    lines = [f"{'before':>9} {'after':>9} {'change':>8}  file"]
    for name in names:
        x, y = a.get(name, {}).get("cpu_s", 0.0), b.get(name, {}).get("cpu_s", 0.0)
        lines.append(f"{x:9.1f} {y:9.1f} {y - x:+8.1f}  {name}")
    total_a = sum(t["cpu_s"] for t in a.values())
    total_b = sum(t["cpu_s"] for t in b.values())
    lines.append(f"{total_a:9.1f} {total_b:9.1f} {total_b - total_a:+8.1f}  (all files)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(_compare(sys.argv[1], sys.argv[2]))
