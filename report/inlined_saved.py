"""What a training step holds for the value_and_grad plans it inlines, read from the step's own
plan: the values of its inlined forward part (the nodes its inlined losses depend on) that the
rest of the step (the gradients, the optimizer update) reads. The joint plan alone is not what
runs: the step's cleanup merges values that plan rebuilds for its gradients back into one
(common-subexpression elimination), and a budget or a saved dtype changes what is held."""

from __future__ import annotations

from dataclasses import dataclass

from backplan.ir.liveness import Plan
from backplan.ir.reference_storage import storage_roots
from backplan.ir.remat import held_across
from backplan.ir.text import format_loc, value_names
from backplan.ir.types import np_dtype
from backplan.runtime.program import SavedBufferInfo

from .joint_view import saved_reason, stored_in
from .plan_view import input_label


@dataclass(frozen=True)
class InlinedSavedInfo(SavedBufferInfo):
    """A row of the step's held values: written and read at steps of its one forward plan."""

    read_phase: str = "f"


def held_values(plan: Plan, forward: frozenset) -> list:
    """The values the step holds for its inlined gradients: forward values the rest reads,
    and your arrays a derivative rule reads (not those only the update reads: optimizer state,
    adam's parameters)."""
    graph = plan.graph
    inputs = set(graph.inputs)
    return [v for v in held_across(graph, set(forward)) if v not in inputs or v in graph.reasons]


def mark_held(view, plan: Plan, forward: frozenset) -> None:
    """The step's view (its timeline and plot) shows the values held for the inlined
    gradients as saved buffers, as section 3 lists them."""
    names = value_names(plan.graph)
    inputs = set(plan.graph.inputs)
    for value in held_values(plan, forward):
        buf = view.buffers.get(f"f{names[value]}")
        if buf is not None and value not in inputs and buf.kind == "temporary":
            buf.kind, buf.saved = "saved", True


def inlined_saved_info(
    plan: Plan, forward: frozenset, input_names, stored: set | None = None
) -> list[InlinedSavedInfo]:
    """The held values of a step with inlined gradients, in the order the step first reads
    them after its inlined forward part (your own arrays among them, marked). stored: the
    values the compiled plan keeps in a buffer; a row of any other is marked fused (None: the
    reference interpreter, which stores every value)."""
    graph = plan.graph
    names = value_names(graph)
    step_of = {node: step for step, node in enumerate(graph.nodes)}
    inputs = {value: i for i, value in enumerate(graph.inputs)}
    held = held_values(plan, forward)
    roots = storage_roots(graph)
    counted = {v for v in held if roots[v] is v}  # a view shares its base's buffer: once
    infos = []
    for value in held:
        nbytes, name = value.type.nbytes, names.get(value)
        if roots[value] is not value:
            base = roots[value]
            nbytes = 0 if base in counted or base in inputs else base.type.nbytes
            counted.add(base)
            of = input_label(input_names, inputs[base]) if base in inputs else names[base]
            name = f"{name} (view of {of})"
        readers = [n for n in graph.nodes if n not in forward and any(i is value for i in n.inputs)]
        mine = value in inputs
        infos.append(
            InlinedSavedInfo(
                slot=len(infos),
                name=input_label(input_names, inputs[value]) if mine else name,
                op=value.op,
                produced_at=format_loc(value.loc) or "<input>",
                shape=value.shape,
                dtype=np_dtype(value.dtype),
                nbytes=nbytes,
                read_by=tuple(f"{r.op} at {format_loc(r.loc)}" for r in readers),
                last_read_step=step_of[readers[-1]],
                reason=_reason(value, graph.reasons),
                is_region_input=mine,
                written_step=-1 if mine else step_of[value],
                read_steps=tuple(step_of[r] for r in readers),
                fused=stored is not None and not stored_in(value, roots, stored, graph),
            )
        )
    return infos


def _reason(value, reasons: dict) -> str:
    """Why the value is held: the derivative rules that read it, where the step's graph still
    records them; else it is read after the forward part, by a gradient the cleanup simplified
    or by the update (adamw's weight decay reads the parameters)."""
    if value in reasons or value.op == "astype":
        return saved_reason(value, reasons)
    return "read after the forward part (by a simplified gradient or the update)"
