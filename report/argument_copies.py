"""A compiled step called with NumPy arrays: each one the backward reads is copied at the call
(tracer/numpy_args.py), so that changing the array after the call cannot change the gradients.
The copy is backplan's buffer, held until backward(): explain lists it as a copy (not as your
input held by reference), counts it in the saved bytes and in the peak, for the call it is
given."""

from __future__ import annotations

import dataclasses

import numpy as np

from backplan.ir.peak import with_argument_copies


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


def mark_argument_copies(report, program, inputs: frozenset[int]) -> None:
    """Make `report` (just built, nothing read from it yet) describe a call passing the forward
    inputs `inputs` as NumPy arrays the step copies: their saved buffers are copies, and every
    peak of the step holds each copy beside your array."""
    if not inputs:
        return
    sources = [s.source for s in program.plans.saved]
    report.saved_buffers = [
        dataclasses.replace(b, is_region_input=False, copy_of_argument=True)
        if sources[b.slot][0] == "input" and sources[b.slot][1] in inputs
        else b
        for b in report.saved_buffers
    ]
    for name in ("peak_calls", "joint_step_calls", "fallback_calls", "retain_calls"):
        setattr(report, name, with_argument_copies(getattr(report, name), inputs))
