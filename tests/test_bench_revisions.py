"""`python -m backplan.bench.revisions`: two installations' step times from interleaved
processes (here the same installation twice, so both columns time the same code)."""

import os
import re
import sys

import pytest

from backplan.bench import revisions


def test_two_installations_are_timed_side_by_side(capsys):
    code = revisions.main(
        ["--a", sys.executable, "--b", sys.executable, "--models", "mlp_tiny"]
        + ["--processes", "1", "--rounds", "1"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(
        r"^CPUs \[\d+\], 1 thread\(s\) per process, peer backplan$", out, flags=re.M
    ), out
    row = re.search(r"^mlp_tiny\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, flags=re.M)
    assert row, out
    a_ms, b_ms, ratio = map(float, row.groups())
    assert 0 < a_ms < 50 and 0 < b_ms < 50  # a tiny MLP's step, in milliseconds
    assert abs(ratio - b_ms / a_ms) < 0.01


def test_threads_beyond_the_usable_cpus_are_a_clear_error(capsys):
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit):
        revisions.main(["--a", sys.executable, "--threads", str(too_many)])
    assert f"--threads {too_many}: this process may use" in capsys.readouterr().err


def test_cpu_clock_reaches_the_children_and_times_cpu_not_sleep(monkeypatch, capsys):
    """--clock cpu: every child is asked for it, the header says so, and a step is timed by
    CPU time (a step that sleeps costs almost none of it, where the wall clock counts it)."""
    import subprocess
    import time
    import types

    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return types.SimpleNamespace(returncode=0, stdout='{"mlp_tiny": 0.001}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    cpu = sorted(os.sched_getaffinity(0))[0]
    args = ["--a", sys.executable, "--models", "mlp_tiny", "--processes", "1", "--cpu", str(cpu)]
    assert revisions.main([*args, "--clock", "cpu"]) == 0
    assert len(commands) == 4 and all(c[c.index("--clock") + 1] == "cpu" for c in commands)
    assert re.search(r"peer backplan, clock cpu$", capsys.readouterr().out, flags=re.M)

    def sleepy():
        time.sleep(0.002)

    seconds = revisions.cpu_medians({"sleepy": sleepy}, 1, 0.02, time.thread_time)["sleepy"]
    assert seconds < 0.001  # the 2 ms sleep is not CPU time


def test_the_default_cpu_is_one_this_process_may_use(monkeypatch, capsys):
    """Without --cpu the children pin to the first CPU this process may use: under
    `taskset -c 1` (CPU 0 not usable) the comparison runs there instead of refusing."""
    import subprocess
    import types

    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return types.SimpleNamespace(returncode=0, stdout='{"mlp_tiny": 0.001}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1})
    assert revisions.main(["--a", sys.executable, "--models", "mlp_tiny", "--processes", "1"]) == 0
    assert len(commands) == 4 and all(c[c.index("--cpus") + 1] == "1" for c in commands)
    assert re.search(r"^CPUs \[1\], 1 thread\(s\) per process", capsys.readouterr().out, re.M)


def test_a_relative_python_path_reaches_the_children_absolute(monkeypatch, capsys):
    """The children run in the temporary folder: `--a .venv/bin/python` is made absolute
    there (it failed with FileNotFoundError); a bare `python` stays a PATH lookup."""
    import subprocess
    import types

    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return types.SimpleNamespace(returncode=0, stdout='{"mlp_tiny": 0.001}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    cpu = str(sorted(os.sched_getaffinity(0))[0])
    args = ["--a", os.path.join(".venv", "bin", "python"), "--b", "python", "--cpu", cpu]
    assert revisions.main([*args, "--models", "mlp_tiny", "--processes", "1"]) == 0
    assert {c[0] for c in commands} == {os.path.abspath(args[1]), "python"}
