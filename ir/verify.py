"""Invariant checks run after every pass in tests, and on every graph loaded from disk."""

from __future__ import annotations

import numpy as np

from .builder import make_value
from .errors import BackplanError, VerifyError
from .graph import Graph, Value
from .liveness import INPUT_STEP, OWNED_ROLES, Plan
from .registry import get_op
from .text import value_names
from .types import TensorType, np_dtype

# The registry's answer for (op, input types, attributes), kept: a rule's `infer` reads only
# those, and the tests verify every graph after every pass, so the same nodes are derived
# again dozens of times (a saved-bytes budget sweep spent 57% of its CPU here). Only
# attributes of plain values are keys (their Python type in the key: 1, 1.0 and True stay
# apart); any other node is derived anew. An op registered again is another OpDef: its
# entries are not reused.
_DERIVED: dict[tuple, tuple[object, TensorType]] = {}
_DERIVED_MAX = 1 << 16
_PLAIN = (str, int, float, bool, type(None))


def _plain_key(value):
    """A hashable key telling apart every plain value (tuples of them included), else None."""
    if isinstance(value, _PLAIN):
        return (type(value), repr(value) if isinstance(value, float) else value)
    if isinstance(value, tuple):
        keys = tuple(_plain_key(v) for v in value)
        return None if None in keys else (tuple, keys)
    return None


def derived_type(node: Value) -> TensorType:
    """The type the registry's rule gives `node`'s op, input types and attributes (what
    make_value would build); raises as make_value does."""
    attrs = []
    for name, value in node.attrs.items():
        key = _plain_key(value)
        if key is None:
            return make_value(node.op, node.inputs, node.attrs).type
        attrs.append((name, key))
    key = (node.op, tuple(i.type for i in node.inputs), tuple(attrs))
    opdef = get_op(node.op)
    try:
        entry = _DERIVED.get(key)
    except TypeError:  # a dimension that is not hashable
        return make_value(node.op, node.inputs, node.attrs).type
    if entry is not None and entry[0] is opdef:
        return entry[1]
    derived = make_value(node.op, node.inputs, node.attrs).type
    if len(_DERIVED) >= _DERIVED_MAX:
        _DERIVED.clear()
    _DERIVED[key] = (opdef, derived)
    return derived


def verify_graph(graph: Graph) -> None:
    """SSA, operands defined before use, and every type re-derived from the registry."""
    defined: set[Value] = set()
    for value in graph.inputs:
        if value.op != "input" or value in defined:
            raise VerifyError(f"bad graph input {value}")
        defined.add(value)
    named: dict = {}

    def names_of() -> dict:  # the printed names, made only for an error's message
        if not named:
            named.update(value_names(graph))
        return named

    for node in graph.nodes:
        if node in defined:
            raise VerifyError(f"{names_of()[node]} is defined twice")
        for inp in node.inputs:
            if inp not in defined:
                raise VerifyError(
                    f"{names_of()[node]} ({node.op}) reads a value defined later or elsewhere"
                )
        try:
            expected = derived_type(node)
        except BackplanError as exc:
            raise VerifyError(f"{names_of()[node]}: {exc}") from None
        if expected != node.type:
            raise VerifyError(
                f"{names_of()[node]} ({node.op}) has type {node.type}, rule gives {expected}"
            )
        if node.op == "const" and node.attrs["name"] not in graph.constants:
            raise VerifyError(f"{names_of()[node]} names a missing constant")
        if node.op == "const":
            array = graph.constants[node.attrs["name"]]
            if not isinstance(array, np.ndarray) or array.dtype != np_dtype(node.dtype):
                raise VerifyError(f"{names_of()[node]}: constant is not a {node.dtype} array")
            if tuple(array.shape) != node.shape:
                raise VerifyError(f"{names_of()[node]}: constant has shape {array.shape}")
        defined.add(node)
    for out in graph.outputs:
        if out not in defined:
            raise VerifyError("an output is not defined in the graph")


