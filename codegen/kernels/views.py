"""Array views made inside loop kernels from a 1-D base array, an element offset and sizes
(and byte strides): the form in which kernels take their arrays (codegen/render/placement.py). The
loop of a kernel that allocates nothing also comes in a form taking each base as its address
(a void pointer; an integer from Python), with the dtype spelled out: a view's `origin`, loads
and stores from it, or the `_at` views; such a loop needs no CPython wrapper
(codegen/render/kernel_source.py, codegen/render/address_loops.py).

Intrinsics, because a view made with slicing and reshape costs Numba's lowering of a slice
normalisation and a reshape check for every array of every kernel (measured: loop kernels of an
unrolled LSTM compiled about a third slower that way); these build the array structure
directly, a few instructions each. Nothing is checked: the code generator computed the offsets
and sizes from the plan's memory layout. A contiguous view is typed C-contiguous, so the loops
over it vectorise as they do over any C array."""

import functools
import math

import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.extending import overload
from numba.core.imputils import impl_ret_borrowed
from numba.core.ir_utils import _add_alias, alias_func_extensions
from numba.np.arrayobj import make_array, populate_array

from backplan.codegen.jit import AS_PYTHON
from backplan.codegen.kernels.intrinsics import intrinsic


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


def _build(context, builder, base_type, result_type, base, offset, shape, strides, item=None):
    """The view's array struct over base's memory from offset; `item` reads the bytes as
    another dtype of the same size (a pointer cast, no copy)."""
    source = make_array(base_type)(context, builder, base)
    data = builder.gep(source.data, [offset])
    if item is not None:
        data = builder.bitcast(data, context.get_data_type(item).as_pointer())
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


def _c_strides(context, builder, base_type, sizes) -> list:
    """Byte strides of a C-contiguous array of base's items with these sizes."""
    itemsize = context.get_constant(
        types.intp, context.get_abi_sizeof(context.get_data_type(base_type.dtype))
    )
    strides, stride = [], itemsize
    for size in reversed(sizes):
        strides.insert(0, stride)
        stride = builder.mul(stride, size)
    return strides


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
        strides = _c_strides(context, builder, base_type, sizes)
        return _build(context, builder, base_type, result_type, args[0], start, sizes, strides)

    return result_type(base, offset, shape), codegen


@intrinsic
def contiguous_bits_view(typingctx, base, offset, shape, dtype):
    """contiguous_view(base, offset, shape).view(dtype) for a dtype of base's item size (float16
    bits as int16, the GEMM's mark for them). Numba's `.view` in a generated kernel kept a
    reference to every array the kernel was passed, at every call: a float16 plan's arrays were
    never freed."""
    is_dtype = isinstance(dtype, (types.DTypeSpec, types.NumberClass))
    if not _is_base(base, offset, shape) or not is_dtype:
        return None
    item = dtype.dtype
    if not isinstance(item, types.Integer) or item.bitwidth != getattr(base.dtype, "bitwidth", 0):
        return None
    result_type = base.copy(dtype=item, ndim=len(shape), layout="C")

    def codegen(context, builder, signature, args):
        base_type, offset_type, shape_type, _ = signature.args
        start = context.cast(builder, args[1], offset_type, types.intp)
        sizes = _sizes(context, builder, shape_type, args[2])
        strides = _c_strides(context, builder, base_type, sizes)
        return _build(
            context, builder, base_type, result_type, args[0], start, sizes, strides, item
        )

    return result_type(base, offset, shape, dtype), codegen


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


def _element(context, builder, dtype, address, offset, in_bytes: bool = False):
    """The pointer to the element `offset` elements (or bytes) from `address`, a void pointer."""
    element = context.get_data_type(dtype).as_pointer()
    if in_bytes:
        return builder.bitcast(builder.gep(address, [offset], inbounds=True), element)
    return builder.gep(builder.bitcast(address, element), [offset], inbounds=True)


def _is_address(address, offset, dtype) -> bool:
    return (
        address == types.voidptr
        and isinstance(offset, types.Integer)
        and isinstance(dtype, types.NumberClass)
    )


def _is_shape(shape) -> bool:
    return (
        isinstance(shape, types.BaseTuple)
        and len(shape) > 0
        and all(isinstance(t, types.Integer) for t in shape)
    )


def _build_at(context, builder, result_type, data, shape, strides):
    view = make_array(result_type)(context, builder)
    itemsize = context.get_constant(
        types.intp, context.get_abi_sizeof(context.get_data_type(result_type.dtype))
    )
    populate_array(
        view, data=data, shape=shape, strides=strides, itemsize=itemsize, meminfo=None, parent=None
    )
    return view._getvalue()


