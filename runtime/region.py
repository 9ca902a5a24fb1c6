"""A region: one forward call's backward plan and the saved buffers it holds until backward."""

from __future__ import annotations

import weakref
from _thread import RLock as _RLock  # threading.RLock's own, without its Python wrapper call
from dataclasses import dataclass

import numpy as np

from backplan.codegen.run import memory_check
from backplan.ir.lowering import BackwardMode
from backplan.ir.types import np_dtype

from . import memory
from .location import loc_text
from .program import RegionProgram, SavedBufferInfo
from .wording import written


class Edge:
    """Where an input's gradient goes: output `index` of an upstream region, or a leaf tensor.
    A plain slotted class: every recorded forward call makes one per differentiated input,
    and a frozen dataclass's __init__ costs three object.__setattr__ calls each."""

    __slots__ = ("region", "index", "leaf")

    def __init__(self, region: Region | None = None, index: int = 0, leaf: object = None):
        self.region = region
        self.index = index
        self.leaf = leaf

    def __repr__(self) -> str:
        target = (
            f"leaf {self.leaf!r}" if self.leaf is not None else f"{self.region!r}[{self.index}]"
        )
        return f"Edge({target})"


class LeafEdges(list):
    """The leaf tensors of a call whose differentiated inputs are all leaves, standing for
    their edges: a Region makes the Edge objects on the first read of input_edges. A compiled
    step that runs as one joint plan hands its gradients to these leaves (hand_over) and
    never reads them, so its calls make no Edge at all. Holding a leaf is what its Edge would
    hold, so nothing lives longer."""

    __slots__ = ()


@dataclass(frozen=True)
class SavedBuffer(SavedBufferInfo):
    """A saved buffer as it is now: the plan's facts plus whether backward has freed it."""

    freed: bool = False


class FreedBy:
    """The backward() that freed a region: where it was called, the output it started from and
    the line that built that output's graph (to tell a loop from a one-off). Every backward()
    makes one; the texts are made only when a message reads them."""

    __slots__ = ("_where", "_root_name", "_root_output", "_root_made", "root_ref", "failed")

    def __init__(self, where, root: Region, index: int, failed: bool = False, own: bool = False):
        self._where = where  # a SourceLoc (or its text)
        self._root_name = root.name
        self._root_output = index if root.program.n_outputs > 1 else None
        self._root_made = root._made_at
        # weak: a freed graph must not keep another alive. own: only the root itself holds
        # this one (a joint step's region), so started_from asks the region, not a reference
        self.root_ref = None if own else weakref.ref(root)
        self.failed = failed  # it raised part-way, after this region started to reuse its buffers

    @property
    def loc(self) -> str:
        return location_text(self._where)

    @property
    def root_created_at(self) -> str:
        return location_text(self._root_made)

    @property
    def root_desc(self) -> str:
        """'`matmul` (created at seed.py:26)'; multi-output regions name the output too."""
        which = f" output {self._root_output}" if self._root_output is not None else ""
        return f"`{self._root_name}`{which} (created at {self.root_created_at})"

    def started_from(self, region) -> bool:
        ref = self.root_ref
        return region.freed_by is self if ref is None else ref() is region


def location_text(where) -> str:
    """A location as people read it: a SourceLoc's text; a text stays as it is."""
    return where if isinstance(where, str) else loc_text(where)


CONSUME = BackwardMode.CONSUME


class Release:
    """What a consuming backward calls as the plan finishes with its inputs: release(i) drops
    the region's reference to backward input i (the cotangents come first, then the saved
    buffers); every() drops them all at once, for a runner done with every input."""

    __slots__ = ("saved", "offset")

    def __init__(self, saved: dict, offset: int):
        self.saved, self.offset = saved, offset

    def __call__(self, index: int) -> None:
        self.saved.pop(index - self.offset, None)

    def every(self) -> None:
        self.saved.clear()


