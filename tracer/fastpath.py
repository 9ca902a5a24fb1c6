"""The fast path of a call to a compiled function: a cheap structural key of the arguments
(containers, tensor shapes, dtypes and requires_grad, static values) that maps straight to the
cached plan and to where each tensor sits, skipping signature binding on every call after the
first. Anything unusual (tracers, NumPy arrays, a tensor passed twice, unhashable statics) just
takes the full path."""

from __future__ import annotations

from .tensor import Tensor

NO_FAST_PATH = None


class _Unusual(Exception):
    pass


def call_key(args: tuple, kwargs: dict, grad_enabled: bool):
    """(key, tensor leaves in walk order), or (None, None) when the call needs the full path."""
    leaves: list = []
    try:
        key = (_walk(args, leaves, grad_enabled), _walk(kwargs, leaves, grad_enabled))
        hash(key)
    except (_Unusual, TypeError):
        return None, None
    return key, leaves


def _walk(tree, leaves: list, grad_enabled: bool):
    kind = type(tree)
    if kind is Tensor:
        data = tree._data
        if data is None:
            raise _Unusual
        leaves.append(tree)
        return (data.shape, data.dtype, tree._requires_grad and grad_enabled)
    if kind is dict:
        parts = [_walk(v, leaves, grad_enabled) for v in tree.values()]
        return ("d", tuple(tree), tuple(parts))
    if kind is list or kind is tuple:
        return (kind, tuple([_walk(v, leaves, grad_enabled) for v in tree]))
    if kind in (int, float, bool, str) or tree is None:
        return ("s", kind, tree)
    raise _Unusual  # arrays, namedtuples, other objects: the full path handles them


def positions_of(wanted: list, leaves: list) -> list[int] | None:
    """Index in leaves of each wanted tensor (by identity); None when it cannot be done
    unambiguously (a tensor passed twice, or one that is not among the leaves)."""
    index = {}
    for i, leaf in enumerate(leaves):
        if id(leaf) in index:
            return None
        index[id(leaf)] = i
    found = [index.get(id(t)) for t in wanted]
    return None if any(i is None for i in found) else found
