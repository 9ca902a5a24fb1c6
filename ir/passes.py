"""Cleanup passes: pure functions Graph -> Graph. Inputs keep their identity; nodes are rebuilt."""

from __future__ import annotations

import math

from .graph import Graph, Value, carry_reasons


def _rebuild(graph: Graph, nodes: list[Value], outputs: list[Value], mapping=None) -> Graph:
    """A new graph of nodes, keeping graph's inputs, constants and (through mapping, old value
    -> the value standing for it) its derivative reasons."""
    new = Graph(graph.name, list(graph.inputs), nodes, outputs, dict(graph.constants))
    return carry_reasons(graph, new, mapping)


def dead_code_elimination(graph: Graph) -> Graph:
    live = set(graph.outputs)
    for node in reversed(graph.nodes):
        if node in live:
            live.update(node.inputs)
    used = {n.attrs["name"] for n in graph.nodes if n in live and n.op == "const"}
    result = _rebuild(graph, [n for n in graph.nodes if n in live], list(graph.outputs))
    result.constants = {k: v for k, v in graph.constants.items() if k in used}
    return result


def attr_key(attrs: dict):
    """A hashable, order-independent key for a node's attributes (CSE, eager program cache)."""
    return tuple(sorted((k, repr(v)) for k, v in attrs.items()))


def common_subexpression_elimination(graph: Graph) -> Graph:
    seen: dict[tuple, Value] = {}
    mapping: dict[Value, Value] = {}
    nodes = []
    for node in graph.nodes:
        inputs = tuple(mapping.get(i, i) for i in node.inputs)
        key = (node.op, tuple(id(i) for i in inputs), attr_key(node.attrs), node.type)
        if key in seen:
            mapping[node] = seen[key]
            continue
        new = Value(node.op, inputs, node.attrs, node.type, node.loc)
        seen[key] = mapping[node] = new
        nodes.append(new)
    return _rebuild(graph, nodes, [mapping.get(o, o) for o in graph.outputs], mapping)


def _is_scalar_const(value: Value, number) -> bool:
    """A filled constant of any shape; callers check the result type is unchanged."""
    return value.op == "full" and value.attrs["value"] == number


def _simplified(node: Value, inputs: tuple[Value, ...]) -> Value | None:
    """The existing value a node equals, or None. Only rewrites that keep type and exact values."""
    op = node.op
    same_type = [i for i in inputs if i.type == node.type]
    if op in ("mul", "div") and _is_scalar_const(inputs[1], 1) and inputs[0].type == node.type:
        return inputs[0]
    if op == "mul" and _is_scalar_const(inputs[0], 1) and inputs[1].type == node.type:
        return inputs[1]
    if op in ("add", "sub") and _is_scalar_const(inputs[1], 0) and inputs[0].type == node.type:
        return inputs[0]
    if op == "add" and _is_scalar_const(inputs[0], 0) and inputs[1].type == node.type:
        return inputs[1]
    if op == "neg" and inputs[0].op == "neg":
        return inputs[0].inputs[0]
    if op in ("reshape", "broadcast_to", "astype") and same_type:
        return inputs[0]
    if op == "transpose" and node.attrs["perm"] == tuple(range(len(node.shape))):
        return inputs[0]
    if op == "transpose" and inputs[0].op == "transpose" and undoes(node, inputs[0]):
        return inputs[0].inputs[0]  # x.T.T: torch's F.linear(x, w.T) imports as two permutes
    if op == "sum" and not node.attrs["axes"] and same_type:
        return inputs[0]
    return None


def algebraic_simplification(graph: Graph) -> Graph:
    mapping: dict[Value, Value] = {}
    nodes = []
    for node in graph.nodes:
        inputs = tuple(mapping.get(i, i) for i in node.inputs)
        replacement = _simplified(node, inputs)
        if replacement is not None:
            mapping[node] = replacement
            continue
        if node.op == "reshape" and inputs[0].op == "reshape":
            inputs = inputs[0].inputs
        if node.op in ("reshape", "broadcast_to") and inputs[0].op == "full":
            attrs = {**inputs[0].attrs, "shape": node.shape}  # a reshaped constant is a constant
            new = Value("full", (), attrs, node.type, node.loc)
            mapping[node] = new
            nodes.append(new)
            continue
        new = Value(node.op, inputs, node.attrs, node.type, node.loc)
        mapping[node] = new
        nodes.append(new)
    return _rebuild(graph, nodes, [mapping.get(o, o) for o in graph.outputs], mapping)


def undoes(outer: Value, inner: Value) -> bool:
    """outer's transpose puts back every axis inner's moved. Only this pair is dropped: other
    pairs stay two views, as the patterns later passes look for (attention's head layouts)
    are written."""
    first, then = inner.attrs["perm"], outer.attrs["perm"]
    return tuple(first[axis] for axis in then) == tuple(range(len(then)))


