"""The own GEMM reads float16 operands as they are: generated code views their bits as int16
(codegen/kernels/matmul.py), which tells them from bfloat16's uint16, and the packing widens
them into float32 panels (VCVTPH2PS with F16C, else the shifts of codegen/kernels/half.py):
float32 products and sums, a float32 result, no float32 copy of either operand at any size
(ir/widen.py), as for bfloat16."""

from __future__ import annotations

import re
from functools import partial

import numpy as np
import pytest
from helpers import assert_16_bit_gemm_exact, run_with_own_gemm_as_python
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

import backplan as bp
from backplan.codegen.kernels import gemm as own
from backplan.codegen.kernels import half
from backplan.ir import widen as widening
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.types import TensorType
from backplan.runtime.backend import use_backend

# A call of the own GEMM in generated code: single-core, or shared over cores (the _par
# forms, which the code uses where the process may run two threads).
GEMM_CALL = re.compile(r"own_gemm(?:_at)?(?:_par)?\(")


SHAPES = [(1, 1, 1), (7, 33, 5), (0, 5, 3), (3, 4, 0), (130, 70, 33), (129, 96, 520)]
FLAGS = [(False, False), (True, True), (True, False), (False, True)]


def _operands(rng, m, n, k, ta, tb):
    """Whole-number float16 a (m x k, or k x m when ta) and b: float32 sums exact in any
    order, so every GEMM of their values gives the same bits."""
    shape_a, shape_b = (k, m) if ta else (m, k), (n, k) if tb else (k, n)
    return (rng.integers(-4, 5, s).astype(np.float16) for s in (shape_a, shape_b))


@pytest.mark.parametrize("width", (512, 256))
def test_f16_gemm_equals_the_float32_product_of_widened_operands_bitwise(width):
    rng = np.random.default_rng(11)
    for ta, tb in FLAGS:
        for m, n, k in SHAPES:
            a, b = _operands(rng, m, n, k, ta, tb)
            assert_16_bit_gemm_exact(partial(own.gemm, width), ta, tb, a, b, np.int16, rng)


def test_f16_gemm_strided_operands_batches_and_special_values():
    rng = np.random.default_rng(12)
    a_big = rng.standard_normal((90, 300)).astype(np.float16)
    b_big = rng.standard_normal((80, 300)).astype(np.float16)
    a_big[0, 0], a_big[2, 3] = 6e-8, np.inf  # a float16 subnormal, an infinity
    a, b = a_big[::2, ::3], b_big[1::2, :100]  # 45 x 100, 40 x 100
    c = np.empty((45, 40), np.float32)
    own.gemm(512, False, True, 1.0, a.view(np.int16), b.view(np.int16), 0.0, c)
    with np.errstate(invalid="ignore"):
        wide = a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(c, wide, rtol=1e-5, atol=1e-4)
    batch_a = rng.standard_normal((3, 33, 17)).astype(np.float16)  # op(A) = a[i].T
    shared_b = rng.standard_normal((1, 33, 9)).astype(np.float16)
    c3 = np.empty((3, 17, 9), np.float32)
    own.batched_gemm(256, True, False, batch_a.view(np.int16), shared_b.view(np.int16), c3)
    for i in range(3):
        wide = batch_a[i].astype(np.float64).T @ shared_b[0].astype(np.float64)
        np.testing.assert_allclose(c3[i], wide, rtol=1e-5, atol=1e-5)


