"""Words and numbers the report's sections share: byte counts, wrapped paragraphs, where the
peak is."""

from __future__ import annotations

import textwrap

from backplan.ir.text import format_loc

WIDTH = 100  # characters per report line


def format_bytes(n: int) -> str:
    """'48 B', '12,288 B (12.0 KiB)', '3,145,728 B (3.0 MiB)'."""
    if n < 10 * 1024:
        return f"{n:,} B"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n:,} B ({n / size:.1f} {unit})"
    return f"{n:,} B"


def wrap(text: str) -> str:
    return "\n".join(
        textwrap.fill(p, WIDTH, initial_indent="  ", subsequent_indent="  ")
        for p in text.split("\n")
    )


def peak_where(report) -> str:
    """Where the reference interpreter's timeline peaks: 'at b3, matmul at model.py:7'."""
    step = report.reference_peak_step
    where = f"at {step.label}, {step.op}"
    if step.node.loc:
        where += f" at {format_loc(step.node.loc)}"
    return where
