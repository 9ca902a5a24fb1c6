"""The SSA graph: every node produces exactly one value, so a node and its value are one object."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress, count
from operator import is_not

import numpy as np

from .printer import format_graph
from .types import TensorType

_ids = count()


class Value:
    """One SSA value: the op that makes it, its inputs, attributes, type and the user's line."""

    __slots__ = ("op", "inputs", "attrs", "type", "loc", "role", "uid")

    def __init__(self, op, inputs, attrs, type_, loc=None, role=None):
        self.op: str = op
        self.inputs: tuple[Value, ...] = tuple(inputs)
        self.attrs: dict = dict(attrs)
        self.type: TensorType = type_
        self.loc: tuple[str, int] | None = loc
        self.role: str | None = role  # graph inputs only: "arg", "cotangent" or "saved"
        self.uid = next(_ids)

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def loc_text(self) -> str:
        if self.loc is None:
            return "<unknown>"
        return f"{self.loc[0]}:{self.loc[1]}"

    def __repr__(self) -> str:
        return f"<Value {self.op} {self.type} #{self.uid}>"


@dataclass
class Graph:
    """Inputs, nodes in a valid execution order, outputs, and the constant arrays nodes name."""

    name: str = "main"
    inputs: list[Value] = field(default_factory=list)
    nodes: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    # A joint graph's (value_and_grad): why its gradients read each forward value, the
    # derivative rules that asked, as autodiff's walk heard them (append_gradients). Passes
    # move them onto the values standing for the old ones (carry_reasons); explain reads them.
    reasons: dict[Value, str] = field(default_factory=dict, repr=False, compare=False)
    # The graph whose inputs and first nodes are this one's own objects (copy_graph's `keep`:
    # a memory plan that recomputes only after them shares them) and, on that graph, a weak
    # reference to the grouping of the latest plan lowered from a graph sharing them
    # (ir/grouping_resume.py), where the next one resumes. Nothing may mutate a shared value:
    # every pass that changes one copies its graph first.
    shares_prefix_of: Graph | None = field(default=None, repr=False, compare=False)
    sharer_grouped: object = field(default=None, repr=False, compare=False)

    def add_input(self, type_: TensorType, role: str = "arg", loc=None) -> Value:
        value = Value("input", (), {}, type_, loc=loc, role=role)
        self.inputs.append(value)
        return value

    def add_constant(self, array: np.ndarray) -> str:
        name = f"k{len(self.constants)}"
        while name in self.constants:
            name += "_"
        self.constants[name] = array
        return name

    def __str__(self) -> str:
        return format_graph(self)

    def users(self) -> dict[Value, list[Value]]:
        result: dict[Value, list[Value]] = {v: [] for v in self.inputs + self.nodes}
        for node in self.nodes:
            for inp in node.inputs:
                result.setdefault(inp, []).append(node)
        return result


def joined_reason(known: str | None, reason: str) -> str:
    """Every derivative rule that reads a value, in walk order, each once ("; "-joined)."""
    if known is None:
        return reason
    parts = known.split("; ")
    return "; ".join(parts + [r for r in reason.split("; ") if r not in parts])


def carry_reasons(old: Graph, new: Graph, mapping: dict[Value, Value] | None = None) -> Graph:
    """new, given old's reasons on the values standing for theirs (mapping, else the same
    value), for those still in new. Returns new."""
    if not old.reasons:
        return new
    present = set(new.inputs) | set(new.nodes)
    mapping = mapping or {}
    for value, reason in old.reasons.items():
        now = mapping.get(value, value)
        if now in present:
            new.reasons[now] = joined_reason(new.reasons.get(now), reason)
    return new


def shared_prefix(nodes: list[Value], others: list[Value]) -> int:
    """How many first nodes of the two lists are the same objects (copy_graph's `keep`)."""
    shorter = min(len(nodes), len(others))
    return next(compress(count(), map(is_not, nodes, others)), shorter)


def copy_graph(
    graph: Graph, name: str | None = None, keep: int = 0
) -> tuple[Graph, dict[Value, Value]]:
    """A structural copy with fresh values, so passes never mutate a graph someone else holds.
    keep > 0: the inputs and the first `keep` nodes are graph's own objects, not copies
    (`shares_prefix_of`), for a caller that changes only the nodes after them: a memory
    plan's rows share the part before their first recomputed value (ir/remat.py), and their
    lowerings resume there (ir/grouping_resume.py)."""
    keep = keep if keep > 0 and all(i.role for i in graph.inputs) else 0  # else copied as ever
    mapping: dict[Value, Value] = {}
    new = Graph(name=name or graph.name, constants=dict(graph.constants))
    if keep:
        new.inputs = list(graph.inputs)
        new.nodes = graph.nodes[:keep]
        new.shares_prefix_of = graph
        mapping = dict(zip(new.inputs, new.inputs, strict=True))
        mapping.update(zip(new.nodes, new.nodes, strict=True))
    else:
        for inp in graph.inputs:
            mapping[inp] = new.add_input(inp.type, role=inp.role or "arg", loc=inp.loc)
    read, nodes = mapping.__getitem__, new.nodes
    for node in graph.nodes[keep:] if keep else graph.nodes:
        nodes.append(_copied(node, tuple(map(read, node.inputs))))
        mapping[node] = nodes[-1]
    new.outputs = [mapping[o] for o in graph.outputs]
    # carry_reasons, knowing every value of the copy is one of mapping's (no set of them built:
    # the memory planner copies a 10,000-node graph for each plan it weighs)
    for value, reason in graph.reasons.items():
        now = mapping.get(value)
        if now is not None:
            new.reasons[now] = joined_reason(new.reasons.get(now), reason)
    return new, mapping


def _copied(node: Value, inputs: tuple) -> Value:
    """Value(node.op, inputs, node.attrs, node.type, node.loc), its slots set directly: the
    memory planner copies a 10,000-node graph for each plan it weighs, and the constructor's
    call and conversions were a fifth of the copy."""
    value = _new_value(Value)
    value.op, value.inputs, value.attrs = node.op, inputs, dict(node.attrs)
    value.type, value.loc, value.role, value.uid = node.type, node.loc, None, next(_ids)
    return value


_new_value = Value.__new__


def inline_graph(target: Graph, source: Graph, args: list[Value]) -> list[Value]:
    """Append source's nodes to target with source's inputs bound to args; returns its outputs."""
    mapping = dict(zip(source.inputs, args, strict=True))
    renamed = {}
    for cname, array in source.constants.items():
        renamed[cname] = target.add_constant(array)
    for node in source.nodes:
        attrs = node.attrs
        if node.op == "const":
            attrs = {**attrs, "name": renamed[attrs["name"]]}
        mapping[node] = Value(
            node.op, [mapping[i] for i in node.inputs], attrs, node.type, node.loc
        )
        target.nodes.append(mapping[node])
    for value, reason in source.reasons.items():  # why its gradients read a value, for explain
        if value in mapping:
            now = mapping[value]
            target.reasons[now] = joined_reason(target.reasons.get(now), reason)
    return [mapping[o] for o in source.outputs]
