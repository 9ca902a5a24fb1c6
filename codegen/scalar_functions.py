"""Scalar functions generated loops call by name (`exp_f32`, `gelu_tanh_f64`, ...). They are
inlined into the loops. Transcendentals come from mathlib when it provides a vectorisable
version, else from libm."""

import math

import numpy as np
from .jit import njit

from .flags import FASTMATH

_inline = {"inline": "always", "cache": True, "fastmath": FASTMATH, "error_model": "numpy"}
GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


@njit(**_inline)
def exp_f32(x):
    return math.exp(x)


@njit(**_inline)
def exp_f64(x):
    return math.exp(x)


@njit(**_inline)
def log_f32(x):
    return math.log(x)


@njit(**_inline)
def log_f64(x):
    return math.log(x)


@njit(**_inline)
def tanh_f32(x):
    return math.tanh(x)


@njit(**_inline)
def tanh_f64(x):
    return math.tanh(x)


@njit(**_inline)
def erf_f32(x):
    return math.erf(x)


@njit(**_inline)
def erf_f64(x):
    return math.erf(x)


@njit(**_inline)
def sigmoid_f32(x):
    return np.float32(1.0) / (np.float32(1.0) + exp_f32(-x))


@njit(**_inline)
def sigmoid_f64(x):
    return 1.0 / (1.0 + exp_f64(-x))


@njit(**_inline)
def gelu_tanh_f32(x):
    inner = np.float32(GELU_K) * (x + np.float32(GELU_C) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + tanh_f32(inner))


@njit(**_inline)
def gelu_tanh_f64(x):
    return 0.5 * x * (1.0 + tanh_f64(GELU_K * (x + GELU_C * x * x * x)))


@njit(**_inline)
def gelu_none_f32(x):
    return np.float32(0.5) * x * (np.float32(1.0) + erf_f32(x * np.float32(1 / math.sqrt(2))))


@njit(**_inline)
def gelu_none_f64(x):
    return 0.5 * x * (1.0 + erf_f64(x * (1 / math.sqrt(2))))
