"""Rematerialisation: a saved value that a short chain of cheap ops rebuilds from values the
backward holds anyway (region inputs, other saved values) is recomputed in backward instead of
saved. Saved bytes only go down: a value is recomputed only when every leaf of its chain is
already available. Every registry op is pure (random draws are functions of their key tensor),
so recomputing gives the same bits the forward computed: a dropout mask is rebuilt from its
16-byte key instead of being saved.
"""

from __future__ import annotations

from dataclasses import dataclass

from .autodiff import SavedValue
from .graph import Graph, Value
from .registry import get_op

MAX_CHAIN = 16


def recomputable(node: Value) -> bool:
    """Sources, moves, arithmetic a fused loop does for free, and one-pass row ops such as
    layer_norm (cheaper than writing the result and reading it back): every cost class but
    `costly`. Transcendentals (exp, tanh, gelu, ...) are saved: recomputing them costs time."""
    return node.op != "input" and get_op(node.op).cost != "costly"


@dataclass(frozen=True)
class Recomputed:
    forward: Value
    nbytes: int
    chain: tuple[Value, ...]  # forward nodes rebuilt in backward, in order
    reason: str


def _chain(value: Value, available: set[Value]) -> list[Value] | None:
    """Forward nodes that rebuild value from available values, in order; None if too long or
    if it needs an op that is not cheap."""
    order, seen, stack = [], set(), [(value, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen or node in available:
            continue
        seen.add(node)
        if not recomputable(node):
            return None
        stack.append((node, True))
        stack.extend((i, False) for i in node.inputs)
        if len(seen) > MAX_CHAIN:
            return None
    return order


def rematerialize(
    forward: Graph, backward: Graph, saved: list[SavedValue], budget: int | None = None
) -> tuple[list[SavedValue], list[Recomputed]]:
    """Rewrites backward in place to recompute what pays; returns (still saved, recomputed).
    budget: stop once the saved bytes (region inputs excluded) fit in it; None means recompute
    everything that qualifies."""
    region_inputs = set(forward.inputs)
    kept = {s.forward: s for s in saved}
    recomputed = []

    def saved_bytes():
        return sum(v.type.nbytes for v in kept if v not in region_inputs)

    for s in sorted(saved, key=lambda s: -s.forward.type.nbytes):
        if budget is not None and saved_bytes() <= budget:
            break
        if s.forward in region_inputs:
            continue
        available = (set(kept) - {s.forward}) | region_inputs
        chain = _chain(s.forward, available)
        if chain is None:
            continue
        del kept[s.forward]
        recomputed.append(Recomputed(s.forward, s.forward.type.nbytes, tuple(chain), s.reason))
    if recomputed:
        for r in recomputed:  # region inputs a chain reads are held by reference, at no cost
            for leaf in _leaves(list(r.chain)):
                if leaf in region_inputs and leaf not in kept:
                    kept[leaf] = SavedValue(
                        leaf,
                        backward.add_input(leaf.type, role="saved"),
                        f"recomputing a {r.forward.op} output reads it",
                    )
        _rewrite(backward, {s.forward: s for s in saved}, kept, recomputed)
    return list(kept.values()), recomputed


def _leaves(chain: list[Value]) -> list[Value]:
    """In first-read order, so a plan's inputs (and its generated source) never depend on
    where Python happened to allocate the values."""
    inside = set(chain)
    return list(dict.fromkeys(i for node in chain for i in node.inputs if i not in inside))


def _rewrite(backward: Graph, all_saved, kept, recomputed) -> None:
    """Insert each chain right before the first backward node that reads the value."""
    replace = {all_saved[r.forward].backward_input: r for r in recomputed}
    mapping: dict[Value, Value] = {}
    nodes = []

    env = {f: s.backward_input for f, s in kept.items()}
    by_forward = {r.forward: r for r in recomputed}

    def resolve(value: Value) -> Value:
        if value not in mapping and value not in env:
            emit(by_forward[value])  # a leaf that is itself recomputed
        return mapping[value] if value in mapping else env[value]

    def emit(r: Recomputed) -> None:
        for node in r.chain:
            if node not in mapping:
                inputs = [resolve(i) for i in node.inputs]
                mapping[node] = Value(node.op, inputs, node.attrs, node.type, node.loc)
                nodes.append(mapping[node])
        mapping[all_saved[r.forward].backward_input] = mapping[r.forward]

    for node in backward.nodes:
        for inp in node.inputs:
            if inp in replace and inp not in mapping:
                emit(replace[inp])
        if any(i in mapping for i in node.inputs):
            node.inputs = tuple(mapping.get(i, i) for i in node.inputs)
        nodes.append(node)
    backward.nodes = nodes
    backward.outputs = [mapping.get(o, o) for o in backward.outputs]
