"""The op functions users call (bp.add, bp.softmax, ...). They promote dtypes the NumPy 2 way,
build composites from registry primitives, and hand every primitive to dispatch.apply."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplan.ir.errors import DtypeError, ShapeError
from backplan.ir.shapes import normalize_axes, normalize_axis
from backplan.ir.types import dtype_name, is_float, is_int, promote_types, promote_with_scalar

from .dispatch import apply
from .float64_promotion import check_promotion
from .operand_errors import operand_type_error
from .source import loc_text, located, user_frame_loc
from .tensor import Axis, DTypeLike, Tensor, TensorLike
from .torch_names import (
    extremum_values_and_indices,
    refuse_torch_dim,
    torch_keywords,
    variance_correction,
)
from .trace import current_trace

Scalar = int | float | bool


@located
def tensor(data: Any, dtype: DTypeLike | None = None, requires_grad: bool = False) -> Tensor:
    """tensor(data, dtype=None, requires_grad=False): a new leaf tensor holding a copy of data.

    NumPy arrays keep their dtype; Python floats make float32 (as PyTorch and JAX), Python ints
    int64, bools bool. Supported dtypes: bool, uint8, int32, int64, bfloat16, float16, float32,
    float64 (a big-endian array is stored in native order); any other (complex, uint64, int16,
    datetime, object, ...) raises DtypeError naming the cast to make.
    Only float tensors can require grad.

    >>> import backplan as bp
    >>> bp.tensor([[1.0, 2.0]]).dtype, bp.tensor([[1, 2]], dtype="int32").dtype
    (dtype('float32'), dtype('int32'))
    """
    traced = isinstance(data, list | tuple) and current_trace() is not None
    if traced and not requires_grad and _holds_traced(data):
        stacked = as_tensor(data)  # inside @compile: the traced elements, stacked
        return stacked if dtype is None else astype(stacked, dtype)
    return Tensor(data, dtype=dtype, requires_grad=requires_grad)


@located
def as_tensor(x: TensorLike) -> Tensor:
    """as_tensor(x): x itself if it is a Tensor, else bp.tensor(x)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, list | tuple) and current_trace() is not None and _holds_traced(x):
        # np.asarray cannot read a traced value: stack the elements instead, as eagerly (and
        # jnp.asarray) a list of tensors and numbers becomes one tensor
        return stack([_element(e) for e in x])
    if isinstance(x, np.ndarray | list | tuple | np.generic):
        return Tensor(x)
    raise operand_type_error(x)


def _holds_traced(items) -> bool:
    return any(
        (isinstance(i, Tensor) and i._data is None)
        or (isinstance(i, list | tuple) and _holds_traced(i))
        for i in items
    )


def _element(e) -> Tensor:
    """One element of a list made a tensor while tracing: a Python float passed to the compiled
    function (a weakly typed 0-d input) makes float32 there, as the same float does eagerly;
    stacked as it was traced, `bp.tensor([lr, 2.0])` was float64 compiled, float32 eagerly."""
    if not isinstance(e, Tensor):
        return as_tensor(_number(e))
    return astype(e, "f32") if e._weak else e


def _number(x):
    """A Python number as a 0-d array of the dtype a Python scalar makes (float32 for floats)."""
    if isinstance(x, list | tuple):
        return x
    if isinstance(x, float):
        return np.float32(x)
    return np.asarray(x)


def _creation_shape(op: str, shape) -> tuple[int, ...]:
    """A creation op's shape: a sequence of ints, or one int for a 1-d result (as np.ones(3),
    torch.ones(3) and bp.random.normal(key, 3) take it); anything else is refused naming it."""
    if isinstance(shape, int | np.integer) and not isinstance(shape, bool):
        return (int(shape),)
    if isinstance(shape, Sequence) and not isinstance(shape, str):
        if all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in shape):
            return tuple(int(d) for d in shape)
    raise ShapeError(
        f"{op}: the shape must be an int or a tuple of ints, got {shape!r} "
        f"({type(shape).__name__}); e.g. bp.{op}((2, 3)) or bp.{op}(3)"
    )


