"""Attention written by hand, softmax(q @ k^T * c) @ v, becomes the fused attention op.

Unfused, the (..., T, S) scores and probabilities are written and read several times, and
backward keeps the probabilities; fused, they live in a per-row-block workspace and backward
recomputes them (ir/ops/attention.py). The rewrite applies only where nothing else reads the
scores or the probabilities (returning the attention weights keeps the unfused form), the
softmax runs over the key axis, k^T is a transpose of k's last two axes, the scale is a
Python number (`full` of shape ()), and q, k, v share their leading axes (no broadcasting).

Then the layout (ir/ops/attention.py): an attention whose only reader is transpose(0, 2, 1, 3),
as in multi-head attention where the heads go back beside the features for the output
projection, becomes a "bthd" attention that writes that transposed result itself. Its q, k
and v are read as (B, T, H, D): a q made by transpose(0, 2, 1, 3) of a reshaped projection is
read as the projection's reshape, with no transpose at all. Unrewritten, the output was copied
to make (B, T, H * D) for the next GEMM, and dq, dk, dv each copied back to (B, T, H * D).
"""

from __future__ import annotations

import math

from .errors import BackplanError
from .graph import Graph, Value
from .ops.attention import HEADS_SWAP, attention_type
from .types import TensorType, is_float


def _users(graph: Graph) -> dict[Value, int]:
    count: dict[Value, int] = {}
    for node in graph.nodes:
        for value in node.inputs:
            count[value] = count.get(value, 0) + 1
    for value in graph.outputs:
        count[value] = count.get(value, 0) + 1
    return count


def _scalar(value: Value) -> float | None:
    if value.op != "full" or value.shape != () or not is_float(value.dtype):
        return None
    number = value.attrs["value"]
    if isinstance(number, bool) or not isinstance(number, int | float):
        return None
    return float(number) if math.isfinite(number) else None


def _swaps_last2(value: Value) -> bool:
    if value.op != "transpose" or len(value.shape) < 2:
        return False
    n = len(value.shape)
    return value.attrs["perm"] == tuple(range(n - 2)) + (n - 1, n - 2)


def _scaled(scores: Value, users: dict) -> tuple[Value, float] | None:
    """(the unscaled product, the scale) of scores = product * c, c * product or product / c."""
    if scores.op not in ("mul", "div") or users.get(scores) != 1:
        return scores, 1.0
    product, c = scores.inputs
    if scores.op == "mul" and _scalar(product) is not None:
        product, c = c, product
    number = _scalar(c)
    if number is None or (scores.op == "div" and number == 0):
        return None
    return product, number if scores.op == "mul" else 1.0 / number


def match(node: Value, users: dict) -> tuple[Value, Value, Value, float] | None:
    """(q, k, v, scale) when node is the final matmul of a hand-written attention."""
    if node.op != "matmul":
        return None
    probs, v = node.inputs
    if probs.op != "softmax" or probs.attrs["axis"] != len(probs.shape) - 1:
        return None
    if users.get(probs) != 1:
        return None
    scaled = _scaled(probs.inputs[0], users)
    if scaled is None:
        return None
    product, scale = scaled
    if product.op != "matmul" or users.get(product) != 1 or not _swaps_last2(product.inputs[1]):
        return None
    q, k = product.inputs[0], product.inputs[1].inputs[0]
    try:
        out = attention_type(q.type, k.type, v.type, "attention")
    except BackplanError:
        return None  # broadcast batch axes, say: the unfused form handles them
    if out != node.type or product.shape != q.shape[:-1] + (k.shape[-2],):
        return None
    return q, k, v, scale


def fuse_attention(graph: Graph) -> Graph:
    """Hand-written attention fused, then laid out for the op that reads it."""
    return choose_layouts(fuse_written(graph))


def fuse_written(graph: Graph) -> Graph:
    users = _users(graph)
    found = {node: m for node in graph.nodes if (m := match(node, users)) is not None}
    if not found:
        return graph
    mapping: dict[Value, Value] = {}
    nodes = []
    for node in graph.nodes:
        if node in found:
            q, k, v, scale = (mapping.get(x, x) if isinstance(x, Value) else x for x in found[node])
            attrs = {"scale": scale, "causal": False, "layout": "bhtd"}
            new = Value("attention", (q, k, v), attrs, node.type, node.loc)
        else:
            inputs = tuple(mapping.get(i, i) for i in node.inputs)
            new = Value(node.op, inputs, node.attrs, node.type, node.loc)
        mapping[node] = new
        nodes.append(new)
    outputs = [mapping.get(o, o) for o in graph.outputs]
    return Graph(graph.name, list(graph.inputs), nodes, outputs, dict(graph.constants))


def _swaps_heads(value: Value) -> bool:
    return value.op == "transpose" and value.attrs["perm"] == HEADS_SWAP


def _heads_last(attention: Value, users: dict) -> bool:
    """attention is a 4-D "bhtd" attention read only by one transpose(0, 2, 1, 3)."""
    return (
        attention.op == "attention"
        and attention.attrs.get("layout", "bhtd") == "bhtd"
        and len(attention.shape) == 4
        and users.get(attention) == 1
    )


def choose_layouts(graph: Graph) -> Graph:
    """Each attention whose only reader is transpose(0, 2, 1, 3) becomes a "bthd" attention in
    its place (the transpose's readers read it); q, k and v are handed over in (B, T, H, D):
    the value under their own head transpose, or a transposed view of them."""
    users = _users(graph)
    readers = {
        node.inputs[0]: node
        for node in graph.nodes
        if _swaps_heads(node) and _heads_last(node.inputs[0], users)
    }
    if not readers:
        return graph
    mapping: dict[Value, Value] = {}
    nodes = []
    for node in graph.nodes:
        if node in readers.values():
            continue  # read through the "bthd" attention that replaced its input
        inputs = tuple(mapping.get(i, i) for i in node.inputs)
        if node in readers:
            inputs = tuple(_tokens_first(x, nodes) for x in inputs)
            new = Value("attention", inputs, {**node.attrs, "layout": "bthd"},
                        readers[node].type, node.loc)  # fmt: skip
            mapping[readers[node]] = new
        else:
            new = Value(node.op, inputs, node.attrs, node.type, node.loc)
        mapping[node] = new
        nodes.append(new)
    outputs = [mapping.get(o, o) for o in graph.outputs]
    return Graph(graph.name, list(graph.inputs), nodes, outputs, dict(graph.constants))


def _tokens_first(value: Value, nodes: list) -> Value:
    """value (B, H, T, D) as (B, T, H, D): what its own head transpose read, or a new view."""
    if _swaps_heads(value):
        return value.inputs[0]
    shape = tuple(value.shape[i] for i in HEADS_SWAP)
    view = Value("transpose", (value,), {"perm": HEADS_SWAP}, TensorType(value.dtype, shape),
                 value.loc)  # fmt: skip
    nodes.append(view)
    return view
