"""Running a region program forward: outputs now, and a Region holding what backward needs."""

from __future__ import annotations

from .program import RegionProgram
from .region import Edge, Region


def run_forward(program: RegionProgram, args: list, edges: list[Edge] | None, loc, donate=()):
    """Returns (user outputs, region or None). edges is None when nothing needs a gradient.
    donate: inputs whose buffers the plan may write outputs into (never saved ones).
    loc: where the user called it (a SourceLoc, or its text), the region's created_at.
    A small compiled step that backward() follows may run as one joint plan (joint_step.py)."""
    if program.retained:  # the last call's backward(retain_graph=True): its arena goes
        program.release_retained()
    joint = program.joint_step
    if edges is not None and joint is not None:
        ran = joint.run(program, args, edges, loc)
        if ran is not None:
            return ran
    outputs = program.run_forward(list(args), donate)  # the runner empties the list it gets
    user_outputs = outputs[: program.n_outputs]
    if edges is None or program.plans.backward is None:
        return user_outputs, None
    saved = [args[i] if from_input else outputs[i] for from_input, i in program.saved_sources]
    return user_outputs, Region(program, saved, edges, loc)
