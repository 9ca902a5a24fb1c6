"""Array views made inside loop kernels from a 1-D base array, an element offset and sizes
(and byte strides): the form in which kernels take their arrays (codegen/placement.py). Loop
kernels that allocate nothing take each base as its address instead (the `_at` views, with the
dtype spelled out): every parameter is then an integer, and the kernel needs no CPython wrapper
(codegen/kernel_source.py).

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


def _address_of(context, builder, dtype, args) -> tuple:
    """(first element's address, its size in bytes) for an `_at` view's address and offset."""
    itemsize = context.get_constant(
        types.intp, context.get_abi_sizeof(context.get_data_type(dtype))
    )
    offset = builder.mul(args[1], itemsize)
    return builder.inttoptr(
        builder.add(args[0], offset), context.get_data_type(dtype).as_pointer()
    ), itemsize


def _is_address_view(address, offset, shape, dtype) -> bool:
    return (
        isinstance(address, types.Integer)
        and isinstance(offset, types.Integer)
        and isinstance(shape, types.BaseTuple)
        and len(shape) > 0
        and all(isinstance(t, types.Integer) for t in shape)
        and isinstance(dtype, types.NumberClass)
    )


def _build_at(context, builder, result_type, data, itemsize, shape, strides):
    view = make_array(result_type)(context, builder)
    populate_array(
        view, data=data, shape=shape, strides=strides, itemsize=itemsize, meminfo=None, parent=None
    )
    return view._getvalue()


@intrinsic
def address(typingctx, array):
    """The address of an array's first element, as an integer."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, context.get_value_type(types.intp))

    return types.intp(array), codegen


@intrinsic
def contiguous_view_at(typingctx, address, offset, shape, dtype):
    """The C-contiguous array of this dtype and shape at element `offset` from `address`."""
    if not _is_address_view(address, offset, shape, dtype):
        return None
    result_type = types.Array(dtype.instance_type, len(shape), "C")

    def codegen(context, builder, signature, args):
        sizes = _sizes(context, builder, signature.args[2], args[2])
        data, itemsize = _address_of(context, builder, result_type.dtype, args)
        strides, stride = [], itemsize
        for size in reversed(sizes):
            strides.insert(0, stride)
            stride = builder.mul(stride, size)
        return _build_at(context, builder, result_type, data, itemsize, sizes, strides)

    return result_type(types.intp, types.intp, shape, dtype), codegen


@intrinsic
def strided_view_at(typingctx, address, offset, shape, strides, dtype):
    """The view of this dtype at element `offset` from `address`, with these byte strides."""
    if not (
        _is_address_view(address, offset, shape, dtype) and isinstance(strides, types.BaseTuple)
    ):
        return None
    if len(strides) != len(shape) or not all(isinstance(t, types.Integer) for t in strides):
        return None
    result_type = types.Array(dtype.instance_type, len(shape), "A")

    def codegen(context, builder, signature, args):
        sizes = _sizes(context, builder, signature.args[2], args[2])
        steps = _sizes(context, builder, signature.args[3], args[3])
        data, itemsize = _address_of(context, builder, result_type.dtype, args)
        return _build_at(context, builder, result_type, data, itemsize, sizes, steps)

    return result_type(types.intp, types.intp, shape, strides, dtype), codegen


def _pointer(context, builder, dtype, address, offset, in_bytes: bool):
    element = context.get_data_type(dtype)
    if in_bytes:
        return builder.inttoptr(builder.add(address, offset), element.as_pointer())
    return builder.gep(builder.inttoptr(address, element.as_pointer()), [offset])


def _load(in_bytes: bool):
    def load(typingctx, address, offset, dtype):
        if not (
            isinstance(address, types.Integer)
            and isinstance(offset, types.Integer)
            and isinstance(dtype, types.NumberClass)
        ):
            return None
        kind = dtype.instance_type

        def codegen(context, builder, signature, args):
            where = _pointer(context, builder, kind, args[0], args[1], in_bytes)
            return context.data_model_manager[kind].from_data(builder, builder.load(where))

        return kind(types.intp, types.intp, dtype), codegen

    return load


def _store(in_bytes: bool):
    def store(typingctx, address, offset, value, dtype):
        if not (
            isinstance(address, types.Integer)
            and isinstance(offset, types.Integer)
            and isinstance(dtype, types.NumberClass)
        ):
            return None
        kind = dtype.instance_type

        def codegen(context, builder, signature, args):
            where = _pointer(context, builder, kind, args[0], args[1], in_bytes)
            item = context.cast(builder, args[2], signature.args[2], kind)
            builder.store(context.data_model_manager[kind].as_data(builder, item), where)
            return context.get_dummy_value()

        return types.none(types.intp, types.intp, value, dtype), codegen

    return store


load = intrinsic(_load(in_bytes=False))
load.__doc__ = "The element at `index` of the dtype's elements from `address`."
load_bytes = intrinsic(_load(in_bytes=True))
load_bytes.__doc__ = "The element of this dtype `offset` bytes from `address`."
store = intrinsic(_store(in_bytes=False))
store.__doc__ = "Writes value, as the dtype, to element `index` from `address`."
store_bytes = intrinsic(_store(in_bytes=True))
store_bytes.__doc__ = "Writes value, as the dtype, `offset` bytes from `address`."


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

    def address(array):  # noqa: F811
        return array.ctypes.data

    def contiguous_view_at(address, offset, shape, dtype):  # noqa: F811
        return _numpy_view_at(address, offset, shape, None, dtype)

    def strided_view_at(address, offset, shape, strides, dtype):  # noqa: F811
        return _numpy_view_at(address, offset, shape, strides, dtype)

    def load(address, index, dtype):  # noqa: F811
        return _numpy_view_at(address, index, (1,), None, dtype)[0]

    def load_bytes(address, offset, dtype):  # noqa: F811
        return _numpy_view_at(address + offset, 0, (1,), None, dtype)[0]

    def store(address, index, value, dtype):  # noqa: F811
        _numpy_view_at(address, index, (1,), None, dtype)[0] = value

    def store_bytes(address, offset, value, dtype):  # noqa: F811
        _numpy_view_at(address + offset, 0, (1,), None, dtype)[0] = value


def _numpy_view_at(address, offset, shape, strides, dtype):
    """The NumPy twin of an `_at` view: the memory at an address seen as an array."""
    import ctypes

    itemsize = np.dtype(dtype).itemsize
    if strides is None:
        strides = tuple(itemsize * math.prod(shape[k + 1 :]) for k in range(len(shape)))
    steps = [(n - 1) * s for n, s in zip(shape, strides, strict=True)] if 0 not in shape else []
    low, high = sum(s for s in steps if s < 0), sum(s for s in steps if s > 0) + itemsize
    start = int(address) + int(offset) * itemsize + low
    memory = (ctypes.c_char * (high - low)).from_address(start)
    return np.ndarray(shape, dtype, buffer=memory, offset=-low, strides=strides)


__all__ = [
    "address",
    "contiguous_view",
    "contiguous_view_at",
    "load",
    "load_bytes",
    "store",
    "store_bytes",
    "strided_view",
    "strided_view_at",
]
