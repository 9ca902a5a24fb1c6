"""The bytes of the values a step holds from its forward part for its gradients that the numba
backend's compiled plan never stores (each computed inside the fused loop that reads it), for
the memory frontier: its saved column is then the compiled plan's, as explain's section 3
(report.fused_saved). The same rows explain lists (report/joint_view.py joint_saved_info,
report/inlined_saved.py inlined_saved_info), counted without describing each: the frontier
asks it of every row, and describing a 10,086-node row's values (names, lines, readers) cost
~0.25 s a row, more than lowering it. tests/test_frontier_saved_fused.py holds the two
equal. Nothing is rendered or compiled."""

from __future__ import annotations

from backplan.codegen.render.opaque import unsupported_reason
from backplan.ir.lowering import lower, stored_values
from backplan.ir.plans import JointPlans
from backplan.ir.reference_storage import VIEW_OPS, view_parents
from backplan.ir.remat import forward_nodes, held_across
from backplan.ir.types import is_half

from .inlined_saved import held_values
from .joint_view import stored_in


def fused_held_bytes(plans) -> int:
    """0 for a forward and backward plan (their saved buffers are the forward's outputs, always
    stored) and for a plan numba cannot compile (the reference interpreter stores every
    value)."""
    if isinstance(plans, JointPlans):
        plan = plans.plan
        stored = _stored(plan)
        if stored is None:
            return 0
        graph = plan.graph
        held = plans.held_values  # a memory frontier row's, known from its rewrite
        if held is None:
            held = held_across(graph, forward_nodes(graph, plans.n_outputs))
        return _fused(graph, held, stored, _roots(held), shared=False)
    if getattr(plans, "inlined_forward", None) is not None:
        stored = _stored(plans.forward)
        if stored is None:
            return 0
        graph = plans.forward.graph
        held = held_values(plans.forward, plans.inlined_forward)
        return _fused(graph, held, stored, _roots(held), shared=True)
    return 0


def _fused(graph, held: list, stored: set, roots: dict, shared: bool) -> int:
    """Bytes of the held values (the caller's arrays left out) that are not stored. shared
    (inlined_saved_info's rows): a held view counts its base's bytes, once, and none where
    the base is held itself or is the caller's array; joint_saved_info's rows count each
    value's own bytes."""
    inputs = set(graph.inputs)
    counted = {v for v in held if roots[v] is v}
    total = 0
    for value in held:
        if value in inputs:
            continue
        nbytes = value.type.nbytes
        if shared and roots[value] is not value:
            base = roots[value]
            nbytes = 0 if base in counted or base in inputs else base.type.nbytes
            counted.add(base)
        if not stored_in(value, roots, stored, graph, inputs):
            total += nbytes
    return total


def _roots(values: list) -> dict:
    """value -> the value whose buffer it lives in (ir/reference_storage.py storage_roots),
    for these values only: each one's chain of view ops, walked up to the value under it
    (C-contiguous there, as storage_roots takes it), is all that decides it."""
    roots = {}
    for value in values:
        if value.op not in VIEW_OPS or is_half(value.dtype):
            roots[value] = value  # no view: its own buffer (most held values)
            continue
        chain, node = [], value
        while node.op in VIEW_OPS and not is_half(node.dtype):
            chain.append(node)
            node = node.inputs[0]
        parents = view_parents(reversed(chain))
        root = value
        while root in parents:
            root = parents[root]
        roots[value] = root
    return roots


def _stored(plan) -> set | None:
    """The values plan's compiled form stores (only tested for membership: a plan given as
    it was lowered is read from its lowering's own set, not a copy of it)."""
    lowered = lower(plan)
    if unsupported_reason(lowered) is not None:
        return None
    return lowered.materialized if lowered.origin is None else stored_values(lowered)
