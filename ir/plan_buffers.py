"""Every buffer a compiled plan's call holds, named, from the lowered plan alone: the scratch
arena (kept by the plan, reused by every call; each dtype views the same bytes), the constants
the plan keeps, and the buffers allocated for what the call returns (those written into donated
inputs excepted).

This is the one list the predicted peak (ir/peak.py) sums and the checked mode
(BACKPLAN_CHECK_MEMORY=1, codegen/run/memory_check.py) compares a call's real allocations with, so
a byte the runtime allocates that is not here is caught by name.
"""

from __future__ import annotations

from typing import NamedTuple

from .graph import Value
from .layout import storage_root
from .lowering import LoweredPlan, literal_outputs
from .printer import format_loc

# What a buffer is, for the per-category accounting of a step.
KEPT = ("constants", "scratch")  # held by the compiled plan across calls


class PlannedBuffer(NamedTuple):
    """One buffer a call holds (a named tuple: a memory frontier weighs each row's peak from
    them, ~1,100 a row of a 10,000-node chain, at a third of a frozen dataclass's cost)."""

    key: str  # unique within a plan: "scratch f32", "output 2", "literal 0", "const c3"
    name: str  # what a reader sees: "%12 f32[64,10] (output 0) at model.py:7"
    category: str  # "scratch", "constants", or the output's kind ("outputs", "saved", ...)
    nbytes: int


def compiled_buffers(
    lowered: LoweredPlan, output_kinds: list[str] | None = None, named: bool = True
) -> list[PlannedBuffer]:
    """The buffers one call of the compiled plan holds. output_kinds: the category of each
    graph output (default "outputs"). An output written into a donated input
    (`lowered.donations`) allocates nothing. named=False: outputs' names left empty, for a
    count of bytes (a memory frontier weighs each row's peak: 1,121 outputs a row of a
    10,000-node chain, each name its op, type and line in words)."""
    name = _value_name if named else _unnamed
    graph = lowered.plan.graph
    kinds = output_kinds or ["outputs"] * len(graph.outputs)
    found = [
        PlannedBuffer(
            f"const {name}",
            f"constant {name} {array.dtype}{list(array.shape)}",
            "constants",
            int(array.nbytes),
        )
        for name, array in graph.constants.items()
    ]
    scratch = sorted(lowered.layout.scratch_elements)
    if scratch:
        found.append(
            PlannedBuffer(
                "scratch",
                f"scratch arena ({', '.join(scratch)})",
                "scratch",
                lowered.layout.scratch_bytes,
            )
        )
    in_place = lowered.donations
    first_output: dict[Value, int] = {}  # buffer -> the first graph output it holds (one pass:
    for i, o in enumerate(graph.outputs):  # a search per buffer was quadratic in the outputs)
        first_output.setdefault(storage_root(o), i)
    for k, root in enumerate(lowered.layout.outputs):
        if k in in_place:
            continue
        index = first_output[root]
        found.append(
            PlannedBuffer(f"output {k}", name(root, index), kinds[index], root.type.nbytes)
        )
    for index, node in literal_outputs(lowered).items():
        found.append(
            PlannedBuffer(f"literal {index}", name(node, index), kinds[index], node.type.nbytes)
        )
    return found


def copy_buffers(plan) -> list[PlannedBuffer]:
    """The C-order copies a compiled call makes on entry of the inputs that arrive in another
    layout (Plan.copied, ir/argument_layout.py), held until it returns."""
    inputs = plan.graph.inputs
    return [
        PlannedBuffer(
            f"copy of input {i}",
            f"copy of input {i} {inputs[i].dtype}{list(inputs[i].shape)} ({word})",
            "copies",
            inputs[i].type.nbytes,
        )
        for i, word in plan.copied
    ]


def _value_name(value, output_index: int) -> str:
    where = format_loc(value.loc)
    return f"{value.op} {value.type} (output {output_index})" + (f" at {where}" if where else "")


def _unnamed(value, output_index: int) -> str:
    return ""
