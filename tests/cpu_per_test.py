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

`python tests/cpu_per_test.py before.json after.json` prints the files' CPU side by side.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import sys
import time

import pytest


def _cpu() -> tuple[float, float]:
    """(self, children) user + system CPU seconds of this process so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


class CpuPerTest:
    """The plugin object: one per process of the run."""

    def __init__(self, path: str, worker: str | None):
        self.path = path
        self.worker = worker
        self._rows = open(f"{path}.{worker or 'main'}.jsonl", "a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        own0, kids0 = _cpu()
        wall0 = time.perf_counter()
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
    return {
        "tests_cpu_s": round(sum(t["cpu_s"] for t in files.values()), 1),
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
