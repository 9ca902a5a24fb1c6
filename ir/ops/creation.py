"""Ops that make values: filled tensors, named constants, one-hot rows, dtype casts."""

import numpy as np

from ..errors import DtypeError, ShapeError
from ..index_check import check_in_range, label_message
from ..registry import AttrSpec, OpDef, register
from ..types import TensorType, is_float, is_int, np_dtype


def _full_infer(types, attrs):
    return TensorType(attrs["dtype"], attrs["shape"])


def _full_ref(value, shape, dtype):
    return np.full(shape, value, dtype=np_dtype(dtype))


register(
    OpDef(
        "full",
        (0,),
        _full_infer,
        _full_ref,
        "source",
        attrs={"value": AttrSpec("float"), "shape": AttrSpec("shape"), "dtype": AttrSpec("dtype")},
        doc="a tensor filled with one value (scalar constants are full with shape ())",
        cost="free",
    )
)


def _const_infer(types, attrs):
    return TensorType(attrs["dtype"], attrs["shape"])


def _const_ref(name, shape, dtype):
    raise RuntimeError("const is resolved by the interpreter from the graph's constants")


register(
    OpDef(
        "const",
        (0,),
        _const_infer,
        _const_ref,
        "source",
        attrs={"name": AttrSpec("str"), "shape": AttrSpec("shape"), "dtype": AttrSpec("dtype")},
        doc="an array captured at trace time, stored in the graph's constants table",
        cost="free",
    )
)


def _one_hot_infer(types, attrs):
    (labels,) = types
    if not is_int(labels.dtype):
        raise DtypeError(f"labels must be integers (u8, i32, i64), got {labels.dtype}")
    if attrs["depth"] < 0:
        raise ShapeError(f"depth must be non-negative, got {attrs['depth']}")
    return TensorType(attrs["dtype"], labels.shape + (attrs["depth"],))


def _one_hot_ref(labels, depth, dtype):
    check_in_range(labels, 0, depth, label_message)
    return (labels[..., None] == np.arange(depth)).astype(np_dtype(dtype))


register(
    OpDef(
        "one_hot",
        (1,),
        _one_hot_infer,
        _one_hot_ref,
        "elementwise",
        differentiable=False,
        attrs={"depth": AttrSpec("int"), "dtype": AttrSpec("dtype")},
        doc="one_hot(labels) with `depth` classes; no gradient",
    )
)


def _astype_infer(types, attrs):
    return TensorType(attrs["dtype"], types[0].shape)


def _astype_ref(x, dtype):
    return x.astype(np_dtype(dtype))


def _astype_vjp(ctx, g):
    src = ctx.in_type(0).dtype
    return [ctx.b.astype(g, dtype=src) if is_float(src) else None]


register(
    OpDef(
        "astype",
        (1,),
        _astype_infer,
        _astype_ref,
        "elementwise",
        _astype_vjp,
        attrs={"dtype": AttrSpec("dtype")},
        doc="cast; gradients flow between float dtypes only",
        scalar={"bool": "({0} != 0)", "*": "{np_type}({0})"},
        cost="cheap",
    )
)
