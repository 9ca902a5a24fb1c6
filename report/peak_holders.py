"""What holds a step at its predicted peak, in the words a memory budget's refusal uses: the
step's own accounting (ir/peak.py), so the bytes named are those the compiled step (or the
reference interpreter) holds there, not a per-value liveness estimate.

On numba the peak is reached with every plan's scratch arena and every buffer a call returns
held at once: the refusal names the kernel and line, the bytes per category, and the largest
buffers (for an arena, the largest values placed in it, with their lines). On the reference
interpreter it names the step and line and the bytes per category there.
"""

from __future__ import annotations

from backplan.ir.lowering import lower
from backplan.ir.peak import PeakReport, PlanCall
from backplan.ir.plan_buffers import PlannedBuffer
from backplan.ir.printer import format_loc
from backplan.ir.strided_copies import is_strided_copy
from backplan.ir.types import DTYPES

from .memory import peak_step_words
from .wording import format_bytes

PACKING_WORDS = "backplan's GEMM packing buffers (the pages its products write)"


def peak_holders(report: PeakReport, calls: list[PlanCall], count: int = 3) -> str:
    """'reached at joint kernel 12 (matmul) at m.py:7: inputs 1,024 B, scratch ...; the
    largest buffers: ...' ('' for a step that holds nothing)."""
    if report.peak_step is None:
        return ""
    largest = _largest_compiled(report, calls, count) if report.backend == "numba" else []
    text = f"reached at {peak_step_words(report)}"
    return text + ("; the largest buffers: " + "; ".join(largest) if largest else "")


def _largest_compiled(report: PeakReport, calls: list[PlanCall], count: int) -> list[str]:
    """The largest buffers the compiled calls hold at the peak (the caller's arrays apart),
    an arena described by the largest values placed in it."""
    by_label = {c.label: c for c in calls}
    least = report.peak_bytes // 100  # a 4-byte loss buffer explains nothing
    held = [(label, b) for label, b in report.buffers if b.category != "constants"]
    sharing = [(label, b) for label, b in held if _shared_arena(by_label, label, b)]
    if len(sharing) > 1:  # one arena, the largest plan's size (ir/peak.py shares_arena)
        largest = max(sharing, key=lambda lb: lb[1].nbytes)
        held = [lb for lb in held if lb not in sharing or lb is largest]
    packing = report.peak_step.held.get("packing", 0)
    if packing:  # the GEMM's kept buffers: no plan's buffer, but held at the peak
        held.append(("", PlannedBuffer("packing", PACKING_WORDS, "packing", packing)))
    held = [(label, b) for label, b in held if b.nbytes >= least]
    held.sort(key=lambda lb: -lb[1].nbytes)
    words = []
    for label, buffer in held[:count]:
        if buffer.category != "scratch":
            words.append(f"{buffer.name} {format_bytes(buffer.nbytes)}")
            continue
        call = by_label[label]
        inside = ", ".join(_arena_words(lower(call.plan, call.private_saved).layout, count))
        whose = f"the {label} plan's scratch arena"
        if len(sharing) > 1 and _shared_arena(by_label, label, buffer):
            whose = f"the scratch arena the plans share, the {label} plan's size,"
        words.append(f"{whose} {format_bytes(buffer.nbytes)} ({inside})")
    return words


def _shared_arena(by_label: dict, label: str, buffer) -> bool:
    return buffer.category == "scratch" and by_label[label].shares_arena


def _arena_words(layout, count: int) -> list[str]:
    """The largest buffers placed in a plan's arena: its values and the workspaces its
    kernels work in (ir/kernel_workspace.py), each with its line."""
    held = [(v.type.nbytes, _value_words(v)) for v in layout.scratch_offsets]
    for node, (_, elements) in layout.workspaces.items():
        nbytes, where = elements * DTYPES[node.dtype].itemsize, format_loc(node.loc)
        words = f"{node.op}'s workspace {format_bytes(nbytes)}"
        held.append((nbytes, words + (f" at {where}" if where else "")))
    held.sort(key=lambda nw: -nw[0])
    return [words for _, words in held[:count]]


def _value_words(value) -> str:
    where = format_loc(value.loc)
    op = "copy of a strided view" if is_strided_copy(value) else value.op
    return f"{op} {value.type}" + (f" at {where}" if where else "")