@located
def full(shape: Sequence[int], value: float, dtype: DTypeLike = "float32") -> Tensor:
    """full(shape, value, dtype="float32"), as np.full (argument order shape, value)."""
    shape = _creation_shape("full", shape)
    if isinstance(value, Tensor):  # a traced float, say: broadcast it instead of baking it in
        return broadcast_to(astype(value, dtype), shape)
    return apply("full", [], value=value, shape=shape, dtype=dtype_name(dtype))


@located
def zeros(shape: Sequence[int], dtype: DTypeLike = "float32") -> Tensor:
    """zeros(shape, dtype="float32"); shape an int or a tuple of ints."""
    return full(_creation_shape("zeros", shape), 0, dtype)


@located
def ones(shape: Sequence[int], dtype: DTypeLike = "float32") -> Tensor:
    """ones(shape, dtype="float32"); shape an int or a tuple of ints."""
    return full(_creation_shape("ones", shape), 1, dtype)


@located
def zeros_like(x: Tensor) -> Tensor:
    """zeros_like(x): zeros of x's shape and dtype."""
    return full(x.shape, 0, x._ir_dtype)


@located
def ones_like(x: Tensor) -> Tensor:
    """ones_like(x): ones of x's shape and dtype."""
    return full(x.shape, 1, x._ir_dtype)


@located
def astype(x: TensorLike, dtype: DTypeLike) -> Tensor:
    """astype(x, dtype): x converted to dtype (any supported dtype; x itself if it has it).
    Gradients flow through casts between float dtypes."""
    x = as_tensor(x)
    name = dtype_name(dtype)
    return x if x._ir_dtype == name else apply("astype", [x], dtype=name)


def _is_weak_scalar(x) -> bool:
    """Python scalars are weak; NumPy scalars (np.float64 subclasses float) are not, as in
    NumPy 2."""
    return isinstance(x, Scalar) and not isinstance(x, np.generic)


def _is_weak_tensor(x) -> bool:
    """A traced Python float argument (or a value computed from such floats only)."""
    return isinstance(x, Tensor) and x._weak


def _operands(a, b, op: str = "this op") -> tuple[Tensor, Tensor]:
    """Promote two operands; Python scalars are weak (2.0 * f32 tensor stays f32), and so are
    traced Python floats (lr * f32 tensor stays f32)."""
    a_scalar, b_scalar = _is_weak_scalar(a), _is_weak_scalar(b)
    if _is_weak_tensor(a) != _is_weak_tensor(b) and not (a_scalar or b_scalar):
        a_weak = _is_weak_tensor(a)
        weak, strong = (a, b) if a_weak else (b, a)
        strong = as_tensor(strong)
        dtype = promote_with_scalar(strong._ir_dtype, 1.0)
        weak, strong = astype(weak, dtype), astype(strong, dtype)
        return (weak, strong) if a_weak else (strong, weak)
    if a_scalar and _is_weak_tensor(b) or b_scalar and _is_weak_tensor(a):
        a, b = (float(a), b) if a_scalar else (a, float(b))
        a_weak, b_weak = _operands_strong(a, b)
        a_weak._weak = b_weak._weak = True  # lr * 0.5 is still a weak float
        return a_weak, b_weak
    return _operands_strong(a, b, op)


def _operands_strong(a, b, op: str = "this op") -> tuple[Tensor, Tensor]:
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
    check_promotion(op, a, b, dtype)
    return astype(a, dtype), astype(b, dtype)


def _binary(op: str) -> Callable[[TensorLike, TensorLike], Tensor]:
    def fn(a: TensorLike, b: TensorLike) -> Tensor:
        return apply(op, list(_operands(a, b, op)))

    fn.__name__ = op
    fn.__doc__ = (
        f"{op}(a, b), elementwise with NumPy broadcasting. Python scalars are weak (2.0 * an\n"
        "    f32 tensor stays f32); tensors of different categories (bool < integer < float)\n"
        "    give the higher category's dtype, as PyTorch and JAX (int64 * float32 is float32)."
    )
    return located(fn)


