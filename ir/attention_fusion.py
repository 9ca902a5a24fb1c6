"""Attention written by hand, softmax(q @ k^T * c) @ v, becomes the fused attention op.

Unfused, the (..., T, S) scores and probabilities are written and read several times, and
backward keeps the probabilities; fused, they live in a per-row-block workspace and backward
recomputes them (ir/ops/attention.py). The rewrite applies only where nothing else reads the
scores or the probabilities (returning the attention weights keeps the unfused form), the
softmax runs over the key axis, k^T is a transpose of k's last two axes, the scale is a
Python number (`full` of shape ()), and q, k, v share their leading axes (no broadcasting).
"""

from __future__ import annotations

import math

from .errors import BackplanError
from .graph import Graph, Value
from .ops.attention import attention_type
from .types import is_float


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
    users = _users(graph)
    found = {node: m for node in graph.nodes if (m := match(node, users)) is not None}
    if not found:
        return graph
    mapping: dict[Value, Value] = {}
    nodes = []
    for node in graph.nodes:
        if node in found:
            q, k, v, scale = (mapping.get(x, x) if isinstance(x, Value) else x for x in found[node])
            attrs = {"scale": scale, "causal": False}
            new = Value("attention", (q, k, v), attrs, node.type, node.loc)
        else:
            inputs = tuple(mapping.get(i, i) for i in node.inputs)
            new = Value(node.op, inputs, node.attrs, node.type, node.loc)
        mapping[node] = new
        nodes.append(new)
    outputs = [mapping.get(o, o) for o in graph.outputs]
    return Graph(graph.name, list(graph.inputs), nodes, outputs, dict(graph.constants))
