"""A tanh whose float32 result a loop only rounds into bfloat16 or float16 is the rational
tanh (mathlib.tanh_rational_f32, 3e-7 relative): far below half a 16-bit ulp, so the stored
bits are the reference interpreter's (np.tanh in float32, rounded once) on every 16-bit
input; such a tanh-form gelu op is x * sigmoid(2u) (scalar_functions.gelu_tanh_sigmoid_f32);
float32 results keep tanh_f32 and gelu_tanh_f32."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import backplan as bp
from backplan.codegen.kernels.half import target_has_avx512bf16
from backplan.codegen.kernels.mathlib import tanh_rational_f32
from backplan.runtime.backend import use_backend

BF16 = np.dtype(ml_dtypes.bfloat16)


@njit  # no cache: Numba would not see a change of the inlined function
def _tanh_all(xs, out):
    for i in range(xs.size):
        out[i] = tanh_rational_f32(xs[i])


def test_rational_tanh_error_and_special_values():
    """Every 64th non-negative float32 pattern (tanh is odd) and their negatives: relative
    error at most 3e-7 against float64's tanh (all 2^31 patterns measured 2.95e-7 once,
    outside the suite); infinities give +-1, zeros and subnormals keep themselves and their
    sign, NaN stays NaN."""
    bits = np.arange(0, 0x7F800000, 64, dtype=np.uint32)
    xs = np.concatenate([bits.view(np.float32), -bits.view(np.float32)])
    out = np.empty_like(xs)
    _tanh_all(xs, out)
    want = np.tanh(xs.astype(np.float64))
    error = np.abs(out - want) / np.maximum(np.abs(want), np.finfo(np.float64).tiny)
    assert error.max() <= 3e-7, (error.max(), xs[error.argmax()])
    special = np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, np.nan], np.float32)
    got = np.empty_like(special)
    _tanh_all(special, got)
    np.testing.assert_array_equal(got[:6], [1.0, -1.0, 0.0, -0.0, special[4], special[5]])
    assert list(np.signbit(got[:6])) == [False, True, False, True, False, True]
    assert np.isnan(got[6])


def _sources(fn, *args):
    runners = fn.trace(*args).runners()
    compiled = [r.compiled for r in runners if hasattr(r, "compiled")]
    return "".join(c.source + "".join(k.source for k in c.loop_kernels) for c in compiled)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_16_bit_tanh_equals_the_reference_on_every_input(dtype):
    """All 65,536 patterns: the compiled 16-bit tanh (the rational one, which its loop calls)
    stores the reference interpreter's bits (NaN as NaN; bfloat16 results below float32's
    normal range are zero where VCVTNEPS2BF16 rounds, as docs/ops.md says)."""
    x = bp.tensor(np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype))
    fn = bp.compile(bp.tanh)
    with use_backend("reference"):
        want = fn(x).numpy()
    with use_backend("numba"):
        got = fn(x).numpy()
        source = _sources(fn, x)
    assert "tanh_rational_f32(" in source and "tanh_f32(" not in source
    want32 = want.astype(np.float32)
    nan = np.isnan(want32)
    assert np.isnan(got.astype(np.float32)[nan]).all()
    kept = ~nan
    if dtype == BF16 and target_has_avx512bf16():  # VCVTNEPS2BF16 stores them as zero
        flushed = np.abs(want32) < np.finfo(np.float32).tiny
        assert (got.astype(np.float32)[flushed] == 0).all()
        kept &= ~flushed
    np.testing.assert_array_equal(got.view(np.uint16)[kept], want.view(np.uint16)[kept])


def test_float32_tanh_and_a_used_float32_value_keep_tanh_f32():
    """A float32 tanh (and tanh-form gelu), and a 16-bit program's float32 tanh whose value is
    used unrounded (here summed in float32 beside its rounding), stay on the 2.42-ulp tanh_f32
    (gelu_tanh_f32)."""
    x32 = bp.tensor(np.linspace(-3, 3, 40, dtype=np.float32))
    xb = bp.tensor(np.linspace(-3, 3, 40).astype(BF16))

    def both_ways(x):
        wide = bp.tanh(x.astype(bp.float32))
        return wide, wide.astype(x.dtype)

    both = bp.compile(both_ways)
    with use_backend("numba"):
        plain = bp.compile(bp.tanh)
        plain(x32)
        assert "tanh_rational_f32(" not in _sources(plain, x32)
        both(xb)
        assert "tanh_f32(" in _sources(both, xb)
        gelu = bp.compile(_gelu_tanh)
        gelu(x32)
        assert "gelu_tanh_f32(" in _sources(gelu, x32)


def _gelu_tanh(x):
    return bp.gelu(x, approximate="tanh")


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_16_bit_tanh_gelu_is_correctly_rounded_on_nearly_every_input(dtype):
    """All 65,536 patterns: the compiled 16-bit gelu(approximate='tanh') (one op, as a
    forward keeps it) is x * sigmoid(2u), which has no 1 + tanh(u) cancellation for negative
    x: at most one 16-bit ulp from float64's gelu rounded once, and that on at most 16
    inputs (float16 measured 4; the reference interpreter's float32 tanh form misses 370,
    by up to 3 ulp, as did the tanh_f32 loop: 272). bfloat16 results below float32's normal
    range are zero where VCVTNEPS2BF16 rounds (docs/ops.md)."""
    x = bp.tensor(np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype))
    fn = bp.compile(_gelu_tanh)
    with use_backend("numba"):
        got = fn(x).numpy()
        source = _sources(fn, x)
    assert "gelu_tanh_sigmoid_f32(" in source and "gelu_tanh_f32(" not in source
    with np.errstate(over="ignore", invalid="ignore"):
        xs = x.numpy().astype(np.float64)
        u = np.sqrt(2 / np.pi) * (xs + 0.044715 * xs**3)
        want = (xs / (1 + np.exp(-2 * u))).astype(np.float32)
    want[xs == -np.inf] = np.nan  # -inf * 0, as the reference's 0.5 * x * (1 + tanh(u))
    nan = np.isnan(want)
    assert np.isnan(got.astype(np.float32)[nan]).all()
    kept = ~nan
    if dtype == BF16 and target_has_avx512bf16():
        flushed = np.abs(want) < np.finfo(np.float32).tiny
        assert (got.astype(np.float32)[flushed & kept] == 0).all()
        kept &= ~flushed
    rounded = want.astype(dtype).view(np.uint16)[kept].astype(np.int32)
    off = np.abs(got.view(np.uint16)[kept].astype(np.int32) - rounded)
    assert off.max() <= 1 and np.count_nonzero(off) <= 16, (off.max(), np.count_nonzero(off))
