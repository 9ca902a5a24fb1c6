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

import numpy as np

from .flops import node_flops
from .fusion import is_alias
from .graph import Value
from .reference_storage import view_parents

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
    view_of: dict[int, int] = field(default_factory=dict)  # a NumPy view -> the value it views
    two_plans: bool = False  # a forward plan, then a backward plan (compile), not one joint
    nbytes: list[int] = field(init=False)
    flops: list[int] = field(init=False)
    producer: dict[int, tuple[int, ...]] = field(init=False)
    position: dict[int, int] = field(init=False)
    held_set: set[int] = field(init=False)
    held_nbytes: dict[int, int] = field(init=False)
    first_read: dict = field(init=False)
    _base: object = field(init=False)

    def __post_init__(self):
        self.nbytes = [0 if i in self.view_of else v.type.nbytes for i, v in enumerate(self.values)]
        self.flops = [node_flops(v) for v in self.values]
        self.producer = {i: ins for i, ins, forward in self.steps if forward}
        self.position = {i: s for s, (i, _, _) in enumerate(self.steps)}
        self.held_set = set(self.held)
        self.held_nbytes = self._held_buffer_bytes()
        self.first_read = {}  # held id -> (first later step reading it, input slot there)
        for step, (_, inputs, forward) in enumerate(self.steps):
            if not forward:
                for slot, i in enumerate(inputs):
                    if i in self.held_set:
                        self.first_read.setdefault(i, (step, slot))
        self._base = _base_arrays(self)

    def held_bytes(self, drop=frozenset()) -> int:
        """Bytes of the buffers the held values keep (held_nbytes), those in drop left out."""
        return sum(self.held_nbytes[i] for i in self.held if i not in drop)

    def _held_buffer_bytes(self) -> dict[int, int]:
        """held id -> the bytes it keeps: its own buffer, or for a view the buffer it views
        (once, at the first held view of it) unless that is held itself or is an input: a
        held reshape of a value nothing else holds keeps that value's buffer alive."""
        found, seen = {}, set()
        for i in self.held:
            root = i
            while root in self.view_of:
                root = self.view_of[root]
            if root == i or root in self.available or root in self.held_set or root in seen:
                found[i] = self.nbytes[i]
            else:
                seen.add(root)
                found[i] = self.values[root].type.nbytes
        return found

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

    def _order(self, drop) -> tuple[list[int], list[int], list[tuple[int, ...]]]:
        """The copies drop needs, in the order ir/remat.py emits them: (ids, the base step each
        goes before, their input ids). Chains run back to the values kept or copied before.
        (_kept asked inline: the planner simulates ~34 plans of up to ~2,000 copies each for
        a 10,000-node step.)"""
        n, copies, ids, before, inputs = len(self.values), {}, [], [], []
        producer, available, held = self.producer, self.available, self.held_set
        copy_of = copies.get
        for root in sorted(drop, key=self.first_read.__getitem__):
            stack = [(root, False)]
            at = self.first_read[root][0]
            while stack:
                node, done = stack.pop()
                if done:
                    copies[node] = node + n
                    ids.append(node + n)
                    before.append(at)
                    inputs.append(tuple([copy_of(i, i) for i in producer[node]]))
                    continue
                if node in copies:
                    continue
                stack.append((node, True))
                stack.extend(
                    [
                        (i, False)
                        for i in producer[node]
                        if i not in copies
                        and i not in available
                        and (i not in held or i in drop)  # not _kept(i, drop)
                    ]
                )
        return ids, before, inputs

    def simulate(self, drop: frozenset[int], compiled: bool = False) -> Outcome:
        """compiled: the peak as the compiled executor holds it (ir/peak.py), not as the
        reference interpreter does (see _compiled_peak)."""
        n, base = len(self.values), self._base
        ids, before, copy_inputs = self._order(drop)
        count = len(base.out) + len(ids)
        keys = np.concatenate([2 * np.arange(len(base.out)) + 1, 2 * np.asarray(before, np.int64)])
        position = np.empty(count, np.int64)
        position[np.argsort(keys, kind="stable")] = np.arange(count)
        out = np.concatenate([base.out, np.asarray(ids, np.int64)])
        edge_ids = base.edge_id.copy()
        if drop:
            redirect = base.edge_later & np.isin(edge_ids, np.fromiter(drop, np.int64))
            edge_ids[redirect] += n
        copy_steps = [len(base.out) + j for j, ins in enumerate(copy_inputs) for _ in ins]
        copy_ids = [i for ins in copy_inputs for i in ins]
        edge_ids = np.concatenate([edge_ids, np.asarray(copy_ids, np.int64)])
        edge_steps = position[np.concatenate([base.edge_step, np.asarray(copy_steps, np.int64)])]
        parent = self._parents(drop, ids, copy_inputs)
        edge_ids, edge_steps = _through_views(parent, edge_ids, edge_steps)
        last = np.full(2 * n, -1, np.int64)
        np.maximum.at(last, edge_ids, edge_steps)
        outputs, _ = _through_views(parent, base.outputs, base.outputs)
        last[outputs] = count
        at = position[np.arange(count)]
        nbytes = (base.compiled_nbytes2 if compiled else base.nbytes2)[out]
        freed = np.where(last[out] >= 0, last[out], at)
        if compiled:
            found = self._compiled_peak(out, at, freed, nbytes, outputs, last, drop)
            peak, peak_step, live_held = found
        else:
            live = _sweep(at, freed, nbytes, count)
            peak_step = int(np.argmax(live)) if count else -1
            peak = int(live[peak_step]) if count else 0
            live_held = self._held_at(peak_step, out, at, last, drop)
        copied = frozenset(i - n for i in ids)
        return Outcome(
            peak,
            peak_step,
            live_held,
            copied,
            sum(self.flops[i] for i in copied),
            self.held_bytes(drop),
            frozenset(i for i in copy_ids if i < n),
        )

    def _held_at(self, step: int, out, at, last, drop) -> tuple[int, ...]:
        """The kept held values live at `step`."""
        defined = np.zeros(len(last), np.int64)
        defined[out] = at
        held = self._base.held
        spans = (defined[held] <= step) & (step <= last[held])
        return tuple(i for i in held[spans].tolist() if i not in drop)

    def _compiled_peak(self, out, at, freed, nbytes, outputs, last, drop) -> tuple:
        """(peak, its step, the held values live there) of the compiled plans, where each
        plan's arena (every value that is not an output) is held for the whole step and
        outputs are allocated on a call's entry. One plan (value_and_grad): outputs from the
        start, the arena's peak where the rest peaks. A forward and a backward plan (compile):
        both arenas at once, plus every saved buffer and output, so every kept held value
        counts. Values fused into loops are not modelled: the planner checks each point with
        ir/peak.py."""
        count = len(out)
        is_out = np.isin(out, outputs)
        if not self.two_plans:
            live = _sweep(np.where(is_out, 0, at), freed, nbytes, count)
            step = int(np.argmax(live)) if count else -1
            return (int(live[step]) if count else 0), step, self._held_at(step, out, at, last, drop)
        kept = np.asarray([i for i in self.held if i not in drop], np.int64)
        other = ~is_out & ~np.isin(out, kept)
        live = _sweep(at[other], freed[other], nbytes[other], count)
        boundary = sum(1 for _, _, forward in self.steps if forward)
        before, after = live[:boundary], live[boundary:]
        step = boundary + (int(np.argmax(after)) if after.size else 0)
        arenas = int(before.max(initial=0)) + int(after.max(initial=0))
        peak = arenas + sum(self.nbytes[i] for i in self.held if i not in drop)
        peak += int(nbytes[is_out].sum())
        return peak, step, tuple(kept.tolist())

    def _parents(self, drop, ids: list[int], copy_inputs: list) -> np.ndarray:
        """id -> the id of the value it is a view of (-1: a buffer of its own). A later node
        viewing a dropped value views its copy; a copy of a view views the copy (or the kept
        value) its chain reads."""
        n = len(self.values)
        parent = np.full(2 * n, -1, np.int64)
        for view, source in self.view_of.items():
            later = view not in self.producer
            parent[view] = source + n if later and source in drop else source
        for copy, inputs in zip(ids, copy_inputs, strict=True):
            if copy - n in self.view_of:
                parent[copy] = inputs[0]
        return parent


