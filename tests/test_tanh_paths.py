"""Every compiled form of a float32 tanh computes mathlib.tanh_f32 bit for bit: the loop after
a BLAS call and backplan's GEMM epilogue, the loops a Python-run driver calls by address (the
small-call form and the full one) and the ones a compiled driver inlines, and a plan saving
bfloat16 copies, whose copies are that float32 tanh rounded once. So a 16-bit plan rounds the
full plan's values; only the reference interpreter (NumPy's tanh) may sit a float32 ulp away
(tests/helpers.py: assert_close_but_for_16_bit_roundings). The operands are multiples of
1/8 and 1/16, so every GEMM's product is exact whatever its summation order."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import backplan as bp
from backplan.codegen.kernels.mathlib import tanh_f32
from backplan.runtime.backend import use_backend


@njit  # no cache: Numba would not see a change of the inlined function
def _tanh_loop(xs, out):
    for i in range(xs.size):
        out[i] = tanh_f32(xs[i])


def _operands():
    rng = np.random.default_rng(42)
    x = (rng.integers(-8, 9, (160, 32)) / 8).astype(np.float32)
    w = (rng.integers(-8, 9, (32, 32)) / 16).astype(np.float32)
    return x, w


def _tanh_f32_of(p):
    out = np.empty_like(p.ravel())
    _tanh_loop(p.ravel(), out)
    return out.reshape(p.shape)


def _layer(x, w):
    return bp.tanh(x @ w)


@pytest.mark.parametrize("gemm", ["own", "blas"])
@pytest.mark.parametrize("driver", ["python", "inline", None])
def test_every_compiled_form_of_a_float32_tanh_is_tanh_f32(gemm, driver, monkeypatch):
    """First and second calls (by default the second runs the direct driver where the first
    ran Python), 40 rows (a loop of 1,280 elements: the small-call form) and 160 (5,120: the
    full one)."""
    monkeypatch.setenv("BACKPLAN_GEMM", gemm)
    if driver is None:
        monkeypatch.delenv("BACKPLAN_DRIVER", raising=False)
    else:
        monkeypatch.setenv("BACKPLAN_DRIVER", driver)
    x, w = _operands()
    for rows in (40, 160):
        want = _tanh_f32_of(x[:rows] @ w)
        fn = bp.compile(_layer)
        with use_backend("numba"):
            calls = [fn(x[:rows], w).numpy() for _ in range(2)]
        for got in calls:
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _doubled(x, w):
    return bp.tanh(x @ w) * 2.0  # the tanh is saved, not an output


def test_bfloat16_saved_copies_are_the_full_plans_tanh_rounded_once():
    """saved_dtype=bp.bfloat16: the forward's tanh is the full plan's, and w's gradient
    x.T @ (2 - 2 c**2) reads c = that tanh rounded to bfloat16 once (a copy rounded from
    another float32 value, or not rounded, moves an element by ~1e-3 of the largest)."""
    x, w = _operands()
    t = _tanh_f32_of(x @ w)
    copies = t.astype(ml_dtypes.bfloat16).astype(np.float64)
    want = x.astype(np.float64).T @ (2 - 2 * copies * copies)
    fn = bp.compile(_doubled, saved_dtype=bp.bfloat16)
    wt = bp.tensor(w, requires_grad=True)
    with use_backend("numba"):
        out = fn(x, wt)
        out.sum().backward()
        assert "bf16" in str(fn.explain(x, wt)).split("backward IR")[1]
    np.testing.assert_array_equal((out.numpy() / 2).view(np.uint32), t.view(np.uint32))
    got = wt.grad.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
