"""value_and_grad's joint plan seen as a forward and a backward: which nodes compute the outputs
(forward), which compute gradients (backward), and which forward values the backward reads
(its saved buffers), each with the derivative rules that read it, as the plan recorded them
when it was differentiated (`Graph.reasons`)."""

from __future__ import annotations

from backplan.ir.graph import Value
from backplan.ir.liveness import Plan
from backplan.ir.reference_storage import storage_roots
from backplan.ir.remat import REBUILT_OPS, forward_nodes
from backplan.ir.text import format_loc, format_node, value_names
from backplan.ir.types import np_dtype
from backplan.runtime.program import SavedBufferInfo

from .plan_view import (
    BufferInfo,
    PlanView,
    StepInfo,
    free_steps,
    hand_to_caller,
    input_label,
    settle_views,
)


def joint_view(
    plan: Plan, n_outputs: int, wrt: list[bool], input_names: list[str] | None, name: str
) -> PlanView:
    graph = plan.graph
    forward = forward_nodes(graph, n_outputs)
    names = value_names(graph)
    view = PlanView(name, [], {}, joint=True)
    keys = {}
    for i, value in enumerate(graph.inputs):
        keys[value] = f"f{names[value]}"
        view.buffers[keys[value]] = BufferInfo(
            keys[value], input_label(input_names, i), value.type, "input", -1, -1
        )
    freed, counts = free_steps(plan), {"forward": 0, "backward": 0}
    backward_values = {n for n in graph.nodes if n not in forward}
    roots = storage_roots(graph)
    for step, node in enumerate(graph.nodes):
        phase = "forward" if node in forward else "backward"
        end = min(freed.get(node, plan.return_step), plan.return_step - 1)
        keys[node] = f"{phase[0]}{names[node]}"
        view.buffers[keys[node]] = BufferInfo(
            keys[node], names[node], node.type, "temporary", step, end, step
        )
        if roots[node] is not node:  # a view lives in its input's buffer (plan_view.py)
            view.buffers[keys[node]].view_of = keys[roots[node]]
        reads = tuple(keys[i] for i in node.inputs)
        for inp in dict.fromkeys(node.inputs):
            view.buffers[keys[inp]].readers.append(step)
            if phase == "backward" and inp not in backward_values and inp.op not in REBUILT_OPS:
                _mark_saved(view.buffers[keys[inp]], step)
        label = f"{phase[0]}{counts[phase]}"
        counts[phase] += 1
        view.steps.append(
            StepInfo(step, phase, label, node, format_node(node, names), keys[node], reads)
        )
    last = len(graph.nodes) - 1
    for out in graph.outputs[:n_outputs]:
        hand_to_caller(view.buffers[keys[out]], "output", last)
    wrt_names = [input_label(input_names, i) for i, w in enumerate(wrt) if w]
    for out, wrt_name in zip(graph.outputs[n_outputs:], wrt_names, strict=True):
        hand_to_caller(view.buffers[keys[out]], "gradient", last, f"grad {wrt_name}")
    settle_views(view)
    return view


def _mark_saved(buf: BufferInfo, reader_step: int) -> None:
    """A forward value (or the caller's input) read by a backward node is a saved buffer."""
    buf.saved = True
    if buf.kind == "temporary":
        buf.kind = "saved"
    if buf.kind == "input":
        buf.start, buf.end = 0, max(buf.end, reader_step)


def joint_saved_info(
    plan: Plan, view: PlanView, stored: set | None = None
) -> list[SavedBufferInfo]:
    """The saved-buffer rows of a joint plan, in the order the forward writes them. stored:
    the values the compiled plan keeps in a buffer (ir/lowering.py stored_values); a row of
    any other is marked fused (computed in the loop that reads it). None: the reference
    interpreter, which stores every value."""
    graph = plan.graph
    roots = storage_roots(graph)
    values = {f"f{name}": v for v, name in value_names(graph).items() if v in graph.inputs}
    values.update({step.writes: step.node for step in view.steps})
    reasons = graph.reasons  # recorded by autodiff, carried by every pass (ir/graph.py)
    labels = {step.index: int(step.label[1:]) for step in view.steps}
    infos = []
    for buf in view.buffers.values():
        if not buf.saved:
            continue
        value = values[buf.key]
        readers = [view.steps[i] for i in buf.readers if view.steps[i].phase == "backward"]
        infos.append(
            SavedBufferInfo(
                slot=len(infos),
                name=buf.name,
                op=value.op,
                produced_at=format_loc(value.loc) or "<input>",
                shape=value.shape,
                dtype=np_dtype(value.dtype),
                nbytes=value.type.nbytes,
                read_by=tuple(f"{r.op} at {format_loc(r.node.loc)}" for r in readers),
                last_read_step=labels[readers[-1].index],
                reason=saved_reason(value, reasons),
                is_region_input=buf.kind == "input",
                written_step=labels[buf.producer] if buf.producer is not None else -1,
                read_steps=tuple(labels[r.index] for r in readers),
                fused=stored is not None and not stored_in(value, roots, stored, graph),
            )
        )
    return infos


def stored_in(value: Value, roots: dict, stored: set, graph, inputs=None) -> bool:
    """Whether value reaches memory in the compiled plan: the caller's array, a stored value,
    or a view or alias of one (it lives in that buffer). inputs: graph.inputs as a set, where
    the caller asks of many values (a list of 1,000 weights scanned per value was most of the
    memory frontier's saved column)."""
    root = roots.get(value, value)
    inputs = graph.inputs if inputs is None else inputs
    return value in inputs or root in inputs or value in stored or root in stored


def saved_reason(value: Value, reasons: dict) -> str:
    """Why value is saved; a saved_dtype copy gives the reason of the value it narrows."""
    if value.op == "astype" and value not in reasons and value.inputs[0] in reasons:
        return f"{reasons[value.inputs[0]]}, kept in {value.dtype} (saved_dtype)"
    return reasons.get(value, "read by the gradient after simplification")
