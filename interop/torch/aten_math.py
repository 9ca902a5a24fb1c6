"""Elementwise arithmetic, comparisons, logic, reductions and tensor creation in core ATen,
as backplan ops. Semantics follow ATen's: `alpha` on add/sub, `correction` on var, dtype
keywords that cast the result."""

from __future__ import annotations

import math

import numpy as np

from backplan.tracer import ops
from backplan.tracer.conv import arange, argmax, argmin, clip

from .dtypes import to_dtype
from .errors import TorchImportError
from .table import aten


def _scaled(b, alpha):
    return b if alpha == 1 else ops.mul(b, alpha)


@aten("add.Tensor", "add.Scalar")
def add(a, b, alpha=1):
    return ops.add(a, _scaled(b, alpha))


@aten("sub.Tensor", "sub.Scalar")
def sub(a, b, alpha=1):
    return ops.sub(a, _scaled(b, alpha))


@aten("rsub.Tensor", "rsub.Scalar")
def rsub(a, b, alpha=1):
    return ops.sub(b, _scaled(a, alpha))


# ops whose ATen arguments are backplan's: the function itself is the handler
_SAME = {
    "mul.Tensor": ops.mul,
    "mul.Scalar": ops.mul,
    "div.Tensor": ops.div,
    "div.Scalar": ops.div,
    "pow.Tensor_Scalar": ops.pow,
    "pow.Tensor_Tensor": ops.pow,
    "pow.Scalar": ops.pow,
    "maximum.default": ops.maximum,
    "minimum.default": ops.minimum,
    "relu.default": ops.relu,
    "sigmoid.default": ops.sigmoid,
    "tanh.default": ops.tanh,
    "exp.default": ops.exp,
    "log.default": ops.log,
    "sqrt.default": ops.sqrt,
    "neg.default": ops.neg,
    "abs.default": ops.abs,
    "sin.default": ops.sin,
    "cos.default": ops.cos,
    "erf.default": ops.erf,
    "sign.default": ops.sign,
}
for _name, _fn in _SAME.items():
    aten(_name)(_fn)


@aten("rsqrt.default")
def rsqrt(x):
    return ops.div(1.0, ops.sqrt(x))


@aten("reciprocal.default")
def reciprocal(x):
    return ops.div(1.0, x)


@aten("silu.default")
def silu(x):
    return ops.mul(x, ops.sigmoid(x))


@aten("gelu.default")
def gelu(x, approximate="none"):
    return ops.gelu(x, approximate=approximate)


@aten("clamp.default", "clamp.Tensor")
def clamp(x, min=None, max=None):  # noqa: A002 - ATen's names
    return clip(x, min, max)


@aten("clamp_min.default")
def clamp_min(x, low):
    return clip(x, low, None)


@aten("clamp_max.default")
def clamp_max(x, high):
    return clip(x, None, high)


@aten("hardtanh.default")
def hardtanh(x, min_val=-1.0, max_val=1.0):
    return clip(x, min_val, max_val)


_COMPARE = {
    "eq": ops.equal,
    "ne": ops.not_equal,
    "lt": ops.less,
    "le": ops.less_equal,
    "gt": ops.greater,
    "ge": ops.greater_equal,
}
for _name, _fn in _COMPARE.items():
    aten(f"{_name}.Tensor", f"{_name}.Scalar")(_fn)


def _bool(x):
    return x if x.dtype == np.bool_ else ops.not_equal(x, 0)


@aten("logical_not.default")
def logical_not(x):
    return ops.equal(_bool(x), False)


@aten("logical_and.default")
def logical_and(a, b):
    return ops.where(_bool(a), _bool(b), False)


@aten("logical_or.default")
def logical_or(a, b):
    return ops.where(_bool(a), True, _bool(b))


def _booleans(op: str, *xs) -> None:
    if any(getattr(x, "dtype", np.bool_) != np.bool_ for x in xs):
        raise TorchImportError(f"{op}: only boolean operands are mapped (as logical ops)")


@aten("bitwise_and.Tensor")
def bitwise_and(a, b):
    _booleans("bitwise_and", a, b)
    return logical_and(a, b)


