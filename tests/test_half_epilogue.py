"""A float16 or bfloat16 dense layer's bias add and activation run inside the GEMM computing
x @ w, as in float32: the bias's widening is recomputed where the loop reads it
(ir/fusion.py _spread_widenings) instead of a loop of its own that ran between the GEMM and the
bias add, so ir/epilogue.py absorbs the add and activation. The product is not rounded to
16 bits before the bias is added: the epilogue rounds x @ w + b once, when it stores, and the
reference interpreter running the plan rounds there too (ir/rounding_points.py; docs/ops.md).
Only a plan interpreted before lowering rounds each op."""

from __future__ import annotations

import sys

import ml_dtypes
import numba
import numpy as np
import pytest

import backplan as bp
from backplan.codegen.kernels.gemm import isa
from backplan.ir import fusion
from backplan.ir.interpreter import run_plan
from backplan.ir.lowering import RUN_KINDS, lower
from backplan.runtime.backend import use_backend

DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}
# (m, k, n): ones, odd sizes off the register tile, more rows than one GEMM row block
SHAPES = [(1, 1, 1), (7, 33, 127), (33, 127, 7), (200, 9, 40)]


@pytest.fixture
def own_gemm(monkeypatch):
    """Every product on the own GEMM (the float32 ones too, however small)."""
    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    isa.active_isa.cache_clear()
    yield monkeypatch
    isa.active_isa.cache_clear()


def dense(x, w, b):
    return bp.relu(x @ w + b)


def layer_loss(w, b, v, x):
    return bp.sum(dense(x, w, b) @ v)


def layer_arrays(rng, m, k, n, dtype):
    """Whole-number x and w (float32 sums exact in any order) and a bias in eighths: x @ w + b
    is exact in float32, so where the plan rounds is all that decides the 16-bit bits."""
    x = rng.integers(-20, 21, (m, k)).astype(dtype)
    w = rng.integers(-20, 21, (k, n)).astype(dtype)
    b = (rng.integers(-32, 33, n) / 8).astype(dtype)
    return x, w, b


def running(lowered) -> list:
    """The kernels of a lowered plan that run code (a loop whose values are all recomputed
    where they are read does not run)."""
    return [
        k
        for k in lowered.kernels
        if k.kind in RUN_KINDS
        and (k.kind != "loop" or any(n in lowered.materialized for n in k.all_nodes))
    ]


@pytest.mark.parametrize("name", DTYPES)
def test_16_bit_layer_runs_bias_and_relu_in_the_gemm_epilogue(own_gemm, monkeypatch, name):
    rng = np.random.default_rng(0)
    arrays = [bp.tensor(a) for a in layer_arrays(rng, 9, 7, 33, DTYPES[name])]
    v = bp.tensor(rng.standard_normal((33, 3)).astype(DTYPES[name]))
    step = bp.value_and_grad(layer_loss, argnums=(0, 1, 2))
    lowered = lower(step.trace(arrays[1], arrays[2], v, arrays[0]).plan, ())
    fused = [k for k in lowered.kernels if k.epilogue is not None and k.shape == (9, 33)]
    # the forward layer's; the backward's dh product takes the bias gradient (a column sum)
    fused = [k for k in fused if not k.epilogue.reductions]
    assert len(fused) == 1, [(k.kind, k.shape, k.epilogue) for k in lowered.kernels]
    ops = [n.op for n in fused[0].epilogue.computed]
    assert "add" in ops and "relu" in ops, ops
    bias_loops = [k for k in running(lowered) if k.kind == "loop" and k.shape == (33,)]
    assert bias_loops == [], "the bias is widened where the epilogue reads it"

    monkeypatch.setattr(fusion, "_spread_widenings", lambda graph: frozenset())
    step = bp.value_and_grad(layer_loss, argnums=(0, 1, 2))  # a plan of its own, lowered anew
    before = lower(step.trace(arrays[1], arrays[2], v, arrays[0]).plan, ())
    assert len(running(lowered)) <= len(running(before)) - 2  # the bias loop and the add loop


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_fused_16_bit_epilogue_rounds_once_on_both_executors(own_gemm, name, m, k, n):
    dtype = DTYPES[name]
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    x, w, b = layer_arrays(rng, m, k, n, dtype)
    product = x.astype(np.float32) @ w.astype(np.float32)  # exact
    once = np.maximum((product + b.astype(np.float32)).astype(dtype), 0)
    per_op = (product.astype(dtype).astype(np.float32) + b.astype(np.float32)).astype(dtype)
    per_op = np.maximum(per_op, 0)
    with use_backend("numba"):
        got = bp.compile(dense)(x, w, b).numpy()
    with use_backend("reference"):
        reference = bp.compile(dense)(x, w, b).numpy()
    assert got.dtype == dtype and reference.dtype == dtype
    np.testing.assert_array_equal(got.view(np.uint16), once.view(np.uint16))
    np.testing.assert_array_equal(reference.view(np.uint16), once.view(np.uint16))
    plan = bp.compile(dense).trace(x, w, b).program.plans.forward  # not lowered: per op
    eager = run_plan(plan, [x, w, b])[0]
    np.testing.assert_array_equal(eager.view(np.uint16), per_op.view(np.uint16))