def _sweep(at: np.ndarray, freed: np.ndarray, nbytes: np.ndarray, count: int) -> np.ndarray:
    """Bytes live at each of `count` steps: each value from `at` to `freed`, inclusive."""
    alloc = np.zeros(count + 1, np.int64)
    np.add.at(alloc, at, nbytes)
    frees = np.zeros(count + 1, np.int64)
    np.add.at(frees, freed, nbytes)
    return np.cumsum(alloc[:count]) - np.concatenate([[0], np.cumsum(frees[: count - 1])])


def _through_views(parent: np.ndarray, ids: np.ndarray, steps: np.ndarray):
    """Reads of views are also reads of the buffers they view: the edges (ids, steps) with
    one more edge per view read, down to the value that owns the buffer."""
    all_ids, all_steps = [ids], [steps]
    while True:
        above = parent[ids]
        viewed = above >= 0
        if not viewed.any():
            break
        ids, steps = above[viewed], steps[viewed]
        all_ids.append(ids)
        all_steps.append(steps)
    return np.concatenate(all_ids), np.concatenate(all_steps)


@dataclass
class _BaseArrays:
    """The schedule with nothing dropped, as arrays: what every simulation starts from."""

    out: np.ndarray
    edge_step: np.ndarray
    edge_id: np.ndarray
    edge_later: np.ndarray  # the edge's reader is a later (backward or gradient) node
    outputs: np.ndarray
    nbytes2: np.ndarray  # bytes by id, then again by copy id
    held: np.ndarray
    compiled_nbytes2: np.ndarray  # the same, literals (ir/fusion.py) 0 unless an output


