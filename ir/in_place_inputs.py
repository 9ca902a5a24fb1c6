"""F-order arguments read where they live: a Fortran array, or a matrix passed transposed
(`w.T`), is the transpose of a C-ordered array of the reversed shape. The lowering of a plan
taking one (Plan.copied, ir/argument_layout.py) takes that C-ordered array as its input instead
and reads the argument as a `transpose` view of it: a GEMM takes it as its transpose flag, a
loop reads it strided, and any kernel that needs it C-contiguous gets a copy the memory planner
places and explain's peak counts (ir/strided_copies.py, which runs next). The compiled call
passes `array.T`, a view (codegen/run/compiled.py): no copy of the whole argument at every call.

The reference interpreter runs the plan as it was (LoweredPlan.interpreted), on the arrays as
given. A donated input, or one an output lives in, keeps its copy (their buffers are paired
with outputs of the argument's own shape).
"""

from __future__ import annotations

from .graph import Graph, Value, carry_reasons
from .layout import storage_root
from .liveness import Plan, plan_liveness
from .types import TensorType

F_ORDER = "F-order"


def in_place_inputs(plan: Plan) -> tuple[tuple[int, str], ...]:
    """(input, layout) of the copied inputs the lowering reads in place: F-order, 2-D or more,
    neither donated nor the storage of an output."""
    if not plan.copied:
        return ()
    inputs = plan.graph.inputs
    kept = {storage_root(o) for o in plan.graph.outputs}
    return tuple(
        (i, word)
        for i, word in plan.copied
        if word == F_ORDER
        and len(inputs[i].shape) >= 2
        and i not in plan.donated
        and inputs[i] not in kept
    )


def read_in_place(
    plan: Plan, origin: dict | None, sources: dict | None = None
) -> tuple[Plan, dict | None]:
    """(plan taking the C-ordered transpose of each input `in_place_inputs` names, read as a
    transpose view of it; origin for its nodes). The same plan and origin when there is none.
    sources, if given, gets each new node -> the value of `plan` it computes (the view: the
    input it stands for), for the reference interpreter's rounding (ir/rounding_points.py)."""
    chosen = in_place_inputs(plan)
    if not chosen:
        return plan, origin
    graph = plan.graph
    inputs, mapping, views = list(graph.inputs), {}, []
    for i, _ in chosen:
        value = inputs[i]
        n = len(value.shape)
        base = Value(
            "input", (), {}, TensorType(value.dtype, value.shape[::-1]), value.loc, value.role
        )
        inputs[i] = base
        view = Value("transpose", [base], {"perm": tuple(range(n))[::-1]}, value.type, value.loc)
        mapping[value] = view
        views.append(view)
        if sources is not None:
            sources[view] = value
    nodes, source = list(views), {}
    for node in graph.nodes:
        if node.op == "transpose" and mapping.get(node.inputs[0]) in views:
            made = mapping[node] = _composed(mapping[node.inputs[0]], node, nodes, views)
            if made.op != "input":
                source[made] = node if origin is None else origin.get(node)
                if sources is not None:
                    sources[made] = node
            continue
        if any(v in mapping for v in node.inputs):
            made = Value(
                node.op, [mapping.get(v, v) for v in node.inputs], node.attrs, node.type, node.loc
            )
            mapping[node] = made
            if sources is not None:
                sources[made] = node
        else:
            made = node
        nodes.append(made)
        source[made] = node if origin is None else origin.get(node)
    outputs = [mapping.get(o, o) for o in graph.outputs]
    used = {v for n in nodes for v in n.inputs} | set(outputs)
    nodes = [n for n in nodes if n not in views or n in used]  # a view only w.T read: none
    new = Graph(graph.name, inputs, nodes, outputs, dict(graph.constants))
    carry_reasons(graph, new, mapping)
    read = plan_liveness(new, plan.donated)
    read.shared = plan.shared
    read.copied = tuple(c for c in plan.copied if c not in chosen)
    read.in_place = chosen
    return read, {v: s for v, s in source.items() if s is not None}


def _composed(view: Value, node: Value, nodes: list, views: list) -> Value:
    """node, a transpose of `view` (itself a transpose of a base input), as one transpose of
    the base, or the base itself where the two undo each other: `w.T` of an F-order `w` is
    the C-ordered array the call passes."""
    base, first, then = view.inputs[0], view.attrs["perm"], node.attrs["perm"]
    perm = tuple(first[k] for k in then)
    if perm == tuple(range(len(perm))):
        return base
    made = Value("transpose", [base], {"perm": perm}, node.type, node.loc)
    nodes.append(made)
    views.append(made)
    return made
