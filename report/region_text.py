"""What print(t.grad_fn) shows: a region's saved-buffer table with the state of each buffer
(alive, freed, recomputed), whether and by which backward() it was freed, and the regions
upstream. Registered with runtime/wording.py, which Region.__str__ asks."""

from __future__ import annotations

from backplan.runtime.region import FreedBy, Region
from backplan.runtime.saved_once import held_totals
from backplan.runtime.walk import regions_in_order

from .recomputed import recomputed_infos
from .saved_table import format_saved_table

JOINT_STATE = "not held (joint plan)"  # runtime/joint_step.py JointRegion.buffer_state
JOINT_NOTE = (
    f"  {JOINT_STATE}: this call ran forward and backward as one plan (compiled losses that\n"
    "    backward() follows do, from the third call), which kept none of them; backward() takes\n"
    "    its gradients, another seed or retain_graph=True recomputes them from the inputs first."
)


def saved_table(region: Region) -> str:
    """The live answer to 'which is freed, which is not?': explain()'s table plus a state column
    (values the backward recomputes instead of saving say "recomputed")."""
    buffers = region.saved_buffers
    states = [region.buffer_state(b) for b in buffers]
    lines = [
        repr(region),
        format_saved_table(buffers, states, recomputed=recomputed_infos(region.program)),
    ]
    if JOINT_STATE in states:
        lines.append(JOINT_NOTE)
    if region.freed_by is not None:
        lines += [
            f"  {freed_by_text(region.freed_by)}; a second backward() through it raises "
            "GraphFreedError.",
            "  The plan itself stays (it holds no arrays) while a tensor points at it "
            "through .grad_fn;",
            "  .detach() makes a tensor that does not.",
        ]
    upstream = regions_in_order(region)[1:]
    if upstream:
        held = held_totals(upstream)  # each array once: two regions may save one array
        lines.append(
            f"  {len(upstream)} more region{'s' if len(upstream) != 1 else ''} upstream "
            f"(holding {held.allocated:,} B they allocated and {held.yours:,} B of your own "
            "arrays, each array once) run in the same backward(); t.graph() or "
            "bp.explain_graph(t) lists them all."
        )
    return "\n".join(lines)


def freed_by_text(by: FreedBy) -> str:
    if by.failed:
        return f"freed when the backward() at {by.loc} failed part-way"
    return f"freed by the backward() at {by.loc}"
