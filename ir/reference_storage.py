"""Which buffer each value of a plan lives in when the reference interpreter runs it, before it
runs: the predicted peak of the reference backend (ir/peak.py) counts buffers, not values.

NumPy gives a view for transpose, broadcast_to, basic slicing and stop_gradient, and for a
reshape whose strides allow one (16-bit floats excepted: the interpreter widens and rounds
each result, a copy); every other op's result is a fresh C-contiguous array (the
interpreter copies one that is not: ir/interpreter.py `fresh`). So a value's storage root is
the value itself, or, for a view, its input's root. Whether a reshape is a view is decided by
NumPy itself, on a stand-in array with the input's strides over one byte (nothing is read).

>>> from backplan.ir.builder import Builder
>>> from backplan.ir.graph import Graph
>>> from backplan.ir.types import TensorType
>>> graph = Graph("f")
>>> b = Builder(graph)
>>> x = graph.add_input(TensorType("f32", (2, 3)))
>>> t = b.transpose(b.exp(x), perm=(1, 0))
>>> r = b.reshape(t, shape=(6,))          # a transposed array reshaped: NumPy copies it
>>> roots = storage_roots(graph)
>>> roots[t] is t.inputs[0], roots[r] is r
(True, True)
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .graph import Graph, Value
from .registry import get_op
from .types import is_half

VIEW_OPS = ("reshape", "transpose", "broadcast_to", "slice", "stop_gradient")


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides, in elements, of a C-contiguous array of `shape`."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def view_strides(node: Value, strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides (in elements) of `node`'s result when NumPy makes it a view of its input
    with `strides`, or None when it copies (a reshape that no strides can express)."""
    stand_in = as_strided(np.zeros(1, np.int8), shape=node.inputs[0].shape, strides=strides)
    if node.op == "reshape":
        try:
            view = np.reshape(stand_in, node.attrs["shape"], copy=False)
        except ValueError:
            return None
    else:
        view = get_op(node.op).reference(stand_in, **node.attrs)
    return tuple(view.strides)


def view_parents(nodes, alias: dict | None = None) -> dict[Value, Value]:
    """view node -> the value it is a NumPy view of (its input), for the nodes in `nodes`
    (in order). Values not produced there (inputs) are C-contiguous; alias maps a value read
    to the one it stands for (a backward's saved input to the forward value)."""
    alias = alias or {}
    parents: dict[Value, Value] = {}
    strides: dict[Value, tuple[int, ...]] = {}
    for node in nodes:
        found = None
        if node.op in VIEW_OPS and not is_half(node.dtype):  # 16-bit values go via float32
            source = alias.get(node.inputs[0], node.inputs[0])
            found = view_strides(node, strides.get(source) or c_strides(source.shape))
        if found is None:
            strides[node] = c_strides(node.shape)
        else:
            parents[node], strides[node] = source, found
    return parents


def storage_roots(graph: Graph) -> dict[Value, Value]:
    """value -> the value whose buffer it lives in (a graph input, a const node, or a node
    whose result NumPy allocated)."""
    parents = view_parents(graph.nodes)
    roots: dict[Value, Value] = {value: value for value in graph.inputs}
    for node in graph.nodes:
        roots[node] = roots[parents[node]] if node in parents else node
    return roots


def array_root(array: np.ndarray) -> np.ndarray:
    """The array that owns the memory `array` reads (itself, or the base of its views; a
    view made by as_strided has a wrapper between it and its base)."""
    while True:
        base = array.base
        if isinstance(base, np.ndarray):
            array = base
        elif base is not None and isinstance(getattr(base, "base", None), np.ndarray):
            array = base.base
        else:
            return array


def fresh(result: np.ndarray, inputs: list) -> np.ndarray:
    """A non-view op's result as a buffer of its own, C-contiguous and exactly its size, as
    storage_roots assumes: copied when NumPy returned a view (of an input, or of a larger
    temporary) or another layout."""
    if result.base is None and result.flags.c_contiguous:  # the common case, checked cheaply
        if not any(result is a for a in inputs):
            return result
        return np.array(result, order="C", copy=True)
    root = array_root(result)
    if (
        result.flags.c_contiguous
        and root.nbytes == result.nbytes
        and not any(root is array_root(a) for a in inputs if isinstance(a, np.ndarray))
    ):
        return result
    return np.array(result, order="C", copy=True)
