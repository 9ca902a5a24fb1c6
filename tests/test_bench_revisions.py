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
