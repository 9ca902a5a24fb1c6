"""The own GEMM reads bfloat16 operands (uint16 bits) as they are, widening them into float32
panels while it packs them (or, on a CPU with AVX512_BF16, packing them in k-pairs for
VDPBF16PS: test_gemm_bf16_dot.py): float32 products and sums, a float32 result. Compiled plans
give a matmul of two bfloat16 values to it directly, with no float32 copy of either
(ir/widen.py)."""

from __future__ import annotations

import re
from functools import partial

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_16_bit_gemm_exact, run_with_own_gemm_as_python

import backplan as bp
from backplan.codegen.kernels import gemm as own
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.types import TensorType
from backplan.ir.widen import widen
from backplan.runtime.backend import use_backend

# A call of the own GEMM in generated code: single-core, or shared over cores (the _par
# forms, which the code uses where the process may run two threads).
GEMM_CALL = re.compile(r"own_gemm(?:_at)?(?:_par)?\(")

BF16 = np.dtype(ml_dtypes.bfloat16)
WIDTHS = (512, 256)
SHAPES = [  # m, n, k: ones, primes, edges of the 8x32 and 6x16 tiles, empty, a long k
    (1, 1, 1),
    (7, 33, 5),
    (33, 7, 1),
    (1, 64, 300),
    (0, 5, 3),
    (4, 0, 3),
    (3, 4, 0),
    (130, 70, 33),
    (129, 96, 520),
]


def _operands(rng, m, n, k, ta, tb, integers=False):
    """bfloat16 a (m x k, or k x m when ta) and b (k x n, or n x k); integers: small whole
    numbers, whose float32 sums are exact in any order."""
    shape_a, shape_b = (k, m) if ta else (m, k), (n, k) if tb else (k, n)
    if integers:
        return (rng.integers(-4, 5, s).astype(BF16) for s in (shape_a, shape_b))
    return (rng.standard_normal(s).astype(np.float32).astype(BF16) for s in (shape_a, shape_b))


def _op(x, trans):
    return x.T if trans else x


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
def test_bf16_gemm_against_float64(width, ta, tb):
    """Random bfloat16 operands: within float32 summation error of the float64 product of
    their values, and within bfloat16 tolerance of the float64 product of the float32 data
    they were rounded from."""
    rng = np.random.default_rng(7)
    for m, n, k in SHAPES:
        a, b = _operands(rng, m, n, k, ta, tb)
        c = np.full((m, n), np.nan, np.float32)
        own.gemm(width, ta, tb, 1.0, a.view(np.uint16), b.view(np.uint16), 0.0, c)
        a64, b64 = _op(a, ta).astype(np.float64), _op(b, tb).astype(np.float64)
        scale = np.abs(a64) @ np.abs(b64)
        bound = 4 * (k + 2) * np.finfo(np.float32).eps * scale
        assert np.all(np.abs(c - a64 @ b64) <= bound), (m, n, k)
        rounded = c.astype(BF16).astype(np.float64)
        assert np.all(np.abs(rounded - a64 @ b64) <= 1e-2 * scale + bound), (m, n, k)


@pytest.mark.parametrize("width", WIDTHS)
def test_bf16_gemm_equals_the_float32_gemm_of_widened_operands_bitwise(width):
    """Whole-number operands: every order of summation gives the same float32, so the GEMM
    that widens while packing equals NumPy's float32 product of the widened copies bit for
    bit; alpha and beta as in the float32 GEMM."""
    rng = np.random.default_rng(8)
    for ta, tb in [(False, False), (True, True), (True, False), (False, True)]:
        for m, n, k in SHAPES:
            a, b = _operands(rng, m, n, k, ta, tb, integers=True)
            assert_16_bit_gemm_exact(partial(own.gemm, width), ta, tb, a, b, np.uint16, rng)


