"""Conversions between 16-bit float storage and float32, for generated loops.

Numba has no bfloat16 type, so compiled plans keep bfloat16 and float16 buffers as uint16 bit
patterns (codegen/run/compiled.py views them so) and every loop converts with integer shifts:
`bf16_to_f32` / `f16_to_f32` when it loads a 16-bit value, `f32_to_bf16` / `f32_to_f16` (round
to nearest even; NaN stays NaN, overflow gives inf) when it stores one; where the code may use
AVX512_BF16, `f32_to_bf16` is the one instruction VCVTNEPS2BF16 instead (float32 subnormals
become zero there, as in the VDPBF16PS GEMM), and where it may use F16C the float16 pair is
VCVTPH2PS / VCVTPS2PH (LLVM's fpext / fptrunc of half). ir/widen.py makes sure these casts are
the only arithmetic on 16-bit values. Without F16C the float16 routines are Fabian Giesen's
branch-light ones (half_to_float_fast5, float_to_half_fast3_rtne), written as LLVM IR on i32
like the bfloat16 rounding so that loops convert in 32-bit vector lanes. The tests compare all
65,536 16-bit patterns, every float32 exponent with all float16 rounding bits, and random
float32 values with NumPy's and ml_dtypes' conversions, on both float16 paths; all 2^32
float32 patterns rounded to the same float16 bits as NumPy's astype on both paths (NaN kept
NaN: the instruction keeps its payload, the shifts store 0x7E00), and the instruction widens
a signalling float16 NaN to a quiet one.
"""

import functools

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

from .mathlib import _bitcast, _scalar_function

_float = _bitcast(types.uint32, types.float32)


@_scalar_function
def bf16_to_f32(h):
    """A bfloat16 is the upper half of a float32."""
    return _float(np.uint32(h) << np.uint32(16))


def target_has(*names: str) -> bool:
    """Whether the code Numba generates may use every one of these CPU features: those it
    compiles for (NUMBA_CPU_FEATURES when set, else the host's, as LLVM reads them). The kernel
    cache keys on the host's features, so code using them never reaches a host without them.
    NUMBA_CPU_NAME=generic makes them "" (none): an fpext from half there is a call to
    compiler-rt's __extendhfsf2, which the JIT lacks (LLVM ERROR ends the process)."""
    from llvmlite import binding
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return all(f"+{name}" in config.CPU_FEATURES.split(",") for name in names)
    features = binding.get_host_cpu_features()
    return all(bool(features.get(name)) for name in names)


def target_has_avx512bf16() -> bool:
    """Whether the code may use AVX512_BF16 (VCVTNEPS2BF16, VDPBF16PS)."""
    return target_has("avx512bf16", "avx512f")


def target_has_f16c() -> bool:
    """Whether the code may use F16C (VCVTPH2PS, VCVTPS2PH): every x86-64 CPU since 2012."""
    return target_has("f16c")


