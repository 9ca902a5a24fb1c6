"""The op functions users call (bp.add, bp.softmax, ...). They promote dtypes the NumPy 2 way,
build composites from registry primitives, and hand every primitive to dispatch.apply."""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

import numpy as np

from backplan.ir.errors import DtypeError, ShapeError
from backplan.ir.shapes import normalize_axes, normalize_axis
from backplan.ir.types import dtype_name, is_float, promote_types, promote_with_scalar

from .dispatch import apply
from .tensor import Tensor

Scalar = int | float | bool


def tensor(data, dtype=None, requires_grad: bool = False) -> Tensor:
    """A new leaf tensor holding a copy of data (float64 Python data stays float64, as NumPy).

    >>> import backplan as bp
    >>> bp.tensor([[1, 2]], dtype="float32").shape
    (1, 2)
    """
    return Tensor(data, dtype=dtype, requires_grad=requires_grad)


def as_tensor(x) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray | list | tuple | np.generic):
        return Tensor(x)
    raise TypeError(f"expected a tensor or array, got {type(x).__name__}")


def full(shape, value, dtype="float32") -> Tensor:
    return apply("full", [], value=value, shape=tuple(shape), dtype=dtype_name(dtype))


def zeros(shape, dtype="float32") -> Tensor:
    return full(shape, 0, dtype)


def ones(shape, dtype="float32") -> Tensor:
    return full(shape, 1, dtype)


def zeros_like(x) -> Tensor:
    return full(x.shape, 0, x._ir_dtype)


def ones_like(x) -> Tensor:
    return full(x.shape, 1, x._ir_dtype)


def astype(x, dtype) -> Tensor:
    x = as_tensor(x)
    name = dtype_name(dtype)
    return x if x._ir_dtype == name else apply("astype", [x], dtype=name)


def _is_weak_scalar(x) -> bool:
    """Python scalars are weak; NumPy scalars (np.float64 subclasses float) are not, as in
    NumPy 2."""
    return isinstance(x, Scalar) and not isinstance(x, np.generic)


def _operands(a, b) -> tuple[Tensor, Tensor]:
    """Promote two operands; Python scalars are weak (2.0 * f32 tensor stays f32)."""
    a_scalar, b_scalar = _is_weak_scalar(a), _is_weak_scalar(b)
    if a_scalar and b_scalar:
        raise TypeError("at least one operand must be a tensor")
    if b_scalar:
        a = as_tensor(a)
        dtype = promote_with_scalar(a._ir_dtype, b)
        return astype(a, dtype), full((), int(b) if isinstance(b, bool) else b, dtype)
    if a_scalar:
        b = as_tensor(b)
        dtype = promote_with_scalar(b._ir_dtype, a)
        return full((), int(a) if isinstance(a, bool) else a, dtype), astype(b, dtype)
    a, b = as_tensor(a), as_tensor(b)
    dtype = promote_types(a._ir_dtype, b._ir_dtype)
    return astype(a, dtype), astype(b, dtype)


def _binary(op: str):
    def fn(a, b) -> Tensor:
        return apply(op, list(_operands(a, b)))

    fn.__name__ = op
    fn.__doc__ = f"Elementwise {op} with NumPy broadcasting and promotion."
    return fn


add, sub, mul, maximum, minimum = (_binary(n) for n in ("add", "sub", "mul", "maximum", "minimum"))
less, less_equal, greater, greater_equal, equal, not_equal = (
    _binary(n) for n in ("lt", "le", "gt", "ge", "eq", "ne")
)


def div(a, b) -> Tensor:
    a, b = _operands(a, b)
    if not is_float(a._ir_dtype):
        a, b = astype(a, "f64"), astype(b, "f64")  # true division, as NumPy
    return apply("div", [a, b])


def pow(a, b) -> Tensor:  # noqa: A001 - mirrors numpy/torch naming
    return apply("pow", list(_operands(a, b)))


def _float_input(x) -> Tensor:
    x = as_tensor(x)
    return x if is_float(x._ir_dtype) else astype(x, "f64")


def _unary(op: str, floats: bool = True):
    def fn(x) -> Tensor:
        return apply(op, [_float_input(x) if floats else as_tensor(x)])

    fn.__name__ = op
    fn.__doc__ = f"Elementwise {op}."
    return fn


exp, log, tanh, sigmoid, sqrt, erf, sin, cos = (
    _unary(n) for n in ("exp", "log", "tanh", "sigmoid", "sqrt", "erf", "sin", "cos")
)
neg, relu, abs, sign = (_unary(n, floats=False) for n in ("neg", "relu", "abs", "sign"))  # noqa: A001


