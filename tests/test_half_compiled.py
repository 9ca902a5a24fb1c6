"""Compiled plans on bfloat16 and float16: buffers are uint16 bit patterns, loops convert with
shifts (codegen/kernels/half.py), compute in float32 and round once when they store (a fused
chain keeps its float32 values); the reference interpreter rounds after every op, so results
agree within the 16-bit dtype's rounding, and exactly where nothing fuses."""

from __future__ import annotations

import os
import re

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import backplan as bp
from backplan.codegen.kernels.half import (
    bf16_to_f32,
    f16_to_f32,
    f32_to_bf16,
    f32_to_f16,
    round_to_bf16_shifts,
    round_to_f16_instruction,
    round_to_f16_integer,
    target_has_avx512bf16,
    target_has_f16c,
    widen_f16_instruction,
    widen_f16_integer,
)
from backplan.runtime.backend import use_backend

BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [BF16, np.dtype(np.float16)]


@njit(cache=True)
def _convert(patterns, values, bf16_out, f16_out, bf16_bits, f16_bits):
    for i in range(patterns.size):
        bf16_out[i] = bf16_to_f32(patterns[i])
        f16_out[i] = f16_to_f32(patterns[i])
    for i in range(values.size):
        bf16_bits[i] = round_to_bf16_shifts(values[i])
        f16_bits[i] = f32_to_f16(values[i])


def _same_floats(a, b):
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    np.testing.assert_array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_shift_conversions_match_numpy_and_ml_dtypes_bit_for_bit():
    patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 2.98e-8, 2.99e-8, 1e-45]
    values = np.concatenate(
        [
            rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
            (rng.standard_normal(100_000) * np.exp(rng.uniform(-20, 20, 100_000))).astype(
                np.float32
            ),
            np.array(special, np.float32),
            -np.array(special, np.float32),
        ]
    )
    out = [np.empty(patterns.size, np.float32) for _ in range(2)]
    out += [np.empty(values.size, np.uint16) for _ in range(2)]
    _convert(patterns, values, *out)
    _same_floats(out[0], patterns.view(BF16).astype(np.float32))
    _same_floats(out[1], patterns.view(np.float16).astype(np.float32))
    nan = np.isnan(values)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(out[2][~nan], values[~nan].astype(BF16).view(np.uint16))
        np.testing.assert_array_equal(out[3][~nan], values[~nan].astype(np.float16).view(np.uint16))
    assert np.isnan(out[2][nan].view(BF16).astype(np.float32)).all()
    assert np.isnan(out[3][nan].view(np.float16)).all()


@njit(cache=True)
def _to_bf16(values, loops, shifts):
    for i in range(values.size):
        loops[i] = f32_to_bf16(values[i])
        shifts[i] = round_to_bf16_shifts(values[i])


def _bf16_rounding_cases():
    """Random float32 patterns (subnormals and NaNs among them), every subnormal exponent's
    rounding bits, ties, and the values next to overflow."""
    rng = np.random.default_rng(3)
    patterns = [
        rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0, 2**17, dtype=np.uint32) * np.uint32(61),  # subnormals, the low bits
        np.array([0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x7F7F7FFF, 0x7F7F8000]),
    ]
    values = np.concatenate(patterns).astype(np.uint32)
    return np.concatenate([values, values | np.uint32(0x80000000)]).view(np.float32)


def test_loops_round_to_bfloat16_as_ml_dtypes_but_subnormals_where_the_instruction_runs():
    """f32_to_bf16 (what loops call) is VCVTNEPS2BF16 where the code may use AVX512_BF16: the
    shifts' bits (= ml_dtypes') except that a float32 subnormal becomes zero of its sign; on
    other hosts it is the shifts."""
    values = _bf16_rounding_cases()
    loops, shifts = np.empty(values.size, np.uint16), np.empty(values.size, np.uint16)
    _to_bf16(values, loops, shifts)
    nan = np.isnan(values)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(shifts[~nan], values[~nan].astype(BF16).view(np.uint16))
    want = shifts.copy()
    bits = values.view(np.uint32)
    subnormal = (bits & np.uint32(0x7F800000) == 0) & (bits & np.uint32(0x7FFFFF) != 0)
    assert subnormal.sum() > 100_000
    if target_has_avx512bf16():
        want[subnormal] = (bits[subnormal] >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000)
    np.testing.assert_array_equal(loops[~nan], want[~nan])
    assert np.isnan(loops[nan].view(BF16).astype(np.float32)).all()
    assert np.array_equal(loops[nan] >> 15, (bits[nan] >> np.uint32(31)).astype(np.uint16))