def _literal_ids(schedule) -> list[int]:
    """Ids of the values compiled code reads as literals, never stored (ir/fusion.py _place):
    `full` nodes and aliases of them, the caller's outputs excepted. The reference interpreter
    allocates them (np.full), so only the compiled simulation leaves them out. Counted, the
    loss's gradient seed sat in the simulated peak: mlp_deep's scalar put it 4 B above the
    built plan's; a 10,000-node chain's 256 x 16 float32 seed 16,384 B (there the values of
    the tanh gradient's fused loop still are: ir/budget.py's plans are checked by ir/peak.py)."""
    found: set[int] = set()
    for i, inputs, _ in schedule.steps:
        value = schedule.values[i]
        if value.op == "full" or (is_alias(value) and inputs and inputs[0] in found):
            found.add(i)
    return sorted(found - schedule.outputs)


def _base_arrays(schedule) -> _BaseArrays:
    steps = schedule.steps
    compiled = np.asarray(schedule.nbytes * 2, np.int64)
    literals = np.asarray(_literal_ids(schedule), np.int64)
    compiled[literals] = 0
    compiled[literals + len(schedule.values)] = 0
    edge_step = [s for s, (_, ins, _) in enumerate(steps) for _ in ins]
    edge_id = [i for _, ins, _ in steps for i in ins]
    later = [not forward for _, ins, forward in steps for _ in ins]
    return _BaseArrays(
        np.asarray([i for i, _, _ in steps], np.int64),
        np.asarray(edge_step, np.int64),
        np.asarray(edge_id, np.int64),
        np.asarray(later, bool),
        np.asarray(sorted(schedule.outputs), np.int64),
        np.asarray(schedule.nbytes * 2, np.int64),  # a view's copy is a view too
        np.asarray(schedule.held, np.int64),
        compiled,
    )


def step_schedule(
    nodes, later: set, outputs, inputs, alias: dict | None = None, two_plans: bool = False
) -> StepSchedule:
    """nodes: the step in order; later: those that read what the forward holds (backward or
    gradient nodes); alias maps a backward input to the forward value it stands for.
    two_plans: a forward plan and a backward plan (bp.compile), not one joint plan."""
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
    views = {id_of(v): id_of(p) for v, p in view_parents(nodes, alias).items()}
    found = {id_of(o) for o in outputs}
    return StepSchedule(values, steps, found, available, order, views, two_plans)
