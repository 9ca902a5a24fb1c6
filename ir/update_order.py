"""Each parameter's optimizer update right after its gradient is final: a step of the pipeline
for a compiled training step (what PyTorch users get from optimizer-in-backward hooks, here
decided on the static plan before anything runs).

A step written as `bp.value_and_grad(loss)` then `opt.update` is traced as every gradient, then
every update, so the step holds all the weight gradients at once until the update loops at the
end. `updates_after_gradients` moves the update part (the nodes after the inlined forward that
no gradient depends on: the optimizer's arithmetic, its state updates, its step count) each to
the earliest point its inputs allow, so each gradient buffer dies right after the update that
reads it. Every other node keeps its place and every value is the same (no op changes, only
when it runs).

True dependencies are kept. An update that reads a donated input (the old parameter, an old
moment) runs after every read of that buffer by the forward and gradient part (dX = dY @ W^T
reads the old W), so the new value may still be written into the old buffer (ir/donation.py
pairs them on the lowered schedule and checks it). Nothing moves into the forward part: the
update part starts after the last forward node. Whether the new order is kept is the
pipeline's choice (PlanChoices.build keeps it where it lowers the step's peak).

>>> from backplan.ir.graph import Graph, Value
>>> from backplan.ir.types import TensorType
>>> g = Graph()
>>> w, x = g.add_input(TensorType("f32", (4,))), g.add_input(TensorType("f32", (4,)))
>>> def node(op, *inputs):
...     return Value(op, inputs, {}, TensorType("f32", (4,)))
>>> y = node("mul", w, x)  # the forward
>>> gw = node("mul", y, x)  # w's gradient
>>> gy = node("exp", y)  # more of the gradient part
>>> gx = node("mul", gy, w)  # x's gradient reads the old w
>>> w2 = node("sub", w, gw)  # w's update
>>> g.nodes, g.outputs = [y, gw, gy, gx, w2], [w2, gx]
>>> [op.op for op in updates_after_gradients(g, {y}, {gw, gx}, ()).nodes]
['mul', 'mul', 'sub', 'exp', 'mul']
>>> updates_after_gradients(g, {y}, {gw, gx}, (0,)) is None  # w donated: it waits for gx
True
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from .graph import Graph, Value, carry_reasons
from .layout import storage_root
from .peak import PlanCall, predicted_peak

_FOLLOWED: ContextVar[bool | None] = ContextVar("followed_update_order", default=None)


@contextmanager
def following(kept: bool | None) -> Iterator[None]:
    """Plans built inside take this order (True: early) instead of weighing both: a dynamic
    axis's probe sizes follow the size they are fitted with, whose plan runs at every size
    (the cheaper order can change with the size; two orders cannot be one plan)."""
    token = _FOLLOWED.set(kept)
    try:
        yield
    finally:
        _FOLLOWED.reset(token)


def followed() -> bool | None:
    """The order `following` asks for here, or None: weigh both."""
    return _FOLLOWED.get()


class UpdateOrder:
    """A training step's peak on `backend` ("numba": the compiled plans; "reference"), with its
    updates in the traced order and run right after their gradients; `kept`: the plans use the
    second order. Given no `kept`, both peaks are taken now and the second order is kept where
    it holds fewer bytes (on the reference interpreter, which allocates every output when it is
    written, an early adam update holds its new parameter and moments longer than the gradient
    it frees: there the traced order is kept). Given `kept` (a budget's plans follow their
    default plan's choice), each peak is taken when first asked for."""

    def __init__(self, backend: str, traced: list[PlanCall], early: list[PlanCall], kept=None):
        self.backend = backend
        self._calls = {"traced": traced, "early": early}
        self._peaks: dict[str, int] = {}
        self.kept: bool = self.early < self.traced if kept is None else kept

    def _peak(self, order: str) -> int:
        if order not in self._peaks:  # two threads may both compute it: the same number
            self._peaks[order] = predicted_peak(self._calls[order], self.backend).peak_bytes
        return self._peaks[order]

    @property
    def traced(self) -> int:
        return self._peak("traced")

    @property
    def early(self) -> int:
        return self._peak("early")

    @property
    def peak_bytes(self) -> int:
        """The peak of the order the plans use."""
        return self.early if self.kept else self.traced

    def __repr__(self) -> str:
        return (
            f"UpdateOrder(backend={self.backend!r}, kept={self.kept}, traced={self.traced}, "
            f"early={self.early})"
        )


def update_part(graph: Graph, forward, gradients) -> set[Value]:
    """The nodes after the forward part that no gradient depends on: the optimizer update (and
    anything else computed from gradients, parameters and state only)."""
    needed = set(gradients)
    for node in reversed(graph.nodes):
        if node in needed:
            needed.update(node.inputs)
    return {n for n in graph.nodes if n not in forward and n not in needed}


def updates_after_gradients(
    graph: Graph, forward, gradients, donated: tuple[int, ...]
) -> Graph | None:
    """graph with its update part run as early as its dependencies allow (module docstring),
    or None when no node moves. forward: the nodes the inlined losses depend on; gradients:
    the inlined value_and_grad's gradient values; donated: the inputs the outputs may be
    written into."""
    update = update_part(graph, forward, gradients)
    if not update:
        return None
    order = _early_order(graph, forward, update, {graph.inputs[i] for i in donated})
    if order == graph.nodes:
        return None
    moved = Graph(graph.name, list(graph.inputs), order, list(graph.outputs), dict(graph.constants))
    return carry_reasons(graph, moved)


def _early_order(graph: Graph, forward, update: set[Value], donated: set[Value]) -> list[Value]:
    """The other nodes in their order; after each (none before the last forward node), every
    update node whose wait is over (_waits_for), with the update nodes made from inputs only
    that they read (adam's beta1 * m, its bias corrections), in their traced relative order:
    each update chain keeps the statement order it had, so the loop it fuses into computes
    the same expressions the same way. Update nodes nothing waits for go at the end."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    made_from_inputs = _made_from_inputs(graph, update)
    waits, dependents = _waits_for(graph, update, made_from_inputs, donated)
    ready = [(index[n], n) for n, count in waits.items() if count == 0]
    heapq.heapify(ready)
    start = max((index[n] for n in forward if n in index), default=-1)
    order: list[Value] = []
    placed: set[Value] = set()

    def place(node: Value, into: list[Value]) -> None:
        into.append(node)
        placed.add(node)
        for later in dependents.get(node, ()):
            waits[later] -= 1
            if waits[later] == 0:
                heapq.heappush(ready, (index[later], later))

    def drain() -> None:
        burst: list[Value] = []
        while ready:
            node = heapq.heappop(ready)[1]
            stack = [v for v in node.inputs if v in made_from_inputs and v not in placed]
            while stack:
                value = stack.pop()
                if value not in placed:
                    place(value, burst)
                    stack.extend(v for v in value.inputs if v in made_from_inputs)
            place(node, burst)
        order.extend(sorted(burst, key=index.__getitem__))

    for node in graph.nodes:
        if node not in update:
            place(node, order)
            if index[node] >= start:
                drain()
    drain()
    order.extend(n for n in graph.nodes if n not in placed)
    if len(order) != len(graph.nodes):  # each node once: an SSA graph in order has no cycle
        raise AssertionError("updates_after_gradients lost or repeated nodes")
    return order


def _made_from_inputs(graph: Graph, update: set[Value]) -> set[Value]:
    """Update nodes computed from the step's inputs and constants only."""
    found: set[Value] = set()
    for node in graph.nodes:
        if node in update and all(v in found or v.op == "input" for v in node.inputs):
            found.add(node)
    return found


def _waits_for(graph: Graph, update: set[Value], made_from_inputs: set[Value], donated):
    """Per update node that reads something the step computes, how many nodes must run before
    it: those it reads (but the ones made from inputs, placed with it), and the last node
    outside the update part reading each donated buffer that it or those read; per node, the
    update nodes waiting on it."""
    last_reader: dict[Value, Value] = {}
    for node in graph.nodes:
        if node not in update:
            for value in node.inputs:
                root = storage_root(value)
                if root in donated:
                    last_reader[root] = node
    reads: dict[Value, set[Value]] = {}  # donated buffers a node or its pulled inputs read
    waits: dict[Value, int] = {}
    dependents: dict[Value, list[Value]] = {}
    for node in graph.nodes:
        if node not in update:
            continue
        roots = {r for r in map(storage_root, node.inputs) if r in donated}
        for value in node.inputs:
            roots |= reads.get(value, set())
        reads[node] = roots if node in made_from_inputs else set()
        if node in made_from_inputs:
            continue
        before = {v for v in node.inputs if v.op != "input" and v not in made_from_inputs}
        before |= {last_reader[r] for r in roots if r in last_reader}
        waits[node] = len(before)
        for value in before:
            dependents.setdefault(value, []).append(node)
    return waits, dependents
