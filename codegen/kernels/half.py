"""Conversions between 16-bit float storage and float32, for generated loops.

Numba has no bfloat16 type, so compiled plans keep bfloat16 and float16 buffers as uint16 bit
patterns (codegen/run/compiled.py views them so) and every loop converts with integer shifts:
`bf16_to_f32` / `f16_to_f32` when it loads a 16-bit value, `f32_to_bf16` / `f32_to_f16` (round
to nearest even; NaN stays NaN, overflow gives inf) when it stores one. ir/widen.py makes sure
these casts are the only arithmetic on 16-bit values. The float16 routines are Fabian Giesen's
branch-light ones (half_to_float_fast5, float_to_half_fast3_rtne); the tests compare all
65,536 patterns and many float32 values with NumPy's and ml_dtypes' conversions.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

from .mathlib import _bitcast, _scalar_function

_bits = _bitcast(types.float32, types.uint32)
_float = _bitcast(types.uint32, types.float32)

_F16_DENORMAL_MAGIC = np.float32(0.5)  # ((127 - 15) + (23 - 10) + 1) << 23 as a float32
_F16_SMALLEST_NORMAL = np.float32(2.0**-14)  # 113 << 23 as a float32


@_scalar_function
def bf16_to_f32(h):
    """A bfloat16 is the upper half of a float32."""
    return _float(np.uint32(h) << np.uint32(16))


@intrinsic
def _round_to_bf16(typingctx, x):
    """Round to nearest even by adding 0x7FFF plus the lowest kept bit; a NaN keeps its sign
    and becomes quiet (adding could carry it into infinity). Written as LLVM IR on i32: Numba
    widens uint32 arithmetic to 64 bits, and a loop storing bfloat16 then ran its rounding in
    8 lanes of a 512-bit vector with packs between (1.17 ms against 0.54 ms here for 4M
    elements of y = 2x + 1, one Zen 4 core; float32 1.03 ms)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        magnitude = builder.and_(bits, ir.Constant(i32, 0x7FFFFFFF))
        nan = builder.icmp_unsigned(">", magnitude, ir.Constant(i32, 0x7F800000))
        high = builder.lshr(bits, ir.Constant(i32, 16))
        odd = builder.and_(high, ir.Constant(i32, 1))
        rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd)
        quiet = builder.or_(high, ir.Constant(i32, 0x40))
        chosen = builder.select(nan, quiet, builder.lshr(rounded, ir.Constant(i32, 16)))
        return builder.trunc(chosen, ir.IntType(16))

    return types.uint16(x), codegen


@_scalar_function
def f32_to_bf16(x):
    """float32 (or a value cast to it) to bfloat16 bits, rounded to nearest even."""
    return _round_to_bf16(np.float32(x))


@_scalar_function
def f16_to_f32(h):
    """Move exponent and mantissa into place and rebias; infinities and NaNs get the float32
    exponent, subnormals are renormalised by one float subtraction."""
    bits = np.int64(h)
    o = (bits & 0x7FFF) << 13
    exponent = o & 0x0F800000
    o += 0x38000000
    if exponent == 0x0F800000:
        o += 0x38000000
    elif exponent == 0:
        o += 0x00800000
        o = np.int64(_bits(_float(np.uint32(o)) - _F16_SMALLEST_NORMAL))
    return _float(np.uint32(o | ((bits & 0x8000) << 16)))


@_scalar_function
def f32_to_f16(x):
    """Round to nearest even; at or above 65520 infinity, NaN stays NaN (quiet); subnormals
    round by one float addition that aligns their bits."""
    f = np.int64(_bits(np.float32(x)))
    sign = (f >> 16) & 0x8000
    a = f & 0x7FFFFFFF
    if a >= 0x47800000:
        h = 0x7E00 if a > 0x7F800000 else 0x7C00
    elif a < 0x38800000:
        h = np.int64(_bits(_float(np.uint32(a)) + _F16_DENORMAL_MAGIC)) - 0x3F000000
    else:
        h = (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
    return np.uint16(h | sign)
