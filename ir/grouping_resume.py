"""Fusion grouping resumed where a plan's graph stops sharing nodes with one grouped before.

The rows of a memory frontier are the default plan's graph with values recomputed in its
gradient part: each row keeps the default graph's nodes as they are up to its first
recomputed value (ir/graph.py copy_graph `keep`, ir/remat.py), and the rows recompute more
and more, so that shared part shrinks row by row and lies inside the row before's. Grouping
places nodes one by one in graph order (ir/fusion.py group_kernels), each by what the nodes
before it were given, so where two graphs' first q nodes are the same objects their kernels
after q nodes are the same too: a row's grouping starts from the row before's state after
those nodes (its Journal, kept on the graph the two share) instead of placing them again.
The placing loop resumes; so do the cheap-input cones of the loops placed whole before the
shared nodes end. After grouping, a GEMM before that point (a kernel that is no loop: the
journal's own) followed by a loop whose nodes, reductions and recomputed values are the
journal's loop's, the same objects (`unchanged`), takes that loop as its epilogue or not as
it did there (ir/epilogue.py), and each such kernel reads what it read there (ir/fusion.py
materialized: the buffers needed are walked only for the other kernels). The other passes
(layout, lifetimes) read the whole plan. A graph whose grouping reads anything beyond the
nodes before each one (read-back casts, spread widenings: ir/fusion.py) never resumes.
"""

from __future__ import annotations

import weakref
from bisect import bisect_left
from functools import partial

from .fusion import Kernel
from .graph import Graph, Value, shared_prefix


class Journal:
    """What group_kernels' placing loop left for a graph: the nodes it placed, each one's
    kernel, the kernels (no pass changes a kernel's kind, shape or node lists after that loop;
    a kernel that is no loop is never changed at all, so a resumed grouping shares it), where
    the loops are, and the buffers each loop reads."""

    __slots__ = (
        "nodes",
        "homes",
        "kernels",
        "loops",
        "reads",
        "cheap",
        "cones",
        "strided",
        "absorbed",
        "known",
        "reads_out",
        "dtypes",
        "__weakref__",
    )

    def __init__(
        self,
        nodes: list[Value],
        home: dict,
        kernels: list[Kernel],
        reads: dict,
        loops: list[int] | None = None,
    ):
        self.nodes = nodes
        self.homes = list(map(home.__getitem__, nodes))
        self.kernels = list(kernels)
        if loops is None:  # every loop's index, in order (group_kernels knows them)
            loops = [k for k, kernel in enumerate(kernels) if kernel.kind == "loop"]
        self.loops = list(loops)
        self.reads = reads.plain() if isinstance(reads, _Reads) else reads
        # loop -> (values it reads that cheap cones could not give, what it recomputes), and
        # loop -> its cones over the frontier: filled by group_kernels' cheap-input pass
        self.cheap: dict[int, tuple] = {}
        self.cones: dict[int, tuple | None] = {}
        # (nodes, what ir/strided_copies.py _needed found for them) of the graph before its
        # strided copies, set by the lowering
        self.strided: tuple | None = None
        # kernel followed by one that runs code -> whether it took that one as its epilogue
        # (ir/epilogue.py), set by the lowering once that pass ran
        self.absorbed: dict | None = None
        # (alias bases, storage roots) of the shared graph's values (ir/lowering.py
        # sources_known), handed from row to row
        self.known: tuple | None = None
        # what each of the first kernels reads from other kernels (ir/fusion.py materialized's
        # `noted`), set by the lowering: a row's unchanged kernels read the same
        self.reads_out: list | None = None
        # each dtype's first place among the shared graph's values (ir/widen.py row_dtypes),
        # handed from row to row
        self.dtypes: dict | None = None

    def let_go(self) -> None:
        """Empty: a later row's journal replaced it (its lowered plan still points at it)."""
        self.nodes, self.homes, self.kernels, self.loops = [], [], [], []
        self.reads, self.cheap, self.cones, self.strided = {}, {}, {}, None
        self.absorbed, self.known, self.reads_out, self.dtypes = None, None, None, None


def resumer(journal: Journal | None, made: list | None = None):
    """group_kernels' `resume` for a journal (None: none). made, if given, gets how many of
    the journal's first kernels the resumed grouping starts from (see `unchanged`)."""
    return None if journal is None else partial(resumed_state, journal, taken=made)


def unchanged(journal: Journal | None, kernels: list[Kernel], made: list) -> list[bool]:
    """For each of the first kernels a grouping resumed from journal took from it (made, as
    resumer filled it: empty when it did not resume), whether it is the journal's unchanged
    once grouping ended: the same object (a kernel that is no loop), or a loop of the same
    nodes, reductions and recomputed values, the same objects in the same order. Their nodes
    are then the shared graph's, and so are the inputs those read (each before its reader),
    with the same kernels: whatever a pass after grouping finds for such a kernel from it and
    its inputs' kernels, it found for the journal's. [] where nothing is known."""
    if journal is None or not made or journal.absorbed is None:
        return []
    count = made[0]
    old = journal.kernels
    if len(old) < count or len(kernels) < count:
        return []
    return [
        new is was
        or (
            new.kind == "loop"
            and was.kind == "loop"
            and new.shape == was.shape
            and new.nodes == was.nodes
            and new.reductions == was.reductions
            and new.recomputed == was.recomputed
        )
        for new, was in zip(kernels[:count], old[:count], strict=True)
    ]


