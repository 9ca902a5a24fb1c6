"""bfloat16 and float16 are storage dtypes: every op that computes reads its 16-bit inputs as
float32, computes in float32 and rounds its result once (round to nearest even) when it is
stored. `widen(graph)` writes that down for compiled plans: each such op gets float32 inputs
(astype) and a float32 result that an astype rounds back, so code generation only ever converts
between 16-bit storage and float32 (codegen/kernels/half.py). Ops that only move data (views,
sources) keep their 16-bit values. The reference interpreter does the same per op
(`computes_in_float32`, `compute_attrs`). A compiled fused loop then drops the round trip of a
value it holds in registers (ir/rounding_points.py, codegen/render/loops.py `_unrounded`): it
rounds once, when it stores, and the reference interpreter running the lowered plan does too.

A matmul of two bfloat16 (or two float16) operands is the exception: it reads them as they are
(matmul's dtype='f32': float32 products and sums, a float32 result), since the GEMM widens its
operands into float32 panels while packing them (codegen/kernels/gemm/pack.py). No float32 copy
of a 16-bit weight or activation is made for a GEMM to read, at any size: small float16
products went to BLAS on float32 copies until the copies (and, in a plan, the loops making
them) measured slower than the own GEMM reading float16 (the bench mlp's float16 step 1.03x
-> 1.00x the float32 one; bench/half_precision.py --float16 --widened).

The float32 copy of a bfloat16 or float16 array (a saved value kept in 16 bits,
ir/saved_dtype.py) is not made where a float32 matmul reads it: the matmul reads the 16-bit
array beside its float32 operand (the GEMM widens it while packing), and a transpose or
reshape of the copy becomes the copy of the transposed or reshaped array, so the cast reaches
its reader (a fused loop widens it as it reads). transformer x 6 with bfloat16 saved buffers:
42 float32 copies no longer made, the step's peak 136.6 -> 119.8 MB, the step 1.036x ->
0.984x the full-precision one (BENCHMARKS.md, 30).

    >>> from backplan.ir.graph import Graph
    >>> from backplan.ir.builder import Builder
    >>> g = Graph(); b = Builder(g)
    >>> x = g.add_input(TensorType("bf16", (4,)))
    >>> g.outputs = [b.exp(x)]
    >>> [(n.op, n.dtype) for n in widen(g).nodes]
    [('astype', 'f32'), ('exp', 'f32'), ('astype', 'bf16')]
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter

import numpy as np

from .graph import Graph, Value, shared_prefix
from .registry import get_op
from .types import HALF_DTYPES, TensorType, is_half, np_dtype

MOVES_DATA = ("input", "const", "full")  # besides the view ops: no arithmetic on the values


def moves_data(op: str) -> bool:
    """True for ops whose 16-bit values pass through unchanged (no rounding to do)."""
    return op in MOVES_DATA or get_op(op).fusion == "view"


def computes_in_float32(node: Value) -> bool:
    """Whether node is an op on 16-bit floats that computes (so it computes in float32)."""
    if node.op == "astype" or moves_data(node.op):
        return False
    return is_half(node.dtype) or any(is_half(i.dtype) for i in node.inputs)


def compute_attrs(attrs: dict) -> dict:
    """The attributes of the float32 computation: a 16-bit `dtype` attribute becomes f32."""
    if is_half(attrs.get("dtype", "")):
        return {**attrs, "dtype": "f32"}
    return attrs


def has_half(graph: Graph) -> bool:
    """Whether any value of graph is a 16-bit float (asked of every plan lowered: the walk
    is one C-level pass over the values' dtypes)."""
    dtypes = map(_dtype_of, chain(graph.inputs, graph.nodes))
    return not _HALF.isdisjoint(dtypes)


def value_dtypes(graph: Graph) -> set[str]:
    """The dtypes of graph's values (one C-level pass): has_half's answer and whether any
    value is float64 at once (ir/lowering.py asks both of every plan it lowers)."""
    return set(map(_dtype_of, chain(graph.inputs, graph.nodes)))


def row_dtypes(graph: Graph, first: dict | None = None) -> tuple[set[str], dict]:
    """(value_dtypes(graph), each dtype's first place among the values of the graph whose
    inputs and first nodes graph shares: graph.shares_prefix_of, ir/graph.py copy_graph):
    the shared values' dtypes from those places, only the nodes after them read. first: those
    places, where a row before worked them out (a memory frontier's rows share one graph)."""
    source = graph.shares_prefix_of
    if first is None:
        dtypes = list(map(_dtype_of, chain(source.inputs, source.nodes)))
        first = {dtype: dtypes.index(dtype) for dtype in set(dtypes)}
    shared = shared_prefix(source.nodes, graph.nodes)
    end = len(source.inputs) + shared  # the inputs are source's own too
    found = {dtype for dtype, at in first.items() if at < end}
    found.update(map(_dtype_of, graph.nodes[shared:]))
    return found, first


def half_among(dtypes) -> bool:
    """Whether a 16-bit float is among these dtypes (has_half, given value_dtypes)."""
    return not _HALF.isdisjoint(dtypes)


_dtype_of = attrgetter("type.dtype")
_HALF = frozenset(HALF_DTYPES)


def widen(graph: Graph) -> Graph:
    """The graph with every computing op on 16-bit floats done in float32 (see the module's
    docstring); the same inputs (objects) and output dtypes. Graphs without 16-bit floats are
    returned as they are."""
    return widen_with_origin(graph)[0]


def widen_with_origin(graph: Graph) -> tuple[Graph, dict[Value, Value]]:
    """widen(graph), and for each node of the result the node of graph it computes (casts
    into float32 have none): reports name the user's nodes, not the casts."""
    if not has_half(graph):
        return graph, {n: n for n in graph.nodes}
    new = Graph(graph.name, list(graph.inputs), [], [], dict(graph.constants))
    mapping: dict[Value, Value] = {v: v for v in graph.inputs}
    origin: dict[Value, Value] = {}
    for node in graph.nodes:
        inputs = [mapping[i] for i in node.inputs]
        start, casts_in = len(new.nodes), 0
        if node.op == "astype":
            mapping[node] = _cast(new, inputs[0], node.dtype, node.loc)
        elif node.op in _CAST_MOVES_PAST and _widens_16_bits(inputs[0]):
            mapping[node] = _widened_view(new, node, inputs[0].inputs[0])
        elif reads_half_operands(node, unwidened := _16_bits_read_as_is(node, inputs)):
            mapping[node] = _half_matmul(new, node, unwidened)
        elif computes_in_float32(node):
            mapping[node] = _in_float32(new, node, inputs)
            casts_in = sum(is_half(i.dtype) for i in inputs)
        else:
            mapping[node] = _add(new, Value(node.op, inputs, node.attrs, node.type, node.loc))
        for value in new.nodes[start + casts_in :]:
            origin[value] = node
    new.outputs = [mapping[o] for o in graph.outputs]
    _drop_unread_widenings(new, origin)
    return new, origin


def reads_half_operands(node: Value, inputs: list[Value]) -> bool:
    """A matmul of two bfloat16 or two float16 arrays, or of one 16-bit array beside a
    float32 one (no literals: a literal operand is widened as before), which the GEMM reads
    without float32 copies."""
    if node.op != "matmul" or not any(is_half(i.dtype) for i in inputs):
        return False
    if {i.dtype for i in inputs} not in ({"bf16"}, {"f16"}, {"bf16", "f32"}, {"f16", "f32"}):
        return False
    return not any(_literal_source(i) for i in inputs)


def _16_bits_read_as_is(node: Value, inputs: list[Value]) -> list[Value]:
    """A float32 matmul's operands, each float32 copy of a bfloat16 or float16 array (astype,
    exact: a saved value kept in 16 bits and widened for the backward, ir/saved_dtype.py)
    replaced by that array: the GEMM widens it while packing (gemm/symbols.py
    `backplan_gemm_bf16_f32`, `backplan_gemm_f16_f32`), so no float32 copy is made or held
    for it to read."""
    if node.op != "matmul" or node.dtype != "f32":
        return inputs
    return [i.inputs[0] if _widens_16_bits(i) else i for i in inputs]


# Views of a float32 copy of a bfloat16 array become the float32 copy of the same view of the
# array: the cast reaches the op reading the view, which then reads the array as it is (a
# matmul) or widens it in its own loop, where before the copy was made whole for the view.
_CAST_MOVES_PAST = ("transpose", "reshape")


def _widened_view(graph: Graph, view: Value, narrow: Value) -> Value:
    """view of narrow's float32 copy as the float32 copy of the same view of narrow."""
    type_ = TensorType(narrow.dtype, view.shape)
    moved = _add(graph, Value(view.op, (narrow,), view.attrs, type_, view.loc))
    return _add(graph, Value("astype", (moved,), {"dtype": "f32"}, view.type, view.loc))


def _widens_16_bits(value: Value) -> bool:
    return (
        value.op == "astype"
        and value.dtype == "f32"
        and is_half(value.inputs[0].dtype)
        and not _literal_source(value.inputs[0])
    )


def _drop_unread_widenings(graph: Graph, origin: dict) -> None:
    """Remove the float32 copies of bfloat16 arrays that no node and no output reads any
    more: every reader was a matmul reading the array as it is, or a view (_widened_view)."""
    drop_unread(graph, origin, _widens_16_bits)


def drop_unread(graph: Graph, origin: dict, removable) -> None:
    """Remove the nodes `removable` accepts that no node and no output reads any more."""
    read = set(graph.outputs)
    unread = set()
    for node in reversed(graph.nodes):
        if node not in read and removable(node):
            unread.add(node)
        else:
            read.update(node.inputs)
    if unread:
        graph.nodes[:] = [n for n in graph.nodes if n not in unread]
        for node in unread:
            origin.pop(node, None)


def _literal_source(value: Value) -> bool:
    while moves_data(value.op) and value.inputs:
        value = value.inputs[0]
    return value.op == "full"


def _half_matmul(graph: Graph, node: Value, inputs: list[Value]) -> Value:
    attrs = {**node.attrs, "dtype": "f32"}
    product = _add(graph, Value("matmul", inputs, attrs, TensorType("f32", node.shape), node.loc))
    return _cast(graph, product, node.dtype, node.loc)


def _add(graph: Graph, value: Value) -> Value:
    graph.nodes.append(value)
    return value


def _astype(graph: Graph, value: Value, dtype: str, loc) -> Value:
    if value.dtype == dtype:
        return value
    if value.op == "full" and is_half(value.dtype) and dtype == "f32":
        return _add(graph, _widened_literal(value, loc))
    return _add(
        graph, Value("astype", (value,), {"dtype": dtype}, TensorType(dtype, value.shape), loc)
    )


def _widened_literal(full: Value, loc) -> Value:
    """A 16-bit literal read as float32: the float32 literal of its rounded value, so the read
    costs no kernel (a cast would be a loop of its own, and every loop reading it would have
    to wait for that one: fused chains were split around it)."""
    rounded = np.asarray(full.attrs["value"], np_dtype(full.dtype)).astype(np.float32)
    attrs = {**full.attrs, "value": float(rounded), "dtype": "f32"}
    return Value("full", (), attrs, TensorType("f32", full.shape), loc)


def _cast(graph: Graph, value: Value, dtype: str, loc) -> Value:
    """A cast into or out of 16 bits goes through float32: bf16 <-> f16 and f64 -> bf16 round
    once, from float32 (f64 -> 16 bits rounds twice, as the compiled kernels do)."""
    if (is_half(dtype) or is_half(value.dtype)) and "f32" not in (dtype, value.dtype):
        value = _astype(graph, value, "f32", loc)
    return _astype(graph, value, dtype, loc)


def _in_float32(graph: Graph, node: Value, inputs: list[Value]) -> Value:
    wide = [_astype(graph, i, "f32", node.loc) if is_half(i.dtype) else i for i in inputs]
    attrs = compute_attrs(node.attrs)
    type_ = get_op(node.op).infer([i.type for i in wide], attrs)
    result = _add(graph, Value(node.op, wide, attrs, type_, node.loc))
    return _cast(graph, result, node.dtype, node.loc)