add, sub, mul, maximum, minimum = (_binary(n) for n in ("add", "sub", "mul", "maximum", "minimum"))
less, less_equal, greater, greater_equal, equal, not_equal = (
    _binary(n) for n in ("lt", "le", "gt", "ge", "eq", "ne")
)


@located
def div(a: TensorLike, b: TensorLike) -> Tensor:
    """div(a, b) = a / b: true division; integer operands give float64, as NumPy."""
    a, b = _operands(a, b, "div")
    if not is_float(a._ir_dtype):
        a, b = astype(a, "f64"), astype(b, "f64")  # true division, as NumPy
    return apply("div", [a, b])


@located
def pow(a: TensorLike, b: TensorLike) -> Tensor:  # noqa: A001 - mirrors numpy/torch naming
    """pow(a, b) = a ** b, elementwise with broadcasting."""
    return apply("pow", list(_operands(a, b, "pow")))


def _float_input(x) -> Tensor:
    x = as_tensor(x)
    return x if is_float(x._ir_dtype) else astype(x, "f64")


def _unary(op: str, floats: bool = True) -> Callable[[TensorLike], Tensor]:
    def fn(x: TensorLike) -> Tensor:
        return apply(op, [_float_input(x) if floats else as_tensor(x)])

    fn.__name__ = op
    fn.__doc__ = f"{op}(x), elementwise." + (" Integer input gives float64." if floats else "")
    return located(fn)


exp, log, tanh, sigmoid, sqrt, erf, sin, cos = (
    _unary(n) for n in ("exp", "log", "tanh", "sigmoid", "sqrt", "erf", "sin", "cos")
)
neg, relu, abs, sign = (_unary(n, floats=False) for n in ("neg", "relu", "abs", "sign"))  # noqa: A001


@located
def gelu(x: TensorLike, approximate: str = "none") -> Tensor:
    """gelu(x, approximate="none"), as torch.nn.functional.gelu; approximate="tanh" is the
    tanh form used by GPT-style models."""
    return apply("gelu", [_float_input(x)], approximate=approximate)


@located
def where(cond: TensorLike, x: TensorLike, y: TensorLike) -> Tensor:
    """where(cond, x, y), as np.where and torch.where: x where cond is true, else y. The
    traceable replacement for `if` on tensor values; cond that is not bool means cond != 0."""
    cond = as_tensor(cond)
    if cond._ir_dtype != "bool":
        cond = not_equal(cond, 0)
    x, y = _operands(x, y)
    return apply("where", [cond, x, y])


@located
def stop_gradient(x: TensorLike) -> Tensor:
    """stop_gradient(x): the same values with no gradient flowing back (traceable detach)."""
    return apply("stop_gradient", [as_tensor(x)])


# ---- reductions -------------------------------------------------------------------------------


@located
@torch_keywords
def cumsum(x: TensorLike, axis: int | None = None, reverse: bool = False) -> Tensor:
    """cumsum(x, axis=None, reverse=False), as np.cumsum: the running sum along axis (None:
    over the flattened tensor); reverse sums from the end (out[i] = x[i] + ... + x[n-1]).
    bool, uint8 and int32 sum into int64, as NumPy and PyTorch; the gradient is the same scan
    run the other way, so nothing is saved.

    >>> import backplan as bp
    >>> bp.cumsum(bp.tensor([1.0, 2.0, 3.0])).numpy().tolist()
    [1.0, 3.0, 6.0]
    """
    x = as_tensor(x)
    if axis is None:
        x, axis = reshape(x, -1), 0
    if x._ir_dtype in ("bool", "u8", "i32"):
        x = astype(x, "i64")
    return apply("cumsum", [x], axis=normalize_axis(axis, x.ndim), reverse=bool(reverse))