def recorder(into: list):
    """group_kernels' `record`, appending the Journal it makes to `into` (and handing the
    dicts its cheap-input pass fills)."""

    def record(nodes, home, kernels, reads, loops=None) -> tuple[dict, dict]:
        journal = Journal(nodes, home, kernels, reads, loops)
        into.append(journal)
        return journal.cheap, journal.cones

    return record


def journal_for(graph: Graph) -> Journal | None:
    """The latest journal of a plan whose graph shares graph's source's first nodes."""
    source = graph.shares_prefix_of
    if source is None or source.sharer_grouped is None:
        return None
    return source.sharer_grouped()


def offer_journal(graph: Graph, journal: Journal) -> None:
    """journal (of a plan lowered from `graph`) is where the next plan sharing graph's
    source's first nodes resumes. The source holds it weakly: the lowered plan holds it
    (LoweredPlan.grouping), so a row whose plans are let go (tracer/budget.py
    forget_plans) takes its journal with it."""
    source = graph.shares_prefix_of
    if source is None:
        return
    before = source.sharer_grouped() if source.sharer_grouped is not None else None
    if before is not None and before is not journal:
        before.let_go()  # only the latest is resumed from: one row's journal held at a time
    source.sharer_grouped = weakref.ref(journal)


class _Reads(dict):
    """loop kernel -> buffers of other kernels it reads. A loop the journal placed whole
    before the shared nodes end reads what the journal says: its set is copied only when the
    resumed grouping asks about that loop (it may join it)."""

    def __init__(self, earlier: dict, made: int):
        super().__init__()
        self.earlier, self.made = earlier, made

    def __missing__(self, k: int) -> set:
        found = self[k] = set(self.earlier[k])
        return found

    def plain(self) -> dict:
        """A dict of every loop's set (those never asked about shared with the journal's)."""
        made = self.made
        return {**{k: s for k, s in self.earlier.items() if k < made}, **self}


def resumed_state(journal: Journal, nodes: list[Value], bases, taken: list | None = None):
    """(q, kernels, home, latest_loops, reads, tails, last_op, earlier): group_kernels' state
    after placing nodes[:q], q the nodes shared with the journal's graph, as its loop leaves
    it, and what the cheap-input pass found for the loops placed whole before q (earlier:
    those loops' entries of the journal's cheap and cones). taken, if given, gets how many
    kernels that state takes from the journal."""
    q = shared_prefix(journal.nodes, nodes)
    homes = journal.homes
    made = max(homes[:q], default=-1) + 1  # kernels are made in node order
    if taken is not None:
        taken.append(made)
    open_ = {k for k in set(homes[q:]) if k < made}  # kernels with nodes on both sides of q
    after = set(journal.nodes[q:]) if open_ else ()
    kernels = journal.kernels[:made]  # those that are no loop shared as they are
    latest_loops: dict[tuple, int] = {}
    tails: set[Value] = set()
    for k in journal.loops[: bisect_left(journal.loops, made)]:
        old = kernels[k]
        members, reductions = old.nodes, old.reductions
        if k in open_:
            members = [n for n in members if n not in after]
            reductions = [n for n in reductions if n not in after]
        kernel = kernels[k] = _new_kernel(Kernel)  # Kernel("loop", [*members], shape)
        kernel.kind, kernel.nodes, kernel.shape = "loop", list(members), old.shape
        kernel.reductions, kernel.recomputed, kernel.epilogue = list(reductions), [], None
        tails.update(reductions)
        latest_loops[old.shape] = k
    last_op = next((k for k in range(made - 1, -1, -1) if kernels[k].kind == "op"), -1)
    home = dict(zip(nodes[:q], homes[:q], strict=True))
    reads = _Reads(journal.reads, made)
    for k in open_:  # what the nodes it has so far read, as group_kernels' loop collects it
        found = reads[k] = set()
        kernel = kernels[k]
        for node in kernel.nodes + kernel.reductions:
            for s in map(bases.__getitem__, node.inputs):
                owner = home.get(s, -1)
                if owner != k and (owner < 0 or kernels[owner].kind != "literal"):
                    found.add(s)
    whole = [k for k in journal.loops[: bisect_left(journal.loops, made)] if k not in open_]
    cheap, cones = journal.cheap, journal.cones
    earlier = (
        {k: cheap[k] for k in whole if k in cheap},
        {k: cones[k] for k in whole if k in cones},
    )
    return q, kernels, home, latest_loops, reads, tails, last_op, earlier


_new_kernel = object.__new__