def verify_plan(plan: Plan) -> None:
    """Every owned input (saved buffers, cotangents) is freed exactly once, nothing is read after
    it is freed, and nothing is freed before it is written."""
    graph = plan.graph
    verify_graph(graph)
    names = value_names(graph)
    freed_at: dict[Value, int] = {}
    for step, values in plan.frees_after.items():
        for value in values:
            if value in freed_at:
                raise VerifyError(f"{names.get(value, value)} is freed twice")
            freed_at[value] = step
    for value in graph.inputs:
        if value.role in OWNED_ROLES and value not in freed_at:
            raise VerifyError(f"{value.role} input {names[value]} is never freed")
    for step, node in enumerate(graph.nodes):
        for inp in node.inputs:
            if inp in freed_at and freed_at[inp] < step:
                raise VerifyError(f"{names[node]} reads {names[inp]} after it was freed")
    for value, step in freed_at.items():
        written = INPUT_STEP if value.op == "input" else graph.nodes.index(value)
        if step < written:
            raise VerifyError(f"{names[value]} is freed before it is written")
        if value in graph.outputs and step < plan.return_step:
            raise VerifyError(f"output {names[value]} is freed before return")


def verify_input_views(graph: Graph, inputs) -> None:
    """Every view read from each of these inputs (slice, transpose, broadcast_to, reshape,
    through any chain of them) stays inside the input's elements: a plan reading an argument
    in place (ir/in_place_inputs.py) raises here, before anything compiles, instead of reading
    out of bounds. Each view is walked as (offset, shape, strides) in elements, as the
    compiled kernels take it."""
    names = value_names(graph)
    where: dict[Value, tuple] = {}
    for i in inputs:
        value = graph.inputs[i]
        where[value] = (0, value.shape, _c_strides(value.shape))
    for node in graph.nodes:
        if not node.inputs or node.inputs[0] not in where or node.op not in _VIEW_STEPS:
            continue
        placed = _VIEW_STEPS[node.op](node, *where[node.inputs[0]])
        if placed is None:
            continue  # a reshape that merges strided axes: the lowering copies it
        offset, shape, strides = placed
        root = node.inputs[0]
        while root not in graph.inputs:
            root = root.inputs[0]
        size = int(np.prod(root.shape, dtype=np.int64))
        if 0 not in shape:
            low = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
            high = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s > 0)
            if low < 0 or high >= size:
                raise VerifyError(
                    f"{names[node]} ({node.op}) reads elements {low}..{high} of "
                    f"{names[root]}, which has {size} ({root.type})"
                )
        where[node] = placed


def _c_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return tuple(strides)


def _slice_step(node, offset, shape, strides):
    a = node.attrs
    offset += sum(s * t for s, t in zip(a["starts"], strides, strict=True))
    return offset, node.shape, tuple(c * t for c, t in zip(a["steps"], strides, strict=True))


def _transpose_step(node, offset, shape, strides):
    return offset, node.shape, tuple(strides[p] for p in node.attrs["perm"])


def _broadcast_step(node, offset, shape, strides):
    shift = len(node.shape) - len(shape)
    kept = [
        0 if n == 1 and node.shape[k + shift] != 1 else s
        for k, (n, s) in enumerate(zip(shape, strides, strict=True))
    ]
    return offset, node.shape, (0,) * shift + tuple(kept)


def _reshape_step(node, offset, shape, strides):
    if [n for n in shape if n != 1] != [n for n in node.shape if n != 1]:
        if strides != _c_strides(shape):
            return None
        return offset, node.shape, _c_strides(node.shape)
    kept = iter([s for n, s in zip(shape, strides, strict=True) if n != 1])
    return offset, node.shape, tuple(next(kept) if n != 1 else 0 for n in node.shape)


_VIEW_STEPS = {
    "slice": _slice_step,
    "transpose": _transpose_step,
    "broadcast_to": _broadcast_step,
    "reshape": _reshape_step,
}
