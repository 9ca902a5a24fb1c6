"""Convolution, pooling and the small array helpers CNN code needs (argmax, argmin, clip,
arange), with PyTorch's argument names and NCHW layout.

Pooling is a composite: windows are strided slices of the (padded) input, reduced with max or
mean, so its derivative, second derivative and compiled form come from those primitives; when
the stride equals the kernel (the usual case) the windows are one reshape, with no copies.
"""

from __future__ import annotations

import math

import numpy as np

from backplan.ir.errors import ShapeError
from backplan.ir.types import dtype_name

from .dispatch import apply
from .ops import (
    _float_input,
    as_tensor,
    astype,
    concatenate,
    full,
    greater,
    less,
    reshape,
    stack,
    where,
)
from .ops import max as _max
from .ops import mean as _mean
from .source import located
from .tensor import Tensor
from .torch_names import torch_keywords


def _pair(value, name: str, op: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in pair):
        raise ShapeError(f"{op}: {name} must be an int or a pair of ints, got {value!r}")
    return pair


def conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups: int = 1) -> Tensor:
    """2-D cross-correlation of x (N, C, H, W) with w (O, C / groups, kH, kW), plus bias b (O,),
    as torch.nn.functional.conv2d (zero padding; padding is an int or a pair)."""
    x = _float_input(x)
    w = astype(w, x._ir_dtype)
    y = apply(
        "conv2d",
        [x, w],
        stride=_pair(stride, "stride", "conv2d"),
        padding=_pair(padding, "padding", "conv2d"),
        dilation=_pair(dilation, "dilation", "conv2d"),
        groups=groups,
    )
    if b is None:
        return y
    b = astype(b, x._ir_dtype)
    if b.shape != (w.shape[0],):
        raise ShapeError(f"conv2d: bias must have shape ({w.shape[0]},), got {b.shape}")
    return y + reshape(b, (1, w.shape[0], 1, 1))


def _pool_geometry(x, kernel_size, stride, padding, op: str):
    if x.ndim != 4:
        raise ShapeError(f"{op}: input must be (N, C, H, W), got shape {x.shape}")
    kernel = _pair(kernel_size, "kernel_size", op)
    stride = kernel if stride is None else _pair(stride, "stride", op)
    padding = _pair(padding, "padding", op)
    if any(k < 1 for k in kernel) or any(s < 1 for s in stride):
        raise ShapeError(f"{op}: kernel_size and stride must be positive, got {kernel}, {stride}")
    if any(p < 0 or 2 * p > k for p, k in zip(padding, kernel, strict=True)):
        raise ShapeError(f"{op}: padding must be at most half the kernel, got {padding}")
    out = tuple(
        (size + 2 * p - k) // s + 1
        for size, k, s, p in zip(x.shape[2:], kernel, stride, padding, strict=True)
    )
    if min(out) < 1:
        raise ShapeError(f"{op}: kernel {kernel} does not fit input {x.shape[2:]}")
    return kernel, stride, padding, out


def _pad(x, padding, value):
    """x with `value` borders of padding[0] rows and padding[1] columns."""
    n, c, h, w = x.shape
    ph, pw = padding
    if ph:
        band = full((n, c, ph, w), value, x._ir_dtype)
        x = concatenate([band, x, band], axis=2)
    if pw:
        band = full((n, c, x.shape[2], pw), value, x._ir_dtype)
        x = concatenate([band, x, band], axis=3)
    return x


def _windows(x, kernel, stride, padding, out, fill):
    """(N, C, OH, OW, taps) when windows overlap, else (N, C, OH, kH, OW, kW); reduce axes."""
    xp = _pad(x, padding, fill)
    (kh, kw), (sh, sw), (oh, ow) = kernel, stride, out
    if (kh, kw) == (sh, sw):
        cropped = xp[:, :, : oh * kh, : ow * kw]
        return reshape(cropped, (x.shape[0], x.shape[1], oh, kh, ow, kw)), (3, 5)
    taps = [
        xp[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw]
        for i in range(kh)
        for j in range(kw)
    ]
    return stack(taps, axis=-1), (4,)


@located
def max_pool2d(x, kernel_size, stride=None, padding=0) -> Tensor:
    """Max over kH x kW windows (stride defaults to the kernel; padding counts as -inf), as
    torch.nn.functional.max_pool2d. Ties share the gradient (PyTorch gives it to one)."""
    x = _float_input(x)
    kernel, stride, padding, out = _pool_geometry(x, kernel_size, stride, padding, "max_pool2d")
    windows, axes = _windows(x, kernel, stride, padding, out, -math.inf)
    return _max(windows, axis=axes)


@located
def avg_pool2d(x, kernel_size, stride=None, padding=0) -> Tensor:
    """Mean over kH x kW windows, zero padding counted (PyTorch's count_include_pad=True)."""
    x = _float_input(x)
    kernel, stride, padding, out = _pool_geometry(x, kernel_size, stride, padding, "avg_pool2d")
    windows, axes = _windows(x, kernel, stride, padding, out, 0)
    return _mean(windows, axis=axes)


def _arg_extreme(op: str, x, axis, keepdims: bool) -> Tensor:
    x = as_tensor(x)
    if axis is None:
        flat = apply(op, [reshape(x, (-1,))], axis=0)
        return reshape(flat, (1,) * x.ndim) if keepdims else flat
    if not -x.ndim <= axis < x.ndim:
        raise ShapeError(f"{op}: axis {axis} is out of range for shape {x.shape}")
    return apply(op, [x], axis=axis % x.ndim, keepdims=keepdims)


@located
@torch_keywords
def argmax(x, axis=None, keepdims: bool = False) -> Tensor:
    """Index of the first maximum along axis (of the flattened tensor when axis is None);
    dim=/keepdim= as torch.argmax, whose meaning is the same."""
    return _arg_extreme("argmax", x, axis, keepdims)


@located
@torch_keywords
def argmin(x, axis=None, keepdims: bool = False) -> Tensor:
    """Index of the first minimum along axis (of the flattened tensor when axis is None);
    dim=/keepdim= as torch.argmin."""
    return _arg_extreme("argmin", x, axis, keepdims)


def clip(x, lo=None, hi=None) -> Tensor:
    """x limited to [lo, hi] (either may be None); the gradient is 1 inside and on the bounds,
    0 outside, as torch.clamp."""
    if lo is None and hi is None:
        raise ValueError("bp.clip: give lo, hi or both")
    x = as_tensor(x)
    if lo is not None:  # where, not maximum: maximum splits a tie's gradient
        x = where(less(x, lo), lo, x)
    if hi is not None:
        x = where(greater(x, hi), hi, x)
    return x


@located
def arange(start, stop=None, step=1, dtype=None) -> Tensor:
    """Evenly spaced values in [start, stop): int64 for integer arguments, else float32 (as
    torch.arange and jax.numpy.arange), unless dtype is given. A constant of the plan."""
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise ShapeError(f"arange({start}, {stop}, step=0): the step must not be zero")
    if dtype is None:
        ints = all(isinstance(v, int | np.integer) for v in (start, stop, step))
        dtype = "i64" if ints else "f32"
    return Tensor(np.arange(start, stop, step), dtype=dtype_name(dtype))
