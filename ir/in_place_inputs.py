"""Arguments read where they live. A Fortran array, or a matrix passed transposed (`w.T`), is the
transpose of a C-ordered array of the reversed shape (any other order of the axes, a torch
.permute(), a transpose of the array with its axes sorted by stride); a broadcast view
(np.broadcast_to, expand) is a C-ordered array with the broadcast axes of size 1, broadcast; a
reversed view (a[::-1]) a C-ordered array sliced with step -1; a sliced view (a[:, ::2], a
column slice, mixed kinds) a slice of a C-ordered span of the array it views, transposed and
broadcast (ir/argument_layout.py names each). The lowering of a plan taking one (Plan.copied)
takes that C-ordered array as its input instead and reads the argument as a `transpose`,
`broadcast_to` or `slice` view of it (a chain of them for a sliced one), checked to stay inside
it (ir/verify.py verify_input_views) before anything compiles: a GEMM
takes a transpose as its flag, a loop reads any of them strided (a broadcast axis with stride
0), and any kernel that needs its operand C-contiguous gets a copy the memory planner places and
explain's peak counts (ir/strided_copies.py, which runs next). The compiled call passes the
C-ordered array, a view of the argument (argument_layout.base; codegen/run/compiled.py): no copy
of the whole argument at every call.

The reference interpreter runs the plan as it was (LoweredPlan.interpreted), on the arrays as
given. A donated input, or one an output lives in, keeps its copy (their buffers are paired
with outputs of the argument's own shape).
"""

from __future__ import annotations

from .argument_layout import (
    BROADCAST,
    F_ORDER,
    PERMUTED,
    REVERSED,
    SLICED,
    layout_axes,
    sliced_parts,
    sliced_shape,
)
from .builder import make_value
from .graph import Graph, Value, carry_reasons
from .layout import storage_root
from .liveness import Plan, plan_liveness
from .types import TensorType
from .verify import verify_input_views


def in_place_inputs(plan: Plan) -> tuple[tuple[int, str], ...]:
    """(input, layout) of the copied inputs the lowering reads in place: F-order, permuted,
    broadcast, reversed or sliced, neither donated nor the storage of an output."""
    if not plan.copied:
        return ()
    inputs = plan.graph.inputs
    kept = {storage_root(o) for o in plan.graph.outputs}

    def _fits(i: int, word: str) -> bool:  # a sliced word names sizes: this input's own?
        if not word.startswith(SLICED):
            return False
        view, shape, broadcast = sliced_shape(word), inputs[i].shape, sliced_parts(word)[5]
        return len(view) == len(shape) and all(
            v == n or (broadcast and v == 1) for v, n in zip(view, shape, strict=True)
        )

    return tuple(
        (i, word)
        for i, word in plan.copied
        if (word == F_ORDER or word.startswith((PERMUTED, BROADCAST, REVERSED)) or _fits(i, word))
        and i not in plan.donated
        and inputs[i] not in kept
    )


def read_in_place(
    plan: Plan, origin: dict | None, sources: dict | None = None
) -> tuple[Plan, dict | None]:
    """(plan taking the C-ordered array under each input `in_place_inputs` names, read through
    a view of it; origin for its nodes). The same plan and origin when there is none.
    sources, if given, gets each new node -> the value of `plan` it computes (the view: the
    input it stands for), for the reference interpreter's rounding (ir/rounding_points.py)."""
    chosen = in_place_inputs(plan)
    if not chosen:
        return plan, origin
    graph = plan.graph
    inputs, mapping, views = list(graph.inputs), {}, []
    for i, word in chosen:
        value = inputs[i]
        shape, chain = _base_and_views(value.shape, word)
        base = Value("input", (), {}, TensorType(value.dtype, shape), value.loc, value.role)
        inputs[i] = view = base
        for op, attrs in chain:
            view = make_value(op, [view], attrs, value.loc)
            views.append(view)
        if view.type != value.type:
            raise ValueError(f"input {i} ({value.type}, {word}) read as a view of {view.type}")
        mapping[value] = view
        if sources is not None:
            sources[view] = value
    nodes, source = list(views), {}
    for node in graph.nodes:
        if node.op == "transpose" and _is_transpose_of_base(mapping.get(node.inputs[0]), views):
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
    while True:  # a view only w.T read: none (nor the views under it, for a chain)
        used = {v for n in nodes for v in n.inputs} | set(outputs)
        kept = [n for n in nodes if n not in views or n in used]
        if len(kept) == len(nodes):
            break
        nodes = kept
    new = Graph(graph.name, inputs, nodes, outputs, dict(graph.constants))
    verify_input_views(new, [i for i, _ in chosen])
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


def _base_and_views(shape: tuple, word: str) -> tuple[tuple, list]:
    """(the shape of the C-ordered array a plan takes for an argument of this shape and
    layout, the (view op, attributes) reading the argument from it, in order)."""
    n = len(shape)
    if word == F_ORDER:
        return tuple(shape[::-1]), [("transpose", {"perm": tuple(range(n))[::-1]})]
    if word.startswith(SLICED):
        span, starts, stops, steps, perm, broadcast = sliced_parts(word)
        chain = [("slice", {"starts": starts, "stops": stops, "steps": steps})]
        if perm != tuple(range(n)):
            chain.append(("transpose", {"perm": perm}))
        if broadcast:
            chain.append(("broadcast_to", {"shape": tuple(shape)}))
        return span, chain
    axes = layout_axes(word)
    if word.startswith(PERMUTED):  # shape = base.transpose(axes).shape
        inverse = tuple(sorted(range(n), key=lambda k: axes[k]))
        return tuple(shape[k] for k in inverse), [("transpose", {"perm": axes})]
    if word.startswith(BROADCAST):
        cut = tuple(1 if k in axes else d for k, d in enumerate(shape))
        return cut, [("broadcast_to", {"shape": tuple(shape)})]
    return (
        tuple(shape),
        [
            (
                "slice",
                {
                    "starts": tuple(d - 1 if k in axes else 0 for k, d in enumerate(shape)),
                    "stops": tuple(-1 if k in axes else d for k, d in enumerate(shape)),
                    "steps": tuple(-1 if k in axes else 1 for k in range(n)),
                },
            )
        ],
    )


def _is_transpose_of_base(view, views: list) -> bool:
    return view is not None and view.op == "transpose" and view in views
