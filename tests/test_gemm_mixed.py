"""One bfloat16 operand beside a float32 one: a saved value kept in bfloat16
(allow_saved_dtype / saved_dtype) that the backward's GEMM reads with a float32 gradient or
weight. The GEMM widens the bfloat16 operand while packing it (gemm/symbols.py
`backplan_gemm_bf16_f32`; the other order computes C.T with the operands swapped), and the
compiled plan gives it the bfloat16 array with no float32 copy (ir/widen.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_close_but_for_16_bit_roundings
from test_gemm_bf16 import SHAPES as BF16_SHAPES

import backplan as bp
from backplan.codegen.kernels import gemm as own
from backplan.ir.builder import Builder
from backplan.ir.errors import DtypeError
from backplan.ir.graph import Graph
from backplan.ir.lowering import lower
from backplan.ir.registry import get_op
from backplan.ir.types import TensorType
from backplan.ir.widen import widen
from backplan.runtime.backend import use_backend

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [  # test_gemm_bf16's shapes (ones, primes, the tiles' edges, empty, a long k) and a
    # narrow C (n under the tile's width: the f32 GEMM's swapped path, not taken here)
    *BF16_SHAPES,
    (300, 9, 129),
]
FLAGS = [(False, False), (True, False), (False, True), (True, True)]


def _operands(rng, m, n, k, ta, tb, bf16_first):
    """Whole numbers (float32 sums exact in any order): a and b as the GEMM takes them, one
    bfloat16 (uint16 bits), and the float32 values of each."""
    shape_a, shape_b = (k, m) if ta else (m, k), (n, k) if tb else (k, n)
    a, b = (rng.integers(-4, 5, s).astype(np.float32) for s in (shape_a, shape_b))
    if bf16_first:
        return a.astype(BF16).view(np.uint16), b, a, b
    return a, b.astype(BF16).view(np.uint16), a, b


@pytest.mark.parametrize("width", (512, 256))
@pytest.mark.parametrize(("ta", "tb"), FLAGS)
@pytest.mark.parametrize("bf16_first", (True, False))
def test_mixed_gemm_equals_the_float32_product_bit_for_bit(width, ta, tb, bf16_first):
    rng = np.random.default_rng(11)
    for m, n, k in SHAPES:
        a, b, a32, b32 = _operands(rng, m, n, k, ta, tb, bf16_first)
        expected = (a32.T if ta else a32) @ (b32.T if tb else b32)
        c = np.full((m, n), np.nan, np.float32)
        own.gemm(width, ta, tb, 1.0, a, b, 0.0, c)
        np.testing.assert_array_equal(c.view(np.uint32), expected.view(np.uint32), (m, n, k))
        c0 = rng.integers(-3, 4, (m, n)).astype(np.float32)
        c = c0.copy()
        own.gemm(width, ta, tb, 2.0, a, b, 1.0, c)
        np.testing.assert_array_equal(c, 2 * expected + c0, (m, n, k))


@pytest.mark.parametrize("bf16_first", (True, False))
def test_mixed_gemm_reads_strided_operands_and_writes_a_strided_c(bf16_first):
    """Every operand a column slice (rows not contiguous), C a transposed view: random values
    within float32 summation error of the float64 product of the values read."""
    rng = np.random.default_rng(5)
    m, n, k = 37, 45, 70
    a = rng.standard_normal((m, 2 * k)).astype(np.float32)[:, ::2]
    b = rng.standard_normal((k, 2 * n)).astype(np.float32)[:, 1::2]
    if bf16_first:
        a = a.astype(BF16)
    else:
        b = b.astype(BF16)
    c = np.full((n, m), np.nan, np.float32).T
    own.gemm(
        512,
        False,
        False,
        1.0,
        *(x.view(np.uint16) if x.dtype == BF16 else x for x in (a, b)),
        0.0,
        c,
    )
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = 4 * (k + 2) * np.finfo(np.float32).eps * (np.abs(a64) @ np.abs(b64))
    assert np.all(np.abs(c - a64 @ b64) <= bound)


def test_widen_gives_a_matmul_the_bfloat16_value_under_its_float32_copy_and_views():
    """matmul(transpose(astype(x_bf16, f32)), w): the GEMM reads x's bfloat16 transpose, and
    the float32 copy, read by nothing else, is not made. A copy another op reads stays."""
    g = Graph()
    b = Builder(g)
    x = g.add_input(TensorType("bf16", (8, 4)))
    w = g.add_input(TensorType("f32", (8, 3)))
    wide = b.astype(x, dtype="f32")
    g.outputs = [b.matmul(b.swap_last2(wide), w)]
    nodes = widen(g).nodes
    assert [(n.op, n.dtype) for n in nodes] == [("transpose", "bf16"), ("matmul", "f32")]
    assert [i.dtype for i in nodes[-1].inputs] == ["bf16", "f32"]
    g.outputs.append(b.exp(wide))
    ops = [(n.op, n.dtype) for n in widen(g).nodes]
    assert ("astype", "f32") in ops and ("matmul", "f32") in ops


def test_matmul_types_a_mixed_pair_only_as_widen_writes_it():
    """bfloat16 or float16 beside float32 with dtype='f32' (ir/widen.py's form): a float32
    result. Without it, or beside float64, or bfloat16 beside float16, the operands' dtypes
    must agree (the tracer promotes a user's mixed operands before matmul is built)."""
    infer = get_op("matmul").infer
    a, b = TensorType("bf16", (2, 3)), TensorType("f32", (3, 4))
    assert infer([a, b], {"dtype": "f32"}) == TensorType("f32", (2, 4))
    assert (
        infer([TensorType("f32", (4, 2)), TensorType("bf16", (2, 3))], {"dtype": "f32"}).dtype
        == "f32"
    )
    assert infer([TensorType("f16", (2, 3)), b], {"dtype": "f32"}) == TensorType("f32", (2, 4))
    for pair, attrs in [
        ((a, b), {}),
        ((TensorType("f16", (2, 3)), b), {}),
        ((a, TensorType("f64", (3, 4))), {"dtype": "f32"}),
        ((a, TensorType("f16", (3, 4))), {"dtype": "f32"}),
    ]:
        with pytest.raises(DtypeError):
            infer(list(pair), attrs)


def _linear(params, x):
    """The activation x @ w0 is saved for the second weight's gradient, which only a GEMM
    reads: with bfloat16 saved buffers, nothing else widens it."""
    h = x @ params[0]
    h = h @ params[1]
    return (h * h).mean()


def test_compiled_step_with_bfloat16_saved_buffers_runs_the_mixed_gemm_and_matches_reference():
    rng = np.random.default_rng(3)
    # 64 wide over 4,096 rows: at 31 rows of 17 and 23 (and at 1,024 rows on two threads) the
    # bfloat16 copies saved less than the mixed GEMM's packing pages cost
    # (codegen/kernels/gemm/packing.py), so none was kept
    params = [(rng.standard_normal((64, 64)) * 0.2).astype(np.float32) for _ in range(2)]
    params[1] = (rng.standard_normal((64, 9)) * 0.2).astype(np.float32)
    x = rng.standard_normal((4096, 64)).astype(np.float32)
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            step = bp.value_and_grad(_linear, saved_dtype=bp.bfloat16)
            value, grads = step(params, x)
            results[backend] = [float(value.numpy())] + [g.numpy() for g in grads]
            if backend == "numba":
                entry = step.lookup((params, x), {}, count_hit=False)[1]
    graph = lower(entry.plan).plan.graph
    mixed = [n for n in graph.nodes if n.op == "matmul" and "bf16" in {i.dtype for i in n.inputs}]
    assert mixed and all({i.dtype for i in n.inputs} == {"bf16", "f32"} for n in mixed)
    widened = [n for n in graph.nodes if n.op == "astype" and n.inputs[0].dtype == "bf16"]
    assert [n.shape for n in widened] == [(4096, 9)]  # h, read by the square's derivative
    for got, want in zip(results["numba"], results["reference"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the rounding is real: the gradient differs from the full-precision step's
    full = [g.numpy() for g in bp.value_and_grad(_linear)(params, x)[1]]
    assert not np.allclose(results["numba"][2], full[1], rtol=1e-6, atol=0)


def test_a_cached_caller_of_the_mixed_gemm_registers_that_symbol_only(monkeypatch):
    """backplan_gemm_bf16 is the start of backplan_gemm_bf16_f32's name: loading a caller of
    the mixed GEMM must not compile the bfloat16 one too (a cold compile not needed)."""
    from backplan.codegen.kernels.gemm import symbols

    registered = []
    monkeypatch.setattr(symbols, "ensure_registered", registered.append)
    symbols._register_named(b"\x00call backplan_gemm_bf16_f32\x00backplan_gemm_f32_bf16@plt\x00")
    assert sorted(registered) == ["bf16_f32", "f32_bf16"]
    registered.clear()
    symbols._register_named(b"backplan_gemm_bf16\x00backplan_gemm_f32")
    assert sorted(registered) == ["bf16", "f32"]


@pytest.mark.parametrize(("ta", "tb"), FLAGS)
@pytest.mark.parametrize("f16_first", (True, False))
def test_mixed_float16_gemm_equals_the_float32_product_bit_for_bit(ta, tb, f16_first):
    """backplan_gemm_f16_f32 / f32_f16: a float16 operand (int16 bits, as generated code marks
    them) beside a float32 one, widened while packing."""
    rng = np.random.default_rng(13)
    for m, n, k in SHAPES:
        shape_a, shape_b = (k, m) if ta else (m, k), (n, k) if tb else (k, n)
        a, b = (rng.integers(-4, 5, s).astype(np.float32) for s in (shape_a, shape_b))
        expected = (a.T if ta else a) @ (b.T if tb else b)
        half = (a if f16_first else b).astype(np.float16).view(np.int16)
        operands = (half, b) if f16_first else (a, half)
        c = np.full((m, n), np.nan, np.float32)
        own.gemm(512, ta, tb, 1.0, *operands, 0.0, c)
        np.testing.assert_array_equal(c.view(np.uint32), expected.view(np.uint32), (m, n, k))


def _layers(params, x):
    for w in params:
        x = bp.tanh(x @ w)
    return (x * x).mean()


def test_float16_saved_buffers_under_compile_are_read_by_the_mixed_gemm_below_full_precision():
    """bp.compile(saved_dtype=bp.float16) on a float32 step whose weight gradients read the
    saved activations: the GEMM reads each float16 copy as it is, as bfloat16 ones are read
    (before: a float32 copy of each, held in the backward's arena, peaked above full
    precision: 5,255,176 against 4,472,840 B on a 4-layer MLP; bfloat16 4,206,600). Values
    against the reference interpreter."""
    from backplan.codegen.run.memory_check import checked_memory, measure

    rng = np.random.default_rng(4)
    arrays = [(rng.standard_normal((32, 32)) * 0.4).astype(np.float32) for _ in range(6)]
    x = rng.standard_normal((64, 32)).astype(np.float32)
    peaks, grads = {}, {}
    for saved in (None, bp.float16, bp.bfloat16):
        loss = bp.compile(_layers, saved_dtype=saved)
        params = [bp.tensor(w, requires_grad=True) for w in arrays]
        with use_backend("numba"), checked_memory():
            loss(params, x).backward()
            for p in params:
                p.grad = None
            with measure() as measured:
                loss(params, x).backward()
            report = loss.explain(params, x)
            # x is a NumPy array the backward reads: the call's copy of it is in the peak
            assert measured.peak == report.peak.allocated_peak_bytes
        peaks[saved] = report.peak_bytes
        grads[saved] = [p.grad.numpy() for p in params]
        if saved is bp.float16:
            text = " ".join(str(report).split())
            assert "(f16 x f32, mixed)" in text or "(f32 x f16, mixed)" in text
            with use_backend("reference"):
                ref = [bp.tensor(w, requires_grad=True) for w in arrays]
                loss(ref, x).backward()
            # the compiled tanh and NumPy's may leave an activation one float32 ulp apart,
            # which then rounds to the other float16 (tests/helpers.py)
            for got, want in zip(grads[saved], (p.grad.numpy() for p in ref), strict=True):
                assert_close_but_for_16_bit_roundings(got, want, "float16", rtol=2**-10, atol=1e-6)
    assert peaks[bp.float16] == peaks[bp.bfloat16] < peaks[None]
    for got, full in zip(grads[bp.float16], grads[None], strict=True):
        np.testing.assert_allclose(got, full, rtol=2e-2, atol=2e-3)
