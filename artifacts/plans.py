"""Plans in an artifact: the IR text (with its free statements) and the facts derived from it
(schedule, last reads, frees, bytes live after each step, peak bytes).

On load the text is parsed (every type re-derived from the op registry), liveness is recomputed
and must give exactly the stored frees and facts, and the plan verifier runs, so an edited plan
is refused at load time rather than misbehaving at the first call.
"""

from __future__ import annotations

import os

import numpy as np

from backplan.codegen.render.opaque import unsupported_reason
from backplan.ir.errors import BackplanError
from backplan.ir.liveness import Plan, plan_liveness
from backplan.ir.lowering import lower
from backplan.ir.shapes import check_size
from backplan.ir.text import parse_graph, value_names
from backplan.ir.types import dtype_name
from backplan.ir.verify import verify_plan

from .format import ExportError

MAX_LINE_CHARS = 10_000
MAX_LINES = 2_000_000


def plan_facts(plan: Plan) -> dict:
    """What a reader (or `inspect`) wants without parsing: schedule, liveness, memory (the
    compiled plan's arenas and buffer offsets; the loader recomputes and compares them)."""
    names = value_names(plan.graph)
    facts = {
        "schedule": [[names[n], n.op, str(n.type)] for n in plan.graph.nodes],
        "last_read": {names[v]: step for v, step in plan.last_read.items()},
        "frees_after": {
            str(step): [names[v] for v in values]
            for step, values in sorted(plan.frees_after.items())
        },
        "live_bytes_by_step": plan.live_bytes_by_step(),
        "peak_bytes": plan.peak_bytes,
        "memory_plan": memory_plan_facts(plan),
    }
    if plan.graph.reasons:  # a joint plan's: why its gradients read each forward value
        facts["reasons"] = {names[v]: r for v, r in plan.graph.reasons.items() if v in names}
    return facts


def read_plan(
    text: str, facts, constants: dict[str, np.ndarray], member: str, max_bytes: int
) -> Plan:
    """Parse, re-derive and verify one plan; any disagreement is an ExportError naming member."""
    _check_text_shape(text, member)
    try:
        graph, frees = parse_graph(text, constants)
    except (BackplanError, RecursionError, MemoryError, ValueError) as exc:
        raise ExportError(f"{member}: {exc}") from None
    _check_inputs(graph, member)
    _check_constants(graph, member)
    graph.reasons = _read_reasons(graph, facts, member)
    plan = plan_liveness(graph)
    if _as_sets(frees) != _as_sets(plan.frees_after):
        raise ExportError(
            f"{member}: the free statements do not match the plan's liveness "
            "(a buffer would be freed early, late, or never)"
        )
    try:
        verify_plan(plan)
    except BackplanError as exc:
        raise ExportError(f"{member}: {exc}") from None
    if facts != plan_facts(plan):
        raise ExportError(f"{member}: the stored schedule and memory facts disagree with the IR")
    _check_bytes(plan, member, max_bytes)
    return plan


def _read_reasons(graph, facts, member: str) -> dict:
    """The stored derivative reasons, by value name: strings naming values of the graph."""
    raw = facts.get("reasons", {}) if isinstance(facts, dict) else {}
    by_name = {name: v for v, name in value_names(graph).items()}
    if not isinstance(raw, dict) or not all(
        name in by_name and isinstance(reason, str) for name, reason in raw.items()
    ):
        raise ExportError(f"{member}: the stored reasons do not name values of the plan")
    return {by_name[name]: reason for name, reason in raw.items()}


def _check_text_shape(text: str, member: str) -> None:
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise ExportError(f"{member}: {len(lines)} lines, more than a plan may have")
    for number, line in enumerate(lines, start=1):
        if len(line) > MAX_LINE_CHARS:
            raise ExportError(f"{member}: line {number} is {len(line)} characters long")


def _check_inputs(graph, member: str) -> None:
    for index, value in enumerate(graph.inputs):
        try:
            check_size(value.shape)
        except BackplanError as exc:
            raise ExportError(f"{member}: input {index} ({value.type}): {exc}") from None


def _check_constants(graph, member: str) -> None:
    for node in graph.nodes:
        if node.op != "const":
            continue
        array = graph.constants[node.attrs["name"]]
        if dtype_name(array.dtype) != node.dtype or tuple(array.shape) != node.shape:
            raise ExportError(
                f"{member}: constant {node.attrs['name']!r} holds "
                f"{dtype_name(array.dtype)}{list(array.shape)}, the IR says "
                f"{node.type}"
            )


def _as_sets(frees: dict) -> dict:
    return {step: set(values) for step, values in frees.items() if values}


def _check_bytes(plan: Plan, member: str, max_bytes: int) -> None:
    """A plan that cannot fit in memory is refused now, not after minutes of work."""
    args = sum(v.type.nbytes for v in plan.graph.inputs if v.role == "arg")
    needed = args + plan.peak_bytes
    if needed > max_bytes:
        raise ExportError(
            f"{member}: the plan needs {needed} bytes at its peak (inputs included), more than "
            f"the {max_bytes} bytes allowed; pass max_bytes= to load() if this is intended"
        )


def machine_memory_bytes() -> int:
    """Physical memory of this machine: the default ceiling for a loaded plan's peak."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40


def memory_plan_facts(plan: Plan) -> dict:
    """The compiled memory plan of a plan as plain data, without compiling: where each buffer
    lives (scratch arena offset, or allocated per call), arena sizes, kernel count."""
    lowered = lower(plan)
    why = unsupported_reason(lowered)
    if why is not None:
        return {"compiled": False, "why": why}
    facts = lowered.layout.describe(value_names(lowered.plan.graph))  # widened: its own values
    return {"compiled": True, "kernels": lowered.kernel_count, **facts}