@njit(fastmath={"contract"})
def _bf16_store_loop(x, y):
    for i in range(x.size):
        y[i] = f32_to_bf16(x[i] * np.float32(2.0))


@pytest.mark.skipif(not target_has_avx512bf16(), reason="the host has no AVX512_BF16")
def test_bfloat16_stores_are_one_instruction_with_avx512_bf16():
    """A loop storing bfloat16 converts with VCVTNEPS2BF16, not the nine-instruction shifts
    (ln_gelu's bf16 step: 0.90-0.93x -> 0.80-0.86x the float32 step by CPU time)."""
    x = np.arange(64, dtype=np.float32)
    y = np.empty(64, np.uint16)
    _bf16_store_loop(x, y)
    assert np.array_equal(y, (x * 2).astype(BF16).view(np.uint16))
    code = _bf16_store_loop.inspect_asm(_bf16_store_loop.signatures[0])
    assert "vcvtneps2bf16" in code


@njit(cache=True)
def _to_f16(values, out):
    for i in range(values.size):
        out[i] = f32_to_f16(values[i])


def test_float16_rounding_matches_numpy_on_every_exponent_and_rounding_bit():
    """Every sign and exponent of float32 with all 2^14 patterns of the mantissa bits a normal
    float16 rounds on (kept bit, round bit, sticky bits), the higher bits random (they decide
    a subnormal result's rounding): 8.4M values, bit for bit as NumPy's astype; NaN stays NaN.
    (All 2^32 float32 patterns agreed too, checked once outside the suite.)"""
    rng = np.random.default_rng(7)
    sign_exponent = np.arange(512, dtype=np.uint32)[:, None] << np.uint32(23)
    low = np.arange(2**14, dtype=np.uint32)[None, :]
    high = rng.integers(0, 2**9, (512, 2**14), dtype=np.uint32) << np.uint32(14)
    values = (sign_exponent | high | low).ravel().view(np.float32)
    got = np.empty(values.size, np.uint16)
    _to_f16(values, got)
    nan = np.isnan(values)
    with np.errstate(all="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


@njit(fastmath={"contract"})
def _f16_loop_integer(x, y):
    for i in range(x.size):
        y[i] = round_to_f16_integer(widen_f16_integer(x[i]) * np.float32(2.0))


def test_float16_integer_conversions_vectorise_in_32_bit_lanes():
    """The conversions without F16C are i32 arithmetic (LLVM IR in codegen/kernels/half.py):
    written as Numba code they ran in 64-bit lanes, half as many per vector, with packs."""
    x = np.arange(64, dtype=np.uint16)
    _f16_loop_integer(x, np.empty_like(x))
    code = _f16_loop_integer.inspect_llvm(_f16_loop_integer.signatures[0])
    integer_ops = set(re.findall(r"(?:lshr|shl|and|or|add|sub|select) <\d+ x (i\d+)>", code))
    assert "i32" in integer_ops and "i64" not in integer_ops, integer_ops


@njit
def _f16_both_ways(patterns, values, widened, rounded):
    for i in range(patterns.size):
        widened[0, i] = widen_f16_integer(patterns[i])
        widened[1, i] = widen_f16_instruction(patterns[i])
        widened[2, i] = f16_to_f32(patterns[i])
    for i in range(values.size):
        rounded[0, i] = round_to_f16_integer(values[i])
        rounded[1, i] = round_to_f16_instruction(values[i])
        rounded[2, i] = f32_to_f16(values[i])


def _signalling_f16(patterns):
    """float16 NaNs with the quiet bit clear: VCVTPH2PS sets it, NumPy's astype does not."""
    return ((patterns & 0x7C00) == 0x7C00) & ((patterns & 0x3FF) != 0) & ((patterns & 0x200) == 0)


def test_float16_conversions_with_and_without_f16c_match_numpy_bit_for_bit():
    """Both float16 paths (the shifts; VCVTPH2PS / VCVTPS2PH, which loops use with F16C) and
    what loops call, on all 65,536 patterns and on every float32 exponent with all rounding
    bits: the same bits as NumPy's astype, infinities, NaNs and subnormals included, but that
    the instruction makes a signalling NaN quiet when it widens (payload and sign kept) and
    keeps a float32 NaN's payload when it rounds (the shifts store 0x7E00); NaN stays NaN.
    (All 2^32 float32 patterns agreed on both paths, checked once outside the suite.)"""
    patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    rng = np.random.default_rng(3)
    sign_exponent = np.arange(512, dtype=np.uint32)[:, None] << np.uint32(23)
    low = np.arange(2**14, dtype=np.uint32)[None, :]
    high = rng.integers(0, 2**9, (512, 2**14), dtype=np.uint32) << np.uint32(14)
    values = (sign_exponent | high | low).ravel().view(np.float32)
    widened = np.empty((3, patterns.size), np.float32)
    rounded = np.empty((3, values.size), np.uint16)
    _f16_both_ways(patterns, values, widened, rounded)
    want = patterns.view(np.float16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(widened[0].view(np.uint32), want)
    quiet = np.where(_signalling_f16(patterns), want | np.uint32(0x00400000), want)
    loops = 1 if target_has_f16c() else 0  # the path loops take on this host
    np.testing.assert_array_equal(widened[1].view(np.uint32), quiet)
    np.testing.assert_array_equal(widened[2].view(np.uint32), widened[loops].view(np.uint32))
    nan = np.isnan(values)
    with np.errstate(all="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    for path in rounded:
        np.testing.assert_array_equal(path[~nan], want[~nan])
        assert np.isnan(path[nan].view(np.float16)).all()
    np.testing.assert_array_equal(rounded[0][nan], (want[nan] & 0x8000) | 0x7E00)
    np.testing.assert_array_equal(rounded[2], rounded[loops])


@njit(fastmath={"contract"})
def _f16_loop(x, y):
    for i in range(x.size):
        y[i] = f32_to_f16(f16_to_f32(x[i]) * np.float32(2.0))


@pytest.mark.skipif(not target_has_f16c(), reason="the host has no F16C")
def test_float16_loads_and_stores_are_one_instruction_with_f16c():
    """A loop on float16 widens with VCVTPH2PS and rounds with VCVTPS2PH, not the dozen
    integer instructions of the shifts each way."""
    x = np.arange(64, dtype=np.uint16)
    _f16_loop(x, np.empty_like(x))
    code = _f16_loop.inspect_asm(_f16_loop.signatures[0])
    assert "vcvtph2ps" in code and "vcvtps2ph" in code


def _both(fn, *args):
    with use_backend("reference"):
        expected = bp.compile(fn)(*args)
    with use_backend("numba"):
        got = bp.compile(fn)(*args)
    return expected, got


def _assert_same_bits(expected, got):
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(g.numpy().view(np.uint16), e.numpy().view(np.uint16))


def _assert_close(expected, got, rtol):
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype
        e32, g32 = e.numpy().astype(np.float32), g.numpy().astype(np.float32)
        np.testing.assert_allclose(g32, e32, rtol=rtol, atol=rtol * max(1.0, np.abs(e32).max()))


TOL = {BF16: 2e-2, np.dtype(np.float16): 3e-3}


@pytest.mark.parametrize("dtype", HALVES)
def test_chains_reductions_and_matmul_match_the_reference(dtype):
    rng = np.random.default_rng(1)
    a = bp.tensor(rng.standard_normal((24, 17)).astype(dtype))
    b = bp.tensor(rng.standard_normal((17, 8)).astype(dtype))

    def f(a, b):
        h = bp.tanh(a * 2.0 + 1.0)
        return h @ b, h.sum(axis=1), bp.exp(h).max(), h.astype(bp.float32) * 3.0

    _assert_close(*_both(f, a, b), rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", HALVES)
def test_a_fused_chain_rounds_once_when_it_stores(dtype):
    rng = np.random.default_rng(5)
    a32, b32 = rng.standard_normal((2, 4096)).astype(np.float32)
    a, b = a32.astype(dtype), b32.astype(dtype)
    with use_backend("numba"):
        got = bp.compile(lambda a, b: (a * b + 1.0) * b)(a, b).numpy()
    wide_a, wide_b = a.astype(np.float32), b.astype(np.float32)
    once = ((wide_a * wide_b + np.float32(1.0)) * wide_b).astype(dtype)
    each = ((wide_a * wide_b).astype(dtype).astype(np.float32) + 1).astype(dtype)
    each = (each.astype(np.float32) * wide_b).astype(dtype)
    same_once = np.mean(got.view(np.uint16) == once.view(np.uint16))
    same_each = np.mean(got.view(np.uint16) == each.view(np.uint16))
    assert same_once > 0.99 > same_each  # (a fused multiply-add may move a float32 last bit)


@pytest.mark.parametrize("dtype", HALVES)
def test_gradients_compiled_match_the_reference(dtype):
    rng = np.random.default_rng(2)
    params = {
        "w": bp.tensor((rng.standard_normal((16, 32)) * 0.3).astype(dtype)),
        "b": bp.tensor(np.zeros(32, dtype)),
    }
    x = bp.tensor(rng.standard_normal((8, 16)).astype(dtype))

    def loss(p, x):
        return bp.mean(bp.relu(x @ p["w"] + p["b"]) ** 2)

    (l1, g1), (l2, g2) = _both(bp.value_and_grad(loss), params, x)
    _assert_close([l1, g1["w"], g1["b"]], [l2, g2["w"], g2["b"]], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", HALVES)
def test_a_16_bit_matmul_compiles(dtype):
    w, x = bp.tensor(np.ones((3, 2), dtype)), bp.tensor(np.ones((4, 3), dtype))
    with use_backend("numba"):
        report = bp.explain(lambda w, x: bp.tanh(x @ w).sum(), w, x)
    assert all(f.unsupported is None for f in report.compiled)


@pytest.mark.parametrize("dtype", HALVES)
def test_a_batch_broadcast_16_bit_matmul_matches_the_reference(dtype):
    """(2, 1, 3, 4) @ (3, 4, 2): both operands are broadcast over the batch before the GEMM.
    A planned copy of them (a same-dtype 16-bit astype loop) stored the widened float32
    values unrounded into the 16-bit buffer: NaNs and zeros."""
    rng = np.random.default_rng(0)
    a = bp.tensor(rng.standard_normal((2, 1, 3, 4)).astype(dtype))
    b = bp.tensor(rng.standard_normal((3, 4, 2)).astype(dtype))
    (expected,), (got,) = _both(lambda a, b: (a @ b,), a, b)
    _assert_close([expected], [got], TOL[np.dtype(dtype)])


def test_float16_overflow_propagates_inf_in_compiled_loops():
    h = bp.tensor(np.array([300.0, 1.0, np.nan], np.float16))
    expected, got = _both(lambda h: (h * h + 1.0,), h)
    _assert_same_bits(expected, got)
    assert np.isinf(got[0].numpy()[0]) and np.isnan(got[0].numpy()[2])


def test_a_16_bit_literal_costs_no_kernel_and_keeps_chains_fused():
    """A bfloat16 constant read by float32 arithmetic is a float32 literal of its rounded
    value, not a cast (a loop of its own, which split the chains reading it)."""
    from backplan.ir.builder import Builder
    from backplan.ir.fusion import group_kernels
    from backplan.ir.graph import Graph
    from backplan.ir.types import TensorType
    from backplan.ir.widen import widen

    graph = Graph()
    build = Builder(graph)
    x = graph.add_input(TensorType("bf16", (8, 4)))
    scale = build.full(value=0.1, shape=(), dtype="bf16")
    graph.outputs = [build.tanh(build.mul(x, scale))]
    wide = widen(graph)
    literals = [n for n in wide.nodes if n.op == "full" and n.dtype == "f32"]
    assert [n.attrs["value"] for n in literals] == [float(np.float32(0.1).astype(BF16))]
    kinds = [k.kind for k in group_kernels(wide)]
    assert kinds.count("loop") == 1, kinds


@pytest.mark.parametrize("dtype", HALVES)
def test_a_compiled_16_bit_layer_norm_rounds_once_as_the_op(dtype):
    """Compiled plans write layer_norm as primitives (ir/passes.py expand_layer_norm); in the
    16-bit dtype each row statistic was a buffer rounded on its own (5 bfloat16 ulps off on a
    4x6 input). They are float32 now: the eager op's values, and torch's bfloat16 layer_norm's
    one rounding; the gradients too (the derivative rule's statistics are the same values)."""
    rng = np.random.default_rng(3)
    x = bp.tensor(rng.standard_normal((4, 6)).astype(np.float32)).astype(dtype)
    w = bp.tensor(rng.standard_normal(6).astype(np.float32)).astype(dtype)
    b = bp.tensor(rng.standard_normal(6).astype(np.float32)).astype(dtype)
    wide = x.astype(bp.float32).numpy().astype(np.float64)
    centred = wide - wide.mean(-1, keepdims=True)
    normed = centred / np.sqrt(centred.var(-1, keepdims=True) + 1e-5)
    want = (normed * w.astype(bp.float32).numpy() + b.astype(bp.float32).numpy()).astype(dtype)
    for backend in ("numba", "reference"):
        with use_backend(backend):
            got = bp.compile(bp.layer_norm)(x, w, b)
        np.testing.assert_array_equal(got.numpy().view(np.uint16), want.view(np.uint16))
    eager = bp.value_and_grad(lambda x, w, b: bp.sum(bp.layer_norm(x, w, b)), argnums=(0, 1))
    compiled = bp.compile(eager)
    for a, c in zip(eager(x, w, b)[1], compiled(x, w, b)[1], strict=True):
        np.testing.assert_array_equal(a.numpy().view(np.uint16), c.numpy().view(np.uint16))


GENERIC = """
import json
import ml_dtypes
import numpy as np
import backplan as bp
from backplan.codegen.kernels.half import target_has_avx512bf16, target_has_f16c
from backplan.runtime.backend import use_backend

x = np.array([1.5, -0.0, 65504, np.inf, np.nan, 6e-8, 3.3, -7.1] * 3, np.float32)
got = {}
for name in ("float16", "bfloat16"):
    dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    with use_backend("numba"):
        out = bp.compile(lambda a: a * 2.0 + 1.0)(bp.tensor(x.astype(dtype))).numpy()
    with np.errstate(all="ignore"):
        want = (x.astype(dtype).astype(np.float32) * 2 + 1).astype(dtype)
    got[name] = bool(np.array_equal(out.view(np.uint16), want.view(np.uint16)))
print(json.dumps({"equal": got, "f16c": target_has_f16c(), "bf16": target_has_avx512bf16()}))
"""


def test_half_loops_compile_for_numbas_generic_cpu(tmp_path):
    """NUMBA_CPU_NAME=generic (portable machine code) makes Numba compile for no CPU features
    (NUMBA_CPU_FEATURES defaults to ""), where the host's F16C was assumed: LLVM lowered the
    fpext from half to compiler-rt's __extendhfsf2, which the JIT lacks, and the process ended
    ("LLVM ERROR: Symbol not found"). The shifts run there, with NumPy's bits."""
    from helpers import script_facts

    env = {
        **os.environ,
        "NUMBA_CPU_NAME": "generic",
        "BACKPLAN_CACHE_DIR": str(tmp_path),
        "BACKPLAN_DRIVER": "python",
    }
    env.pop("NUMBA_CPU_FEATURES", None)
    facts = script_facts(GENERIC, env=env)
    assert facts == {"equal": {"float16": True, "bfloat16": True}, "f16c": False, "bf16": False}
