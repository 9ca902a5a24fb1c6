"""Plain-Python twins of codegen/kernels/half.py for BACKPLAN_KERNELS_AS_PYTHON=1 (its bit
tricks need Numba): the same conversions, done by NumPy and ml_dtypes."""

import numpy as np

from backplan.ir.types import np_dtype


def bf16_to_f32(h):
    return np.array(h, np.uint16).view(np_dtype("bf16")).astype(np.float32)[()]


def f16_to_f32(h):
    return np.array(h, np.uint16).view(np.float16).astype(np.float32)[()]


def f32_to_bf16(x):
    return np.array(x, np.float32).astype(np_dtype("bf16")).view(np.uint16)[()]


def f32_to_f16(x):
    return np.array(x, np.float32).astype(np.float16).view(np.uint16)[()]
