"""How much arithmetic a node costs, for the planner that trades memory for recomputation
(ir/budget.py). An op whose work is not proportional to its output (matmul, conv, attention)
says so in its registry entry (`OpDef.flops`); the rest are estimated per output element from
their cost class, which is enough to rank a `tanh` above an `add` and both far below a GEMM."""

from __future__ import annotations

from .graph import Value
from .registry import get_op

PER_ELEMENT = {"free": 0, "cheap": 1, "one_pass": 8, "costly": 20}


def node_flops(node: Value) -> int:
    """Estimated floating-point operations of one run of node (0 for graph inputs).

    >>> from backplan.ir.graph import Value
    >>> from backplan.ir.types import TensorType
    >>> a = Value("input", (), {}, TensorType("f32", (4, 3)))
    >>> b = Value("input", (), {}, TensorType("f32", (3, 5)))
    >>> node_flops(Value("matmul", (a, b), {}, TensorType("f32", (4, 5))))
    120
    """
    if node.op == "input":
        return 0
    opdef = get_op(node.op)
    if opdef.flops is not None:
        return int(opdef.flops([i.type for i in node.inputs], node.type, node.attrs))
    size = max([node.type.size, *(i.type.size for i in node.inputs)])
    return PER_ELEMENT[opdef.cost] * size