@aten("bitwise_or.Tensor")
def bitwise_or(a, b):
    _booleans("bitwise_or", a, b)
    return logical_or(a, b)


@aten("bitwise_not.default")
def bitwise_not(x):
    _booleans("bitwise_not", x)
    return logical_not(x)


@aten("where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar")
def where(cond, a, b):
    return ops.where(cond, a, b)


# ---- reductions -------------------------------------------------------------------------------


def _axes(dims):
    return None if dims is None or (isinstance(dims, list | tuple) and not dims) else dims


def _cast(x, dtype):
    return x if dtype is None else ops.astype(x, to_dtype(dtype))


@aten("sum.dim_IntList", "sum.default")
def reduce_sum(x, dim=None, keepdim=False, dtype=None):
    return _cast(ops.sum(_cast(x, dtype), _axes(dim), keepdim), dtype)


@aten("mean.dim", "mean.default")
def reduce_mean(x, dim=None, keepdim=False, dtype=None):
    return ops.mean(_cast(x, dtype), _axes(dim), keepdim)


@aten("amax.default")
def amax(x, dim=(), keepdim=False):
    return ops.max(x, _axes(dim), keepdim)


@aten("amin.default")
def amin(x, dim=(), keepdim=False):
    return ops.min(x, _axes(dim), keepdim)


@aten("max.dim")
def max_dim(x, dim, keepdim=False):
    return ops.max(x, dim, keepdim), argmax(x, dim, keepdim)


@aten("min.dim")
def min_dim(x, dim, keepdim=False):
    return ops.min(x, dim, keepdim), argmin(x, dim, keepdim)


@aten("argmax.default")
def argmax_(x, dim=None, keepdim=False):
    return argmax(x, dim, keepdim)


@aten("argmin.default")
def argmin_(x, dim=None, keepdim=False):
    return argmin(x, dim, keepdim)


@aten("cumsum.default")
def cumsum(x, dim, dtype=None):
    return ops.cumsum(_cast(x, dtype), dim)


@aten("any.dim", "any.dims", "any.default")
def any_(x, dim=None, keepdim=False):
    return ops.greater(ops.sum(_bool(x), _axes(dim), keepdim), 0)


@aten("all.dim", "all.dims", "all.default")
def all_(x, dim=None, keepdim=False):
    return ops.equal(ops.sum(logical_not(x), _axes(dim), keepdim), 0)


@aten("var.correction", "var.dim")
def var(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    axes = _axes(dim)
    picked = range(x.ndim) if axes is None else [axes] if isinstance(axes, int) else axes
    n = math.prod(x.shape[a] for a in picked)
    biased = ops.var(x, axes, keepdim)
    return biased if not correction else ops.mul(biased, n / max(n - correction, 0))


# ---- creation ---------------------------------------------------------------------------------


@aten("arange.start_step", "arange.start", "arange.default")
def arange_(start, end=None, step=1, dtype=None, **_placement):
    if end is None:
        start, end = 0, start
    return arange(start, end, step, dtype=to_dtype(dtype) if dtype is not None else None)


def _number(value):
    return int(value) if isinstance(value, bool) else value  # full takes True as 1


@aten("full.default")
def full(size, value, dtype=None, **_placement):
    return ops.full(tuple(size), _number(value), to_dtype(dtype, value))


@aten("full_like.default")
def full_like(x, value, dtype=None, **_placement):
    return ops.full(x.shape, _number(value), to_dtype(dtype) if dtype is not None else x.dtype)


@aten("zeros.default")
def zeros(size, dtype=None, **_placement):
    return ops.full(tuple(size), 0, to_dtype(dtype, 0.0))


@aten("ones.default")
def ones(size, dtype=None, **_placement):
    return ops.full(tuple(size), 1, to_dtype(dtype, 1.0))


@aten("zeros_like.default")
def zeros_like(x, dtype=None, **_placement):
    return full_like(x, 0, dtype)


@aten("ones_like.default")
def ones_like(x, dtype=None, **_placement):
    return full_like(x, 1, dtype)


@aten("scalar_tensor.default")
def scalar_tensor(value, dtype=None, **_placement):
    return ops.full((), _number(value), to_dtype(dtype, value))