@intrinsic
def contiguous_view_at(typingctx, address, offset, shape, dtype):
    """The C-contiguous array of this dtype and shape at element `offset` from `address`."""
    if not (_is_address(address, offset, dtype) and _is_shape(shape)):
        return None
    result_type = types.Array(dtype.instance_type, len(shape), "C")

    def codegen(context, builder, signature, args):
        sizes = _sizes(context, builder, signature.args[2], args[2])
        start = context.cast(builder, args[1], signature.args[1], types.intp)
        data = _element(context, builder, result_type.dtype, args[0], start)
        itemsize = context.get_abi_sizeof(context.get_data_type(result_type.dtype))
        strides, stride = [], context.get_constant(types.intp, itemsize)
        for size in reversed(sizes):
            strides.insert(0, stride)
            stride = builder.mul(stride, size)
        return _build_at(context, builder, result_type, data, sizes, strides)

    return result_type(address, offset, shape, dtype), codegen


@intrinsic
def strided_view_at(typingctx, address, offset, shape, strides, dtype):
    """The view of this dtype at element `offset` from `address`, with these byte strides."""
    if not (_is_address(address, offset, dtype) and _is_shape(shape) and _is_shape(strides)):
        return None
    if len(strides) != len(shape):
        return None
    result_type = types.Array(dtype.instance_type, len(shape), "A")

    def codegen(context, builder, signature, args):
        sizes = _sizes(context, builder, signature.args[2], args[2])
        steps = _sizes(context, builder, signature.args[3], args[3])
        start = context.cast(builder, args[1], signature.args[1], types.intp)
        data = _element(context, builder, result_type.dtype, args[0], start)
        return _build_at(context, builder, result_type, data, sizes, steps)

    return result_type(address, offset, shape, strides, dtype), codegen


@intrinsic
def origin(typingctx, address, offset, dtype):
    """The typed pointer to element `offset` of the dtype's elements from `address`: a view's
    first element, which loads and stores index from."""
    if not _is_address(address, offset, dtype):
        return None
    result_type = types.CPointer(dtype.instance_type)

    def codegen(context, builder, signature, args):
        start = context.cast(builder, args[1], signature.args[1], types.intp)
        return _element(context, builder, dtype.instance_type, args[0], start)

    return result_type(address, offset, dtype), codegen


def _is_pointer(pointer, offset) -> bool:
    return isinstance(pointer, types.CPointer) and isinstance(offset, types.Integer)


def _at(context, builder, signature, args, in_bytes: bool):
    kind = signature.args[0].dtype
    offset = context.cast(builder, args[1], signature.args[1], types.intp)
    if not in_bytes:
        return kind, builder.gep(args[0], [offset], inbounds=True)
    byte = builder.bitcast(args[0], context.get_value_type(types.voidptr))
    where = builder.gep(byte, [offset], inbounds=True)
    return kind, builder.bitcast(where, args[0].type)


def _load(in_bytes: bool):
    def load(typingctx, pointer, offset):
        if not _is_pointer(pointer, offset):
            return None

        def codegen(context, builder, signature, args):
            kind, where = _at(context, builder, signature, args, in_bytes)
            return context.data_model_manager[kind].from_data(builder, builder.load(where))

        return pointer.dtype(pointer, offset), codegen

    return load


def _store(in_bytes: bool):
    def store(typingctx, pointer, offset, value):
        if not _is_pointer(pointer, offset):
            return None

        def codegen(context, builder, signature, args):
            kind, where = _at(context, builder, signature, args, in_bytes)
            item = context.cast(builder, args[2], signature.args[2], kind)
            builder.store(context.data_model_manager[kind].as_data(builder, item), where)
            return context.get_dummy_value()

        return types.none(pointer, offset, value), codegen

    return store


load = intrinsic(_load(in_bytes=False))
load.__doc__ = "The element at `index` from a view's origin."
load_bytes = intrinsic(_load(in_bytes=True))
load_bytes.__doc__ = "The element `offset` bytes from a view's origin."
store = intrinsic(_store(in_bytes=False))
store.__doc__ = "Writes value, cast to the element type, to element `index` from an origin."
store_bytes = intrinsic(_store(in_bytes=True))
store_bytes.__doc__ = "Writes value, cast to the element type, `offset` bytes from an origin."


def _aliases_its_base(lhs, args, alias_map, arg_aliases):
    """Tell Numba's alias analysis that a view aliases its base: without this, parfor passes
    take a view for a fresh array and drop stores into it as dead (wrong results)."""
    _add_alias(lhs, args[0].name, alias_map, arg_aliases)


for _view in (contiguous_view, contiguous_bits_view, strided_view):
    alias_func_extensions[(_view.__name__, __name__)] = _aliases_its_base