def test_bf16_gemm_strided_operands_and_batches():
    rng = np.random.default_rng(9)
    a_big, b_big = _operands(rng, 90, 80, 300, False, True)
    a, b = a_big[::2, ::3].view(np.uint16), b_big[1::2].view(np.uint16)  # 45 x 100, 40 x 300
    b = b[:, :100]
    c = np.empty((45, 40), np.float32)
    own.gemm(512, False, True, 1.0, a, b, 0.0, c)
    wide = a.view(BF16).astype(np.float64) @ b.view(BF16).astype(np.float64).T
    np.testing.assert_allclose(c, wide, rtol=1e-5, atol=1e-4)
    batch_a = rng.standard_normal((3, 33, 17)).astype(BF16)  # op(A) = a[i].T, 17 x 33
    shared_b = rng.standard_normal((1, 33, 9)).astype(BF16)  # one B for every entry
    c3 = np.empty((3, 17, 9), np.float32)
    own.batched_gemm(256, True, False, batch_a.view(np.uint16), shared_b.view(np.uint16), c3)
    for i in range(3):
        wide = batch_a[i].astype(np.float64).T @ shared_b[0].astype(np.float64)
        np.testing.assert_allclose(c3[i], wide, rtol=1e-5, atol=1e-5)


def _matmul_graph(dtype, transposed=False, m=8, k=4, n=6):
    graph = Graph()
    build = Builder(graph)
    x = graph.add_input(TensorType(dtype, (m, k)))
    w = graph.add_input(TensorType(dtype, (n, k) if transposed else (k, n)))
    rhs = build.transpose(w, perm=(1, 0)) if transposed else w
    graph.outputs = [build.tanh(build.matmul(x, rhs))]
    return graph


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_widen_leaves_16_bit_matmul_operands_unwidened(dtype):
    """No cast into float32 before the GEMM (also through a transpose it takes as a flag):
    the product is float32 (dtype='f32') and rounds once into the 16-bit dtype after it.
    (every size of product: test_gemm_f16.)"""
    for transposed in (False, True):
        wide = widen(_matmul_graph(dtype, transposed, 64, 128, 128))
        matmul = next(n for n in wide.nodes if n.op == "matmul")
        assert matmul.attrs == {"dtype": "f32"} and matmul.dtype == "f32"
        assert all(i.dtype == dtype for i in matmul.inputs)
        casts = [(n.inputs[0].dtype, n.dtype) for n in wide.nodes if n.op == "astype"]
        assert casts.count((dtype, "f32")) == 1  # the tanh's read of the rounded product
        assert ("f32", dtype) in casts


def test_widened_matmul_prints_and_parses_back():
    from backplan.ir.errors import DtypeError
    from backplan.ir.text import format_graph, parse_graph

    wide = widen(_matmul_graph("bf16"))
    text = format_graph(wide)
    assert "matmul %0, %1 {dtype='f32'} : f32[8,6]" in text
    assert format_graph(parse_graph(text)[0]) == text
    graph = Graph()
    a = graph.add_input(TensorType("f32", (2, 2)))
    with pytest.raises(DtypeError, match="only for bf16 or f16 operands summed in f32, got f32"):
        Builder(graph).matmul(a, a, dtype="f32")


def _mlp_loss(p, x):
    h = bp.tanh(x @ p["w1"] + p["b"])
    return bp.sum((h @ p["w2"].T) ** 2)


