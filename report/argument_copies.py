"""A compiled step called with NumPy arrays: each one the backward reads is copied at the call
(tracer/numpy_args.py), so that changing the array after the call cannot change the gradients.
The copy is backplan's buffer, held until backward(): explain lists it as a copy (not as your
input held by reference), counts it in the saved bytes and in the peak, for the call it is
given. The call's other copies of NumPy arguments (read by an output, converted from another
byte order, the reference interpreter's C-order copy for a reshape) are in the peak too
(mark_call_copies)."""

from __future__ import annotations

import dataclasses

import numpy as np

from backplan.ir.peak import COPIED_IN, COPIED_OUT, with_argument_copies


def numpy_inputs(call) -> frozenset[int]:
    """The graph inputs the call passes as NumPy arrays (call: tracer/signature.py BoundCall;
    its tensor leaves are the graph's first inputs, in order)."""
    return frozenset(
        k for k, p in enumerate(call.tensor_positions) if isinstance(call.sources[p], np.ndarray)
    )


def numpy_saved_inputs(program, call) -> frozenset[int]:
    """The forward inputs of `program` the call passes as NumPy arrays that its backward reads
    (call: the bound call, tracer/signature.py BoundCall)."""
    saved = {s.source[1] for s in program.plans.saved if s.source[0] == "input"}
    return numpy_inputs(call) & saved


def mark_argument_copies(
    report, program, inputs: frozenset[int], kept=frozenset(), during=frozenset()
) -> None:
    """Make `report` (just built, nothing read from it yet) describe a call passing the forward
    inputs `inputs` as NumPy arrays the step copies: their saved buffers are copies, and every
    peak of the step holds each copy beside your array. kept, during: see mark_call_copies."""
    if inputs:
        sources = [s.source for s in program.plans.saved]
        report.saved_buffers = [
            dataclasses.replace(b, is_region_input=False, copy_of_argument=True)
            if sources[b.slot][0] == "input" and sources[b.slot][1] in inputs
            else b
            for b in report.saved_buffers
        ]
    mark_call_copies(report, inputs, kept, during)


def mark_call_copies(report, saved, kept=frozenset(), during=frozenset()) -> None:
    """Count in every peak of `report` the copies a call makes of its NumPy arguments
    (tracer/numpy_args.py): `saved`, held for the backward; `kept`, read by an output (the
    copy is that output, the caller's to keep); `during`, made for the call alone (another
    byte order; on the reference interpreter an array not in C order that a reshape reads).
    One copy serves each input: saved before kept before during."""
    kept = frozenset(kept) - saved
    during = frozenset(during) - saved - kept
    if not (saved or kept or during):
        return
    for name in ("peak_calls", "joint_step_calls", "fallback_calls", "retain_calls"):
        calls = with_argument_copies(getattr(report, name), saved)
        calls = with_argument_copies(calls, kept, COPIED_OUT)
        setattr(report, name, with_argument_copies(calls, during, COPIED_IN))
