"""Rematerialisation: a saved value that a short chain of cheap ops rebuilds from values the
backward holds anyway (region inputs, other saved values) is recomputed in backward instead of
saved. Saved bytes only go down: a value is recomputed only when every leaf of its chain is
already available. Every registry op is pure (random draws are functions of their key tensor),
so recomputing gives the same bits the forward computed: a dropout mask is rebuilt from its
16-byte key instead of being saved.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .autodiff import SavedValue
from .graph import Graph, Value, copy_graph
from .registry import get_op
from .saved_dtype import is_saved_narrowing

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


def _chain(
    value: Value, available: set[Value], allow=recomputable, limit: int | None = MAX_CHAIN
) -> list[Value] | None:
    """Forward nodes that rebuild value from available values, in order; None if longer than
    limit or if it needs an op `allow` refuses (by default, one that is not cheap)."""
    order, seen, stack = [], set(), [(value, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen or node in available:
            continue
        seen.add(node)
        if not allow(node):
            return None
        stack.append((node, True))
        stack.extend((i, False) for i in node.inputs)
        if limit is not None and len(seen) > limit:
            return None
    return order


def any_op(node: Value) -> bool:
    """What the memory planner may recompute: every op (all are pure), not a graph input."""
    return node.op != "input"


def rematerialize(
    forward: Graph, backward: Graph, saved: list[SavedValue], budget: int | None = None
) -> tuple[Graph, list[SavedValue], list[Recomputed]]:
    """Recompute in backward what pays: (a new backward, still saved, recomputed); the graphs
    given are not changed. budget: stop once the saved bytes (region inputs excluded) fit in
    it; None means recompute everything that qualifies."""
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
    return _apply(forward, backward, saved, kept, recomputed)


def recompute_chosen(
    forward: Graph, backward: Graph, saved: list[SavedValue], chosen: set[Value]
) -> tuple[Graph, list[SavedValue], list[Recomputed]]:
    """The memory planner's rewrite of a region (ir/budget.py): every saved value in chosen
    is recomputed in backward from the values still saved, by any chain of ops. Returns (a
    new backward, still saved, recomputed)."""
    region_inputs = set(forward.inputs)
    kept = {s.forward: s for s in saved if s.forward not in chosen}
    available = set(kept) | region_inputs
    recomputed = []
    for s in saved:
        if s.forward in chosen:
            chain = tuple(_chain(s.forward, available, any_op, None))
            recomputed.append(Recomputed(s.forward, s.forward.type.nbytes, chain, s.reason))
    return _apply(forward, backward, saved, kept, recomputed)


def _apply(forward: Graph, backward: Graph, saved, kept: dict, recomputed: list):
    """Hold the region inputs the chains read (by reference, at no cost) and rewrite a copy
    of backward."""
    region_inputs = set(forward.inputs)
    if recomputed:
        backward, mapping = copy_graph(backward)
        saved = [replace(s, backward_input=mapping[s.backward_input]) for s in saved]
        kept = {s.forward: s for s in saved if s.forward in kept}
        for r in recomputed:
            for leaf in _leaves(list(r.chain)):
                if leaf in region_inputs and leaf not in kept:
                    kept[leaf] = SavedValue(
                        leaf,
                        backward.add_input(leaf.type, role="saved"),
                        f"recomputing a {r.forward.op} output reads it",
                    )
        _rewrite(backward, {s.forward: s for s in saved}, kept, recomputed)
    return backward, list(kept.values()), recomputed


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


# Constants are rebuilt wherever they are read, never held.
REBUILT_OPS = ("full", "const")


def forward_nodes(graph: Graph, n_outputs: int) -> set[Value]:
    """In a joint plan (value_and_grad), the nodes the user's outputs depend on, and the
    narrowing casts of saved_dtype (ir/saved_dtype.py) of those; every other node belongs to
    the gradients."""
    needed = set(graph.outputs[:n_outputs])
    for node in reversed(graph.nodes):
        if node in needed:
            needed.update(node.inputs)
    forward = {n for n in graph.nodes if n in needed}
    forward.update(n for n in graph.nodes if is_saved_narrowing(n, forward))
    return forward


def held_across(graph: Graph, forward: set[Value]) -> list[Value]:
    """Forward values (and inputs) that gradient nodes read: what the joint plan holds from its
    forward part into its gradient part, in first-read order."""
    held, inputs = {}, set(graph.inputs)  # a set: a deep model has a thousand inputs
    for node in graph.nodes:
        if node in forward:
            continue
        for value in node.inputs:
            if (value in forward or value in inputs) and value.op not in REBUILT_OPS:
                held.setdefault(value, None)
    return list(held)


def rematerialize_joint(graph: Graph, n_outputs: int) -> Graph:
    """The joint plan's rematerialisation: a held value that a short chain of cheap ops rebuilds
    is recomputed in the gradient part instead of held, when the chains together hold fewer
    bytes. Their leaves are values held anyway, inputs, or costly forward values (a matmul's or
    a tanh's result), which are then held instead: tanh-form gelu, expanded for the joint plan,
    held five tensors of its width (x*x, 0.5*x, tanh, 1+tanh, the output), now two (x, tanh).
    Returns a new graph whose gradient part reads the copies (or graph itself, unchanged)."""
    forward = forward_nodes(graph, n_outputs)
    held = held_across(graph, forward)
    inputs = set(graph.inputs)
    costly = {n for n in forward if not recomputable(n)}
    candidates = [v for v in held if v not in inputs and recomputable(v)]
    kept = set(held) - set(candidates)
    chains = {}
    stops = kept | inputs | costly | _constants(graph)  # once: a scan of the graph each
    for value in candidates:
        chain = _chain(value, stops)
        if chain is not None:
            chains[value] = chain
    if not chains:
        return graph
    leaves = {leaf for chain in chains.values() for leaf in _leaves(chain)}
    new_held = {leaf for leaf in leaves if leaf not in kept and leaf.op not in REBUILT_OPS}
    new_held |= {v for v in candidates if v not in chains}
    before = sum(v.type.nbytes for v in held if v not in inputs)
    after = sum(v.type.nbytes for v in kept | new_held if v not in inputs)
    if after >= before:
        return graph
    return _recomputed_in_gradients(graph, forward, chains)[0]


def recompute_joint_chosen(
    graph: Graph,
    n_outputs: int,
    chosen: set[Value],
    split: tuple | None = None,
    held_into: list | None = None,
) -> Graph:
    """The memory planner's rewrite of a joint plan: every held value in chosen is recomputed
    in the gradient part from the values still held, by any chain of ops. A new graph.
    split: (forward_nodes, held_across) of graph, where the caller keeps them (the planner
    rewrites one graph once per plan it weighs). held_into, if given, gets the new graph's
    held values that are no graph input (held_recomputed)."""
    if split is None:
        forward = forward_nodes(graph, n_outputs)
        split = (forward, held_across(graph, forward))
    new, _, mapping = recompute_after(graph, split[0], chosen, split[1])
    if held_into is not None:
        held_into.extend(held_recomputed(split[1], chosen, mapping))
    return new


def held_recomputed(held: list[Value], chosen: set[Value], mapping: dict) -> list[Value]:
    """held_across of recompute_after's graph, the graph inputs left out, without walking it:
    the gradient nodes read what they read before, each chosen value's copy instead of it,
    and the copies read only copies, inputs, constants and the held values not chosen. So
    the held values not chosen (their copies: the same objects where copy_graph kept them),
    in the old graph's first-read order (the copies read some of them earlier). Exact where no
    forward node is a narrowing cast (forward_nodes counts such a cast of a forward value as
    forward: a copy of one, or one whose input is now a copy, moves across the split);
    PlanChoices asks only then."""
    return [mapping[v] for v in held if v not in chosen and v.op != "input"]


def recompute_after(
    graph: Graph, forward: set[Value], chosen: set[Value], held: list[Value] | None = None
) -> tuple[Graph, frozenset[Value], dict[Value, Value]]:
    """The same rewrite for any split of graph into a forward part (the nodes in forward) and
    the nodes after it: a compiled training step, whose inlined value_and_grad's forward is
    the part its losses depend on and whose gradients and optimizer update follow. Returns
    (a new graph, its forward part, each old value -> its copy). held: held_across(graph,
    forward), where the caller keeps it."""
    held = held_across(graph, forward) if held is None else held
    available = (set(held) - chosen) | set(graph.inputs) | _constants(graph)
    # the nodes before the first gradient node reading a chosen value stay as they are
    # (_recompute_in_gradients changes nothing before it): shared, not copied
    start = _first_reader(graph, forward, chosen)
    graph, mapping = copy_graph(graph, keep=start)
    forward = frozenset(mapping[n] for n in forward)
    targets = {mapping[v] for v in held if v in chosen}
    available = {mapping[v] for v in available}

    def chain_of(value: Value, copies: dict) -> list[Value]:
        # the chain to value less what earlier chains copied already (their own chains are
        # copied too): each node is walked once, where one chain per value, each walked back
        # to the values still held, was quadratic in a run of recomputed layers
        chain = _chain(value, _Either(available, copies), any_op, None)
        if chain is None:
            raise ValueError(f"a {value.op} value chosen for recomputation needs a graph input")
        return chain

    _recompute_in_gradients(graph, forward, targets, chain_of, start)
    return graph, forward, mapping


def _first_reader(graph: Graph, forward, chosen: set[Value]) -> int:
    """The place in graph.nodes of the first node after the forward part reading a value of
    chosen (len(graph.nodes) if none does)."""
    for at, node in enumerate(graph.nodes):
        if node not in forward and not chosen.isdisjoint(node.inputs):
            return at
    return len(graph.nodes)


class _Either:
    """Membership in either of two containers (a stop set for _chain)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __contains__(self, value) -> bool:
        return value in self.first or value in self.second


def _recomputed_in_gradients(
    graph: Graph, forward: set[Value], chains: dict
) -> tuple[Graph, frozenset[Value], dict[Value, Value]]:
    """A copy of graph whose gradient part recomputes each chain (mapped onto the copy), the
    copy's forward part and the mapping onto the copy."""
    graph, mapping = copy_graph(graph)
    chains = {mapping[v]: [mapping[n] for n in chain] for v, chain in chains.items()}
    forward = frozenset(mapping[n] for n in forward)
    _recompute_in_gradients(graph, forward, chains, lambda value, _copies: chains[value])
    return graph, forward, mapping


def _constants(graph: Graph) -> set[Value]:
    return {n for n in graph.nodes if n.op in REBUILT_OPS}


def _recompute_in_gradients(
    graph: Graph, forward: set[Value], chains, chain_of, start: int = 0
) -> None:
    """Copy each chain right before the first gradient node that reads its value. chains: the
    values rebuilt; chain_of(value, copies made so far): the forward nodes rebuilding it.
    start: no node before graph.nodes[start] is a gradient node reading a chain's value.
    A copy the gradients read keeps the value's derivative reasons (explain's why-saved column:
    without them a recomputed astype read as a saved_dtype copy of its input)."""
    copies: dict[Value, Value] = {}
    nodes = graph.nodes[:start]
    reasons = graph.reasons

    def emit(value: Value) -> Value:
        for node in chain_of(value, copies):
            if node not in copies:
                inputs = tuple(copies.get(i, i) for i in node.inputs)
                copies[node] = Value(node.op, inputs, node.attrs, node.type, node.loc)
                nodes.append(copies[node])
        if value in reasons:
            reasons[copies[value]] = reasons[value]
        return copies[value]

    for node in graph.nodes[start:] if start else graph.nodes:
        if node not in forward:
            reads = False  # a chain's value: the node reads its copy instead
            for value in node.inputs:
                if value in chains:
                    reads = True
                    if value not in copies:
                        emit(value)
            if reads:
                node.inputs = tuple(copies[i] if i in chains else i for i in node.inputs)
        nodes.append(node)
    graph.nodes = nodes
