"""Array views made inside loop kernels from a 1-D base array, an element offset and sizes
(and byte strides): the form in which kernels take their arrays (codegen/placement.py).

Intrinsics, because a view made with slicing and reshape costs Numba's lowering of a slice
normalisation and a reshape check for every array of every kernel (measured: loop kernels of an
unrolled LSTM compiled about a third slower that way); these build the array structure
directly, a few instructions each. Nothing is checked: the code generator computed the offsets
and sizes from the plan's memory layout. A contiguous view is typed C-contiguous, so the loops
over it vectorise as they do over any C array."""

import math

import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic
from numba.core.imputils import impl_ret_borrowed
from numba.core.ir_utils import _add_alias, alias_func_extensions
from numba.np.arrayobj import make_array, populate_array

from .jit import AS_PYTHON


def _sizes(context, builder, tuple_type, value):
    return [
        context.cast(builder, item, item_type, types.intp)
        for item, item_type in zip(cgutils.unpack_tuple(builder, value), tuple_type, strict=True)
    ]


def _is_base(base, offset, shape) -> bool:
    return (
        isinstance(base, types.Array)
        and base.ndim == 1
        and base.layout == "C"
        and isinstance(offset, types.Integer)
        and isinstance(shape, types.BaseTuple)
        and len(shape) > 0
        and all(isinstance(t, types.Integer) for t in shape)
    )


def _build(context, builder, base_type, result_type, base, offset, shape, strides):
    source = make_array(base_type)(context, builder, base)
    data = builder.gep(source.data, [offset])
    view = make_array(result_type)(context, builder)
    populate_array(
        view,
        data=data,
        shape=shape,
        strides=strides,
        itemsize=source.itemsize,
        meminfo=source.meminfo,
        parent=source.parent,
    )
    return impl_ret_borrowed(context, builder, result_type, view._getvalue())


@intrinsic
def contiguous_view(typingctx, base, offset, shape):
    """base[offset : offset + prod(shape)].reshape(shape), typed C-contiguous."""
    if not _is_base(base, offset, shape):
        return None
    result_type = base.copy(ndim=len(shape), layout="C")

    def codegen(context, builder, signature, args):
        base_type, offset_type, shape_type = signature.args
        start = context.cast(builder, args[1], offset_type, types.intp)
        sizes = _sizes(context, builder, shape_type, args[2])
        itemsize = context.get_constant(
            types.intp, context.get_abi_sizeof(context.get_data_type(base_type.dtype))
        )
        strides, stride = [], itemsize
        for size in reversed(sizes):
            strides.insert(0, stride)
            stride = builder.mul(stride, size)
        return _build(context, builder, base_type, result_type, args[0], start, sizes, strides)

    return result_type(base, offset, shape), codegen


@intrinsic
def strided_view(typingctx, base, offset, shape, strides):
    """The view at element `offset` of base with these sizes and byte strides."""
    if not (_is_base(base, offset, shape) and isinstance(strides, types.BaseTuple)):
        return None
    if len(strides) != len(shape) or not all(isinstance(t, types.Integer) for t in strides):
        return None
    result_type = base.copy(ndim=len(shape), layout="A")

    def codegen(context, builder, signature, args):
        base_type, offset_type, shape_type, strides_type = signature.args
        start = context.cast(builder, args[1], offset_type, types.intp)
        sizes = _sizes(context, builder, shape_type, args[2])
        steps = _sizes(context, builder, strides_type, args[3])
        return _build(context, builder, base_type, result_type, args[0], start, sizes, steps)

    return result_type(base, offset, shape, strides), codegen


def _aliases_its_base(lhs, args, alias_map, arg_aliases):
    """Tell Numba's alias analysis that a view aliases its base: without this, parfor passes
    take a view for a fresh array and drop stores into it as dead (wrong results)."""
    _add_alias(lhs, args[0].name, alias_map, arg_aliases)


for _view in (contiguous_view, strided_view):
    alias_func_extensions[(_view.__name__, __name__)] = _aliases_its_base


if AS_PYTHON:

    def contiguous_view(base, offset, shape):  # noqa: F811 - the NumPy twins
        return base[offset : offset + math.prod(shape)].reshape(shape)

    def strided_view(base, offset, shape, strides):  # noqa: F811
        return np.lib.stride_tricks.as_strided(base[offset:], shape, strides)


__all__ = ["contiguous_view", "strided_view"]