def _widen_row(widen):
    """An intrinsic widening 16 float16 patterns at once, as the GEMM's packing does."""

    @intrinsic
    def row(typingctx, src, dst):
        def codegen(context, builder, signature, args):
            vector = ir.VectorType(ir.IntType(16), 16)
            source = context.make_array(signature.args[0])(context, builder, args[0]).data
            target = context.make_array(signature.args[1])(context, builder, args[1]).data
            bits = builder.load(builder.bitcast(source, vector.as_pointer()), align=2)
            wide = widen(builder, bits)
            builder.store(wide, builder.bitcast(target, wide.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(src, dst), codegen

    return row


_rows_integer = _widen_row(half._widen_f16_integer)
_rows_instruction = _widen_row(half._widen_f16_instruction)


@njit
def _widen_all(patterns, shifts, instruction):
    for i in range(0, patterns.size, 16):
        _rows_integer(patterns[i : i + 16], shifts[i : i + 16])
        _rows_instruction(patterns[i : i + 16], instruction[i : i + 16])


def test_packing_widens_float16_rows_as_numpy_with_and_without_f16c():
    """Both vector widenings the packing may use (the shifts where the CPU lacks F16C) on all
    65,536 patterns: NumPy's float32 bits, but that VCVTPH2PS makes a signalling NaN quiet."""
    patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    shifts, instruction = np.empty((2, patterns.size), np.float32)
    _widen_all(patterns, shifts, instruction)
    want = patterns.view(np.float16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(shifts.view(np.uint32), want)
    nan = np.isnan(patterns.view(np.float16))
    np.testing.assert_array_equal(instruction.view(np.uint32)[~nan], want[~nan])
    np.testing.assert_array_equal(instruction.view(np.uint32)[nan], want[nan] | 0x00400000)


def _loss(p, x):
    h = bp.tanh(x @ p["w1"] + p["b"])
    return bp.sum((h @ p["w2"].T) ** 2)


def test_compiled_f16_step_reads_operands_without_copies():
    """A float16 value_and_grad step: its GEMMs read the float16 arrays (viewed as int16 for
    the own GEMM), no loop makes a float32 copy for them, and the loss and gradients are
    within float16 tolerance of the reference interpreter's."""
    rng = np.random.default_rng(13)

    def draw(*shape):
        return bp.tensor((rng.standard_normal(shape) * 0.3).astype(np.float16))

    params, x = {"w1": draw(16, 40), "b": draw(40), "w2": draw(12, 40)}, draw(9, 16)
    step = bp.value_and_grad(_loss)
    with use_backend("reference"):
        l0, g0 = step(params, x)
    with use_backend("numba"):
        l1, g1 = step(params, x)
        compiled = step.trace(params, x).runner().compiled
    for e, g in [(l0, l1)] + [(g0[k], g1[k]) for k in g0]:
        assert g.dtype == bp.float16
        e32, g32 = e.numpy().astype(np.float32), g.numpy().astype(np.float32)
        np.testing.assert_allclose(g32, e32, rtol=4e-3, atol=4e-3 * max(1.0, np.abs(e32).max()))
    matmuls = [n for n in compiled.plan.graph.nodes if n.op == "matmul"]
    sources = compiled.source + "".join(k.source for k in compiled.loop_kernels)  # epilogues
    calls = [line for line in sources.splitlines() if GEMM_CALL.search(line)]
    assert len(matmuls) == 5 and len(calls) >= 4  # one epilogue kernel serves two
    assert all("view(np.int16)" in line or "mat_a" in line for line in calls), calls
    assert sources.count(".view(np.int16)") >= len(calls)
    for node in matmuls:
        sources = [i.inputs[0] if i.op == "transpose" else i for i in node.inputs]
        assert [s.dtype for s in sources] == ["f16", "f16"]  # read as stored: no f32 copy


def _products(x, w, y, batch):
    return x @ w, x.T @ y, y @ w.T, batch @ batch.swapaxes(1, 2)


def test_compiled_f16_products_equal_the_reference_bitwise():
    """Whole numbers (exact float32 sums, results above 2048 where float16 rounds): the
    compiled products, transposed operands and a batch, bit for bit the reference's."""
    rng = np.random.default_rng(14)
    shapes = [(9, 16), (16, 40), (9, 40), (3, 7, 33)]
    args = [bp.tensor(rng.integers(-20, 21, s).astype(np.float16)) for s in shapes]
    with use_backend("reference"):
        expected = bp.compile(_products)(*args)
    with use_backend("numba"):
        got = bp.compile(_products)(*args)
    assert any(np.abs(e.numpy().astype(np.float32)).max() > 2048 for e in expected)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == bp.float16
        np.testing.assert_array_equal(g.numpy().view(np.uint16), e.numpy().view(np.uint16))


def test_f16_plan_with_kernels_as_python(tmp_path):
    """The GEMM's plain-Python twin widens int16 (float16) operands too."""
    script = (
        "import numpy as np, backplan as bp\n"
        "from backplan.runtime.backend import use_backend\n"
        "a = np.arange(12).reshape(3, 4).astype(np.float16)\n"
        "b = (np.arange(20).reshape(5, 4) % 3).astype(np.float16)\n"
        "with use_backend('numba'):\n"
        "    got = bp.compile(lambda a, b: a @ b.T)(a, b).numpy()\n"
        "want = (a.astype(np.float32) @ b.astype(np.float32).T).astype(np.float16)\n"
        "print(got.dtype, np.array_equal(got.view(np.uint16), want.view(np.uint16)))\n"
    )
    assert run_with_own_gemm_as_python(script, tmp_path).split() == ["float16", "True"]


def _matmul_casts(dtype, m, k, n):
    graph = Graph()
    build = Builder(graph)
    x = graph.add_input(TensorType(dtype, (m, k)))
    w = graph.add_input(TensorType(dtype, (k, n)))
    graph.outputs = [build.matmul(x, w)]
    wide = widening.widen(graph)
    matmul = next(node for node in wide.nodes if node.op == "matmul")
    return [i.dtype for i in matmul.inputs], matmul.attrs


@pytest.mark.parametrize("m, k, n", [(64, 128, 128), (63, 128, 128), (4096, 1024, 31), (8, 4, 6)])
def test_16_bit_matmul_read_unwidened_at_every_size(m, k, n):
    """A float16 or bfloat16 product of any size (below the float32 crossover with BLAS, or
    narrower than the register tile, too) is read as stored by the own GEMM: no float32
    copies (a float16 one under 2**20 multiply-adds or 32 columns used to get them)."""
    for dtype in ("f16", "bf16"):
        assert _matmul_casts(dtype, m, k, n) == ([dtype, dtype], {"dtype": "f32"})
    inputs, attrs = _matmul_casts("f32", m, k, n)
    assert (inputs, attrs) == (["f32", "f32"], {})
