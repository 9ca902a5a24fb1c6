"""The text report printed at the end of a run."""

from __future__ import annotations

from .format import (
    COLUMNS,
    LEGEND,
    environment_lines,
    footnotes,
    limit_lines,
    model_title,
    row_cells,
    run_lines,
    threads_set,
    warm_lines,
)
from .imported import HEADER, TITLE, imported_rows


def align(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def render_text(record: dict) -> str:
    lines = [
        "backplan bench: " + record["command"],
        *run_lines(record),
        *environment_lines(record),
        *limit_lines(record),
        "",
    ]
    for model in record["models"]:
        rows = [r for r in record["results"] if r["model"] == model["name"]]
        lines.append(model_title(record, model))
        table = [list(COLUMNS), *(row_cells(r) for r in rows)]
        body = align([cells[:-1] for cells in table])  # the last column (check) is free text
        lines += [f"  {line}  {cells[-1]}" for line, cells in zip(body, table, strict=True)]
        lines += [f"  note: {note}" for note in footnotes(rows, threads_set(record))]
        lines.append("")
    lines += imported_text(record)
    for skipped in record["skipped_peers"]:
        lines.append(f"skipped {skipped['peer']}: {skipped['reason']}")
    lines += ["", *LEGEND]
    if record["run"].get("warm_compile", True):
        lines += warm_lines(record)
    return "\n".join(lines)


def imported_text(record: dict) -> list[str]:
    """The imported models' summary table, or nothing when the run had none."""
    rows = imported_rows(record)
    if not rows:
        return []
    return [f"{TITLE}:", *(f"  {line}" for line in align([list(HEADER), *rows])), ""]
