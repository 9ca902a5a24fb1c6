"""The hand-fused ln_gelu baseline computes the bench model's loss and gradients (so a
comparison against it is fair), and its harness prints both peers, checked, at 1 and 2
threads."""

import os
import subprocess
import sys

import numpy as np
import pytest

from backplan.bench import ln_gelu_fused


@pytest.mark.parametrize("threads", [1, 2])
def test_hand_fused_step_matches_the_float64_reference_on_odd_shapes(threads):
    rng = np.random.default_rng(3)
    rows, cols = 7, 33
    params = {
        "x": rng.standard_normal((rows, cols)) * 3.0,
        "g": 1.0 + 0.1 * rng.standard_normal(cols),
        "b": 0.1 * rng.standard_normal(cols),
    }
    upstream = rng.standard_normal((rows, cols))
    value, grads = ln_gelu_fused.hand_fused(params, upstream, threads)()
    want_value, want = ln_gelu_fused.reference(params, upstream)
    assert value == pytest.approx(want_value, rel=1e-4)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-4 * np.abs(expected).max())


@pytest.mark.parametrize("threads", ["1", "2"])
def test_harness_prints_both_peers_checked(threads):
    done = subprocess.run(
        [sys.executable, "-m", "backplan.bench.ln_gelu_fused", "--shape", "16,40"]
        + ["--rounds", "1", "--seconds", "0.01", "--threads", threads],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BACKPLAN_QUIET": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # both peers' gradients checked
    rows = {
        line[:18].strip(): line[18:].split()
        for line in done.stdout.splitlines()
        if line.startswith(("backplan ", "hand-fused"))
    }
    assert set(rows) == {"backplan", "hand-fused Numba"}
    assert float(rows["hand-fused Numba"][1]) == 1.0  # the ratio column is against it
    assert f"{threads} thread(s)" in done.stdout
