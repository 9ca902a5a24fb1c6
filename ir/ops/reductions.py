"""Reductions over axes, with keepdims. mean is sum times a constant, built by the tracer."""

import numpy as np

from ..errors import ShapeError
from ..registry import AttrSpec, OpDef, register
from ..shapes import normalize_axes, reduced_shape
from ..types import TensorType
from .common import numeric_only

REDUCE_ATTRS = {"axes": AttrSpec("axes"), "keepdims": AttrSpec("bool", False, required=False)}


def _reduce_infer(name):
    def infer(types, attrs):
        (x,) = types
        numeric_only(types, name)
        axes = normalize_axes(attrs["axes"], len(x.shape))
        if tuple(attrs["axes"]) != axes:
            raise ShapeError(f"axes must be sorted and non-negative, got {attrs['axes']}")
        if name == "max" and any(x.shape[a] == 0 for a in axes):
            raise ShapeError(f"max over an empty axis of shape {x.shape}")
        return TensorType(x.dtype, reduced_shape(x.shape, axes, attrs["keepdims"]))

    return infer


def _sum_ref(x, axes, keepdims):
    return np.sum(x, axis=axes, keepdims=keepdims, dtype=x.dtype)


def _max_ref(x, axes, keepdims):
    return np.max(x, axis=axes, keepdims=keepdims)


def _sum_vjp(ctx, g):
    b, x = ctx.b, ctx.in_type(0)
    g = b.keepdims_like(g, ctx.attrs["axes"], len(x.shape))
    return [b.broadcast_to(g, shape=x.shape)]


def _max_vjp(ctx, g):
    """Ties share the gradient evenly, as torch.amax does."""
    b, x_type, axes = ctx.b, ctx.in_type(0), ctx.attrs["axes"]
    ndim = len(x_type.shape)
    x = ctx.input(0)
    out = b.keepdims_like(ctx.output(), axes, ndim)
    mask = b.astype(b.eq(x, out), dtype=g.dtype)
    count = b.sum(mask, axes=axes, keepdims=True)
    g = b.keepdims_like(g, axes, ndim)
    return [b.mul(mask, b.div(g, count))]


register(
    OpDef(
        "sum",
        (1,),
        _reduce_infer("sum"),
        _sum_ref,
        "reduction",
        _sum_vjp,
        attrs=REDUCE_ATTRS,
        doc="saves nothing",
        loop_tail=True,
    )
)
register(
    OpDef(
        "max",
        (1,),
        _reduce_infer("max"),
        _max_ref,
        "reduction",
        _max_vjp,
        attrs=REDUCE_ATTRS,
        doc="saves input and output to find the maxima",
        loop_tail=True,
    )
)


def _arg_infer(types, attrs):
    (x,) = types
    numeric_only(types, "argmax")
    axis = attrs["axis"]
    if not 0 <= axis < len(x.shape):
        raise ShapeError(f"axis must be in [0, {len(x.shape)}), got {axis}")
    if x.shape[axis] == 0:
        raise ShapeError(f"needs a non-empty axis, got shape {x.shape}")
    return TensorType("i64", reduced_shape(x.shape, (axis,), attrs["keepdims"]))


def _argmax_ref(x, axis, keepdims):
    return np.argmax(x, axis=axis, keepdims=keepdims).astype(np.int64)


def _argmin_ref(x, axis, keepdims):
    return np.argmin(x, axis=axis, keepdims=keepdims).astype(np.int64)


ARG_ATTRS = {"axis": AttrSpec("int"), "keepdims": AttrSpec("bool", False, required=False)}
for _name, _ref in (("argmax", _argmax_ref), ("argmin", _argmin_ref)):
    register(
        OpDef(
            _name,
            (1,),
            _arg_infer,
            _ref,
            "opaque",
            differentiable=False,
            attrs=ARG_ATTRS,
            doc="index of the first extreme along one axis (a NaN counts as extreme); no gradient",
        )
    )


def _cumsum_infer(types, attrs):
    (x,) = types
    numeric_only(types, "cumsum")
    if x.dtype not in ("f32", "f64", "bf16", "f16", "i64"):
        raise ShapeError(f"sums in f32, f64 or i64 (cast {x.dtype} first), got {x.dtype}")
    axis = attrs["axis"]
    if not 0 <= axis < len(x.shape):
        raise ShapeError(f"axis must be in [0, {len(x.shape)}), got {axis} for shape {x.shape}")
    return x


def _cumsum_ref(x, axis, reverse):
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis, dtype=x.dtype), axis).copy()
    return np.cumsum(x, axis, dtype=x.dtype)


def _cumsum_vjp(ctx, g):
    """Each output sums the inputs up to it, so each input's gradient sums the output
    gradients from it on: the same scan run the other way. Saves nothing."""
    attrs = ctx.attrs
    return [ctx.b.cumsum(g, axis=attrs["axis"], reverse=not attrs["reverse"])]


register(
    OpDef(
        "cumsum",
        (1,),
        _cumsum_infer,
        _cumsum_ref,
        "opaque",
        _cumsum_vjp,
        attrs={"axis": AttrSpec("int"), "reverse": AttrSpec("bool", False, required=False)},
        doc="running sum along one axis (reverse: from the end); saves nothing",
        cost="one_pass",
    )
)
