"""The fast path of a call to a compiled function: a cheap structural key of the arguments
(containers, tensor shapes, dtypes and requires_grad, static values) that maps straight to the
cached plan and to where each tensor sits, skipping signature binding on every call after the
first. NumPy arrays are leaves of their own kind (tracer/numpy_args.py says how the plan reads
them). Anything unusual (tracers, arrays of unsupported dtypes, a leaf passed twice, unhashable
statics) just takes the full path, which raises the errors."""

from __future__ import annotations

import numpy as np

from backplan.ir.errors import BackplanError
from backplan.ir.types import dtype_name

from .tensor import Tensor

_SUPPORTED_DTYPES: set = set()  # NumPy dtypes dtype_name accepted, so it is asked once

NO_FAST_PATH = None


class _Unusual(Exception):
    pass


def call_key(
    args: tuple,
    kwargs: dict,
    grad_enabled: bool,
    static_nums=frozenset(),
    static_names=(),
    check_hash: bool = True,
):
    """(key, dynamic leaves in walk order: tensors, NumPy arrays and Python floats), or
    (None, None) when the call needs the full path. Floats under static_nums / static_names
    are part of the key. check_hash=False leaves hashing to the caller's lookup (a tuple does
    not keep its hash; hashing twice costs a microsecond), which then meets the TypeError of a
    static value that cannot be hashed."""
    leaves: list = []
    try:
        parts = tuple(
            [_walk(a, leaves, grad_enabled, i in static_nums) for i, a in enumerate(args)]
        )
        named = tuple(
            [(k, _walk(v, leaves, grad_enabled, k in static_names)) for k, v in kwargs.items()]
        )
        key = (parts, named)
        if check_hash:
            hash(key)
    except (_Unusual, TypeError):
        return None, None
    return key, leaves


def _walk(tree, leaves: list, grad_enabled: bool, static: bool = False):
    kind = type(tree)
    if kind is Tensor:
        return _tensor_part(tree, leaves, grad_enabled)
    if kind is np.ndarray:
        leaves.append(tree)
        return ("a", tree.shape, _supported(tree.dtype))
    if kind is float and not static:
        leaves.append(tree)
        return "f"
    if kind is dict:
        return ("d", tuple(tree), _children(tree.values(), leaves, grad_enabled, static))
    if kind is list or kind is tuple:
        return (kind, _children(tree, leaves, grad_enabled, static))
    if kind in (int, float, bool, str) or tree is None:
        return ("s", kind, tree)
    raise _Unusual  # namedtuples, other objects: the full path handles them


def _children(values, leaves: list, grad_enabled: bool, static: bool) -> tuple:
    """The parts of a container's children; tensors, the common case, without a call."""
    parts = []
    for value in values:
        if type(value) is Tensor:
            data = value._data
            if data is None or value._donated is not None:
                raise _Unusual
            leaves.append(value)
            parts.append((data.shape, data.dtype, value._requires_grad and grad_enabled))
        else:
            parts.append(_walk(value, leaves, grad_enabled, static))
    return tuple(parts)


def _tensor_part(tensor, leaves: list, grad_enabled: bool) -> tuple:
    data = tensor._data
    if data is None or tensor._donated is not None:
        raise _Unusual  # a tracer, or a donated tensor: the full path raises DonatedError
    leaves.append(tensor)
    return (data.shape, data.dtype, tensor._requires_grad and grad_enabled)


def positions_of(wanted: list, leaves: list) -> list[int] | None:
    """Index in leaves of each wanted leaf (by identity); None when it cannot be done
    unambiguously (a tensor or float object passed twice, or one not among the leaves)."""
    index = {}
    for i, leaf in enumerate(leaves):
        if id(leaf) in index:
            return None
        index[id(leaf)] = i
    found = [index.get(id(t)) for t in wanted]
    return None if any(i is None for i in found) else found


def _supported(dtype):
    if dtype not in _SUPPORTED_DTYPES:
        try:
            dtype_name(dtype)
        except BackplanError:
            raise _Unusual from None
        _SUPPORTED_DTYPES.add(dtype)
    return dtype