class Region:
    """Holds saved buffers until backward. Output tensors point at it; it points only upstream,
    so it dies when the last tensor that can reach it does."""

    def __init__(
        self, program: RegionProgram, saved: list, edges: list[Edge], loc, copies=frozenset()
    ):
        self.program = program
        # forward inputs this region holds as copies of the caller's NumPy arrays, taken at
        # the call (tracer/numpy_args.py): its own buffers, not the caller's
        self.copies = copies
        self.name = program.name
        self._made_at = loc  # a SourceLoc (or its text): created_at makes the text on demand
        self._edges = edges  # a list of Edge, or LeafEdges made into one when first read
        self._saved: dict[int, np.ndarray] = dict(enumerate(saved)) if saved else {}
        self.freed_by: FreedBy | None = None
        self.backward_calls = 0
        self.lock = _RLock()  # held by the backward() running through this region
        memory.track(self)

    @property
    def input_edges(self) -> list[Edge]:
        """Where each differentiated input's gradient goes, in the plan's order. Two threads
        reading it first both make equal lists; either one is kept."""
        edges = self._edges
        if type(edges) is LeafEdges:
            edges = self._edges = [Edge(leaf=leaf) for leaf in edges]
        return edges

    @property
    def created_at(self) -> str:
        """Where the user made this region: 'train.py:12 (via loss at model.py:30)'."""
        return location_text(self._made_at)

    @property
    def freed(self) -> bool:
        return self.freed_by is not None

    @property
    def saved_bytes(self) -> int:
        return sum(a.nbytes for a in self._saved.values())

    @property
    def saved_buffers(self) -> list[SavedBuffer]:
        """Each saved buffer: name, shape, dtype, nbytes, producer, readers, freed or not."""
        buffers = []
        for info in self.program.saved_info:
            fields = dict(info.__dict__, freed=info.slot not in self._saved)
            upstream = self._upstream_of(self.program.plans.saved[info.slot].source)
            if upstream is not None:  # an earlier region's output, not the user's own array
                fields.update(
                    op=upstream.name, produced_at=upstream.created_at, is_region_input=False
                )
            elif self._is_copy(self.program.plans.saved[info.slot].source):
                fields.update(is_region_input=False, copy_of_argument=True)
            buffers.append(SavedBuffer(**fields))
        return buffers

    def buffer_state(self, buffer: SavedBuffer) -> str:
        """What print(t.grad_fn) says of one saved buffer now: held, or freed by backward()."""
        return "freed" if buffer.freed else "alive"

    def held_arrays(self) -> list[tuple[np.ndarray, bool]]:
        """Each saved array held now, and whether it is the user's own (no region made it)."""
        saved = self.program.plans.saved
        held = list(self._saved.items())  # one step under the GIL: backward() may pop meanwhile
        return [(array, self._is_yours(saved[slot].source)) for slot, array in held]

    def saved_keys(self) -> list[tuple[tuple, int, bool]]:
        """(key, nbytes, yours) per saved buffer of the plan, freed or not; two regions saving
        one array give it the same key: the region that produced it and its output index (or
        the leaf tensor, or this region's input for an array that came from no region)."""
        keys = []
        for info in self.program.saved_info:
            source = self.program.plans.saved[info.slot].source
            keys.append((self._array_key(source), info.nbytes, self._is_yours(source)))
        return keys

    def _array_key(self, source: tuple[str, int]) -> tuple:
        kind, index = source
        if kind == "output":
            return ("out", id(self), index)
        edge = self._edge_of(index)
        if edge is not None and edge.region is not None:
            return ("out", id(edge.region), edge.index)
        if edge is not None and edge.leaf is not None:
            return ("leaf", id(edge.leaf))
        return ("in", id(self), index)

    def _edge_of(self, index: int) -> Edge | None:
        wrt = self.program.plans.wrt
        return self.input_edges[sum(wrt[:index])] if wrt[index] else None

    def _is_yours(self, source: tuple[str, int]) -> bool:
        return (
            source[0] == "input"
            and source[1] not in self.copies
            and self._upstream_of(source) is None
        )

    def _is_copy(self, source: tuple[str, int]) -> bool:
        """Whether a saved forward input is the copy of a NumPy array taken at the call."""
        return source[0] == "input" and source[1] in self.copies

    def _upstream_of(self, source: tuple[str, int]) -> Region | None:
        """The region that produced forward input `source[1]`, when a gradient flows to it."""
        kind, index = source
        wrt = self.program.plans.wrt
        if kind != "input" or not wrt[index]:
            return None
        return self.input_edges[sum(wrt[:index])].region

    @property
    def planned_saved_bytes(self) -> int:
        """Bytes the plan saves for backward (what it held before anything was freed)."""
        return sum(info.nbytes for info in self.program.saved_info)

    @property
    def next_regions(self) -> list[Region]:
        return [e.region for e in self.input_edges if e.region is not None]

    def run_backward(self, cotangents: dict[int, np.ndarray], mode: BackwardMode) -> list:
        """Gradients for the differentiated inputs, in edge order. A CONSUME backward frees each
        saved buffer right after its last read; RETAIN keeps them."""
        program = self.program
        args = []
        for index in program.cotangent_slot:
            ct = cotangents.get(index)
            if ct is None:
                out = program.plans.forward.graph.outputs[index]
                ct = np.zeros(out.shape, dtype=np_dtype(out.dtype))
            args.append(ct)
        n_cot = len(args)
        if memory_check.checking():  # arrays backward() made, held while its plan runs
            memory_check.count_held(args, "backward()'s cotangents")
        saved = self._saved
        args += [saved[i] for i in range(len(program.saved_info))]
        release = Release(saved, n_cot) if mode is CONSUME else None
        self.backward_calls += 1
        if program.joint_step is not None:  # a compiled step learning whether to run as one plan
            program.joint_step.observe(cotangents, mode)
        return program.run_backward(args, mode, release)

    ready = False  # whether hand_over() has them (a JointRegion's, until backward)

    def hand_over(self, loc, index: int) -> bool:
        """backward() at loc from the default seed of output index, when the forward computed
        the gradients (runtime/joint_step.py JointRegion): a plain region has none."""
        return False

    def mark_freed(self, by: FreedBy) -> None:
        self._saved.clear()
        self.freed_by = by

    def __repr__(self) -> str:
        state = "freed" if self.freed else "alive"
        n = len(self.program.saved_info)
        recomputed = len(self.program.plans.recomputed)
        also = f" and {recomputed} recomputed instead" if recomputed else ""
        return (
            f"<Region {self.name} at {self.created_at}: {n} saved buffer(s){also}, "
            f"{self.saved_bytes} B held, {state}>"
        )

    def __str__(self) -> str:
        """print(t.grad_fn): the saved-buffer table with each buffer's state, as
        report/region_text.py writes it (runtime/wording.py); the one-line repr without it."""
        return written("region", self, repr(self))
