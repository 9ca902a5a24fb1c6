"""The memory frontier of a step (`fn.memory_frontier(*args)`): the plans the budget option
chooses from, peak bytes against the FLOPs each adds by recomputing, as a table and a picture.
Peaks strictly fall as FLOPs rise; `max_peak_bytes=point.peak_bytes` picks that point's plan.
With `allow_saved_dtype=bp.bfloat16` the plans keeping their saved buffers in bfloat16 are rows
too: no added FLOPs (a cast each way), but the backward reads rounded values, so they are
marked as rounding."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .plot import PlotDependencyError
from .wording import format_bytes


@dataclass(frozen=True)
class FrontierPoint:
    peak_bytes: int  # the whole step, the arrays passed in included
    added_flops: int  # beyond the default plan
    recomputed: int  # held values the backward recomputes instead, beyond the default plan's
    # held from the forward into the backward (inputs excluded), in the plan that runs: on
    # numba a value computed inside the fused loop reading it is not held (report.fused_saved)
    saved_bytes: int
    saved_dtype: str | None = None  # "bfloat16": saved buffers narrowed, the backward rounds

    @property
    def rounds(self) -> bool:
        """Whether the backward reads rounded saved values (a narrower saved dtype)."""
        return self.saved_dtype is not None


@dataclass(frozen=True)
class MemoryFrontier:
    name: str
    points: list[FrontierPoint]  # the default plan first
    step_flops: int  # of the default plan
    input_bytes: int
    # the lowest peak any plan reaches, where it is below the last row by less than a row must
    # lower it (1%: no row); a budget from it up to the last row runs it, one under it is refused
    floor: FrontierPoint | None = None

    def __str__(self) -> str:
        rounding = any(p.rounds for p in self.points)
        rows = [("peak", "saved", "added FLOPs", "of the step", "recomputed")]
        rows[0] += ("saved as",) if rounding else ()
        rows += [self._row(p, rounding) for p in self.points]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        head = (
            f"memory frontier of {self.name}: {len(self.points)} plan(s), peak against added "
            f"arithmetic (the default plan first; the arrays passed in hold "
            f"{format_bytes(self.input_bytes)}); max_peak_bytes=N runs the first plan whose "
            "peak fits N"
        )
        tail = [
            "  (rounds): the saved buffers are kept in that dtype (allow_saved_dtype): no added "
            "FLOPs, a cast each way, and the backward reads values rounded to its precision"
        ]
        return "\n".join(
            [head, *("  " + line for line in lines), *(tail if rounding else []), *self._floor()]
        )

    def _floor(self) -> list[str]:
        """The line on the plan under the last row, the lowest peak a refusal names."""
        if self.floor is None:
            return []
        p, last = self.floor, self.points[-1]
        rounds = f", saved buffers in {p.saved_dtype} (rounds)" if p.rounds else ""
        return [
            f"  below the last row: {format_bytes(p.peak_bytes)}, "
            f"{format_bytes(last.peak_bytes - p.peak_bytes)} less for {p.added_flops:,} "
            f"added FLOPs (+{100 * p.added_flops / max(self.step_flops, 1):.1f}%, "
            f"{p.recomputed} recomputed{rounds}), the lowest peak any plan reaches: no row (it "
            f"lowers the last by under 1%), but max_peak_bytes from {p.peak_bytes:,} below "
            f"{last.peak_bytes:,} runs it and a budget under it is refused"
        ]

    def _row(self, p: FrontierPoint, rounding: bool) -> tuple[str, ...]:
        share = f"+{100 * p.added_flops / max(self.step_flops, 1):.1f}%"
        row = (
            format_bytes(p.peak_bytes),
            format_bytes(p.saved_bytes),
            f"{p.added_flops:,}",
            share,
            str(p.recomputed),
        )
        if not rounding:
            return row
        return (*row, f"{p.saved_dtype} (rounds)" if p.rounds else "as computed")

    def plot(self, path) -> None:
        """Peak bytes against added FLOPs, as PNG or SVG (by the suffix). Needs matplotlib:
        `pip install backplan[plot]`."""
        self.figure().savefig(os.fspath(path))

    def figure(self):
        """The plot as a matplotlib Figure: the rows as a falling step, and the floor (the
        lowest peak, no row) as its own point, so the picture shows what a refusal names."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise PlotDependencyError(
                "memory_frontier().plot() needs matplotlib, which is not installed. Install "
                "the plot extra: pip install 'backplan[plot]' (or: pip install matplotlib)"
            ) from None
        figure = Figure(figsize=(6, 4))
        axes = figure.add_subplot()
        flops = [p.added_flops / 1e6 for p in self.points]
        peaks = [p.peak_bytes / 2**20 for p in self.points]
        axes.step(flops, peaks, where="post", color="#4c72b0")
        for rounds, marker, color in ((False, "o", "#4c72b0"), (True, "s", "#c44e52")):
            chosen = [p for p in self.points if p.rounds == rounds]
            if chosen:
                label = f"saved in {chosen[0].saved_dtype} (rounds)" if rounds else "as computed"
                axes.plot(
                    [p.added_flops / 1e6 for p in chosen],
                    [p.peak_bytes / 2**20 for p in chosen],
                    marker,
                    color=color,
                    label=label,
                )
        if self.floor is not None:
            axes.plot(
                [self.floor.added_flops / 1e6],
                [self.floor.peak_bytes / 2**20],
                "v",
                color="#55a868",
                label="lowest peak (no row: under 1% below the last)"
                + (f", saved in {self.floor.saved_dtype} (rounds)" if self.floor.rounds else ""),
            )
        if self.floor is not None or any(p.rounds for p in self.points):
            axes.legend()
        axes.set_xlabel("added MFLOPs (recomputation)")
        axes.set_ylabel("step peak (MiB)")
        axes.set_title(f"{self.name}: plans a memory budget chooses from")
        figure.tight_layout()
        return figure
