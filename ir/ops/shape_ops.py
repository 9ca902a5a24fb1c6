"""Ops that move data without arithmetic: reshape, transpose, broadcast, slicing, gather, concat."""

import numpy as np

from ..errors import DtypeError, ShapeError
from ..index_check import check_in_range, index_message
from ..registry import AttrSpec, OpDef, register
from ..shapes import broadcast_shapes, fmt, normalize_axis
from ..types import TensorType, is_int


def _size(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ---- stop_gradient ----------------------------------------------------------------------------

register(
    OpDef(
        "stop_gradient",
        (1,),
        lambda types, attrs: types[0],
        lambda x: x,
        "view",
        differentiable=False,
        doc="identity whose gradient is zero: detach() in a trace",
        cost="free",
        alias=True,
    )
)


# ---- reshape ----------------------------------------------------------------------------------


def _reshape_infer(types, attrs):
    (x,) = types
    if _size(x.shape) != _size(attrs["shape"]):
        raise ShapeError(f"cannot reshape {fmt(x.shape)} into {fmt(attrs['shape'])}")
    return TensorType(x.dtype, attrs["shape"])


def _reshape_vjp(ctx, g):
    return [ctx.b.reshape(g, shape=ctx.in_type(0).shape)]


register(
    OpDef(
        "reshape",
        (1,),
        _reshape_infer,
        lambda x, shape: np.reshape(x, shape),
        "view",
        _reshape_vjp,
        attrs={"shape": AttrSpec("shape")},
        doc="saves nothing",
        cost="free",
    )
)


# ---- transpose --------------------------------------------------------------------------------


def _transpose_infer(types, attrs):
    (x,) = types
    perm = attrs["perm"]
    if sorted(perm) != list(range(len(x.shape))):
        raise ShapeError(f"perm {perm} is not a permutation of the axes of {fmt(x.shape)}")
    return TensorType(x.dtype, tuple(x.shape[p] for p in perm))


def _transpose_vjp(ctx, g):
    perm = ctx.attrs["perm"]
    inverse = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    return [ctx.b.transpose(g, perm=inverse)]


register(
    OpDef(
        "transpose",
        (1,),
        _transpose_infer,
        lambda x, perm: np.transpose(x, perm),
        "view",
        _transpose_vjp,
        attrs={"perm": AttrSpec("ints")},
        doc="saves nothing",
        cost="free",
    )
)


# ---- broadcast_to -----------------------------------------------------------------------------


def _broadcast_infer(types, attrs):
    (x,) = types
    shape = attrs["shape"]
    if len(shape) < len(x.shape) or broadcast_shapes(x.shape, shape) != shape:
        raise ShapeError(f"cannot broadcast {fmt(x.shape)} to {fmt(shape)}")
    return TensorType(x.dtype, shape)


def _broadcast_vjp(ctx, g):
    return [ctx.b.sum_to(g, ctx.in_type(0).shape)]


register(
    OpDef(
        "broadcast_to",
        (1,),
        _broadcast_infer,
        lambda x, shape: np.broadcast_to(x, shape),
        "view",
        _broadcast_vjp,
        attrs={"shape": AttrSpec("shape")},
        doc="saves nothing",
        cost="free",
        alias=True,
    )
)


# ---- slice and its adjoint pad_slice ----------------------------------------------------------

SLICE_ATTRS = {"starts": AttrSpec("ints"), "stops": AttrSpec("ints"), "steps": AttrSpec("ints")}


def _slice_lengths(shape, starts, stops, steps):
    if not len(shape) == len(starts) == len(stops) == len(steps):
        raise ShapeError(f"slice needs one start, stop and step per axis of {fmt(shape)}")
    out = []
    for dim, start, stop, step in zip(shape, starts, stops, steps, strict=True):
        if step == 0:
            raise ShapeError("slice step cannot be zero")
        count = len(range(start, stop, step))
        if not (0 <= start <= dim and -1 <= stop <= dim) or (count and start == dim):
            raise ShapeError(f"slice {start}:{stop}:{step} is out of range for size {dim}")
        out.append(count)
    return tuple(out)


def _slices(starts, stops, steps):
    return tuple(
        slice(a, None if b < 0 else b, c) for a, b, c in zip(starts, stops, steps, strict=True)
    )


def _slice_infer(types, attrs):
    (x,) = types
    return TensorType(
        x.dtype, _slice_lengths(x.shape, attrs["starts"], attrs["stops"], attrs["steps"])
    )


def _slice_ref(x, starts, stops, steps):
    return x[_slices(starts, stops, steps)]


def _slice_vjp(ctx, g):
    a = ctx.attrs
    return [
        ctx.b.pad_slice(
            g, shape=ctx.in_type(0).shape, starts=a["starts"], stops=a["stops"], steps=a["steps"]
        )
    ]


register(
    OpDef(
        "slice",
        (1,),
        _slice_infer,
        _slice_ref,
        "view",
        _slice_vjp,
        attrs=SLICE_ATTRS,
        doc="basic slicing, normalised to start/stop/step per axis; saves nothing",
        cost="free",
    )
)


def _pad_slice_infer(types, attrs):
    (g,) = types
    lengths = _slice_lengths(attrs["shape"], attrs["starts"], attrs["stops"], attrs["steps"])
    if lengths != g.shape:
        raise ShapeError(f"pad_slice of {fmt(g.shape)} does not match the slice {fmt(lengths)}")
    return TensorType(g.dtype, attrs["shape"])


def _pad_slice_ref(g, shape, starts, stops, steps):
    out = np.zeros(shape, dtype=g.dtype)
    out[_slices(starts, stops, steps)] = g
    return out


def _pad_slice_vjp(ctx, g):
    a = ctx.attrs
    return [ctx.b.slice(g, starts=a["starts"], stops=a["stops"], steps=a["steps"])]


register(
    OpDef(
        "pad_slice",
        (1,),
        _pad_slice_infer,
        _pad_slice_ref,
        "opaque",
        _pad_slice_vjp,
        attrs={"shape": AttrSpec("shape"), **SLICE_ATTRS},
        doc="zeros of `shape` with the input written into a slice (slice's adjoint)",
    )
)


# ---- concatenate ------------------------------------------------------------------------------


def _concat_infer(types, attrs):
    first = types[0]
    axis = normalize_axis(attrs["axis"], len(first.shape))
    if attrs["axis"] != axis:
        raise ShapeError(f"axis must be non-negative, got {attrs['axis']}")
    for t in types[1:]:
        if t.dtype != first.dtype:
            raise DtypeError(f"inputs have dtypes {first.dtype} and {t.dtype}")
        if len(t.shape) != len(first.shape) or any(
            a != b for i, (a, b) in enumerate(zip(t.shape, first.shape, strict=True)) if i != axis
        ):
            raise ShapeError(
                f"cannot concatenate {fmt(first.shape)} and {fmt(t.shape)} on axis {axis}"
            )
    shape = list(first.shape)
    shape[axis] = sum(t.shape[axis] for t in types)
    return TensorType(first.dtype, tuple(shape))


def _concat_vjp(ctx, g):
    axis, grads, offset = ctx.attrs["axis"], [], 0
    for i, need in enumerate(ctx.needs):
        shape = ctx.in_type(i).shape
        if need:
            starts = tuple(offset if a == axis else 0 for a in range(len(shape)))
            stops = tuple(offset + d if a == axis else d for a, d in enumerate(shape))
            grads.append(ctx.b.slice(g, starts=starts, stops=stops, steps=(1,) * len(shape)))
        else:
            grads.append(None)
        offset += shape[axis]
    return grads


register(
    OpDef(
        "concatenate",
        None,
        _concat_infer,
        lambda *xs, axis: np.concatenate(xs, axis=axis),
        "opaque",
        _concat_vjp,
        attrs={"axis": AttrSpec("int")},
        doc="saves nothing",
    )
)


# ---- take (gather along one axis) and its adjoint take_grad (scatter-add) ---------------------


def _check_index(idx):
    if not is_int(idx.dtype):
        raise DtypeError(f"indices must be integers (u8, i32, i64), got {idx.dtype}")


def _take_infer(types, attrs):
    x, idx = types
    _check_index(idx)
    axis = attrs["axis"]
    if not 0 <= axis < len(x.shape):
        raise ShapeError(f"axis {axis} is out of range for {fmt(x.shape)}")
    return TensorType(x.dtype, x.shape[:axis] + idx.shape + x.shape[axis + 1 :])


def checked_indices(idx, size):
    check_in_range(idx, -size, size, index_message)
    return np.where(idx < 0, idx + size, idx)


def _take_ref(x, idx, axis):
    return np.take(x, checked_indices(idx, x.shape[axis]), axis=axis)


def _take_vjp(ctx, g):
    axis = ctx.attrs["axis"]
    size = ctx.in_type(0).shape[axis]
    return [ctx.b.take_grad(g, ctx.input(1), axis=axis, size=size), None]


register(
    OpDef(
        "take",
        (2,),
        _take_infer,
        _take_ref,
        "opaque",
        _take_vjp,
        attrs={"axis": AttrSpec("int")},
        doc="gather along one axis (integer-array indexing, embedding); saves the indices",
    )
)


def _take_grad_infer(types, attrs):
    g, idx = types
    _check_index(idx)
    axis, k = attrs["axis"], len(idx.shape)
    if not 0 <= axis <= len(g.shape) - k or attrs["size"] < 0:
        raise ShapeError(f"axis {axis} and size {attrs['size']} do not fit {fmt(g.shape)}")
    if g.shape[axis : axis + k] != idx.shape:
        raise ShapeError(f"take_grad of {fmt(g.shape)} does not match indices {fmt(idx.shape)}")
    return TensorType(g.dtype, g.shape[:axis] + (attrs["size"],) + g.shape[axis + k :])


def _take_grad_ref(g, idx, axis, size):
    k = idx.ndim
    shape = g.shape[:axis] + (size,) + g.shape[axis + k :]
    out = np.zeros(shape, dtype=g.dtype)
    idx = checked_indices(idx, size)
    moved = np.moveaxis(out, axis, 0)
    flat = g.reshape(g.shape[:axis] + (idx.size,) + g.shape[axis + k :])  # -1 fails on empty
    g_moved = np.moveaxis(flat, axis, 0)
    np.add.at(moved, idx.reshape(-1), g_moved)
    return out


def _take_grad_vjp(ctx, g):
    return [ctx.b.take(g, ctx.input(1), axis=ctx.attrs["axis"]), None]


register(
    OpDef(
        "take_grad",
        (2,),
        _take_grad_infer,
        _take_grad_ref,
        "opaque",
        _take_grad_vjp,
        attrs={"axis": AttrSpec("int"), "size": AttrSpec("int")},
        doc="scatter-add into zeros (take's adjoint); saves the indices",
    )
)
