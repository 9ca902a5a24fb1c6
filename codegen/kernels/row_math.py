"""Scalar helpers the row kernels (softmax, log_softmax) call in their inner loops, written so
that each loop vectorises: a max that LLVM reduces in vector registers, mathlib's exp inlined
for the row's dtype, and a one and a zero in the row's dtype (a Python 1.0 would make the math
float64).

Under BACKPLAN_KERNELS_AS_PYTHON=1 they are the plain Python functions below; compiled, each
call is replaced by its overload at the call site (inline="always"), so no call is left in the
loop. mathlib's exp keeps its own fast-math flags: LLVM, not Numba, inlines its body.
"""

import math

from backplan.codegen.jit import AS_PYTHON


def maxnum(a, b):
    """The larger of a and b; a NaN loses to a number (IEEE maxNum, LLVM's llvm.maxnum), which
    LLVM vectorises as a reduction where a compare-and-select max stays scalar."""
    if a != a:
        return b
    if b != b:
        return a
    return a if a >= b else b


def row_exp(x):
    """e**x in x's dtype: mathlib's exp_f32 or exp_f64 (about 1 ulp; exp(-inf) = 0)."""
    return math.exp(x)


def one_like(x):
    """1 in x's dtype."""
    return type(x)(1)


def zero_like(x):
    """0 in x's dtype."""
    return type(x)(0)


if not AS_PYTHON:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic, overload

    from backplan.codegen.kernels.mathlib import exp_f32, exp_f64

    @intrinsic
    def _llvm_maxnum(typingctx, a, b):
        if not isinstance(a, types.Float) or a != b:
            return None

        def codegen(context, builder, signature, args):
            value = args[0].type
            name = f"llvm.maxnum.f{32 if value == ir.FloatType() else 64}"
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(value, [value, value]), name
            )
            return builder.call(fn, args)

        return a(a, b), codegen

    @overload(maxnum, inline="always")
    def _maxnum_for(a, b):
        if isinstance(a, types.Float) and a == b:
            return lambda a, b: _llvm_maxnum(a, b)
        return None

    @overload(row_exp, inline="always")
    def _row_exp_for(x):
        if x == types.float32:
            return lambda x: exp_f32(x)
        if x == types.float64:
            return lambda x: exp_f64(x)
        return lambda x: math.exp(x)

    @overload(one_like, inline="always")
    def _one_like_for(x):
        if isinstance(x, types.Float):
            one = x.cast_python_value(1)
            return lambda x: one
        return None

    @overload(zero_like, inline="always")
    def _zero_like_for(x):
        if isinstance(x, types.Float):
            zero = x.cast_python_value(0)
            return lambda x: zero
        return None
