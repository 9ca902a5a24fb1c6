"""Running a region program forward: outputs now, and a Region holding what backward needs."""

from __future__ import annotations

import numpy as np

from backplan.codegen.run import memory_check
from backplan.ir.reference_storage import array_root

from .program import RegionProgram
from .region import Edge, Region


def run_forward(
    program: RegionProgram, args: list, edges: list[Edge] | None, loc, donate=(), copies=frozenset()
):
    """Returns (user outputs, region or None). edges is None when nothing needs a gradient.
    donate: inputs whose buffers the plan may write outputs into (never saved ones).
    copies: inputs that are copies of the caller's NumPy arrays (the region's own buffers).
    loc: where the user called it (a SourceLoc, or its text), the region's created_at.
    A small compiled step that backward() follows may run as one joint plan (joint_step.py)."""
    if copies and memory_check.checking():  # backplan's buffers, in explain's saved bytes
        # each copy's own array: a broadcast view's compact one, a sliced view's span
        roots = [array_root(args[i]) for i in copies]
        memory_check.count_held(roots, "copies of NumPy arguments")
    if program.retained:  # the last call's backward(retain_graph=True): its arena goes
        program.release_retained()
    joint = program.joint_step
    if edges is not None and joint is not None:
        ran = joint.run(program, args, edges, loc, copies)
        if ran is not None:
            return ran
    outputs = program.run_forward(list(args), donate)  # the runner empties the list it gets
    user_outputs = outputs[: program.n_outputs]
    if edges is None or program.plans.backward is None:
        _freeze_own_views(user_outputs, args, ())
        return user_outputs, None
    saved = [args[i] if from_input else outputs[i] for from_input, i in program.saved_sources]
    _freeze_own_views(user_outputs, args, saved)
    return user_outputs, Region(program, saved, edges, loc, copies)


def count_argument_copy(array: np.ndarray) -> np.ndarray:
    """array, a copy of a caller's NumPy argument made for a call (tracer/numpy_args.py),
    counted by the checked mode's open measurements while it lives, as explain counts it."""
    if memory_check.checking():
        memory_check.count_held([array_root(array)], "copies of NumPy arguments")
    return array


def _freeze_own_views(outputs: list, args: list, saved: list) -> None:
    """A compiled plan may return a view of its own output buffer (a reshape of it): read-only,
    the tensor wrapping it takes it as it is, where it copies a writeable view (someone else's
    buffer: 4 MB a call for a reshaped 2048x512 result). Views of the caller's arrays and the
    arrays the backward receives (it may write a dead saved buffer) stay as they are."""
    callers = None
    for array in outputs:
        if not isinstance(array, np.ndarray) or array.base is None or not array.flags.writeable:
            continue
        if any(array is s for s in saved):
            continue
        if callers is None:
            callers = {id(array_root(a)) for a in args if isinstance(a, np.ndarray)}
        if id(array_root(array)) not in callers:
            array.flags.writeable = False