if AS_PYTHON:

    def contiguous_view(base, offset, shape):  # noqa: F811 - the NumPy twins
        return base[offset : offset + math.prod(shape)].reshape(shape)

    def contiguous_bits_view(base, offset, shape, dtype):  # noqa: F811
        return contiguous_view(base, offset, shape).view(dtype)

    def strided_view(base, offset, shape, strides):  # noqa: F811
        return np.lib.stride_tricks.as_strided(base[offset:], shape, strides)

    def contiguous_view_at(address, offset, shape, dtype):  # noqa: F811
        return _numpy_view_at(address, offset, shape, None, dtype)

    def strided_view_at(address, offset, shape, strides, dtype):  # noqa: F811
        return _numpy_view_at(address, offset, shape, strides, dtype)

    def origin(address, offset, dtype):  # noqa: F811
        return (int(address) + int(offset) * np.dtype(dtype).itemsize, dtype)

    def load(pointer, index):  # noqa: F811
        return _numpy_view_at(pointer[0], index, (1,), None, pointer[1])[0]

    def load_bytes(pointer, offset):  # noqa: F811
        return _numpy_view_at(pointer[0] + offset, 0, (1,), None, pointer[1])[0]

    def store(pointer, index, value):  # noqa: F811
        _numpy_view_at(pointer[0], index, (1,), None, pointer[1])[0] = value

    def store_bytes(pointer, offset, value):  # noqa: F811
        _numpy_view_at(pointer[0] + offset, 0, (1,), None, pointer[1])[0] = value


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


def as_read_only(array):
    """The array as a read-only view. Library kernels (conv, attention) are called with it on
    every array they only read, so each compiles one variant: a plan's first conv reads the
    caller's input (read-only), its second an intermediate (writable), and Numba compiled
    conv2d_gemm once for each (2.5 s each when cold). Compiled code gets the same array as a
    read-only Numba type."""
    view = array.view()
    view.flags.writeable = False
    return view


@intrinsic
def _read_only_type(typingctx, array):
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, signature.return_type, args[0])

    return array.copy(readonly=True)(array), codegen


@overload(as_read_only, inline="always")
def _as_read_only_compiled(array):
    return lambda array: _read_only_type(array)


def transposed(array, *axes):
    """array.transpose(*axes): how a generated driver writes a transposed view (a transpose
    node, attention's "bthd" layout, a row kernel's axes). Compiled, Numba's own transpose with
    axes checks them at run time through a helper whose error message formats the shapes:
    compiling it took ~3 CPU s the first time in each process (a function of one transpose:
    3.6 CPU s cold against 0.4 without it), and every call allocated four small arrays
    (NUMBA_NRT_STATS: 5 allocations a call against 1). Here the axes are literals, so the
    shape and strides are permuted as it compiles: nothing is checked (the code generator wrote
    the axes from the IR) and nothing allocated. The result's type is Numba's (layout "A").
    Drivers write the axes as one string ("0,2,1,3"): a size-generic driver reads every number
    of its text at run time (codegen/render/lift.py), and these must be known as it compiles."""
    return array.transpose(_axes(axes))


def _axes(axes: tuple) -> tuple:
    """The axes as ints, from ints or from one string of them ("0,2,1,3")."""
    if len(axes) == 1 and isinstance(axes[0], str):
        return tuple(int(axis) for axis in axes[0].split(","))
    return axes


@overload(transposed, prefer_literal=True)
def _transposed_compiled(array, *axes):
    if len(axes) == 1 and isinstance(axes[0], types.StringLiteral):
        perm = _axes((axes[0].literal_value,))
    else:
        perm = tuple(getattr(axis, "literal_value", None) for axis in axes)
    if not isinstance(array, types.Array) or sorted(perm, key=str) != list(range(array.ndim)):
        return None
    permute = _permutation(perm)
    return lambda array, *axes: permute(array)


@functools.cache
def _permutation(perm: tuple[int, ...]):
    """The intrinsic viewing an array with its axes in the order perm (literal, checked)."""

    @intrinsic
    def permuted(typingctx, array):
        result = array.copy(layout="A") if array.ndim > 1 else array

        def codegen(context, builder, signature, args):
            source = make_array(array)(context, builder, args[0])
            shape = cgutils.unpack_tuple(builder, source.shape)
            strides = cgutils.unpack_tuple(builder, source.strides)
            view = make_array(result)(context, builder)
            populate_array(
                view,
                data=source.data,
                shape=[shape[p] for p in perm],
                strides=[strides[p] for p in perm],
                itemsize=source.itemsize,
                meminfo=source.meminfo,
                parent=source.parent,
            )
            return impl_ret_borrowed(context, builder, result, view._getvalue())

        return result(array), codegen

    return permuted


__all__ = [
    "contiguous_view",
    "contiguous_view_at",
    "load",
    "load_bytes",
    "origin",
    "store",
    "store_bytes",
    "strided_view",
    "strided_view_at",
]