class BFloat(ir.types.Type):
    """LLVM's `bfloat` (llvmlite's IR builder has no such type). Values of it are only ever
    converted to or bitcast from other types, never computed with here."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, BFloat)

    def __hash__(self):
        return hash("bfloat")


def _round_with_shifts(builder, value):
    """Round to nearest even by adding 0x7FFF plus the lowest kept bit; a NaN keeps its sign
    and becomes quiet (adding could carry it into infinity). LLVM IR on i32: Numba widens
    uint32 arithmetic to 64 bits, and a loop storing bfloat16 then ran its rounding in 8 lanes
    of a 512-bit vector with packs between (1.17 ms against 0.54 ms here for 4M elements of
    y = 2x + 1, one Zen 4 core; float32 1.03 ms)."""
    i32 = ir.IntType(32)
    bits = builder.bitcast(value, i32)
    magnitude = builder.and_(bits, ir.Constant(i32, 0x7FFFFFFF))
    nan = builder.icmp_unsigned(">", magnitude, ir.Constant(i32, 0x7F800000))
    high = builder.lshr(bits, ir.Constant(i32, 16))
    odd = builder.and_(high, ir.Constant(i32, 1))
    rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd)
    quiet = builder.or_(high, ir.Constant(i32, 0x40))
    chosen = builder.select(nan, quiet, builder.lshr(rounded, ir.Constant(i32, 16)))
    return builder.trunc(chosen, ir.IntType(16))


def _round_with_instruction(builder, value):
    """LLVM's fptrunc to bfloat: VCVTNEPS2BF16 on AVX512_BF16, one instruction where the shifts
    take about nine (and three constants the fused loops reload under register pressure). Round
    to nearest even and NaN stay; float32 subnormals become zero of their sign (the instruction
    ignores MXCSR), as in the VDPBF16PS GEMM. ln_gelu's bf16 step 0.90-0.93x -> 0.80-0.86x the
    float32 step by CPU time (3 runs each, interleaved, load 3-4)."""
    return builder.bitcast(builder.fptrunc(value, BFloat()), ir.IntType(16))


def _conversion(emit, source, result):
    """An intrinsic `source` -> `result` (a float32 and 16-bit float bits as uint16) whose
    code `emit(builder, value)` emits: each conversion's instruction and integer paths."""

    @intrinsic
    def conversion(typingctx, x):
        if x != source:
            return None

        def codegen(context, builder, signature, args):
            return emit(builder, args[0])

        return result(x), codegen

    return conversion


_rounding = functools.partial(_conversion, source=types.float32, result=types.uint16)
_widening = functools.partial(_conversion, source=types.uint16, result=types.float32)


def _round_for_target(builder, value):
    """The instruction where the code may use AVX512_BF16, else the shifts (the same bits but
    for float32 subnormals, which the shifts keep)."""
    if target_has_avx512bf16():
        return _round_with_instruction(builder, value)
    return _round_with_shifts(builder, value)


round_to_bf16_shifts = _rounding(_round_with_shifts)  # tests compare it on every host
_round_to_bf16 = _rounding(_round_for_target)


@_scalar_function
def f32_to_bf16(x):
    """float32 (or a value cast to it) to bfloat16 bits, rounded to nearest even."""
    return _round_to_bf16(np.float32(x))


def _i32(value):
    return ir.Constant(ir.IntType(32), value & 0xFFFFFFFF)


