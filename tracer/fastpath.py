"""The fast path of a call to a compiled function: a cheap structural key of the arguments
(containers, tensor shapes, dtypes, requires_grad and layouts, static values) that maps
straight to the cached plan and to where each tensor sits, skipping signature binding on every
call after the first. NumPy arrays are leaves of their own kind (tracer/numpy_args.py says how
the plan reads them). Anything unusual (tracers, arrays of unsupported dtypes, a leaf passed
twice, unhashable statics) just takes the full path, which raises the errors."""

from __future__ import annotations

import numpy as np

from backplan.ir.argument_layout import C_ORDER, any_size, layout
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
        return ("a", tree.shape, _supported(tree.dtype), _layout(tree))
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
            rg = value._requires_grad and grad_enabled
            parts.append((data.shape, data.dtype, rg, _layout(data)))
        else:
            parts.append(_walk(value, leaves, grad_enabled, static))
    return tuple(parts)


def _tensor_part(tensor, leaves: list, grad_enabled: bool) -> tuple:
    data = tensor._data
    if data is None or tensor._donated is not None:
        raise _Unusual  # a tracer, or a donated tensor: the full path raises DonatedError
    leaves.append(tensor)
    return (data.shape, data.dtype, tensor._requires_grad and grad_enabled, _layout(data))


def guard_for(key):
    """A check of later calls against one call_key: guard(args, kwargs, grad_enabled) returns
    the dynamic leaves exactly when call_key would give an equal key, else None. It compares
    the arguments with the key's parts in place: no key tuples are built and nothing is
    hashed, so a repeated call costs a few comparisons per leaf.

    >>> import backplan as bp
    >>> x = bp.tensor([1.0, 2.0])
    >>> guard = guard_for(call_key((x, 3), {}, True)[0])
    >>> guard((bp.tensor([5.0, 6.0]), 3), {}, True) is not None, guard((x, 4), {}, True)
    (True, None)
    """
    parts, named = key
    matchers = [_matcher(part) for part in parts]
    names = tuple(name for name, _ in named)
    matchers += [_matcher(part) for _, part in named]
    count = len(parts)

    def guard(args: tuple, kwargs: dict, grad_enabled: bool):
        if len(args) != count or (kwargs and tuple(kwargs) != names) or len(kwargs) != len(names):
            return None
        leaves: list = []
        values = (*args, *kwargs.values()) if kwargs else args
        for match, value in zip(matchers, values, strict=True):
            if not match(value, leaves, grad_enabled):
                return None
        return leaves

    return guard


def _matcher(part):
    """match(tree, leaves, grad_enabled) -> bool for one part _walk made; appends the leaves."""
    if part == "f":
        return _match_float
    head = part[0]
    if type(head) is tuple:
        return _tensor_matcher(part)
    if head == "a":
        return _array_matcher(part)
    if head == "s":
        return _static_matcher(part)
    if head == "d":
        return _container_matcher(dict, part[2], part[1])
    return _container_matcher(head, part[1])


def _match_float(tree, leaves: list, grad_enabled: bool) -> bool:
    if type(tree) is not float:
        return False
    leaves.append(tree)
    return True


def _tensor_matcher(part):
    shape, dtype, requires_grad, order = part
    c_order = order == C_ORDER

    def match(tree, leaves: list, grad_enabled: bool) -> bool:
        if type(tree) is not Tensor or tree._donated is not None:
            return False
        data = tree._data
        if data is None or data.shape != shape or not _same_dtype(data.dtype, dtype):
            return False
        if (tree._requires_grad and grad_enabled) != requires_grad:
            return False
        if not _same_layout(data, order, c_order):
            return False
        leaves.append(tree)
        return True

    return match


def _array_matcher(part):
    _, shape, dtype, order = part
    c_order = order == C_ORDER

    def match(tree, leaves: list, grad_enabled: bool) -> bool:
        if type(tree) is not np.ndarray or tree.shape != shape:
            return False
        if not _same_dtype(tree.dtype, dtype) or not _same_layout(tree, order, c_order):
            return False
        leaves.append(tree)
        return True

    return match


def _static_matcher(part):
    _, kind, value = part

    def match(tree, leaves: list, grad_enabled: bool) -> bool:
        return type(tree) is kind and (tree is value or tree == value)

    return match


def _container_matcher(kind, children: tuple, keys: tuple | None = None):
    """A dict (keys in order), list or tuple; tensor children are checked inline, as _children
    walks them."""
    count = len(children)
    checks = [
        (None, *child, child[3] == C_ORDER)
        if type(child[0]) is tuple
        else (_matcher(child), None, None, None, None, None)
        for child in children
    ]

    def match(tree, leaves: list, grad_enabled: bool) -> bool:
        if type(tree) is not kind or len(tree) != count:
            return False
        if keys is not None:
            if tuple(tree) != keys:
                return False
            tree = tree.values()
        for value, (match_child, shape, dtype, requires_grad, order, c_order) in zip(
            tree, checks, strict=True
        ):
            if match_child is not None:
                if not match_child(value, leaves, grad_enabled):
                    return False
                continue
            if type(value) is not Tensor or value._donated is not None:
                return False
            data = value._data
            if data is None or data.shape != shape:
                return False
            if data.dtype is not dtype and data.dtype != dtype:
                return False
            if (value._requires_grad and grad_enabled) != requires_grad:
                return False
            if data.flags.c_contiguous:  # _same_layout, inline: the common case is one read
                if not c_order:
                    return False
            elif c_order or (layout(data) != order and any_size(layout(data)) != order):
                return False
            leaves.append(value)
        return True

    return match


def _same_layout(array, order: str, c_order: bool) -> bool:
    """Whether array has the layout a key part recorded; C order costs one flag read. A plan
    keyed "strided" also takes a sliced view (keyed so on a dynamic axis: ir/argument_layout.py
    any_size), which it copies."""
    if array.flags.c_contiguous:
        return c_order
    if c_order:
        return False
    word = layout(array)
    return word == order or any_size(word) == order


def _layout(array) -> str:
    """The signature's layout word (ir/argument_layout.py): C order costs one flag read."""
    return C_ORDER if array.flags.c_contiguous else layout(array)


def _same_dtype(dtype, wanted) -> bool:
    return dtype is wanted or dtype == wanted


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
