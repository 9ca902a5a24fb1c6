"""Scalar functions generated loops call by name (`exp_f32`, `gelu_tanh_f64`, ...), inlined
into the loops. Transcendentals come from mathlib, which vectorises (libm calls do not)."""

import math

import numpy as np

from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import AS_PYTHON, njit

_inline = {"inline": "always", "cache": True, "fastmath": FASTMATH, "error_model": "numpy"}
GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


if AS_PYTHON:  # plain-Python twins of mathlib's functions (its bit tricks need Numba)

    def _sigmoid(x):
        return 1.0 / (1.0 + math.exp(-x))

    exp_f32 = exp_f64 = math.exp
    log_f32 = log_f64 = math.log
    tanh_f32 = tanh_f64 = tanh_rational_f32 = math.tanh
    erf_f32 = erf_f64 = math.erf
    sigmoid_f32 = sigmoid_f64 = _sigmoid
    from backplan.codegen.kernels.half_python import (  # noqa: F401 - called by name
        bf16_to_f32,
        f16_to_f32,
        f32_to_bf16,
        f32_to_f16,
    )
else:
    from backplan.codegen.kernels.half import (  # noqa: F401 - generated loops call these by name
        bf16_to_f32,
        f16_to_f32,
        f32_to_bf16,
        f32_to_f16,
    )
    from backplan.codegen.kernels.mathlib import (  # noqa: F401 - generated loops call these by name
        erf_f32,
        erf_f64,
        exp_f32,
        exp_f64,
        log_f32,
        log_f64,
        sigmoid_f32,
        sigmoid_f64,
        tanh_f32,
        tanh_f64,
        tanh_rational_f32,
    )


@njit(**_inline)
def gelu_tanh_f32(x):
    inner = np.float32(GELU_K) * (x + np.float32(GELU_C) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + tanh_f32(inner))


@njit(**_inline)
def gelu_tanh_sigmoid_f32(x):
    """gelu_tanh_f32 as x * sigmoid(2 * inner) (0.5 * (1 + tanh(u)) = sigmoid(2u)), for a
    float32 result a loop only rounds into 16 bits (codegen/render/loops.py): no 1 + tanh
    cancellation for negative x, where tanh's absolute error becomes the result's relative
    one; it costs what tanh_f32 costs (one exp-like reduction and one division)."""
    inner = np.float32(2 * GELU_K) * (x + np.float32(GELU_C) * x * x * x)
    return x * sigmoid_f32(inner)


@njit(**_inline)
def gelu_tanh_f64(x):
    return 0.5 * x * (1.0 + tanh_f64(GELU_K * (x + GELU_C * x * x * x)))


@njit(**_inline)
def gelu_none_f32(x):
    return np.float32(0.5) * x * (np.float32(1.0) + erf_f32(x * np.float32(1 / math.sqrt(2))))


@njit(**_inline)
def gelu_none_f64(x):
    return 0.5 * x * (1.0 + erf_f64(x * (1 / math.sqrt(2))))


def fast_exp(x):
    """exp for library kernels that serve both dtypes: mathlib's version for the dtype."""
    return math.exp(x)


if not AS_PYTHON:
    from numba import types
    from numba.extending import overload

    @overload(fast_exp, inline="never")
    def _fast_exp_for(x):
        if x == types.float32:
            return lambda x: exp_f32(x)
        if x == types.float64:
            return lambda x: exp_f64(x)
        return lambda x: math.exp(x)
