"""The saved-buffer table: one text form shared by `explain()` reports and `print(t.grad_fn)`,
so the answer to "what is saved, why, and is it freed yet?" reads the same before and after
backward runs."""

from __future__ import annotations

import re
from collections.abc import Sequence

from backplan.ir.types import dtype_name

INPUT_NOTE = (
    "* your own input: the graph holds a reference to your array, not a copy. Freeing it drops\n"
    "  the graph's reference; the array itself lives on while you still hold it."
)
COPY_NOTE = (
    "(copy): a NumPy array you passed, copied at the call so that changing your array later\n"
    "  cannot change the gradients: backplan's buffer, in the saved bytes and the peak."
)
LEGEND = "fN / bN: forward / backward step N (the N-th op line of that phase's IR, from 0)"
RECOMPUTED_NOTE = (
    "recomputed: not saved and not in the bytes held between forward and backward; the backward\n"
    "  reruns the listed forward ops on what it holds. Under bp.compile(remat=False) it is saved."
)
MAX_CHAIN_OPS = 4


def lifetime_text(info) -> str:
    """'f3 -> b7': written at forward step 3, last read at backward step 7."""
    start = "input" if info.written_step < 0 else f"f{info.written_step}"
    return f"{start} -> {getattr(info, 'read_phase', 'b')}{info.last_read_step}"


def read_by_text(info) -> str:
    """'b8 transpose; b11 mul': the backward steps that read it (their lines are in the IR)."""
    ops = [r.split(" at ")[0] for r in info.read_by]
    steps = getattr(info, "read_steps", ())
    if len(steps) == len(ops):
        phase = getattr(info, "read_phase", "b")  # a training step's rows: forward steps
        return "; ".join(f"{phase}{s} {op}" for s, op in zip(steps, ops, strict=True))
    return "; ".join(ops)


def reason_text(reason: str) -> str:
    """Rules that read several inputs of one node read as one: 'mul derivative reads inputs 1,
    0'."""
    parts, merged = reason.split("; "), {}
    for part in parts:
        match = re.fullmatch(r"(.+ derivative reads) input (\d+)", part)
        key = match.group(1) if match else part
        merged.setdefault(key, []).append(match.group(2) if match else None)
    texts = []
    for key, inputs in merged.items():
        if inputs == [None]:
            texts.append(key)
        else:
            texts.append(f"{key} input{'s' if len(inputs) > 1 else ''} {', '.join(inputs)}")
    return "; ".join(texts)


def recomputed_reason_text(info) -> str:
    """'recomputed, not saved: 2 ops (mul, add) rerun at b7; gelu derivative reads input 0'."""
    ops = list(info.chain[:MAX_CHAIN_OPS]) + (["..."] if len(info.chain) > MAX_CHAIN_OPS else [])
    n = len(info.chain)
    where = "in the backward" if info.recomputed_step is None else f"at b{info.recomputed_step}"
    return (
        f"recomputed, not saved: {n} op{'s' if n != 1 else ''} ({', '.join(ops)}) rerun "
        f"{where}; {reason_text(info.reason)}"
    )


def recomputed_lifetime_text(info) -> str:
    """'b5 -> b32': held inside the backward only, from the step that rebuilds it."""
    if info.recomputed_step is None:
        return "backward"
    return f"b{info.recomputed_step} -> b{max(info.last_read_step, info.recomputed_step)}"


def _type_text(info) -> str:
    return f"{dtype_name(info.dtype)}[{','.join(str(d) for d in info.shape)}]"


def saved_rows(
    infos: Sequence, states: Sequence[str] | None = None, recomputed: Sequence = ()
) -> list[tuple[str, ...]]:
    header = ("name", "type", "bytes", "produced by", "read by", "lifetime", "why saved")
    rows = [header + (("state",) if states is not None else ())]
    for i, info in enumerate(infos):
        name, produced = info.name, f"{info.op} at {info.produced_at}"
        if info.is_region_input:
            name, produced = f"{info.name} *", "your input"
        elif getattr(info, "copy_of_argument", False):
            name, produced = f"{info.name} (copy)", f"copy of {info.name} taken at the call"
        row = (
            name,
            _type_text(info),
            f"{info.nbytes:,}",
            produced,
            read_by_text(info),
            lifetime_text(info),
            reason_text(info.reason),
        )
        rows.append(row + ((states[i],) if states is not None else ()))
    for info in recomputed:
        row = (
            info.name,
            _type_text(info),
            f"{info.nbytes:,}",
            f"{info.op} at {info.produced_at}",
            read_by_text(info),
            recomputed_lifetime_text(info),
            recomputed_reason_text(info),
        )
        rows.append(row + (("recomputed",) if states is not None else ()))
    return rows


def format_saved_table(
    infos: Sequence,
    states: Sequence[str] | None = None,
    indent: str = "  ",
    recomputed: Sequence = (),
    notes: bool = True,
) -> str:
    """The table with one row per saved buffer, then one per value the backward recomputes
    instead of saving; `states` adds the freed/alive/recomputed column. notes=False leaves out
    the legend and footnotes (a report of many tables prints them once, see `table_notes`)."""
    if not infos and not recomputed:
        return f"{indent}(no saved buffers)"
    rows = saved_rows(infos, states, recomputed)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if notes:
        lines.extend(indent + line for line in table_notes(infos, recomputed))
    return "\n".join(lines)


def table_notes(infos: Sequence, recomputed: Sequence = ()) -> list[str]:
    """The legend, and the footnotes that apply to these rows."""
    lines = [LEGEND]
    if any(info.is_region_input for info in infos):
        lines.extend(INPUT_NOTE.splitlines())
    if any(getattr(info, "copy_of_argument", False) for info in infos):
        lines.extend(COPY_NOTE.splitlines())
    if recomputed:
        lines.extend(RECOMPUTED_NOTE.splitlines())
    return lines


def fused_note(fused: Sequence) -> str:
    """The values the unfused plan reads across that the compiled plan never stores (fused
    into the loop that reads them): named, so a reader of the reference interpreter's plan
    sees where they went. Empty when there are none."""
    if not fused:
        return ""
    from .wording import format_bytes, wrap

    names = "; ".join(
        f"{f.name} ({f.op} at {f.produced_at}, {format_bytes(f.nbytes)})" for f in fused
    )
    return wrap(
        f"Not stored by the compiled plan, so in no total above: {names}. Each is computed "
        "inside the fused loop that reads it for the gradient; the reference interpreter "
        "(BACKPLAN_BACKEND=reference) stores them."
    )
