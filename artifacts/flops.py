"""How much arithmetic a plan does per call, counted from its IR before anything runs, so
`inspect` can report it and `bp.load(max_flops=...)` can refuse a plan that would compute for
hours.

The count is the usual estimate: a matmul is 2*m*n*k (times its batch), an elementwise op one
per output element, a reduction one per input element, a gather or copy one per element moved;
sources and views are free. Transcendentals count as one: it bounds work, it is not a timing.
"""

from __future__ import annotations

from backplan.ir.graph import Graph, Value
from backplan.ir.registry import get_op

FREE_CLASSES = ("source", "view")


def node_flops(node: Value) -> int:
    """FLOPs of one IR node (see the module docstring for the rule)."""
    if node.op == "input":
        return 0
    fusion = get_op(node.op).fusion
    if fusion in FREE_CLASSES:
        return 0
    if node.op == "matmul":
        return 2 * node.type.size * node.inputs[0].shape[-1]
    if fusion == "reduction":
        return max((value.type.size for value in node.inputs), default=0)
    return node.type.size


def graph_flops(graph: Graph) -> int:
    """FLOPs of one run of a graph: the sum over its nodes."""
    return sum(node_flops(node) for node in graph.nodes)
