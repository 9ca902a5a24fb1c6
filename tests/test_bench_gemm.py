"""The GEMM harness's yardstick: the FMA peak probe computes what it counts, and the table
reports backplan's share of that peak."""

import numpy as np
import pytest

from backplan.bench import gemm
from backplan.bench.peak_flops import ACCUMULATORS, fma_chain


@pytest.mark.parametrize("lanes", [8, 16])
def test_fma_chain_runs_every_counted_fma(lanes):
    scale, shift, steps = np.float32(0.999), np.float32(1e-3), 37
    acc = shift
    for _ in range(steps):
        acc = np.float32(acc * scale + shift)
    expected = np.float32(ACCUMULATORS * lanes) * acc
    got = fma_chain(lanes)(steps, scale, shift)
    assert got == pytest.approx(float(expected), rel=1e-5)
    assert fma_chain(lanes)(steps + 5, scale, shift) != pytest.approx(float(expected), rel=1e-5)


def test_table_reports_share_of_peak_and_own_over_blas():
    results = {"mlp fwd": {"backplan": [90.0, 100.0, 110.0], "openblas": [50.0, 50.0, 50.0]}}
    table = gemm.format_table(results, peak=200.0)
    header, row = table.splitlines()
    assert header.split()[-2:] == ["own/blas", "own/peak"]
    assert row.split()[-2:] == ["2.00", "50%"]
    assert "own/peak" not in gemm.format_table(results)


def test_table_at_two_threads_shows_the_gain_over_one_thread():
    """ "bp 1 thread" (2-D shapes only at T > 1): own/1t is backplan over it, a dash without."""
    results = {
        "mlp fwd": {"backplan": [180.0], "openblas": [90.0], "bp 1 thread": [100.0]},
        "attn": {"backplan": [150.0], "openblas": [100.0]},
    }
    header, mlp, attn = gemm.format_table(results).splitlines()
    assert header.split()[-1] == "own/1t"
    assert mlp.split()[-1] == "1.80" and attn.split()[-1] == "-"
    assert attn.split()[-3] == "-" and attn.split()[-2] == "1.50"
