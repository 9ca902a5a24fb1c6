"""Fusion grouping: partition a plan's nodes into kernels, before code generation.

- Elementwise nodes of one iteration shape form one loop nest; values used only inside it are
  never materialised.
- `alias` views (broadcast_to, stop_gradient) and reshapes that only add or drop size-1 axes
  are aliases: a loop reads their source through an index transform, so they cost nothing.
- `loop_tail` reductions (sum, max) join the loop nest that computes their input and
  accumulate as it runs.
- `full` nodes are literals, never buffers, when only loops read them.
- Everything else (matmul, gather, the row composites such as layer_norm) is one kernel each;
  transposes, slices and other reshapes are views.
- A loop that reads a widening cast of a 16-bit value another loop computes recomputes the
  cast and reads the 16-bit value: stored, it takes half the bytes of the widened one.
- A widening cast of a 16-bit value of a smaller shape that every reader reads in place
  (a bias's widening, broadcast over rows) is recomputed by each larger loop reading it: a
  shift per element instead of a float32 copy written by a loop of its own, and the loop
  reading it need not wait for that copy (it may join the loop before it: a 16-bit GEMM's
  bias add and activation then run in the GEMM's epilogue, ir/epilogue.py).
- A cast that reads back a 16-bit copy of a value used elsewhere too (saved_dtype's copy, read
  by a joint plan's gradient part) never joins the loop that made the copy: there it would hold
  the widened value instead of the 16-bit one.
Which op is which is read from its registry entry; no op is named here (but astype, above).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .graph import Graph, Value
from .registry import REGISTRY, get_op
from .types import is_float, is_half, np_dtype


def is_unit_reshape(node: Value) -> bool:
    """A reshape that only inserts or removes axes of size 1."""
    if node.op != "reshape":
        return False
    return [d for d in node.inputs[0].shape if d != 1] == [d for d in node.shape if d != 1]


def is_alias(node: Value) -> bool:
    op = node.op
    if op == "reshape":
        return is_unit_reshape(node)
    # the registry read in place of get_op (which raises for an unknown op): lowering asks
    # this millions of times of a 10,000-node plan
    return op != "input" and (REGISTRY.get(op) or get_op(op)).alias


def alias_base(value: Value) -> Value:
    while True:  # is_alias, inlined: the lowering's most frequent question
        op = value.op
        if op == "reshape":
            if not is_unit_reshape(value):
                return value
        elif op == "input" or not (REGISTRY.get(op) or get_op(op)).alias:
            return value
        value = value.inputs[0]


class Bases(dict):
    """value -> alias_base(value), each worked out at its first question: a lowering asks it
    of every input of every node in several passes (~90,000 times a row of a 10,000-node
    memory frontier). Values never change op or inputs while a plan is lowered."""

    __slots__ = ()

    def __missing__(self, value: Value) -> Value:
        base = self[value] = alias_base(value)
        return base


def internal_shape(shape) -> tuple[int, ...]:
    """Compiled code keeps 0-d values as 1-element vectors."""
    return tuple(shape) if shape else (1,)


def index_map(value: Value, loop_shape) -> tuple[Value, list[int | None]]:
    """The array a loop really reads for `value`, and for each of its dimensions the loop
    dimension that indexes it (None: always index 0)."""
    offset = len(loop_shape) - len(value.shape)
    dims = [offset + k if d != 1 else None for k, d in enumerate(value.shape)]
    while is_alias(value):
        source = value.inputs[0]
        if value.op == "broadcast_to":
            shift = len(value.shape) - len(source.shape)
            dims = [dims[k + shift] if d != 1 else None for k, d in enumerate(source.shape)]
        elif value.op == "reshape":
            kept = iter([dims[k] for k, d in enumerate(value.shape) if d != 1])
            dims = [next(kept) if d != 1 else None for d in source.shape]
        value = source
    return value, dims or [None]


def is_loop_op(node: Value) -> bool:
    """An elementwise op with a scalar expression: a fused loop computes it per element."""
    return get_op(node.op).scalar is not None


def is_loop_tail(node: Value) -> bool:
    return get_op(node.op).loop_tail


def is_cheap(node: Value) -> bool:
    """Arithmetic a loop recomputes more cheaply than it reads a stored copy."""
    return get_op(node.op).cost == "cheap"


class _Unchanging(list):
    """The empty list of recomputed values or reduction tails of a kernel that has none: only
    loops take either, while they are grouped (group_kernels), so every other kernel, and each
    grouped loop without any, shares this one. A 10,086-node plan lowers to ~8,300 kernels,
    most of them views, aliases and single ops: two lists each that the cyclic collector
    tracked as long as the plan lived (a third of a memory frontier's objects). Adding to it
    raises, so a pass that meant to is told."""

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError("a kernel that is not a loop has no recomputed values or reductions")

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse


NONE_HELD = _Unchanging()


@dataclass
class Kernel:
    """One step of a compiled plan. kind is "loop" (fused loop nest over `shape`, with optional
    reduction tails), "literal", "alias", "view" or "op" (one node, one template)."""

    kind: str
    nodes: list[Value] = field(default_factory=list)
    shape: tuple[int, ...] = ()
    reductions: list[Value] = field(default_factory=list)
    recomputed: list[Value] = field(default_factory=list)  # cheap values of other kernels
    epilogue: Kernel | None = None  # a loop run on each block of a matmul's result (ir/epilogue.py)

    # Both lists are read, never changed, by their callers: a kernel that has nothing but its
    # nodes (most of a plan's: views, aliases, single ops) hands `nodes` itself, not a copy
    # (the passes of a lowering ask them ~40,000 times a row of a 10,000-node frontier).

    @property
    def all_nodes(self) -> list[Value]:
        """The nodes this kernel is home to (each value has exactly one home)."""
        if self.epilogue is None:
            return self.nodes + self.reductions if self.reductions else self.nodes
        return self.nodes + self.reductions + self.epilogue.all_nodes

    @property
    def computed(self) -> list[Value]:
        """Everything the kernel computes, in order: recomputed values first."""
        if self.epilogue is None and not self.recomputed and not self.reductions:
            return self.nodes
        after = self.epilogue.computed if self.epilogue is not None else []
        return self.recomputed + self.nodes + self.reductions + after


# A loop kernel takes at most this many nodes, and reads at most this many buffers computed
# outside it: each buffer is two arguments of its native entry (address, offset), which ctypes
# caps at 1024, and LLVM's time on one loop grows faster than its length (a chain of 1,100
# elementwise ops fused into one loop took 213 s to compile). Longer chains become several
# loops of bounded size, so a deep graph compiles in time linear in its length.
MAX_LOOP_NODES = 128
MAX_LOOP_READS = 128


def group_kernels(
    graph: Graph,
    origin: dict[Value, Value] | None = None,
    bases: Bases | None = None,
    resume=None,
    record=None,
    homes: list | None = None,
) -> list[Kernel]:
    """The graph's nodes grouped into kernels, in run order. origin: for a graph ir/widen.py
    made, its node -> the node of the graph it was made from (the casts it added have none).
    bases: alias bases already worked out for this graph (the lowering shares one).
    resume(nodes, bases): the placing loop's state after the first nodes of the graph, which
    another graph shared and left (ir/grouping_resume.py resumed_state: (how many, kernels,
    home, latest_loops, reads, tails, last_op, earlier)); the loop places only the nodes after
    them, and the loops it placed whole before them take the inputs they recompute from
    `earlier` (_recompute_cheap_inputs). record(nodes, home, kernels, reads, loops), if given, is
    told what the loop left, and returns the `noted` dicts _recompute_cheap_inputs fills.
    homes, if given, gets each node -> the index of the kernel it is in (materialized's
    `home`: no later pass of grouping moves a node)."""
    bases = Bases() if bases is None else bases
    kernels: list[Kernel] = []
    home: dict[Value, int] = {}
    latest_loops: dict[tuple, int] = {}  # iteration shape -> its latest loop kernel
    reads: dict[int, set[Value]] = {}  # loop kernel -> buffers of other kernels it reads
    tails: set[Value] = set()  # every reduction placed so far (kernels' lists are long)
    read_backs = _read_backs(graph, origin)
    spread = _spread_widenings(graph)
    last_op = -1  # the latest kernel that is an op (a GEMM...): a read-back is not hoisted above it
    nodes, earlier, noted = graph.nodes, None, None
    if resume is not None and not read_backs and not spread:  # else a node reads ahead
        start, kernels, home, latest_loops, reads, tails, last_op, earlier = resume(nodes, bases)
        nodes = nodes[start:]
    for node in nodes:
        copy = read_backs.get(node)
        avoid = home.get(copy)
        k = home[node] = _place(
            node,
            kernels,
            home,
            latest_loops,
            reads,
            tails,
            avoid,
            spread,
            bases,
            not_before=last_op if copy is not None else -1,
        )
        if kernels[k].kind == "op":
            last_op = k
    # every loop's index, in order: `reads` has one entry per loop (a resumed grouping's
    # holds the journal's loops before it in `plain`), so no pass walks every kernel for them
    reads = reads.plain() if hasattr(reads, "plain") else reads
    loops = sorted(reads)
    if record is not None:
        noted = record(graph.nodes, home, kernels, reads, loops)
    kept = frozenset(read_backs.values())
    _recompute_cheap_inputs(
        kernels, home, graph.outputs, kept, spread, bases, earlier, noted, loops, graph.nodes
    )
    if any(n.op == "astype" for n in graph.nodes):  # it rounds only where a cast widens
        _round_where_recomputed(kernels, home, kept, graph)
    for k in loops:  # grouped: a loop with nothing recomputed or reduced shares the empty
        kernel = kernels[k]  # (every other kernel was made with it: _single)
        kernel.recomputed = kernel.recomputed or NONE_HELD
        kernel.reductions = kernel.reductions or NONE_HELD
    if homes is not None:
        homes.append(home)
    return kernels


def _read_backs(graph: Graph, origin: dict[Value, Value] | None) -> dict[Value, Value]:
    """Widening casts of a narrower copy of a float value that is read elsewhere too -> the copy.
    (Inside a fused chain, ir/widen.py rounds a value made only for its 16-bit copy.) Only the
    graph's own casts (saved_dtype's read-back, a user's astype) count: a cast ir/widen.py
    added for an op reading a 16-bit result (bfloat16 layer_norm's rounded output, whose
    float32 value its gradient reads) is arithmetic like any other."""
    users = None  # graph.users(), made at the first widening cast (most plans have none)
    found = {}
    for node in graph.nodes:
        if node.op != "astype" or not _widens_float(node):  # the op asked inline: every node
            continue
        if origin is not None and node not in origin:
            continue
        chain, copy = [node], alias_base(node.inputs[0])
        while _widens_float(copy):  # a 16-bit copy read back as float64: through float32
            chain.append(copy)
            copy = alias_base(copy.inputs[0])
        if copy.op != "astype":
            continue
        users = graph.users() if users is None else users
        source = copy.inputs[0]
        while _narrows_float(source) and len(users.get(source, ())) == 1:
            source = source.inputs[0]  # float64 made float32 on its way to 16 bits
        if len(users.get(source, ())) > 1:
            found.update(dict.fromkeys(chain, copy))
    return found


def _float_cast_growth(node: Value) -> int:
    """Bytes an element gains (> 0) or loses (< 0) in a cast between floats; 0 for any other
    node. Widening: a 16-bit copy read back in float32, or a float32 copy of a float64 value
    read back in float64 (saved_dtype on a float64 step)."""
    if node.op != "astype":
        return 0
    source, target = node.inputs[0].dtype, node.dtype
    if not (is_float(source) and is_float(target)):
        return 0
    return np_dtype(target).itemsize - np_dtype(source).itemsize


def _widens_float(node: Value) -> bool:
    return _float_cast_growth(node) > 0


def _narrows_float(node: Value) -> bool:
    return _float_cast_growth(node) < 0


def _spread_widenings(graph: Graph) -> frozenset[Value]:
    """Widening casts of 16-bit values that only loops read, each directly (not through a
    view or an alias): a loop of a larger shape reads such a cast broadcast from the right, as
    it would read the cast's input, so it can recompute the cast from the 16-bit input."""
    casts = {n for n in graph.nodes if n.op == "astype" and _widens_half(n)}
    if not casts:
        return frozenset()
    for node in graph.nodes:
        if not is_loop_op(node) and not is_loop_tail(node):
            casts.difference_update(node.inputs)
    casts.difference_update(alias_base(o) for o in graph.outputs)
    casts.difference_update(graph.outputs)
    return frozenset(casts)


def _spreads_into(value: Value, shape, spread) -> bool:
    """Whether a loop over `shape` recomputes the spread widening `value` (a smaller shape
    that broadcasts to it from the right)."""
    if value not in spread or tuple(value.shape) == tuple(shape) or len(value.shape) > len(shape):
        return False
    tail = tuple(shape)[len(shape) - len(value.shape) :]
    return all(d in (1, t) for d, t in zip(value.shape, tail, strict=True))


MAX_RECOMPUTE = 4


def _recompute_cheap_inputs(
    kernels: list[Kernel],
    home,
    outputs: list[Value],
    kept,
    spread=frozenset(),
    bases=None,
    earlier=None,
    noted=None,
    loops: list[int] | None = None,
    nodes: list[Value] | None = None,
) -> None:
    """A loop that reads a value another loop of the same shape computed with a few cheap ops
    from stable inputs recomputes it instead, so that value need not be written and read back.
    Then each loop that still reads several such values made cheaply from fewer expensive ones
    (tanh-GELU's backward reads 1 + tanh, 0.5 (1 + tanh) and 1 - tanh**2) reads those instead.
    kept: values always read, never recomputed (16-bit copies read back: _read_backs);
    spread: widenings recomputed by every larger loop reading them (_spread_widenings).
    earlier: ({loop: (the values it reads that its cheap cones could not give, what it
    recomputes)}, {loop: its cones over the frontier}) of loops placed as in a graph grouped
    before, whose nodes before them were the same (ir/grouping_resume.py): a loop's cones read
    only those nodes and its own recomputed values, so they are what they were. noted: the
    same two dicts to fill for this grouping. loops: every loop kernel's index, in order,
    where the caller knows them. nodes: the graph's nodes, each in the kernel `home` says
    (_readers reads them so)."""
    bases = Bases() if bases is None else bases
    blocked: dict[int, list[Value]] = {}
    known, known_cones = earlier if earlier is not None else ({}, {})
    noted, noted_cones = noted if noted is not None else (None, None)
    if loops is None:
        loops = [k for k, kernel in enumerate(kernels) if kernel.kind == "loop"]
    for k in loops:
        kernel = kernels[k]
        before = known.get(k)
        if before is not None:
            blocked[k] = before[0]
            kernel.recomputed.extend(before[1])
            if noted is not None:
                noted[k] = before
            continue
        reads = blocked[k] = []
        for node in list(kernel.computed):
            for inp in node.inputs:
                source = bases[inp]
                # _cheap_cone's first tests, asked here: most inputs are stored anyway (an
                # input, this loop's own value, or a value of a kernel that is no loop)
                owner = home.get(source, k)
                if owner == k or source in kept or source in kernel.recomputed:
                    continue
                if kernels[owner].kind != "loop" and source not in spread:
                    continue
                cone = _cheap_cone(source, kernel, k, kernels, home, kept, spread, bases=bases)
                if cone is None and source not in reads:
                    reads.append(source)
                for value in cone or ():
                    if value not in kernel.recomputed:
                        kernel.recomputed.append(value)
        if noted is not None:
            noted[k] = (reads, tuple(kernel.recomputed))
    # each loop's cones over the frontier, worked out before any loop takes its own: a loop's
    # cones read only its own recomputed values, which only its own turn changes
    turns, wanted = [], set()
    for k, values in blocked.items():
        if not values:
            continue  # reads nothing another loop computes cheaply
        if k in known_cones:
            found = known_cones[k]
        else:
            found = _cones_over_frontier(values, k, kernels, home, kept, spread, bases)
        if noted_cones is not None:
            noted_cones[k] = found
        if found is not None:
            turns.append((k, values, *found))
            wanted.update(values)
            wanted.update(found[1])
    if not turns:
        return
    readers = _readers(kernels, home, outputs, bases, wanted, nodes, loops)
    for k, values, cones, frontier in turns:
        _recompute_over_frontier(values, k, kernels, readers, cones, frontier)


def _cheap_cone(
    value, kernel, k, kernels, home, kept, spread, frontier=None, depth=1, bases=None
) -> list[Value] | None:
    """value and the cheap values it needs, in order, if all can be recomputed in kernel k from
    values that are stored anyway (inputs, reductions, op results, other shapes, literals).
    Given a frontier set, an expensive value of the same shape is read instead (added to it).
    Each level down adds a value, so the walk stops MAX_RECOMPUTE levels down (a long chain of
    cheap ops split over several loops would otherwise be walked to its start)."""
    owner = home.get(value)
    if owner is None or owner == k or value in kernel.recomputed or value in kept:
        return []
    if spread and _spreads_into(value, kernel.shape, spread):
        return [value]  # from its 16-bit input, which the loop may run before (_read_source)
    owner = kernels[owner]
    if owner.kind != "loop" or value.type.shape != kernel.shape or value in owner.reductions:
        return []  # stored anyway: read it
    op = value.op
    if op == "astype" and _widens_half(value):  # round it here, or read the 16-bit value
        return _rounded_here(value, kernel, k, kernels, home, kept, spread, depth) or [value]
    if (REGISTRY.get(op) or get_op(op)).cost != "cheap":  # is_cheap
        if frontier is None:
            return None
        frontier.add(value)
        return []
    if depth > MAX_RECOMPUTE:
        return None  # value and one cheap value per level above it: too many already
    cone = []
    for inp in value.inputs:
        base = alias_base(inp) if bases is None else bases[inp]
        sub = _cheap_cone(base, kernel, k, kernels, home, kept, spread, frontier, depth + 1, bases)
        if sub is None:
            return None
        cone += [v for v in sub if v not in cone]
    cone.append(value)
    return cone if len(cone) <= MAX_RECOMPUTE else None


def _rounded_here(widening, kernel, k, kernels, home, kept, spread, depth) -> list[Value] | None:
    """[..., rounding, widening] where the float value a 16-bit rounding was made from can be
    recomputed cheaply in loop k (at least one op, from values stored anyway): the loop
    rounds it itself and the rounding's loop need not store it (bfloat16 layer_norm's
    normalised rows were stored by its statistics pass, 2 bytes an element, and read back by
    the ln_gelu loop that reads x anyway). None where the 16-bit value is to be read."""
    rounding = widening.inputs[0]
    if rounding.op != "astype" or rounding in kept or rounding.shape != kernel.shape:
        return None
    if rounding not in home or home[rounding] == k:
        return None
    source = alias_base(rounding.inputs[0])
    cone = _cheap_cone(source, kernel, k, kernels, home, kept, spread, None, depth + 1)
    if not cone and not (home.get(source) == k or source in kernel.recomputed):
        return None
    return cone + [rounding, widening]


def _round_where_recomputed(kernels: list[Kernel], home, kept, graph: Graph) -> None:
    """A loop that recomputes a float value and the widening of its 16-bit rounding (made in
    another loop of its shape) rounds the value itself instead of reading the rounding: one
    instruction sequence instead of 2 bytes an element read, and the other loop need not store
    it (bfloat16 ln_gelu stored layer_norm's rounded output in a pass of its own, then read it
    back beside the input it recomputed the float32 value from). kept: never recomputed."""
    order = None  # node -> its place in graph.nodes, made at the first rounding added
    for k, kernel in enumerate(kernels):
        if kernel.kind != "loop":
            continue
        added = False
        for value in list(kernel.recomputed):
            rounding = value.inputs[0] if _widens_half(value) else None
            if (
                rounding is None
                or rounding.op != "astype"
                or rounding in kept
                or rounding in kernel.recomputed
                or home.get(rounding, k) == k
                or rounding.shape != kernel.shape
                or rounding.inputs[0] not in kernel.recomputed
            ):
                continue
            kernel.recomputed.append(rounding)
            added = True
        if added:
            if order is None:
                order = {n: i for i, n in enumerate(graph.nodes)}
            kernel.recomputed.sort(key=order.__getitem__)


def _widens_half(value: Value) -> bool:
    """A cast of a 16-bit float value to a wider float (its bits shifted, nothing rounded)."""
    if value.op != "astype" or is_half(value.dtype) or not is_half(value.inputs[0].dtype):
        return False
    return value.dtype in ("f32", "f64")


def _readers(
    kernels: list[Kernel],
    home,
    outputs: list[Value],
    bases=None,
    wanted=None,
    nodes: list[Value] | None = None,
    loops: list[int] | None = None,
) -> dict:
    """value -> the kernels that read its buffer (graph outputs are read by the caller, -1),
    for the values in `wanted` (None: every value). nodes, loops: the graph's nodes and every
    loop kernel's index, where the caller has them: each node read as its home kernel's (a
    kernel computes its own nodes and what it recomputes, and only loops recompute), the
    kernels of the others not walked (~7,000 of a 10,000-node plan's ~8,000 are views, aliases
    and single ops, each asked its lists before its one node)."""
    bases = Bases() if bases is None else bases
    readers: dict[Value, set[int]] = {
        bases[o]: {-1} for o in outputs if wanted is None or bases[o] in wanted
    }
    # the inputs that stand for a wanted value: itself, or an alias of it (every alias is the
    # node of an alias or literal kernel, ir/fusion.py _place): each input is asked of this
    # small set, its base looked up only where it is in it (a lowering's bases hold every
    # value of the plan, and ~23,000 inputs a row of a 10,000-node frontier missed its cache)
    asked = None
    if wanted is not None:
        asked = set(wanted)
        asked.update(
            k.nodes[0] for k in kernels if k.kind in _ALIASES and bases[k.nodes[0]] in wanted
        )
    if nodes is None or loops is None:  # every kernel walked for what it computes
        for k, kernel in enumerate(kernels):
            recomputed = kernel.recomputed
            plain = not (recomputed or kernel.reductions or kernel.epilogue)
            for node in kernel.nodes if plain else kernel.computed:
                for inp in node.inputs:
                    if asked is None or inp in asked:
                        _read_by(readers, bases[inp], k, home, recomputed)
        return readers
    # grouping's kernels (no epilogue yet): each node is computed by its home kernel, and
    # the loops compute what they recompute too
    for node in nodes:
        for inp in node.inputs:
            if asked is None or inp in asked:
                k = home[node]
                _read_by(readers, bases[inp], k, home, kernels[k].recomputed)
    for k in loops:
        recomputed = kernels[k].recomputed
        for node in recomputed:
            for inp in node.inputs:
                if asked is None or inp in asked:
                    _read_by(readers, bases[inp], k, home, recomputed)
    return readers


def _read_by(readers: dict, source: Value, k: int, home, recomputed) -> None:
    """Kernel k reads source's buffer, unless source is its own or one it recomputes."""
    if home.get(source) != k and source not in recomputed:
        found = readers.get(source)
        if found is None:
            readers[source] = {k}
        else:
            found.add(k)


_ALIASES = ("alias", "literal")  # kernels whose node may be an alias (_place)


def _cones_over_frontier(blocked: list[Value], k: int, kernels, home, kept, spread, bases):
    """(each blocked value's cone in kernel k, the expensive values under them: the frontier),
    or None where one has no cheap cone even over a frontier."""
    kernel = kernels[k]
    frontier: set[Value] = set()
    cones = []
    for value in blocked:
        cone = _cheap_cone(value, kernel, k, kernels, home, kept, spread, frontier, bases=bases)
        if cone is None:
            return None
        cones.append(cone)
    return cones, frontier


def _recompute_over_frontier(
    blocked: list[Value], k: int, kernels, readers, cones: list, frontier: set
) -> None:
    """Kernel k recomputes the blocked values it reads from the expensive values under them
    (cones, frontier: _cones_over_frontier), when that moves fewer bytes: reads saved, plus
    blocked values nobody else reads (no longer written), minus frontier values nobody read
    before (now written)."""
    kernel = kernels[k]
    reads_saved = len(blocked) - len(frontier)
    writes_saved = sum(1 for v in blocked if v not in frontier and readers.get(v) == {k})
    writes_added = sum(1 for v in frontier if not readers.get(v))
    if reads_saved + writes_saved - writes_added <= 0:
        return
    for cone in cones:
        for value in cone:
            if value not in kernel.recomputed:
                kernel.recomputed.append(value)
    for value in blocked:  # one input's cone may have recomputed what another's left to read
        readers.get(value, set()).discard(k)
    for value in frontier:
        readers.setdefault(value, set()).add(k)


def _new(kernels, kernel) -> int:
    kernels.append(kernel)
    return len(kernels) - 1


def _place(
    node: Value,
    kernels,
    home,
    latest_loops: dict,
    reads: dict,
    tails,
    avoid=None,
    spread=(),
    bases=None,
    not_before: int = -1,
) -> int:
    """The kernel node joins (a new one if none); never the loop `avoid`. Asked of every node
    of every plan lowered (a 10,000-node memory frontier lowers 22): its registry entry is read
    once and its inputs' bases and homes worked out once, for every kernel it might join.
    not_before: the latest loop of the shape is joined only if it comes after this kernel
    (a read-back cast of a narrower saved copy: joined to a loop before the GEMMs that run
    ahead of its reader, its full-width buffer was held across them, 1 MiB a layer of a
    float64 MLP with float32 saved values)."""
    op = node.op
    if op == "full":
        return _new(kernels, _single("literal", node))
    spec = REGISTRY.get(op) or get_op(op)
    if is_unit_reshape(node) if op == "reshape" else spec.alias:
        base = alias_base(node) if bases is None else bases[node]
        return _new(kernels, _single("literal" if base.op == "full" else "alias", node))
    tail = spec.loop_tail
    if spec.scalar is None and not tail:
        return _new(kernels, _single("view" if spec.fusion == "view" else "op", node))
    shape = node.inputs[0].shape if tail else node.shape
    inputs = node.inputs
    bases = [alias_base(i) for i in inputs] if bases is None else [bases[i] for i in inputs]
    # the buffers node reads, with the kernel each comes from (-1: none; literals are none)
    read = {}
    for s in bases:
        k = home.get(s, -1)
        if k < 0 or kernels[k].kind != "literal":
            read[s] = k
    latest = latest_loops.get(shape)
    if latest is not None and latest < not_before:
        latest = None
    target = _joinable_loop(bases, shape, kernels, home, latest, reads, read, tails, avoid, spread)
    if target is None:
        target = latest_loops[shape] = _new(kernels, Kernel("loop", [], shape))
        reads[target] = set()
    (kernels[target].reductions if tail else kernels[target].nodes).append(node)
    if tail:
        tails.add(node)
    held = reads[target]
    for s, k in read.items():
        if k != target:
            held.add(s)
    return target


def _single(kind: str, node: Value) -> Kernel:
    """A kernel of one node that is not a loop: it never recomputes or reduces (NONE_HELD).
    Kernel(kind, [node], node.shape, NONE_HELD, NONE_HELD), its fields set directly: a
    10,000-node plan makes ~6,000 a lowering, and the dataclass's __init__ was half again."""
    kernel = _new_kernel(Kernel)
    kernel.kind, kernel.nodes, kernel.shape = kind, [node], node.type.shape
    kernel.reductions = kernel.recomputed = NONE_HELD
    kernel.epilogue = None
    return kernel


_new_kernel = object.__new__


def _has_room(target: int, kernels, reads: dict, read: dict) -> bool:
    """Whether loop `target` takes one more node reading `read` (buffer -> its kernel):
    MAX_LOOP_NODES nodes, MAX_LOOP_READS buffers computed outside it."""
    kernel = kernels[target]
    if len(kernel.nodes) + len(kernel.reductions) >= MAX_LOOP_NODES:
        return False
    held = reads[target]
    added = sum(1 for s, k in read.items() if k != target and s not in held)
    return len(held) + added <= MAX_LOOP_READS


def _joinable_loop(
    bases: list,
    shape,
    kernels,
    home,
    latest: int | None,
    reads: dict,
    read: dict,
    tails: set,
    avoid: int | None = None,
    spread=(),
) -> int | None:
    """The latest loop kernel of this iteration shape that computes one of the node's inputs
    (bases: each input's alias_base), or else the latest loop kernel of this shape at all
    (`latest`, kept by the caller: looking it up made grouping quadratic in the plan's length),
    whichever has every input ready and room for it (MAX_LOOP_NODES, MAX_LOOP_READS), and is
    not `avoid` (a read-back cast's copy's loop: the read-back then joins the latest loop
    instead of opening one of its own, which split bfloat16 ln_gelu's layer-norm gradient into
    a loop of its own). A spread widening counts as its 16-bit input: the loop recomputes it."""
    sources = [_read_source(s, shape, spread) for s in bases] if spread else bases
    producer = -1  # the latest loop of this shape computing an input
    for s in sources:
        k = home.get(s)
        if k is not None and k > producer and s not in tails:
            kernel = kernels[k]
            if kernel.kind == "loop" and kernel.shape == shape:
                producer = k
    for target in (producer, latest):
        if target is None or target < 0 or target == avoid:
            continue
        if _ready(sources, target, kernels, home, tails) and _has_room(
            target, kernels, reads, read
        ):
            return target
    return None


def _read_source(source: Value, shape, spread) -> Value:
    """What a loop over `shape` reads for source: a spread widening's input (recomputed)."""
    if _spreads_into(source, shape, spread):
        return alias_base(source.inputs[0])
    return source


def _ready(sources, target: int, kernels, home, tails: set) -> bool:
    """Every input exists before kernel `target` runs (aliases and literals cost nothing, so
    only the source matters) and none is a reduction that kernel is still accumulating
    (tails: every reduction placed, each in the reductions of its home kernel only)."""
    for source in sources:
        k = home.get(source, -1)
        if k >= 0 and kernels[k].kind == "literal":
            continue
        if k > target or (k == target and source in tails):
            return False
    return True


def materialized(
    graph: Graph,
    kernels: list[Kernel],
    bases: Bases | None = None,
    home: dict | None = None,
    known: tuple | None = None,
    noted: list | None = None,
) -> set[Value]:
    """Values that need a buffer: outputs, values a loop reads from another kernel (through
    aliases), and every operand of views and ops. Literals and aliases never need one.
    home: each node -> its kernel's index, where grouping gave it (group_kernels' homes).
    known: (for each of the first kernels, whether it is unchanged from the kernel a plan
    grouped before had there: ir/grouping_resume.py `unchanged`; what each of that plan's
    first kernels read from other kernels, as `noted` got it): an unchanged kernel reads
    what it read there (its nodes, and the inputs those read, are the shared graph's, with
    the same kernels), so only the others are walked (a memory frontier's row: the kernels
    from its first recomputed value on, ~45% of them). noted, if given, gets a list of what
    each of the first kernels reads (each kernel's where nothing is known), for the next."""
    bases = Bases() if bases is None else bases
    if home is None:
        home = {n: k for k, kernel in enumerate(kernels) for n in kernel.all_nodes}
    needed = {bases[o] for o in graph.outputs} | set(graph.outputs)
    base_of, add_all = bases.__getitem__, needed.update
    first, reads = 0, None
    if known is not None:
        same, before = known
        first = len(same)
        reads = before[:first]
        for k in range(first):
            if not same[k]:
                reads[k] = _reads_of(k, kernels[k], base_of, home)
        add_all(itertools.chain.from_iterable(reads))
    elif noted is not None:
        first = len(kernels)
        reads = [_reads_of(k, kernel, base_of, home) for k, kernel in enumerate(kernels)]
        add_all(itertools.chain.from_iterable(reads))
    if noted is not None:
        noted.append(reads)
    for k in range(first, len(kernels)):
        kernel = kernels[k]
        recomputed = kernel.recomputed
        plain = not (recomputed or kernel.reductions or kernel.epilogue)  # computed: its nodes
        if kernel.kind not in ("loop", "alias"):  # every operand from a buffer
            for node in kernel.nodes if plain else kernel.computed:
                add_all(map(base_of, node.inputs))
            continue
        for node in kernel.nodes if plain else kernel.computed:  # its own and recomputed values
            for inp in node.inputs:  # are computed in place
                source = bases[inp]
                owner = home.get(source)
                if owner == k or source in recomputed:
                    continue
                if owner is not None and kernels[owner].kind == "literal":
                    continue
                needed.add(source)
    # those a kernel computes, less the one node of each literal and alias kernel (_place):
    # set operations and one walk of the kernels in order, not a kernel looked up for each of
    # ~10,000 values (a row of a 10,000-node memory frontier: 2.1 -> 0.6 ms)
    found = needed.intersection(home)
    found.difference_update([k.nodes[0] for k in kernels if k.kind in _ALIASES])
    return found


def _reads_of(k: int, kernel: Kernel, base_of, home: dict) -> tuple[Value, ...]:
    """What kernel k adds to materialized's values (a literal's values among them: they are
    left out at its end with every value no buffer holds)."""
    nodes = kernel.computed
    if kernel.kind not in ("loop", "alias"):
        return tuple(base_of(i) for node in nodes for i in node.inputs)
    recomputed = kernel.recomputed
    return tuple(
        source
        for node in nodes
        for source in map(base_of, node.inputs)
        if home.get(source) != k and source not in recomputed
    )