def _rewrite(graph: Graph, matches, expand, made: dict | None = None) -> Graph:
    """The graph with every node `matches` accepts replaced by what `expand(builder, node,
    inputs)` builds from the (rewritten) inputs, at the node's source line. `made`, when given,
    receives old node -> the new nodes standing for it, in order (the last is its value)."""
    from .builder import Builder

    if not any(matches(n) for n in graph.nodes):
        return graph
    mapping: dict[Value, Value] = {}
    result = _rebuild(graph, [], [])
    for node in graph.nodes:
        inputs = tuple(mapping.get(i, i) for i in node.inputs)
        start = len(result.nodes)
        if matches(node):
            mapping[node] = expand(Builder(result, node.loc), node, inputs)
        else:
            mapping[node] = Value(node.op, inputs, node.attrs, node.type, node.loc)
            result.nodes.append(mapping[node])
        if made is not None:
            made[node] = result.nodes[start:] or [mapping[node]]
    result.outputs = [mapping.get(o, o) for o in graph.outputs]
    return carry_reasons(graph, result, mapping)


def flatten_shared_matmuls(graph: Graph) -> Graph:
    """x[..., m, k] @ w[k, n] as one (batch * m) x k @ k x n product: every batch shares w, so
    one GEMM does what a loop of small ones did, and the derivative the rule then builds for w
    is one (batch * m)-deep product too, instead of a product per batch element written out
    and summed (a transformer block's weight gradients: 8 MiB written and read back per
    matmul). Only where x is computed, a plan input or a reshape, so flattening it costs
    nothing (a transposed view stays batched: flattening it would copy it)."""
    from .registry import get_op

    def plain(value: Value) -> bool:
        if value.op in ("input", "reshape"):
            return True  # a reshape that is not a view is a copy already: flattening it is free
        return value.op != "const" and get_op(value.op).fusion in ("elementwise", "reduction",
                                                                   "opaque")  # fmt: skip

    def flattens(node: Value) -> bool:
        return (
            node.op == "matmul"
            and len(node.shape) > 2
            and len(node.inputs[1].shape) == 2
            and plain(node.inputs[0])
        )

    def flat(b, node: Value, inputs: tuple) -> Value:
        x, w = inputs
        rows = math.prod(x.shape[:-1])  # not size // features: features may be 0
        product = b.matmul(b.reshape(x, shape=(rows, x.shape[-1])), w)
        return b.reshape(product, shape=node.shape)

    return _rewrite(graph, flattens, flat)


def expand_layer_norm(graph: Graph, made: dict | None = None) -> Graph:
    """Rewrite layer_norm into the primitives its derivative rule uses, in the same order
    (ir/ops/nn.py normalise_last_axis), so common-subexpression elimination shares them with
    the gradient and fusion can make one loop over each row of its statistics, its
    normalisation and the elementwise ops around it (as one call it wrote its whole output and
    the next loop read it back). Every compiled plan does it; eager one-op regions do not.
    `made`: see _rewrite."""
    from .ops.nn import as_dtype, normalise_last_axis

    def expand(b, node: Value, inputs: tuple) -> Value:
        _, _, y = normalise_last_axis(b, inputs[0], node.attrs["eps"])  # float32 for 16-bit
        if len(inputs) == 3:
            y = b.add(b.mul(y, as_dtype(b, inputs[1], y.dtype)), as_dtype(b, inputs[2], y.dtype))
        return as_dtype(b, y, node.dtype)  # one rounding, as layer_norm's own

    return _rewrite(graph, lambda n: n.op == "layer_norm", expand, made)


def expand_tanh_gelu(graph: Graph) -> Graph:
    """Rewrite tanh-form gelu into the primitives its derivative rule uses, in the same order,
    so common-subexpression elimination computes the tanh once for both: where forward and
    backward live in one graph (joint plans), or a backward that recomputes the gelu's input
    (region plans). A forward alone keeps gelu as one op: nothing there shares its tanh."""
    from .ops.elementwise import GELU_C, GELU_K

    def expand(b, node: Value, inputs: tuple) -> Value:
        (x,), dt = inputs, node.dtype
        x2 = b.mul(x, x)
        inner = b.mul(b.scalar(GELU_K, dt), b.add(x, b.mul(b.scalar(GELU_C, dt), b.mul(x2, x))))
        half_x = b.mul(b.scalar(0.5, dt), x)
        return b.mul(half_x, b.add(b.scalar(1, dt), b.tanh(inner)))

    return _rewrite(graph, lambda n: n.op == "gelu" and n.attrs["approximate"] == "tanh", expand)
