"""bench/half_ulps.py measures distances in 16-bit ulps at the reference value."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from backplan.bench.half_ulps import summary, ulps


def test_ulps_counts_16_bit_steps_at_the_reference_value():
    bf16 = ml_dtypes.bfloat16
    want = np.array([1.0, 1.0, -2.0, 0.0, np.inf, np.nan, 3.0], bf16)
    bits = want.view(np.uint16).copy()
    bits[1] += 1  # the next bfloat16 above 1: one ulp
    bits[2] += 3  # three steps further from zero below -2
    got = bits.view(bf16)
    got[6] = np.nan
    apart = ulps(got, want, bf16)
    np.testing.assert_array_equal(apart[:6], [0, 1, 3, 0, 0, 0])
    assert apart[6] == np.inf  # a NaN where the reference has a number
    tiny = np.array([2.0**-20], np.float16)  # float16 subnormal spacing 2^-24 below 2^-14
    np.testing.assert_array_equal(ulps(tiny + np.float16(2.0**-24), tiny, np.float16), [1.0])


def test_summary_reads_largest_p99_and_bit_equal_share():
    want = [np.ones(1, np.float16), np.ones(99, np.float16)]
    got = [np.ones(1, np.float16), np.ones(99, np.float16)]
    got[1][0] = np.float16(1.0 + 2.0**-10) * 1  # one element one ulp apart
    line = summary(got, want, np.float16)
    assert line == "loss 0.00, max 1, p99 0.01, over 1 ulp 0, bit-equal 99.00% of 100"