@located
@torch_keywords
def sum(x: TensorLike, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """sum(x, axis=None, keepdims=False), as np.sum: axis is an int, a tuple of ints or None
    (all axes). bool, uint8 and int32 sum into int64, as NumPy and PyTorch."""
    x = as_tensor(x)
    if x._ir_dtype in ("bool", "u8", "i32"):
        x = astype(x, "i64")  # as NumPy and PyTorch: small integers sum into int64
    return apply("sum", [x], axes=normalize_axes(axis, x.ndim), keepdims=keepdims)


@located
@torch_keywords
def mean(x: TensorLike, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """mean(x, axis=None, keepdims=False), as np.mean; integer input gives float64, bool input
    float32 (the default float, as JAX: `mean(pred == y)` meets float32 losses unwidened).
    A bfloat16 or float16 mean is summed and divided in float32 and rounded once, as PyTorch
    and JAX compute it: the float16 mean of 262,144 values near 1 is near 1, not the inf
    its rounded sum would make it."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim)
    count = math.prod(x.shape[a] for a in axes)
    # the mean of nothing is nan, as in NumPy, PyTorch and JAX (a 0 would hide an empty batch)
    scale = 1.0 / count if count else math.nan
    if x._ir_dtype in ("bf16", "f16"):
        return astype(mul(sum(astype(x, "f32"), axes, keepdims), scale), x._ir_dtype)
    if x._ir_dtype == "bool":  # counted exactly (an int64 sum), then one float32 rounding
        total = astype(sum(x, axes, keepdims), "f32")
    else:
        total = sum(_float_input(x), axes, keepdims)
    return mul(total, scale)


@located
@refuse_torch_dim(variance_correction)
def var(x: TensorLike, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """var(x, axis=None, keepdims=False): population variance (ddof=0), as np.var."""
    centered = sub(x, mean(x, axis, keepdims=True))
    return mean(mul(centered, centered), axis, keepdims)


@located
@refuse_torch_dim(extremum_values_and_indices)
def max(x: TensorLike, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """max(x, axis=None, keepdims=False), as np.max (values only, no indices)."""
    x = as_tensor(x)
    return apply("max", [x], axes=normalize_axes(axis, x.ndim), keepdims=keepdims)


@located
@refuse_torch_dim(extremum_values_and_indices)
def min(x: TensorLike, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """min(x, axis=None, keepdims=False), as np.min (values only, no indices)."""
    return neg(max(neg(x), axis, keepdims))


@located
@torch_keywords
def logsumexp(x: TensorLike, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """logsumexp(x, axis=None, keepdims=False): log(sum(exp(x))) computed stably."""
    x = _float_input(x)
    return apply("logsumexp", [x], axes=normalize_axes(axis, x.ndim), keepdims=keepdims)


@located
@torch_keywords
def softmax(x: TensorLike, axis: int = -1) -> Tensor:
    """softmax(x, axis=-1); the axis is a keyword `dim` in PyTorch."""
    x = _float_input(x)
    return apply("softmax", [x], axis=normalize_axis(axis, x.ndim))


@located
@torch_keywords
def log_softmax(x: TensorLike, axis: int = -1) -> Tensor:
    """log_softmax(x, axis=-1), computed stably."""
    x = _float_input(x)
    return apply("log_softmax", [x], axis=normalize_axis(axis, x.ndim))


# ---- shapes -----------------------------------------------------------------------------------


@located
def reshape(x: TensorLike, *shape: int | Sequence[int]) -> Tensor:
    """reshape(x, shape) or reshape(x, *dims); one dimension may be -1. A view: no copy in
    compiled plans."""
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


@located
def transpose(x: TensorLike, *axes: int | Sequence[int]) -> Tensor:
    """transpose(x, axes=None) as np.transpose: reverse the axes, or permute them (also
    transpose(x, 1, 0, 2)). Two axes written apart, PyTorch's swap (x.transpose(0, 1)), are
    refused where NumPy's meaning differs (the identity on 2-d) or does not exist: swapaxes."""
    x = as_tensor(x)
    if len(axes) == 2 and all(isinstance(a, int) for a in axes):
        _refuse_torch_transpose(x, axes)
    return _permuted(x, axes)


@located
def permute(x: TensorLike, *axes: int | Sequence[int]) -> Tensor:
    """permute(x, *axes) as torch.permute (and np.transpose with axes): the axes in this order,
    given apart (permute(x, 2, 0, 1)) or as one sequence."""
    return _permuted(as_tensor(x), axes)


def _permuted(x: Tensor, axes: tuple) -> Tensor:
    if len(axes) == 1 and isinstance(axes[0], Sequence):
        axes = tuple(axes[0])
    perm = tuple(normalize_axis(a, x.ndim) for a in axes) if axes else tuple(range(x.ndim))[::-1]
    return apply("transpose", [x], perm=perm)


def _refuse_torch_transpose(x: Tensor, axes: tuple) -> None:
    """x.transpose(0, 1) swaps two axes in PyTorch; as np.transpose it is a permutation, the
    identity on a 2-d tensor: running it would silently give PyTorch users the wrong layout."""
    a, b = axes
    swap = f"Write x.swapaxes({a}, {b}) to swap two axes (x.T reverses them)"
    if x.ndim == 2 and {normalize_axis(a, 2), normalize_axis(b, 2)} == {0, 1}:
        if normalize_axis(a, 2) == 1:
            return  # (1, 0): the same swap in NumPy and PyTorch
        meaning = "as np.transpose it keeps the axes in place, as torch.transpose it swaps them"
        swap += f", or x.permute({a}, {b}) to keep them in place"
    else:
        meaning = f"as np.transpose it needs all {x.ndim} axes, as torch.transpose it swaps two"
    raise TypeError(
        f"transpose({a}, {b}) at {loc_text(user_frame_loc())} on a tensor of shape "
        f"{tuple(x.shape)}: {meaning}. {swap}"
    )


@located
def swapaxes(x: TensorLike, a: int, b: int) -> Tensor:
    """swapaxes(x, a, b): exchange two axes (torch.transpose(x, a, b))."""
    x = as_tensor(x)
    perm = list(range(x.ndim))
    a, b = normalize_axis(a, x.ndim), normalize_axis(b, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


@located
def broadcast_to(x: TensorLike, shape: Sequence[int]) -> Tensor:
    """broadcast_to(x, shape), as np.broadcast_to."""
    x = as_tensor(x)
    shape = tuple(shape)
    return x if shape == x.shape else apply("broadcast_to", [x], shape=shape)


@located
@torch_keywords
def expand_dims(x: TensorLike, axis: int) -> Tensor:
    """expand_dims(x, axis): a new axis of size 1 (bp.unsqueeze is the same function)."""
    x = as_tensor(x)
    axis = normalize_axis(axis, x.ndim + 1)
    return reshape(x, x.shape[:axis] + (1,) + x.shape[axis:])


unsqueeze = expand_dims


@located
@torch_keywords
def squeeze(x: TensorLike, axis: Axis = None) -> Tensor:
    """squeeze(x, axis=None): drop axes of size 1 (all of them, or the ones named, which
    must have size 1)."""
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


@located
@torch_keywords
def flatten(x: TensorLike, start_axis: int = 0) -> Tensor:
    """flatten(x, start_axis=0): merge the axes from start_axis on into one."""
    x = as_tensor(x)
    start = normalize_axis(start_axis, x.ndim) if x.ndim else 0
    return reshape(x, x.shape[:start] + (math.prod(x.shape[start:]),))  # -1: not when empty


@located
@torch_keywords
def concatenate(tensors: Sequence[TensorLike], axis: int = 0) -> Tensor:
    """concatenate(tensors, axis=0), as np.concatenate; dtypes promote."""
    tensors = [as_tensor(t) for t in tensors]
    if not tensors:
        raise ShapeError("concatenate needs at least one tensor")
    dtype = tensors[0]._ir_dtype
    for t in tensors[1:]:
        dtype = promote_types(dtype, t._ir_dtype)
    tensors = [astype(t, dtype) for t in tensors]
    return apply("concatenate", tensors, axis=normalize_axis(axis, tensors[0].ndim))


@located
@torch_keywords
def stack(tensors: Sequence[TensorLike], axis: int = 0) -> Tensor:
    """stack(tensors, axis=0), as np.stack: equal shapes, joined along a new axis."""
    tensors = [as_tensor(t) for t in tensors]
    if not tensors:
        raise ShapeError("stack needs at least one tensor")
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise ShapeError(f"stack needs equal shapes, got {sorted(shapes)}")
    axis = normalize_axis(axis, tensors[0].ndim + 1)
    return concatenate([expand_dims(t, axis) for t in tensors], axis)


@located
def matmul(a: TensorLike, b: TensorLike) -> Tensor:
    """a @ b with NumPy semantics: batched, broadcasting, 1-D operands as vectors."""
    a, b = _operands(a, b, "matmul")
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: operands must not be scalars, got {a.shape} @ {b.shape}")
    a2 = reshape(a, (1,) + a.shape) if a.ndim == 1 else a
    b2 = reshape(b, b.shape + (1,)) if b.ndim == 1 else b
    out = apply("matmul", [a2, b2])
    dropped = {out.ndim - 2} if a.ndim == 1 else set()
    dropped |= {out.ndim - 1} if b.ndim == 1 else set()
    return reshape(out, tuple(d for i, d in enumerate(out.shape) if i not in dropped))


@located
def take(x: TensorLike, indices: TensorLike, axis: int = 0) -> Tensor:
    """take(x, indices, axis=0): gather along one axis with integer indices (uint8, int32 or
    int64; negative ones count from the end), as np.take with an explicit axis."""
    x, indices = as_tensor(x), _index_tensor(indices)
    return apply("take", [x, indices], axis=normalize_axis(axis, x.ndim))


def _index_tensor(indices) -> Tensor:
    indices = as_tensor(indices)
    if indices._ir_dtype == "bool":
        raise DtypeError(
            "boolean mask indexing has a shape that depends on the data; use bp.where(mask, x, 0)"
        )
    if not is_int(indices._ir_dtype):
        raise DtypeError(f"indices must be integers, got {indices.dtype}")
    return indices


@located
def embedding(indices: TensorLike, weight: TensorLike) -> Tensor:
    """Rows of weight picked by integer indices: weight[indices]. The argument order is
    (indices, weight), as torch.nn.functional.embedding.

    >>> import backplan as bp
    >>> bp.embedding(bp.tensor([2, 0]), bp.tensor([[0.0], [1.0], [2.0]])).numpy().tolist()
    [[2.0], [0.0]]
    """
    indices, weight = as_tensor(indices), as_tensor(weight)
    if not is_int(indices._ir_dtype):
        swapped = is_int(weight._ir_dtype)
        hint = (
            "the arguments look swapped: " if swapped else ""
        ) + "the order is embedding(indices, weight), integer indices first"
        raise DtypeError(
            f"indices must be integers, got {indices.dtype} indices of shape {indices.shape} "
            f"and {weight.dtype} weight of shape {weight.shape}; {hint}"
        )
    return take(weight, indices, axis=0)


@located
def one_hot(labels: TensorLike, num_classes: int, dtype: DTypeLike = "float32") -> Tensor:
    """one_hot(labels, num_classes, dtype="float32"), as torch.nn.functional.one_hot (which
    returns int64); labels are integers in [0, num_classes)."""
    return apply("one_hot", [_index_tensor(labels)], depth=num_classes, dtype=dtype_name(dtype))


# ---- neural-network composites with their own registry entries ---------------------------------


@located
def cross_entropy(logits: TensorLike, labels: TensorLike, reduction: str = "mean") -> Tensor:
    """cross_entropy(logits, labels, reduction="mean"), as torch.nn.functional.cross_entropy:
    logits (..., C) first, integer class labels (...) second; reduction "mean", "sum" or
    "none"."""
    return apply(
        "cross_entropy", [_float_input(logits), _index_tensor(labels)], reduction=reduction
    )


@located
def layer_norm(
    x: TensorLike,
    weight: TensorLike | None = None,
    bias: TensorLike | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """layer_norm(x, weight=None, bias=None, eps=1e-5): normalise over the last axis, then
    scale and shift (torch's normalized_shape is always the last axis here). Saves x, not the
    normalised copy."""
    x = _float_input(x)
    _refuse_normalized_shape(weight, x)
    if (weight is None) != (bias is None):
        weight = weight if weight is not None else ones(x.shape[-1:], x._ir_dtype)
        bias = bias if bias is not None else zeros(x.shape[-1:], x._ir_dtype)
    inputs = [x] if weight is None else [x, astype(weight, x.dtype), astype(bias, x.dtype)]
    return apply("layer_norm", inputs, eps=float(eps))


def _refuse_normalized_shape(weight, x: Tensor) -> None:
    """torch's F.layer_norm(x, normalized_shape, weight, bias) passes a shape second, which here
    is the weight: refused naming both spellings (it failed later as a float() of the bias)."""
    if not isinstance(weight, tuple | list | int) or isinstance(weight, bool):
        return
    shape = tuple(weight) if isinstance(weight, tuple | list) else (weight,)
    call = "bp.layer_norm(x, weight, bias)"
    if len(shape) > 1:  # several normalised axes: flatten them into one, then reshape back
        call = (
            f"bp.layer_norm(x.reshape(*x.shape[:-{len(shape)}], -1), weight.reshape(-1), "
            "bias.reshape(-1)).reshape(x.shape)"
        )
    dims = ",".join(str(d) for d in x.shape)
    raise ShapeError(
        f"layer_norm({x._ir_dtype}[{dims}], {weight!r}, ...): the second argument is the weight, "
        "but a shape was passed (torch's F.layer_norm(x, normalized_shape, weight, bias)); "
        "backplan's layer_norm(x, weight=None, bias=None, eps=1e-5) always normalises the last "
        f"axis and takes no shape: call {call}"
    )


@located
def mse_loss(prediction: TensorLike, target: TensorLike) -> Tensor:
    """mse_loss(prediction, target): mean of squared differences, as torch's default.

    prediction and target must have one shape (a Python number as target is taken as is):
    a (N, 1) prediction against (N,) targets would broadcast to an (N, N) grid of every
    prediction against every target, a wrong loss that trains without an error (torch warns)."""
    prediction = as_tensor(prediction)
    if not isinstance(target, int | float):
        target = as_tensor(target)
        if target.shape != prediction.shape:
            raise ShapeError(_mse_shapes_differ(prediction, target))
    diff = sub(prediction, target)
    return mean(mul(diff, diff))


def _mse_shapes_differ(prediction: Tensor, target: Tensor) -> str:
    def typed(t: Tensor) -> str:
        return f"{t._ir_dtype}[{','.join(map(str, t.shape))}]"

    try:
        grid = np.broadcast_shapes(prediction.shape, target.shape)
        why = f"broadcast to {grid}, they would give a wrong loss that trains without an error"
    except ValueError:
        why = "they do not broadcast either"
    fix = ""
    if [d for d in target.shape if d != 1] == [d for d in prediction.shape if d != 1]:
        fix = f"; reshape the target: target.reshape({', '.join(map(str, prediction.shape))})"
    return (
        f"mse_loss({typed(prediction)}, {typed(target)}): prediction {prediction.shape} and "
        f"target {target.shape} differ in shape; {why}{fix}"
    )


# The public ops, re-exported by the face (`bp.exp`, ...): add a new op's function here too.
__all__ = [
    "abs",
    "add",
    "as_tensor",
    "astype",
    "broadcast_to",
    "cumsum",
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