def gelu(x, approximate: str = "none") -> Tensor:
    """GELU; approximate="tanh" is the tanh form used by GPT-style models."""
    return apply("gelu", [_float_input(x)], approximate=approximate)


def where(cond, x, y) -> Tensor:
    """Choose x where cond is true, else y: the traceable replacement for `if` on tensors."""
    cond = as_tensor(cond)
    if cond._ir_dtype != "bool":
        cond = not_equal(cond, 0)
    x, y = _operands(x, y)
    return apply("where", [cond, x, y])


def stop_gradient(x) -> Tensor:
    return apply("stop_gradient", [as_tensor(x)])


# ---- reductions -------------------------------------------------------------------------------


def sum(x, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    x = as_tensor(x)
    if x._ir_dtype == "bool":
        x = astype(x, "i64")
    return apply("sum", [x], axes=normalize_axes(axis, x.ndim), keepdims=keepdims)


def mean(x, axis=None, keepdims: bool = False) -> Tensor:
    x = _float_input(x)
    axes = normalize_axes(axis, x.ndim)
    count = math.prod(x.shape[a] for a in axes)
    return mul(sum(x, axes, keepdims), 1.0 / builtins.max(count, 1))


def var(x, axis=None, keepdims: bool = False) -> Tensor:
    """Population variance (ddof=0), as NumPy."""
    centered = sub(x, mean(x, axis, keepdims=True))
    return mean(mul(centered, centered), axis, keepdims)


def max(x, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    x = as_tensor(x)
    return apply("max", [x], axes=normalize_axes(axis, x.ndim), keepdims=keepdims)


def min(x, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return neg(max(neg(x), axis, keepdims))


def logsumexp(x, axis=None, keepdims: bool = False) -> Tensor:
    x = _float_input(x)
    return apply("logsumexp", [x], axes=normalize_axes(axis, x.ndim), keepdims=keepdims)


def softmax(x, axis: int = -1) -> Tensor:
    x = _float_input(x)
    return apply("softmax", [x], axis=normalize_axis(axis, x.ndim))


def log_softmax(x, axis: int = -1) -> Tensor:
    x = _float_input(x)
    return apply("log_softmax", [x], axis=normalize_axis(axis, x.ndim))


# ---- shapes -----------------------------------------------------------------------------------


def reshape(x, *shape) -> Tensor:
    x = as_tensor(x)
    if len(shape) == 1 and isinstance(shape[0], Sequence):
        shape = tuple(shape[0])
    shape = _resolve_shape(tuple(int(d) for d in shape), x.size, x.shape)
    return x if shape == x.shape else apply("reshape", [x], shape=shape)


def _resolve_shape(shape, size, old) -> tuple[int, ...]:
    unknown = [i for i, d in enumerate(shape) if d == -1]
    if len(unknown) > 1 or any(d < -1 for d in shape):
        raise ShapeError(f"reshape: bad target shape {shape}")
    if unknown:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or size % known:
            raise ShapeError(f"reshape: cannot reshape {old} into {shape}")
        shape = tuple(size // known if d == -1 else d for d in shape)
    return shape


def transpose(x, *axes) -> Tensor:
    x = as_tensor(x)
    if len(axes) == 1 and isinstance(axes[0], Sequence):
        axes = tuple(axes[0])
    perm = tuple(normalize_axis(a, x.ndim) for a in axes) if axes else tuple(range(x.ndim))[::-1]
    return apply("transpose", [x], perm=perm)


permute = transpose


def swapaxes(x, a: int, b: int) -> Tensor:
    x = as_tensor(x)
    perm = list(range(x.ndim))
    a, b = normalize_axis(a, x.ndim), normalize_axis(b, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


def broadcast_to(x, shape) -> Tensor:
    x = as_tensor(x)
    shape = tuple(shape)
    return x if shape == x.shape else apply("broadcast_to", [x], shape=shape)


def expand_dims(x, axis: int) -> Tensor:
    x = as_tensor(x)
    axis = normalize_axis(axis, x.ndim + 1)
    return reshape(x, x.shape[:axis] + (1,) + x.shape[axis:])


unsqueeze = expand_dims


def squeeze(x, axis=None) -> Tensor:
    x = as_tensor(x)
    axes = (
        [i for i, d in enumerate(x.shape) if d == 1]
        if axis is None
        else normalize_axes(axis, x.ndim)
    )
    for a in axes:
        if x.shape[a] != 1:
            raise ShapeError(f"squeeze: axis {a} of shape {x.shape} has size {x.shape[a]}, not 1")
    return reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))


def flatten(x, start_axis: int = 0) -> Tensor:
    x = as_tensor(x)
    start = normalize_axis(start_axis, x.ndim) if x.ndim else 0
    return reshape(x, x.shape[:start] + (-1,))


def concatenate(tensors, axis: int = 0) -> Tensor:
    tensors = [as_tensor(t) for t in tensors]
    if not tensors:
        raise ShapeError("concatenate needs at least one tensor")
    dtype = tensors[0]._ir_dtype
    for t in tensors[1:]:
        dtype = promote_types(dtype, t._ir_dtype)
    tensors = [astype(t, dtype) for t in tensors]
    return apply("concatenate", tensors, axis=normalize_axis(axis, tensors[0].ndim))


def stack(tensors, axis: int = 0) -> Tensor:
    tensors = [as_tensor(t) for t in tensors]
    if not tensors:
        raise ShapeError("stack needs at least one tensor")
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise ShapeError(f"stack needs equal shapes, got {sorted(shapes)}")
    axis = normalize_axis(axis, tensors[0].ndim + 1)
    return concatenate([expand_dims(t, axis) for t in tensors], axis)


def matmul(a, b) -> Tensor:
    """a @ b with NumPy semantics: batched, broadcasting, 1-D operands as vectors."""
    a, b = _operands(a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: operands must not be scalars, got {a.shape} @ {b.shape}")
    a2 = reshape(a, (1,) + a.shape) if a.ndim == 1 else a
    b2 = reshape(b, b.shape + (1,)) if b.ndim == 1 else b
    out = apply("matmul", [a2, b2])
    dropped = {out.ndim - 2} if a.ndim == 1 else set()
    dropped |= {out.ndim - 1} if b.ndim == 1 else set()
    return reshape(out, tuple(d for i, d in enumerate(out.shape) if i not in dropped))


def take(x, indices, axis: int = 0) -> Tensor:
    """Gather along one axis with an integer index tensor (negative indices count from the end)."""
    x, indices = as_tensor(x), _index_tensor(indices)
    return apply("take", [x, indices], axis=normalize_axis(axis, x.ndim))


def _index_tensor(indices) -> Tensor:
    indices = as_tensor(indices)
    if indices._ir_dtype == "bool":
        raise DtypeError(
            "boolean mask indexing has a shape that depends on the data; use bp.where(mask, x, 0)"
        )
    if indices._ir_dtype != "i64":
        raise DtypeError(f"indices must be integers, got {indices.dtype}")
    return indices


def embedding(indices, weight) -> Tensor:
    """Rows of weight picked by integer indices: weight[indices]."""
    return take(weight, indices, axis=0)


def one_hot(labels, num_classes: int, dtype="float32") -> Tensor:
    return apply("one_hot", [_index_tensor(labels)], depth=num_classes, dtype=dtype_name(dtype))


# ---- neural-network composites with their own registry entries ---------------------------------


def cross_entropy(logits, labels, reduction: str = "mean") -> Tensor:
    """Softmax cross-entropy of logits (..., C) against integer labels (...)."""
    return apply(
        "cross_entropy", [_float_input(logits), _index_tensor(labels)], reduction=reduction
    )


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """Normalise over the last axis, then scale and shift; saves x, not the normalised copy."""
    x = _float_input(x)
    if (weight is None) != (bias is None):
        weight = weight if weight is not None else ones(x.shape[-1:], x._ir_dtype)
        bias = bias if bias is not None else zeros(x.shape[-1:], x._ir_dtype)
    inputs = [x] if weight is None else [x, astype(weight, x.dtype), astype(bias, x.dtype)]
    return apply("layer_norm", inputs, eps=float(eps))


def mse_loss(prediction, target) -> Tensor:
    diff = sub(prediction, target)
    return mean(mul(diff, diff))


# The public ops, re-exported by the face (`bp.exp`, ...): add a new op's function here too.
__all__ = [
    "abs",
    "add",
    "as_tensor",
    "astype",
    "broadcast_to",
    "concatenate",
    "cross_entropy",
    "div",
    "embedding",
    "equal",
    "erf",
    "exp",
    "expand_dims",
    "flatten",
    "full",
    "gelu",
    "greater",
    "greater_equal",
    "layer_norm",
    "less",
    "less_equal",
    "log",
    "log_softmax",
    "logsumexp",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mse_loss",
    "mul",
    "neg",
    "not_equal",
    "one_hot",
    "ones",
    "ones_like",
    "permute",
    "pow",
    "relu",
    "reshape",
    "sigmoid",
    "sin",
    "cos",
    "sign",
    "softmax",
    "sqrt",
    "squeeze",
    "stack",
    "stop_gradient",
    "sub",
    "sum",
    "swapaxes",
    "take",
    "tanh",
    "tensor",
    "transpose",
    "unsqueeze",
    "var",
    "where",
    "zeros",
    "zeros_like",
]
