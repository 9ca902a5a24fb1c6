"""Matching a call of a loaded artifact against the signature it was exported for.

A loaded artifact cannot retrace, so every argument must have the exported structure, dtype and
shape, and every static argument the exported value. Dicts may list their keys in any order,
and a dataclass may stand where its exported dict of fields is;
arguments are rebuilt in the exported order before they are flattened.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from backplan.ir.types import dtype_name
from backplan.runtime.execute import count_argument_copy
from backplan.tracer.numpy_args import borrowed
from backplan.tracer.pytree import TreeDef, flatten
from backplan.tracer.signature import LeafKey
from backplan.tracer.tensor import Tensor

from .format import ExportError
from .tree import child_path


def conform(treedef: TreeDef, value, path: str, artifact: str):
    """value rebuilt with the exported container kinds and dict key order."""
    kind = treedef.kind
    if kind == "leaf":
        if isinstance(value, list | dict | tuple) or value is None:
            raise _mismatch(artifact, path, "a tensor or static value", type(value).__name__)
        return value
    if kind == "none":
        if value is not None:
            raise _mismatch(artifact, path, "None", type(value).__name__)
        return None
    if kind == "dict":
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        if not isinstance(value, dict) or set(value) != set(treedef.meta):
            got = (
                f"a dict with keys {sorted(value, key=repr)}"
                if isinstance(value, dict)
                else type(value).__name__
            )
            raise _mismatch(
                artifact, path, f"a dict with keys {sorted(treedef.meta, key=repr)}", got
            )
        return {
            k: conform(c, value[k], child_path(path, k), artifact)
            for k, c in zip(treedef.meta, treedef.children, strict=True)
        }
    expected_type = tuple if kind == "tuple" else list
    if not isinstance(value, expected_type) or len(value) != len(treedef.children):
        got = (
            f"{type(value).__name__} of length {len(value)}"
            if isinstance(value, tuple | list)
            else type(value).__name__
        )
        raise _mismatch(artifact, path, f"a {kind} of length {len(treedef.children)}", got)
    items = [
        conform(c, v, child_path(path, i), artifact)
        for i, (c, v) in enumerate(zip(treedef.children, value, strict=True))
    ]
    return tuple(items) if kind == "tuple" else items


def match_leaves(
    tree_value, keys: list[LeafKey], artifact: str, symbolic: dict | None = None
) -> tuple[list, list[int]]:
    """Leaves of an already conformed value, checked against the exported leaf keys; ndarrays
    become tensors, each a read-only view of the caller's array (no copy: the call copies
    what outlives it, as a compiled call does, tracer/numpy_args.py; an array in another byte
    order is converted, a copy). symbolic maps a leaf's position to (axis, symbol) where an
    axis is dynamic, so a refusal shows the symbol there, not this call's size. Returns
    (leaves, positions of the tensor leaves)."""
    leaves, _ = flatten(tree_value)
    positions = []
    for i, (leaf, key) in enumerate(zip(leaves, keys, strict=True)):
        if isinstance(leaf, np.ndarray):
            leaves[i] = leaf = _argument_tensor(leaf)
        if key.weak and type(leaf) is float:
            leaves[i] = leaf = Tensor._weak_scalar(leaf)  # exported as a traced float
        if key.kind == "tensor":
            _check_tensor(leaf, key, artifact, (symbolic or {}).get(i))
            positions.append(i)
        elif isinstance(leaf, Tensor) or (type(leaf).__name__, leaf) != key.static:
            shown = "a tensor" if isinstance(leaf, Tensor) else repr(leaf)
            raise _mismatch(artifact, key.path, f"the static value {key.static[1]!r}", shown)
    return leaves, positions


def borrowed_leaves(sources: list, positions: list[int]) -> frozenset[int]:
    """The tensor positions match_leaves read in place: NumPy arrays in this machine's byte
    order (BoundCall.borrowed)."""
    return frozenset(
        p for p in positions if isinstance(sources[p], np.ndarray) and sources[p].dtype.isnative
    )


def _argument_tensor(array: np.ndarray) -> Tensor:
    if not array.dtype.isnative:  # its values in this machine's order: a copy explain counts
        converted = Tensor(array)
        count_argument_copy(converted._data)
        return converted
    dtype_name(array.dtype)  # refuses complex, object, ... as Tensor(array) does
    return Tensor._from_array(borrowed(array))


def _check_tensor(leaf, key: LeafKey, artifact: str, dynamic: tuple | None) -> None:
    dims = [str(d) for d in key.shape]
    if dynamic is not None:
        axis, symbol = dynamic
        dims[axis] = f"{symbol} (any size)"
    expected = "a float" if key.weak else f"a tensor {key.dtype}[{', '.join(dims)}]"
    if not isinstance(leaf, Tensor):
        raise _mismatch(artifact, key.path, expected, f"{leaf!r} of type {type(leaf).__name__}")
    if leaf._ir_dtype != key.dtype or tuple(leaf.shape) != tuple(key.shape):
        error = _mismatch(artifact, key.path, expected, f"{leaf._ir_dtype}{list(leaf.shape)}")
        if leaf._ir_dtype == key.dtype and dynamic is None and len(leaf.shape) == len(key.shape):
            error.args = (error.args[0] + _dynamic_hint(key.path, key.shape, leaf.shape),)
        raise error


def _dynamic_hint(path: str, exported: tuple, passed: tuple) -> str:
    """How to export an artifact that takes the sizes a call passed: the axes that differ made
    dynamic, in bp.export's dynamic= form, keyed by the argument's name."""
    axes = [axis for axis, (a, b) in enumerate(zip(exported, passed, strict=True)) if a != b]
    argument = re.split(r"[\[.]", path, maxsplit=1)[0]
    spec = ", ".join(f"{axis}: {'batch' if axis == 0 else f'n{axis}'!r}" for axis in axes)
    return (
        f", or, if the function takes any size there, export with dynamic={{{argument!r}: "
        f"{{{spec}}}}} (the same symbol on the matching axes of the other arguments)"
    )


def _mismatch(artifact: str, path: str, expected: str, got: str) -> ExportError:
    return ExportError(
        f"{artifact} was exported for {path} = {expected}, but the call passed {got}; a loaded "
        "artifact cannot retrace, so re-export it with arguments like these"
    )
