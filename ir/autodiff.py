"""Reverse-mode autodiff over a graph, written with the registry's derivative rules.

Two forms share one walk:
- `backward_graph`: a separate backward graph whose inputs are the output cotangents and the
  saved forward values, for regions that run forward now and backward later;
- `append_gradients`: gradients appended to the forward graph itself, for value_and_grad, so
  forward and backward are one plan (and can be differentiated again).
"""

from __future__ import annotations

from dataclasses import dataclass

from .builder import Builder, VjpContext
from .errors import BackplanError
from .graph import Graph, Value, joined_reason
from .registry import get_op
from .types import is_float


@dataclass
class SavedValue:
    """A forward value the backward reads, and the first derivative rule that asked for it."""

    forward: Value
    backward_input: Value
    reason: str


def needs_grad(graph: Graph, wrt: list[bool]) -> set[Value]:
    """Values that depend on a differentiated input through differentiable float ops."""
    active = {v for v, w in zip(graph.inputs, wrt, strict=True) if w and is_float(v.dtype)}
    for node in graph.nodes:
        if (
            get_op(node.op).differentiable
            and is_float(node.dtype)
            and any(i in active for i in node.inputs)
        ):
            active.add(node)
    return active


def reaching_inputs(graph: Graph, wrt: list[bool]) -> list[bool]:
    """wrt narrowed to inputs that can reach a float output through differentiable ops, so an
    input cut off by stop_gradient (detach) gets no gradient at all, not a zero one."""
    active = needs_grad(graph, wrt)
    reaches = {o for o in graph.outputs if o in active}
    for node in reversed(graph.nodes):
        if node in reaches and get_op(node.op).differentiable:
            reaches.update(i for i in node.inputs if i in active)
    return [w and v in reaches for v, w in zip(graph.inputs, wrt, strict=True)]


def _walk(graph: Graph, active: set[Value], seeds: dict[Value, Value], target: Graph, lookup):
    cotangents = dict(seeds)
    for node in reversed(graph.nodes):
        g = cotangents.pop(node, None)
        if g is None or node not in active:
            continue
        opdef = get_op(node.op)
        needs = [i in active for i in node.inputs]
        ctx = VjpContext(node, Builder(target, node.loc), lookup, needs)
        grads = opdef.vjp(ctx, g)
        for inp, grad, need in zip(node.inputs, grads, needs, strict=True):
            if not need or grad is None:
                continue
            if grad.type != inp.type:
                raise BackplanError(
                    f"{node.op} derivative gave {grad.type} for an input of type {inp.type}"
                )
            prev = cotangents.get(inp)
            cotangents[inp] = grad if prev is None else Builder(target, inp.loc).add(prev, grad)
    return cotangents


def _input_grads(graph, wrt, cotangents, builder: Builder) -> list[Value]:
    grads = []
    for inp, w in zip(graph.inputs, wrt, strict=True):
        if not w:
            continue
        grads.append(cotangents.get(inp) or builder.zeros(inp.type))
    return grads


def backward_graph(graph: Graph, wrt: list[bool]) -> tuple[Graph, list[SavedValue]]:
    """Backward graph: inputs are one cotangent per float output, then the saved values;
    outputs are the gradients of the inputs flagged in wrt, in order."""
    active = needs_grad(graph, wrt)
    bwd = Graph(name=f"{graph.name}_backward", constants=dict(graph.constants))
    seeds = {}
    for out in graph.outputs:
        if is_float(out.dtype):
            ct = bwd.add_input(out.type, role="cotangent", loc=out.loc)
            if out in active and out not in seeds:
                seeds[out] = ct
            elif out in active:
                seeds[out] = Builder(bwd, out.loc).add(seeds[out], ct)
    saved: dict[Value, SavedValue] = {}

    def lookup(value: Value, reason: str) -> Value:
        if value.op in ("full", "const"):  # constants are rebuilt, never saved
            copy = Value(value.op, (), value.attrs, value.type, value.loc)
            bwd.nodes.append(copy)
            return copy
        if value not in saved:
            saved[value] = SavedValue(value, bwd.add_input(value.type, role="saved"), reason)
        else:
            saved[value].reason = joined_reason(saved[value].reason, reason)
        return saved[value].backward_input

    cotangents = _walk(graph, active, seeds, bwd, lookup)
    bwd.outputs = _input_grads(graph, wrt, cotangents, Builder(bwd))
    return bwd, list(saved.values())


def append_gradients(graph: Graph, wrt: list[bool], output_index: int = 0) -> list[Value]:
    """Append d(outputs[output_index])/d(inputs in wrt) to graph itself; returns the gradients.
    Why each forward value is read (the rules that ask) is recorded in `graph.reasons`."""
    out = graph.outputs[output_index]
    if out.shape != () or not is_float(out.dtype):
        raise BackplanError(
            f"grad needs a scalar float output, got {out.type}; sum it or pass has_aux"
        )
    active = needs_grad(graph, wrt)
    builder = Builder(graph, out.loc)
    seeds = {out: builder.scalar(1, out.dtype)} if out in active else {}

    def lookup(value: Value, reason: str) -> Value:
        graph.reasons[value] = joined_reason(graph.reasons.get(value), reason)
        return value

    cotangents = _walk(graph, active, seeds, graph, lookup)
    return _input_grads(graph, wrt, cotangents, builder)