@pytest.mark.parametrize("name", DTYPES)
def test_fused_16_bit_epilogue_keeps_nan_and_inf_where_the_reference_has_them(own_gemm, name):
    """An infinite input row makes infinities and NaNs (inf * 0, inf - inf) in the product; a
    bias of inf and of NaN columns: the compiled layer is the float32 sum rounded once, and has
    NaN and inf where the reference interpreter has them. A float16 row whose products pass
    65504: both add the bias to the float32 product first (65534 - inf: -inf, relu 0), where
    rounding each op rounds the product to inf before adding the bias (inf + -inf: NaN)."""
    dtype = DTYPES[name]
    rng = np.random.default_rng(3)
    x, w, b = layer_arrays(rng, 7, 33, 40, dtype)
    x[2, 5] = np.inf
    x[4, :2] = np.inf, -np.inf
    w[5, :3] = 0
    b[7], b[8], b[9] = np.inf, np.nan, -np.inf
    x[6] = 2000 if name == "f16" else 0  # float16: sums past its largest value
    w[:, 9] = np.abs(w[:, 9]) + 1  # column 9: x[6] @ w[:, 9] > 65504, plus a bias of -inf
    with np.errstate(invalid="ignore", over="ignore"):
        product = x.astype(np.float32) @ w.astype(np.float32)
        once = np.maximum((product + b.astype(np.float32)).astype(dtype), 0)
    with use_backend("numba"):
        got = bp.compile(dense)(x, w, b).numpy()
    with use_backend("reference"):
        want = bp.compile(dense)(x, w, b).numpy()
    bits, nan = got.view(np.uint16), np.isnan(once.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(bits[~nan], once.view(np.uint16)[~nan])

    wide, want_wide = got.astype(np.float32), want.astype(np.float32)
    assert np.isnan(want_wide).any() and np.isinf(want_wide).any()
    np.testing.assert_array_equal(np.isnan(wide), np.isnan(want_wide))
    finite = ~np.isnan(want_wide)
    np.testing.assert_array_equal(bits[finite], want.view(np.uint16)[finite])
    if name == "f16":
        eager = run_plan(bp.compile(dense).trace(x, w, b).program.plans.forward, [x, w, b])[0]
        assert got[6, 9] == 0 and want[6, 9] == 0 and np.isnan(eager[6, 9])


@pytest.mark.parametrize("name", DTYPES)
def test_compiled_16_bit_gemm_keeps_no_reference_to_its_arrays(own_gemm, name):
    """A float16 GEMM kernel with an epilogue (one thread: the GEMM is not shared out) viewed
    its operands as int16 with Numba's `.view`, and each call of the compiled driver kept a
    reference to every array it was passed: inputs and outputs were never freed (a float16
    mlp step grew its memory by its gradients' size, 321 new pages a step)."""
    own_gemm.setenv("BACKPLAN_DRIVER", "inline")  # the compiled driver from the first call
    dtype = DTYPES[name]
    rng = np.random.default_rng(5)
    x, w, b = layer_arrays(rng, 7, 33, 40, dtype)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with use_backend("numba"):
            layer = bp.compile(dense)
            out = layer(x, w, b)
            before = [sys.getrefcount(a) for a in (x, w, b)]
            for _ in range(5):
                out = layer(x, w, b)
            after = [sys.getrefcount(a) for a in (x, w, b)]
    finally:
        numba.set_num_threads(threads)
    assert after == before
    assert out.dtype == dtype
