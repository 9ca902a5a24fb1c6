"""The whole graph behind a tensor: every region its backward() would run, in that order, with
each saved buffer, its bytes, the line that produced it, the backward steps that read it and
whether it is still held. The live answer to "what will o.backward() free?"."""

from __future__ import annotations

from dataclasses import dataclass, field

from backplan.runtime.freed import output_desc
from backplan.runtime.region import Region
from backplan.runtime.saved_once import held_totals, planned_totals
from backplan.runtime.walk import regions_in_order

from .recomputed import recomputed_infos
from .region_text import freed_by_text
from .saved_table import format_saved_table, table_notes


@dataclass
class GraphReport:
    """`regions` in the order backward() runs them (the root's region first); `str()` prints
    the report. Built from the regions as they are now: print it again after backward() to see
    what was freed."""

    root: str  # the output backward() starts from, or what the tensor is when it has no graph
    regions: list[Region] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the buffers the graph allocated and holds now, each array once (one array
        saved by two regions counts once); your own arrays are `input_bytes`. backward()
        without retain_graph frees all of them."""
        return held_totals(self.regions).allocated

    @property
    def input_bytes(self) -> int:
        """Bytes of your own arrays (passed in, leaf tensors) the graph holds references to
        now: not allocated by it, not in saved_bytes."""
        return held_totals(self.regions).yours

    @property
    def planned_bytes(self) -> int:
        """Bytes the graph allocated for its saved buffers before anything was freed, each
        array once, your own arrays apart (planned_input_bytes)."""
        return planned_totals(self.regions).allocated

    @property
    def planned_input_bytes(self) -> int:
        return planned_totals(self.regions).yours

    @property
    def freed_regions(self) -> list[Region]:
        return [r for r in self.regions if r.freed]

    def __str__(self) -> str:
        return format_graph(self)

    def __repr__(self) -> str:
        n, held = len(self.regions), self.saved_bytes
        return f"<GraphReport of {self.root}: {n} region(s), {held} B held>"


def graph_report(region: Region | None, index: int, requires_grad: bool) -> GraphReport:
    if region is None:
        what = (
            "a leaf tensor: it has no graph; backward() adds the gradient into its .grad"
            if requires_grad
            else "a tensor that does not require grad: it has no graph"
        )
        return GraphReport(what)
    return GraphReport(output_desc(region, index), regions_in_order(region))


def format_graph(report: GraphReport) -> str:
    if not report.regions:
        return f"graph: {report.root}"
    n = len(report.regions)
    lines = [
        f"graph of {report.root}: backward() runs {n} region{'s' if n != 1 else ''}, in this order"
    ]
    infos, recomputed = [], []
    for i, region in enumerate(report.regions, 1):
        lines.append(f"  {i}. {_region_line(region)}")
        buffers, again = region.saved_buffers, recomputed_infos(region.program)
        if buffers or again:
            states = [region.buffer_state(b) for b in buffers]
            lines.append(format_saved_table(buffers, states, "       ", again, notes=False))
        infos += buffers
        recomputed += again
    lines.append(_total_line(report))
    if infos or recomputed:
        lines.extend("  " + line for line in table_notes(infos, recomputed))
    return "\n".join(lines)


def _region_line(region: Region) -> str:
    n = len(region.program.saved_info)
    saved = (
        f"{n} saved buffer{'s' if n != 1 else ''}, {region.planned_saved_bytes:,} B"
        if n
        else "saved nothing"
    )
    state = freed_by_text(region.freed_by) if region.freed else "alive"
    return f"`{region.name}` created at {region.created_at}: {saved}; {state}"


def _total_line(report: GraphReport) -> str:
    n_saved = sum(len(r.program.saved_info) for r in report.regions)
    planned, held = planned_totals(report.regions), held_totals(report.regions)
    text = (
        f"  total: {n_saved} saved buffer{'s' if n_saved != 1 else ''}, each array once: "
        f"{planned.allocated:,} B allocated by the graph, {planned.yours:,} B your own arrays "
        f"held by reference; held now: {held.allocated:,} B allocated, {held.yours:,} B yours"
    )
    freed = report.freed_regions
    if not freed:
        return (
            f"{text}, all of which backward() frees as it goes (backward(retain_graph=True) "
            "keeps them)."
        )
    first = report.regions.index(freed[0]) + 1
    which = (
        "every region is freed"
        if len(freed) == len(report.regions)
        else f"{len(freed)} of the {len(report.regions)} regions are freed"
    )
    return (
        f"{text}; {which}: backward() raises GraphFreedError at region {first} (`{freed[0].name}`)."
    )
