"""A GEMM's epilogue writes its result over the GEMM's product where only the epilogue reads the
product (ir/layout.py `_epilogues_over_products`), in backplan's GEMM and in the loop after a
BLAS call alike: one buffer, not two, per layer. Without it, bp.compile(fn,
saved_dtype=bp.bfloat16) on a float32 step peaked above full precision although it saved fewer
bytes: each layer's float32 activation, no longer a saved buffer itself, sat in the arena beside
the next layer's product (3 x tanh(x @ w), 64 x 64 weights: 360,456 B against 311,308)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close_but_for_16_bit_roundings

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.ir import layout
from backplan.ir.peak import predicted_peak, region_calls
from backplan.runtime.backend import use_backend


def _layers(params, x):
    for w in params:
        x = bp.tanh(x @ w)
    return (x * x).mean()


def _arguments(n=64, rows=128, dtype=np.float32):
    rng = np.random.default_rng(5)
    params = [(rng.standard_normal((n, n)) * 0.5).astype(dtype) for _ in range(3)]
    return params, rng.standard_normal((rows, n)).astype(dtype)


def _region_step(params, x_array, saved_dtype):
    """(peak explain prints, the peak the checked mode counts, x's gradient) of
    bp.compile(saved_dtype=...) with x requiring grad: forward plan, then backward()."""
    loss = bp.compile(lambda x: _layers(params, x), saved_dtype=saved_dtype)
    x = bp.tensor(x_array, requires_grad=True)

    def step():
        loss(x).backward()

    step()  # compiles
    x.grad = None
    with measure() as measured:
        step()
    predicted = predicted_peak(region_calls(loss.trace(x).program.plans), "numba")
    assert measured.peak == predicted.allocated_peak_bytes
    return loss.explain(x).peak_bytes, x.grad.numpy()


def test_bfloat16_saved_copies_under_compile_peak_below_full_precision():
    params, x = _arguments()
    with use_backend("numba"), checked_memory():
        full_peak, full_grad = _region_step(params, x, None)
        narrow_peak, narrow_grad = _region_step(params, x, bp.bfloat16)
    assert narrow_peak < full_peak
    np.testing.assert_allclose(narrow_grad, full_grad, rtol=5e-2, atol=5e-3)
    assert not np.array_equal(narrow_grad, full_grad)  # it did read rounded copies
    loss = bp.compile(lambda x: _layers(params, x), saved_dtype=bp.bfloat16)
    with use_backend("reference"):
        xr = bp.tensor(x, requires_grad=True)
        loss(xr).backward()
    # NumPy's tanh and the compiled one may leave an activation one float32 ulp apart, which
    # then rounds to the other bfloat16 (tests/helpers.py)
    assert_close_but_for_16_bit_roundings(
        narrow_grad, xr.grad.numpy(), "bfloat16", rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("gemm", ["own", "blas"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_result_over_its_product_gives_the_values_of_two_buffers(gemm, dtype, monkeypatch):
    """Bit for bit the step with the product and the result apart, with a smaller arena:
    in backplan's GEMM's row blocks and in the loop after a BLAS call."""
    monkeypatch.setenv("BACKPLAN_GEMM", gemm)
    params, x = _arguments(dtype=dtype)
    arrays, arenas = {}, {}
    for over in (False, True):
        monkeypatch.setattr(layout, "EPILOGUE_OVER_PRODUCT", over)
        step = bp.value_and_grad(lambda x: _layers(params, x))  # a plan of its own
        with use_backend("numba"), checked_memory():
            value, grad = step(x)
            with measure() as measured:
                step(x)
        arrays[over] = [value.numpy(), grad.numpy()]
        arenas[over] = measured.peak
    for apart, over in zip(arrays[False], arrays[True], strict=True):
        np.testing.assert_array_equal(over, apart)
    assert arenas[True] < arenas[False]
    with use_backend("reference"):
        value, grad = bp.value_and_grad(lambda x: _layers(params, x))(x)
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    for got, want in zip(arrays[True], [value.numpy(), grad.numpy()], strict=True):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


def test_a_sum_of_arrays_after_a_gemm_keeps_its_product_apart():
    """h = a + b + c + x @ w runs as shared add kernels over whole arrays (the sum written
    first, each later term added to it): written over the product, the sum overwrote it
    before the product was added (-15.33 against -48.83)."""

    def f(p, x):
        h = p["a"] + p["b"] + p["c"] + x @ p["w"]
        return bp.sum(bp.tanh(h @ p["w2"]))

    rng = np.random.default_rng(0)
    p = {k: rng.standard_normal((64, 64)).astype(np.float32) for k in ("a", "b", "c", "w", "w2")}
    x = rng.standard_normal((64, 64)).astype(np.float32)
    with use_backend("numba"):
        got = bp.compile(lambda p, x: f(p, x))(p, x).numpy()
    with use_backend("reference"):
        want = bp.compile(lambda p, x: f(p, x))(p, x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)
