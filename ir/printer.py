"""Printing the text form (see ir/text.py): value names given at print time, one line per node
with its type and the user's file:line. Needs nothing but the values it is handed, so the
graph itself can print without importing the parser."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .graph import Graph, Value


def value_names(graph: Graph) -> dict[Value, str]:
    names = {}
    for value in graph.inputs + graph.nodes:
        names[value] = f"%{len(names)}"
    return names


def format_attr(value) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, tuple | list):
        inner = ", ".join(format_attr(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def format_loc(loc) -> str:
    """`model.py:41`; a location that names the module it came from (an imported PyTorch
    model's `scope`) reads `layer2.0.conv1 at model.py:41`."""
    if not loc:
        return ""
    scope = getattr(loc, "scope", None)
    where = f"{os.path.basename(loc[0])}:{loc[1]}"
    return f"{scope} at {where}" if scope else where


def format_node(node: Value, names: dict[Value, str]) -> str:
    text = f"{names[node]} = {node.op}"
    if node.inputs:
        text += " " + ", ".join(names[i] for i in node.inputs)
    if node.attrs:
        text += " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in node.attrs.items()) + "}"
    text += f" : {node.type}"
    if node.loc:
        text += f"  # {format_loc(node.loc)}"
    return text


def format_graph(graph: Graph, frees_after: dict[int, list[Value]] | None = None) -> str:
    """frees_after maps a step (index into nodes, -1 for 'before the first node', len(nodes) for
    'after return') to the values freed there."""
    names = value_names(graph)
    frees_after = frees_after or {}
    params = ", ".join(f"{names[v]}: {v.type} {v.role or 'arg'}" for v in graph.inputs)
    lines = [f"graph @{graph.name}({params}) {{"]

    def add_frees(step):
        for value in frees_after.get(step, ()):
            lines.append(f"  free {names[value]}")

    add_frees(-1)
    for step, node in enumerate(graph.nodes):
        lines.append("  " + format_node(node, names))
        add_frees(step)
    lines.append("  return " + ", ".join(names[o] for o in graph.outputs))
    add_frees(len(graph.nodes))
    lines.append("}")
    return "\n".join(lines)
