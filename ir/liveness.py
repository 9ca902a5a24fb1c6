"""Liveness over the linear schedule: for every value the step that writes it and the step that
reads it last, and the explicit `free` statements that follow from them.

plan_liveness leaves them to be worked out when first read: most plans a memory frontier
builds are lowered for their peaks only, which never read them (a 10,086-node row's three
maps took ~4.6 ms of its ~130), while explain, the reference interpreter and export do."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .graph import Graph, Value
from .text import format_graph

OWNED_ROLES = ("saved", "cotangent")  # inputs the plan owns and frees; args belong to the caller
INPUT_STEP = -1


@dataclass
class Plan:
    """A graph in schedule order plus explicit frees. Steps are node indices; -1 is 'on entry'
    and len(nodes) is 'at return'."""

    graph: Graph
    first_write: dict[Value, int] = field(default_factory=dict)
    last_read: dict[Value, int] = field(default_factory=dict)
    frees_after: dict[int, list[Value]] = field(default_factory=dict)
    donated: tuple[int, ...] = ()  # inputs whose buffers outputs may take (ir/donation.py)
    lowered: dict = field(default_factory=dict, repr=False, compare=False)  # see ir/lowering.py
    # Plans instantiated from one symbolic plan (ir/symbolic.py) share this dict: codegen keeps
    # there the size-generic driver they all run (codegen/render/lift.py). None: a plain plan.
    shared: dict | None = field(default=None, repr=False, compare=False)
    # where the compiled loops keep a fused 16-bit chain in float32 (ir/rounding_points.py),
    # for the reference interpreter: a widening cast -> the float32 value it holds; a node ->
    # {input cast: the value its loop reads in the cast's place}
    unrounded: dict = field(default_factory=dict, repr=False, compare=False)
    reads_instead: dict = field(default_factory=dict, repr=False, compare=False)
    # (input index, layout) of each input whose array arrives in another layout than C order
    # (ir/argument_layout.py): a compiled call copies it whole on entry, held until it returns
    copied: tuple = field(default=(), compare=False)
    # a lowered plan's inputs of `copied` it reads in place instead (ir/in_place_inputs.py):
    # (input index, layout), the compiled call passing a C-ordered view of the argument
    in_place: tuple = field(default=(), compare=False)

    def __getattr__(self, name: str):
        """Reached only for an attribute the plan lacks: liveness plan_liveness left to be
        worked out (from the graph's lists as they were then), filled on the first read."""
        if name in _LIVENESS and "_scheduled" in self.__dict__:
            _fill(self)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def return_step(self) -> int:
        return len(self.graph.nodes)

    def text(self) -> str:
        return format_graph(self.graph, self.frees_after)

    def __str__(self) -> str:
        return self.text()

    def live_bytes_by_step(self) -> list[int]:
        """Bytes held after each node runs (its output allocated, before the frees that follow)."""
        live = sum(v.type.nbytes for v in self.graph.inputs if v.role in OWNED_ROLES)
        live -= sum(v.type.nbytes for v in self.frees_after.get(INPUT_STEP, ()))
        series = []
        for step, node in enumerate(self.graph.nodes):
            live += node.type.nbytes
            series.append(live)
            live -= sum(v.type.nbytes for v in self.frees_after.get(step, ()))
        return series

    @property
    def peak_bytes(self) -> int:
        """Predicted peak of the bytes this plan holds: owned inputs and values it computes."""
        series = self.live_bytes_by_step()
        start = sum(v.type.nbytes for v in self.graph.inputs if v.role in OWNED_ROLES)
        return max([start, *series])

    def live_at_peak(self) -> list[Value]:
        """The values held at the peak step (owned inputs included), largest first: what a
        budget that is too small should be told dominates."""
        series = self.live_bytes_by_step()
        if not series:
            return []
        step = series.index(max(series))
        live = [
            v
            for v, first in self.first_write.items()
            if (first >= 0 or v.role in OWNED_ROLES)
            and first <= step <= self.last_read.get(v, first)
        ]
        return sorted(live, key=lambda v: -v.type.nbytes)


def plan_liveness(graph: Graph, donated: tuple[int, ...] = ()) -> Plan:
    """graph's frees after each value's last read. donated: the inputs the pipeline lets the
    outputs be written into, kept with the plan for its lowering to pair them. The three
    maps are worked out when first read (see the module's docstring), from graph's inputs,
    nodes and outputs as they are now."""
    plan = Plan(graph, donated=tuple(donated))
    state = plan.__dict__
    for name in _LIVENESS:
        del state[name]
    state["_scheduled"] = (list(graph.inputs), list(graph.nodes), list(graph.outputs))
    return plan


_LIVENESS = ("first_write", "last_read", "frees_after")
_filling = threading.Lock()  # two threads reading a new plan's liveness at once fill it once


def _fill(plan: Plan) -> None:
    """plan's liveness maps that are still missing (one assigned since is kept)."""
    with _filling:
        state = plan.__dict__
        scheduled = state.get("_scheduled")
        if scheduled is None:
            return  # filled by another thread meanwhile
        made = dict(zip(_LIVENESS, _liveness(*scheduled), strict=True))
        for name, value in made.items():
            state.setdefault(name, value)
        del state["_scheduled"]


def _liveness(inputs: list[Value], nodes: list[Value], outputs: list[Value]):
    """(first_write, last_read, frees_after) of a schedule."""
    first_write: dict[Value, int] = dict.fromkeys(inputs, INPUT_STEP)
    first_write.update(zip(nodes, range(len(nodes)), strict=True))
    # each value's last reader's step (a later reader's overwrites it), in first-read order
    last_read = {inp: step for step, node in enumerate(nodes) for inp in node.inputs}
    ret = len(nodes)
    for out in outputs:
        last_read[out] = ret
    frees_after: dict[int, list[Value]] = {}
    returned = set(outputs)
    for value, written in first_write.items():
        if written == INPUT_STEP:
            if value.role not in OWNED_ROLES:
                continue
        elif value in returned:
            continue  # handed to the caller
        frees_after.setdefault(last_read.get(value, written), []).append(value)
    return first_write, last_read, frees_after