def _mlp_inputs():
    rng = np.random.default_rng(4)

    def draw(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(BF16)

    params = {"w1": draw(16, 40), "b": draw(40), "w2": draw(12, 40)}
    return {k: bp.tensor(v) for k, v in params.items()}, bp.tensor(draw(9, 16))


def _products(x, w, y, batch):
    return x @ w, x.T @ y, y @ w.T, batch @ batch.swapaxes(1, 2)


def test_compiled_bf16_products_equal_the_reference_bitwise():
    """Whole-number data (float32 sums exact in any order; above 256 the bfloat16 rounding
    of the same float32 is the same): the compiled products, transposed operands and a
    batch included, equal the reference interpreter's (widened float32 matmul, rounded once)
    bit for bit."""
    rng = np.random.default_rng(4)
    shapes = [(9, 16), (16, 40), (9, 40), (3, 7, 33)]
    args = [bp.tensor(rng.integers(-4, 5, s).astype(BF16)) for s in shapes]
    with use_backend("reference"):
        expected = bp.compile(_products)(*args)
    with use_backend("numba"):
        got = bp.compile(_products)(*args)
    assert any(np.abs(e.numpy().astype(np.float32)).max() > 256 for e in expected)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == bp.bfloat16
        np.testing.assert_array_equal(g.numpy().view(np.uint16), e.numpy().view(np.uint16))


def test_compiled_bf16_step_reads_operands_without_copies():
    """A bfloat16 value_and_grad step: its GEMMs (forward, dX through a transposed weight,
    dW) read the bfloat16 arrays, no loop makes a float32 copy for them, and the loss and
    gradients are within bfloat16 tolerance of the reference interpreter's."""
    params, x = _mlp_inputs()
    step = bp.value_and_grad(_mlp_loss)
    with use_backend("reference"):
        l0, g0 = step(params, x)
    with use_backend("numba"):
        l1, g1 = step(params, x)
        compiled = step.trace(params, x).runner().compiled
    for e, g in [(l0, l1)] + [(g0[k], g1[k]) for k in g0]:
        assert g.dtype == bp.bfloat16
        e32, g32 = e.numpy().astype(np.float32), g.numpy().astype(np.float32)
        np.testing.assert_allclose(g32, e32, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(e32).max()))
    graph = compiled.plan.graph  # the plan the code was generated from (widened)
    matmuls = [n for n in graph.nodes if n.op == "matmul"]
    sources = compiled.source + "".join(k.source for k in compiled.loop_kernels)  # epilogues
    assert len(matmuls) == 5 and len(GEMM_CALL.findall(sources)) >= 4
    for node in matmuls:
        sources = [i.inputs[0] if i.op == "transpose" else i for i in node.inputs]
        assert [s.dtype for s in sources] == ["bf16", "bf16"]  # read as stored: no f32 copy


def test_bf16_plan_with_kernels_as_python(tmp_path):
    """The GEMM's plain-Python twin widens uint16 operands too (BACKPLAN_KERNELS_AS_PYTHON)."""
    script = (
        "import numpy as np, ml_dtypes, backplan as bp\n"
        "from backplan.runtime.backend import use_backend\n"
        "bf = ml_dtypes.bfloat16\n"
        "a = np.arange(12).reshape(3, 4).astype(bf)\n"
        "b = (np.arange(20).reshape(5, 4) % 3).astype(bf)\n"
        "with use_backend('numba'):\n"
        "    got = bp.compile(lambda a, b: a @ b.T)(a, b).numpy()\n"
        "want = (a.astype(np.float32) @ b.astype(np.float32).T).astype(bf)\n"
        "print(got.dtype, np.array_equal(got.view(np.uint16), want.view(np.uint16)))\n"
    )
    assert run_with_own_gemm_as_python(script, tmp_path).split() == ["bfloat16", "True"]


def test_bf16_products_share_the_gemm_out_on_threads(monkeypatch):
    """Where a float32 product would get BLAS's threads, a bfloat16 one runs the own GEMM cut
    in as many blocks (BLAS has no bfloat16): same bits, on one thread or two."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    rng = np.random.default_rng(6)
    shapes = [(9, 16), (16, 40), (9, 40), (3, 7, 33)]
    args = [bp.tensor(rng.integers(-4, 5, s).astype(BF16)) for s in shapes]
    with use_backend("reference"):
        expected = bp.compile(_products)(*args)
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        with use_backend("numba"):
            traced = bp.compile(_products)
            got = traced(*args)
            runners = traced.trace(*args).runners()
    finally:
        numba.set_num_threads(previous)
    source = "".join(r.compiled.source for r in runners if hasattr(r, "compiled"))
    assert source.count("own_gemm_at_par(np.intp(2), ") == 3 and "own_batched_gemm_par(" in source
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(g.numpy().view(np.uint16), e.numpy().view(np.uint16))