def _widen_f16_integer(builder, bits16):
    """Move exponent and mantissa into place and rebias; infinities and NaNs get the float32
    exponent, subnormals are renormalised by one float subtraction (Giesen's
    half_to_float_fast5). LLVM IR on i32 with selects, for the reason _round_with_shifts gives: as
    Numba code the loads ran in 64-bit lanes (vpmovzxwq, vpsllq, vpmovqd). Works on a scalar
    i16 or on a vector of them (the GEMM's packing widens whole rows)."""
    i32, f32 = _like(bits16, ir.IntType(32)), _like(bits16, ir.FloatType())
    c = functools.partial(_i32_like, bits16)
    bits = builder.zext(bits16, i32)
    o = builder.shl(builder.and_(bits, c(0x7FFF)), c(13))
    exponent = builder.and_(o, c(0x0F800000))
    o = builder.add(o, c(0x38000000))
    special = builder.add(o, c(0x38000000))
    small = builder.bitcast(builder.add(o, c(0x00800000)), f32)
    offset = _constant_like(bits16, ir.FloatType(), 2.0**-14)
    small = builder.bitcast(builder.fsub(small, offset), i32)
    o = builder.select(builder.icmp_unsigned("==", exponent, c(0)), small, o)
    o = builder.select(builder.icmp_unsigned("==", exponent, c(0x0F800000)), special, o)
    sign = builder.shl(builder.and_(bits, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(o, sign), f32)


def _widen_f16_instruction(builder, bits16):
    """LLVM's fpext from half: VCVTPH2PS with F16C, one instruction for a vector of eight or
    sixteen where the shifts take about twelve per vector. Exact, subnormals included; a NaN
    keeps its sign and payload and becomes quiet (NumPy keeps a signalling NaN signalling)."""
    return builder.fpext(
        builder.bitcast(bits16, _like(bits16, ir.HalfType())), _like(bits16, ir.FloatType())
    )


def widen_f16_for_target(builder, bits16):
    """float16 bits (i16, or a vector of them) as float32: the instruction where the code may
    use F16C, else the shifts (the same values; NaNs stay NaN)."""
    if target_has_f16c():
        return _widen_f16_instruction(builder, bits16)
    return _widen_f16_integer(builder, bits16)


def _like(value, scalar):
    """scalar's type, or a vector of it as long as value's vector."""
    if isinstance(value.type, ir.VectorType):
        return ir.VectorType(scalar, value.type.count)
    return scalar


def _constant_like(value, scalar, number):
    kind = _like(value, scalar)
    if isinstance(kind, ir.VectorType):
        return ir.Constant(kind, [number] * kind.count)
    return ir.Constant(kind, number)


def _i32_like(value, number):
    return _constant_like(value, ir.IntType(32), number & 0xFFFFFFFF)


widen_f16_integer = _widening(_widen_f16_integer)  # tests compare both on every host
widen_f16_instruction = _widening(_widen_f16_instruction)
_widen_f16 = _widening(widen_f16_for_target)


@_scalar_function
def f16_to_f32(h):
    """float16 bits to float32 (exact)."""
    return _widen_f16(np.uint16(h))


def _round_f16_integer(builder, value):
    """Round to nearest even (Giesen's float_to_half_fast3_rtne): at or above 65520 infinity,
    NaN a quiet NaN with the sign kept; subnormal results round by one float addition that
    aligns their bits, normal ones by adding 0xFFF plus the lowest kept bit. LLVM IR on i32:
    as Numba code the stores ran in 64-bit lanes (1.88 ms against 1.03 ms for 4M elements of
    y = 2x + 1, one Zen 4 core)."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    bits = builder.bitcast(value, i32)
    sign = builder.and_(builder.lshr(bits, _i32(16)), _i32(0x8000))
    a = builder.and_(bits, _i32(0x7FFFFFFF))
    nan = builder.icmp_unsigned(">", a, _i32(0x7F800000))
    special = builder.select(nan, _i32(0x7E00), _i32(0x7C00))
    aligned = builder.fadd(builder.bitcast(a, f32), ir.Constant(f32, 0.5))
    subnormal = builder.sub(builder.bitcast(aligned, i32), _i32(0x3F000000))
    odd = builder.and_(builder.lshr(a, _i32(13)), _i32(1))
    normal = builder.add(builder.add(a, _i32(0xFFF - 0x38000000)), odd)
    h = builder.select(
        builder.icmp_unsigned("<", a, _i32(0x38800000)),
        subnormal,
        builder.lshr(normal, _i32(13)),
    )
    h = builder.select(builder.icmp_unsigned(">=", a, _i32(0x47800000)), special, h)
    return builder.trunc(builder.or_(h, sign), ir.IntType(16))


def _round_f16_instruction(builder, value):
    """LLVM's fptrunc to half: VCVTPS2PH with F16C (rounding by MXCSR, round to nearest even
    unless a program changed it; Numba never does). The same bits as the shifts for every
    float32 but NaNs, whose payload's upper bits are kept (the shifts store 0x7E00)."""
    return builder.bitcast(builder.fptrunc(value, ir.HalfType()), ir.IntType(16))


def _round_f16_for_target(builder, value):
    if target_has_f16c():
        return _round_f16_instruction(builder, value)
    return _round_f16_integer(builder, value)


round_to_f16_integer = _rounding(_round_f16_integer)  # tests compare both on every host
round_to_f16_instruction = _rounding(_round_f16_instruction)
_round_to_f16 = _rounding(_round_f16_for_target)


@_scalar_function
def f32_to_f16(x):
    """float32 (or a value cast to it) to float16 bits, rounded to nearest even."""
    return _round_to_f16(np.float32(x))
