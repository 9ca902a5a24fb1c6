"""bench.tanh_ulps counts what tests/test_mathlib.py counts: ulps of the correctly rounded
float32 result against float64's tanh, 0 where a library rounds correctly."""

import numpy as np

from backplan.bench import tanh_ulps


def test_sweep_counts_ulps_of_the_correctly_rounded_result():
    exact = {"float64 rounded": lambda x: np.tanh(x.astype(np.float64)).astype(np.float32)}
    off = {"one ulp up": lambda x: np.nextafter(exact["float64 rounded"](x), np.float32(2))}
    found = tanh_ulps.sweep({**exact, **off}, stride=1 << 20)
    rounded, up = found["float64 rounded"], found["one ulp up"]
    assert rounded["max_ulp"] == 0 and rounded["not_correctly_rounded"] == 0
    assert 1.0 <= up["max_ulp"] <= 1.5  # one ulp from the rounded value, < 1.5 from the exact
    assert up["not_correctly_rounded"] == up["inputs"] == rounded["inputs"] > 1000


def test_backplans_tanh_f32_within_its_bound_on_a_sample():
    found = tanh_ulps.sweep(tanh_ulps.tanhs([]), stride=1 << 14)
    assert found["backplan tanh_f32"]["max_ulp"] <= 2.5
    assert found["backplan rational"]["max_ulp"] <= 4.7  # XLA's Eigen form, 16-bit results
