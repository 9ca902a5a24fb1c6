"""The bytes of the values a step holds from its forward part for its gradients that the numba
backend's compiled plan never stores (each computed inside the fused loop that reads it), for
the memory frontier: its saved column is then the compiled plan's, as explain's section 3
(report.fused_saved). Read from the same rows explain lists; nothing is rendered or compiled."""

from __future__ import annotations

from backplan.codegen.render.opaque import unsupported_reason
from backplan.ir.lowering import lower, stored_values
from backplan.ir.plans import JointPlans

from .inlined_saved import inlined_saved_info
from .joint_view import joint_saved_info, joint_view


def fused_held_bytes(plans) -> int:
    """0 for a forward and backward plan (their saved buffers are the forward's outputs, always
    stored) and for a plan numba cannot compile (the reference interpreter stores every
    value)."""
    if isinstance(plans, JointPlans):
        plan = plans.plan
        stored = _stored(plan)
        if stored is None:
            return 0
        view = joint_view(plan, plans.n_outputs, list(plans.wrt), None, "")
        rows = joint_saved_info(plan, view, stored)
    elif getattr(plans, "inlined_forward", None) is not None:
        stored = _stored(plans.forward)
        if stored is None:
            return 0
        rows = inlined_saved_info(plans.forward, plans.inlined_forward, None, stored)
    else:
        return 0
    return sum(r.nbytes for r in rows if r.fused and not r.is_region_input)


def _stored(plan) -> set | None:
    lowered = lower(plan)
    return None if unsupported_reason(lowered) is not None else stored_values(lowered)
