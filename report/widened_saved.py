"""The reference interpreter runs a joint plan with 16-bit values widened (ir/widen.py), and
where a compiled loop keeps a value in float32 rather than rounding it, the interpreter reads
that float32 value too (`Plan.unrounded`, `Plan.reads_instead`: ir/rounding_points.py). A
gradient-part op read that way holds a float32 value of the forward part across, one the plan
before widening never saves (its 16-bit value may be saved beside it). Those are saved buffers
of what runs on the reference backend: explain lists them as rows of their own, counted in the
saved bytes as the peak counts them (ir/peak.py `_as_interpreted`)."""

from __future__ import annotations

from backplan.ir.liveness import Plan
from backplan.ir.lowering import lower
from backplan.ir.plans import JointPlans
from backplan.ir.remat import forward_nodes, held_across
from backplan.ir.rounding_points import spec_values
from backplan.ir.text import format_loc, value_names
from backplan.ir.types import np_dtype
from backplan.ir.widen import has_half
from backplan.runtime.program import SavedBufferInfo

from .inlined_saved import InlinedSavedInfo

REASON = (
    "read unrounded by the gradient part, as its compiled loop reads it (reference "
    "interpreter: held in float32 until then)"
)


def float32_held(plan: Plan, n_outputs: int, inlined: frozenset | None = None) -> list[tuple]:
    """(value of the widened plan, the node of `plan` it computes, the nodes of `plan` reading
    it) for each forward float32 value the reference interpreter holds into the gradient part
    only because a gradient-part op reads it in a cast's place. The forward part: what the
    first n_outputs outputs depend on (a joint plan), or for a training step's plan the nodes
    of its inlined forward part (`inlined`, nodes of `plan`) and the casts widening made for
    them."""
    if not has_half(plan.graph):
        return []
    lowered = lower(plan)
    interpreted = lowered.interpreted
    if interpreted is None or not (interpreted.unrounded or interpreted.reads_instead):
        return []
    graph = interpreted.graph
    origin = lowered.origin or {}
    users: dict = {}
    for node in graph.nodes:
        for value in node.inputs:
            users.setdefault(value, []).append(node)
    if inlined is None:
        forward = forward_nodes(graph, n_outputs)
    else:
        forward = {
            n
            for n in graph.nodes
            if origin.get(n) in inlined
            or (n not in origin and set(_named_readers([n], origin, users)) <= inlined)
        }
    readers: dict = {}
    specs = [(node, spec) for node, spec in interpreted.unrounded.items()]
    specs += [
        (node, s) for node, reads in interpreted.reads_instead.items() for s in reads.values()
    ]
    for node, spec in specs:
        if node in forward:
            continue
        for value in spec_values(spec):
            if value in forward:
                readers.setdefault(value, {})[node] = None
    held = set(held_across(graph, forward)) | set(graph.inputs)
    return [
        (value, origin.get(value), _named_readers(list(nodes), origin, users))
        for value, nodes in readers.items()
        if value not in held
    ]


def _named_readers(nodes: list, origin: dict, users: dict) -> list:
    """The nodes of the plan given that read through `nodes` (widened-plan nodes): a cast into
    float32 that widening made has no node of its own there; the ops reading it do."""
    found, seen = [], set()
    while nodes:
        node = nodes.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if node in origin:
            found.append(origin[node])
        else:
            nodes.extend(users.get(node, ()))
    return list(dict.fromkeys(found))


def widened_saved_info(
    plan: Plan, n_outputs: int, view, infos: list[SavedBufferInfo]
) -> list[SavedBufferInfo]:
    """`infos` (a joint plan's saved rows) and a row for each float32 value float32_held finds,
    numbered on: the reference backend's saved buffers. view: the plan's joint_view, whose
    step labels (f3, b7) the rows use."""
    labels = {step.node: int(step.label[1:]) for step in view.steps}
    found = float32_held(plan, n_outputs)
    return infos + _rows(plan, found, labels, SavedBufferInfo, len(infos))


def widened_inlined_info(plan: Plan, plans, infos: list) -> list:
    """`infos` (a training step's held values, report/inlined_saved.py) and a row for each
    float32 value the reference interpreter also holds for its inlined gradients."""
    found = float32_held(plan, plans.n_outputs, plans.inlined_forward)
    labels = {node: step for step, node in enumerate(plan.graph.nodes)}
    return infos + _rows(plan, found, labels, InlinedSavedInfo, len(infos))


def _rows(plan: Plan, found: list, labels: dict, row, first: int) -> list:
    names = value_names(plan.graph)
    rows = []
    for value, node, readers in found:
        steps = sorted({labels[r] for r in readers if r in labels})
        rows.append(
            row(
                slot=first + len(rows),
                name=f"{names[node]} in f32" if node in names else f"f32 {value.op}",
                op=(node or value).op,
                produced_at=format_loc(value.loc) or "<input>",
                shape=value.shape,
                dtype=np_dtype(value.dtype),
                nbytes=value.type.nbytes,
                read_by=tuple(f"{r.op} at {format_loc(r.loc)}" for r in readers),
                last_read_step=steps[-1] if steps else -1,
                reason=REASON,
                is_region_input=False,
                written_step=labels.get(node, -1),
                read_steps=tuple(steps),
            )
        )
    return rows


def widened_held_bytes(plans) -> int:
    """The bytes of the rows widened_saved_info and widened_inlined_info add, without
    describing them: what the memory frontier's saved column adds on the reference backend."""
    if isinstance(plans, JointPlans):
        found = float32_held(plans.plan, plans.n_outputs)
    elif getattr(plans, "inlined_forward", None) is not None:
        found = float32_held(plans.forward, plans.n_outputs, plans.inlined_forward)
    else:
        return 0
    return sum(value.type.nbytes for value, _, _ in found)
