"""A training step as one linear schedule of integer ids, for the memory planner (ir/budget.py):
the forward nodes, then the nodes that read what the forward holds for them (the backward plan,
its saved buffers pointed back at the forward values, or the joint plan's gradient part).

`simulate(drop)` answers "what if these held values were recomputed instead of held": it places
each dropped value's chain of forward nodes right before the first node that reads it, exactly
where ir/remat.py's rewrites put them (one copy per node, shared by every chain that needs it),
and sweeps the liveness of the result as ir/liveness.py does. It builds no graph, so the planner
can try a few hundred plans of a 10,000-node step in a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .flops import node_flops
from .graph import Value

REBUILT_OPS = ("full", "const")  # rebuilt wherever read: never a candidate, always at hand


@dataclass(frozen=True)
class Outcome:
    """One simulated plan: its peak (bytes the plan itself holds; the caller's arrays are not
    counted), the step where it is reached, the held values live there, the forward nodes
    copied and the arithmetic those copies add."""

    peak: int
    peak_step: int
    live_held: tuple[int, ...]
    recomputed: frozenset[int]
    added_flops: int
    held_bytes: int
    read_by_copies: frozenset[int]


@dataclass
class StepSchedule:
    """ids index `values`; a copy of forward node i has id i + len(values)."""

    values: list[Value]
    steps: list[tuple[int, tuple[int, ...], bool]]  # (id, input ids, is a forward node)
    outputs: set[int]
    available: set[int]  # inputs and rebuilt constants: read in place by any chain
    held: list[int]  # forward values the later part reads, in forward order
    nbytes: list[int] = field(init=False)
    flops: list[int] = field(init=False)
    producer: dict[int, tuple[int, ...]] = field(init=False)
    position: dict[int, int] = field(init=False)
    held_set: set[int] = field(init=False)

    def __post_init__(self):
        self.nbytes = [v.type.nbytes for v in self.values]
        self.flops = [node_flops(v) for v in self.values]
        self.producer = {i: ins for i, ins, forward in self.steps if forward}
        self.position = {i: s for s, (i, _, _) in enumerate(self.steps)}
        self.held_set = set(self.held)

    def held_bytes(self, drop=frozenset()) -> int:
        return sum(self.nbytes[i] for i in self.held if i not in drop)

    def simulate(self, drop: frozenset[int]) -> Outcome:
        order, copies = self._order(drop)
        return self._sweep(order, copies, drop)

    def chain_cost(self, start: int, drop: frozenset[int], copied) -> tuple[int, bool]:
        """(flops that recomputing `start` adds beyond the nodes already copied, whether its
        chain meets an existing copy): start's forward nodes back to the values kept."""
        total, touches, seen, stack = 0, False, {start}, [start]
        while stack:
            node = stack.pop()
            total += self.flops[node]
            for i in self.producer[node]:
                if i in seen or self._kept(i, drop) or i == start:
                    continue
                if i in copied:
                    touches = True
                    continue
                seen.add(i)
                stack.append(i)
        return total, touches

    def _kept(self, i: int, drop) -> bool:
        return i in self.available or (i in self.held_set and i not in drop)

    def _order(self, drop) -> tuple[list[tuple[int, tuple[int, ...]]], dict[int, int]]:
        n, copies, order = len(self.values), {}, []

        def emit(root: int) -> None:
            stack = [(root, False)]
            while stack:
                node, done = stack.pop()
                if done:
                    copies[node] = node + n
                    order.append((node + n, tuple(copies.get(i, i) for i in self.producer[node])))
                    continue
                if node in copies:
                    continue
                stack.append((node, True))
                stack.extend(
                    (i, False)
                    for i in self.producer[node]
                    if i not in copies and not self._kept(i, drop)
                )

        for node, inputs, forward in self.steps:
            if not forward and drop:
                for i in inputs:
                    if i in drop and i not in copies:
                        emit(i)
                inputs = tuple(copies[i] if i in drop else i for i in inputs)
            order.append((node, inputs))
        return order, copies

    def _sweep(self, order, copies: dict[int, int], drop) -> Outcome:
        n, end = len(self.values), len(order)
        last: dict[int, int] = {}
        for step, (_, inputs) in enumerate(order):
            for i in inputs:
                last[i] = step
        for i in self.outputs:
            last[i] = end
        frees: dict[int, int] = {}
        for step, (node, _) in enumerate(order):
            at = last.get(node, step)
            frees[at] = frees.get(at, 0) + self.nbytes[node % n]
        live = peak = 0
        peak_step = -1
        for step, (node, _) in enumerate(order):
            live += self.nbytes[node % n]
            if live > peak:
                peak, peak_step = live, step
            live -= frees.get(step, 0)
        steps = {node: step for step, (node, _) in enumerate(order)}
        live_held = tuple(
            i for i in self.held if i not in drop and steps[i] <= peak_step <= last.get(i, steps[i])
        )
        read = {i for c in copies.values() for i in order[steps[c]][1] if i < n}
        return Outcome(
            peak,
            peak_step,
            live_held,
            frozenset(copies),
            sum(self.flops[i] for i in copies),
            self.held_bytes(drop),
            frozenset(read),
        )


def step_schedule(nodes, later: set, outputs, inputs, alias: dict | None = None) -> StepSchedule:
    """nodes: the step in order; later: those that read what the forward holds (backward or
    gradient nodes); alias maps a backward input to the forward value it stands for."""
    alias = alias or {}
    values: list[Value] = []
    ids: dict[Value, int] = {}

    def id_of(value: Value) -> int:
        value = alias.get(value, value)
        if value not in ids:
            ids[value] = len(values)
            values.append(value)
        return ids[value]

    available = {id_of(v) for v in inputs}
    steps = []
    for node in nodes:
        steps.append((id_of(node), tuple(id_of(i) for i in node.inputs), node not in later))
    forward_ids = {i for i, _, forward in steps if forward}
    available |= {i for i in forward_ids if values[i].op in REBUILT_OPS}
    held = {}
    for _, inputs_, forward in steps:
        if not forward:
            for i in inputs_:
                if i in forward_ids and i not in available:
                    held.setdefault(i, None)
    order = sorted(held, key=lambda i: i)  # ids follow forward order
    return StepSchedule(values, steps, {id_of(o) for o in outputs}, available, order)
