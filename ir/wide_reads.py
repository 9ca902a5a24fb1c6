"""A float64 matmul reads a float32 value as it is where the plan widens it for the matmul (a
float64 step's saved value kept in float32, `saved_dtype=bp.float32`, read back as a float64
copy by a weight gradient's product): backplan's GEMM widens it while packing
(codegen/kernels/gemm/symbols.py `backplan_gemm_f32_f64`), exactly, so the float64 copy is
neither made nor held. A transpose of the copy becomes the copy of the transpose, which the
matmul then reads as it is. The lowering applies it (ir/lowering.py _prepared) to plans with no
16-bit value (ir/widen.py does the same for 16-bit copies beside float32); the reference
interpreter runs the plan as it was (the same values: the widening is exact)."""

from __future__ import annotations

from .graph import Graph, Value
from .types import TensorType
from .widen import drop_unread, has_half

_MOVES_PAST = ("transpose",)


def reads_wide_copies(graph: Graph, half: bool | None = None) -> bool:
    """Whether a float64 matmul of graph (no 16-bit values) reads a float64 copy of a float32
    value, directly or through a transpose. half: has_half(graph), where the caller asked it."""
    if has_half(graph) if half is None else half:
        return False
    return any(
        n.op == "matmul"
        and n.dtype == "f64"
        and any(
            _wide_copy(i) or (i.op in _MOVES_PAST and _wide_copy(i.inputs[0])) for i in n.inputs
        )
        for n in graph.nodes
    )


def wide_copies_read_as_is(graph: Graph) -> tuple[Graph, dict[Value, Value]]:
    """graph with those matmuls reading the float32 values, and for each node of the result
    the node of graph it computes."""
    new = Graph(graph.name, list(graph.inputs), [], [], dict(graph.constants))
    mapping: dict[Value, Value] = {v: v for v in graph.inputs}
    origin: dict[Value, Value] = {}
    for node in graph.nodes:
        inputs = [mapping[i] for i in node.inputs]
        start = len(new.nodes)
        if node.op in _MOVES_PAST and _wide_copy(inputs[0]):
            narrow = inputs[0].inputs[0]
            moved = _add(
                new, Value(node.op, (narrow,), node.attrs, TensorType("f32", node.shape), node.loc)
            )
            mapping[node] = _add(
                new, Value("astype", (moved,), {"dtype": "f64"}, node.type, node.loc)
            )
        elif node.op == "matmul" and node.dtype == "f64" and node.attrs.get("dtype") is None:
            read = list(inputs)
            for k, value in enumerate(inputs):  # one operand at most: the other stays float64
                if _wide_copy(value):
                    read[k] = value.inputs[0]
                    break
            attrs = {**node.attrs, "dtype": "f64"} if read != inputs else node.attrs
            mapping[node] = _add(new, Value("matmul", tuple(read), attrs, node.type, node.loc))
        else:
            mapping[node] = _add(
                new, Value(node.op, tuple(inputs), node.attrs, node.type, node.loc)
            )
        for value in new.nodes[start:]:
            origin[value] = node
    new.outputs = [mapping[o] for o in graph.outputs]
    _drop_unread_copies(new, origin)
    return new, origin


def _wide_copy(value: Value) -> bool:
    return (
        value.op == "astype"
        and value.dtype == "f64"
        and value.inputs[0].dtype == "f32"
        and value.inputs[0].op != "full"
    )


def _add(graph: Graph, value: Value) -> Value:
    graph.nodes.append(value)
    return value


def _drop_unread_copies(graph: Graph, origin: dict) -> None:
    """Remove the float64 copies (and moved views' copies) nothing reads any more."""
    drop_unread(graph, origin, _wide_copy)
