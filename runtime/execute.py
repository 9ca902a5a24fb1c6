"""Running a region program forward: outputs now, and a Region holding what backward needs."""

from __future__ import annotations

from .program import RegionProgram
from .region import Edge, Region


def run_forward(program: RegionProgram, args: list, edges: list[Edge] | None, loc: str, donate=()):
    """Returns (user outputs, region or None). edges is None when nothing needs a gradient.
    donate: inputs whose buffers the plan may write outputs into (never saved ones)."""
    inputs = list(args)
    outputs = program.run_forward(list(args), donate)
    user_outputs = outputs[: program.n_outputs]
    if edges is None or program.plans.backward is None:
        return user_outputs, None
    saved = []
    for slot in program.plans.saved:
        kind, i = slot.source
        saved.append(inputs[i] if kind == "input" else outputs[i])
    return user_outputs, Region(program, saved, edges, loc)
