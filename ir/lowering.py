"""The last steps of the pipeline: a plan with liveness becomes a lowered plan, the one object
code generation renders and explain, export and the runtime read.

widen (ops on bfloat16 and float16 compute in float32: ir/widen.py) -> strided copies (a
reshape of a strided view reads a copy the plan holds: ir/strided_copies.py) -> fusion (which nodes
share a kernel) -> epilogues (a GEMM takes the loop after it into its row
blocks: ir/epilogue.py) -> schedule (consecutive row loops become stages of one row kernel,
sharing a step) -> memory plan (where every buffer lives) -> donation (which outputs are
written into the inputs the plan donates: ir/donation.py). Computed once per plan
and backward mode, then kept: nobody re-derives a fact the lowered plan holds.
"""

from __future__ import annotations

import enum
import threading
from copy import copy
from dataclasses import dataclass, field
from itertools import chain

from .donation import donation_pairs
from .epilogue import absorb_epilogues
from .fusion import Bases, Kernel, alias_base, group_kernels, internal_shape, materialized
from .graph import Value
from .grouping_resume import journal_for, offer_journal, recorder, resumer, unchanged
from .grouping_reuse import KEPT, find, grouping_key, read_back, written
from .in_place_inputs import read_in_place
from .layout import BufferLayout, Roots, plan_layout
from .liveness import Plan, plan_liveness
from .rounding_points import reference_plan, rounding_points
from .row_local import row_local_values
from .strided_copies import copy_strided_reshapes
from .wide_reads import reads_wide_copies, wide_copies_read_as_is
from .widen import half_among, row_dtypes, value_dtypes, widen_with_origin

RUN_KINDS = ("loop", "op")  # kernels that run code; views, aliases and literals cost nothing


class BackwardMode(enum.Enum):
    """How a backward plan treats its saved buffers. RETAIN (backward(retain_graph=True))
    never touches them; CONSUME (the default) may put temporaries into private saved buffers
    after their last read, since the graph is released anyway."""

    RETAIN = "retain"
    CONSUME = "consume"

    @classmethod
    def of(cls, retain_graph: bool) -> BackwardMode:
        return cls.RETAIN if retain_graph else cls.CONSUME


@dataclass
class LoweredPlan:
    """A plan ready to render: kernels in run order, the schedule step of each, the values
    that need a buffer and where each buffer lives."""

    plan: Plan
    private_saved: tuple[int, ...]  # saved inputs whose storage temporaries may take over
    kernels: list[Kernel]
    row_runs: list[tuple[int, int]]  # [start, end) kernels fused into one row kernel
    steps: list[int]  # schedule step of each kernel (a row kernel's stages share one)
    materialized: set[Value]  # values that need a buffer
    buffers: list[Value]  # those that get storage (not constants), in kernel order
    layout: BufferLayout
    # plan widened for 16-bit floats (ir/widen.py): its node -> the node of the plan given
    # (casts into float32 have none); None: the plan given, unchanged
    origin: dict[Value, Value] | None = None
    # the plan before its strided copies (ir/strided_copies.py), what the reference interpreter
    # runs: NumPy copies such a reshape itself, a buffer ir/reference_storage.py counts
    interpreted: Plan | None = None
    rendered: object = None  # what codegen made of it (codegen/render/emit.generate), once
    # output buffer (index in layout.outputs) -> the donated input it is written into
    donations: dict[int, int] = field(default_factory=dict)
    # for a plan whose graph shares its first nodes with another's (a memory plan's row),
    # what its fusion grouping's placing loop left, where the next such plan resumes
    # (ir/grouping_resume.py); None for any other plan
    grouping: object = None
    # (op, dtype) of the node of each kernel that is one op, each once, in kernel order:
    # noted by the lowering's walk of its kernels (_buffers), so that whether codegen renders
    # every op (codegen/render/opaque.py unsupported_reason) walks no kernel again; None:
    # not noted (a lowered plan made otherwise), the kernels are read
    op_kinds: tuple | None = None
    # the packing pages its products write in the GEMM's kept buffers (codegen/kernels/gemm/
    # packing.py planned_packing), noted when first asked
    packing: dict = field(default_factory=dict)

    @property
    def kernel_count(self) -> int:
        """Kernels the driver calls: fused loops and single ops, a row kernel's stages once
        (one loop over the rows runs them all), a constant none (the driver reads the array)."""
        return len(self.calls())

    def calls(self) -> list[tuple[int, int]]:
        """[start, end) ranges of `kernels`, one per kernel the driver calls, in run order: a
        row run is one range (literals and aliases between its stages emit no code), any
        other kernel that runs code a range of one; a loop storing nothing runs not at all
        (every value it computes is recomputed where it is read)."""
        runs = dict(self.row_runs)
        ranges, index = [], 0
        while index < len(self.kernels):
            end = runs.get(index, index + 1)
            if end > index + 1 or self.runs(self.kernels[index]):
                ranges.append((index, end))
            index = end
        return ranges

    def runs(self, kernel: Kernel) -> bool:
        """Whether the driver calls code for this kernel (outside a row run): not for a
        constant, nor for a loop none of whose values needs a buffer."""
        if kernel.kind == "loop":
            return any(n in self.materialized for n in kernel.all_nodes)
        return runs_code(kernel)


def stored_values(lowered: LoweredPlan) -> set[Value]:
    """The nodes of the plan given to `lower` that the compiled plan keeps in a buffer (the
    plan's inputs are the caller's; an alias lives in its base's): the others are literals or
    computed inside the loop that reads them and never reach memory. A widened or copied plan
    names its nodes by `origin`."""
    if lowered.origin is None:
        return set(lowered.materialized)
    return {lowered.origin[v] for v in lowered.materialized if v in lowered.origin}


def runs_code(kernel: Kernel) -> bool:
    """Whether the driver calls code for this kernel: a loop or an op, not a constant."""
    return kernel.kind in RUN_KINDS and not (kernel.kind == "op" and kernel.nodes[0].op == "const")


def lower(plan: Plan, private_saved: tuple[int, ...] = ()) -> LoweredPlan:
    """private_saved: indices of saved inputs whose storage may be reused after their last
    read (the consuming backward variant). Cached per plan and variant, in `plan.lowered`;
    the lowered plan points at a copy of `plan` (`detached`), not at `plan` itself, so the
    two do not hold each other and reference counting frees them."""
    key = tuple(private_saved)
    with _lock:
        if key not in plan.lowered:
            plan.lowered[key] = _lower(plan, key)
        return plan.lowered[key]


_lock = threading.Lock()


def let_go(plan: Plan) -> None:
    """A size of a symbolic plan other than its first keeps no lowering once its runner
    exists: the runner holds what it runs, and explain or export lowers the size again (the
    same kernels and layout: lowering is deterministic, its grouping read back or made afresh
    alike, ir/grouping_reuse.py). A lowering was about a quarter of the objects a size kept
    (lstm12: 3,660 -> 2,800 a size), which every full collection of the cyclic collector walks."""
    shared = plan.shared
    if shared is None:
        return
    first = shared.get("first")
    if first is not None and first() is plan:
        return
    with _lock:
        plan.lowered.clear()


def detached(plan: Plan) -> Plan:
    """plan's graph, liveness, donations and shared driver, without its cache of lowerings:
    what a lowered plan keeps as its `plan` (and `interpreted`). Kept as `plan` itself, each
    plan and its lowering were a reference cycle (plan.lowered -> LoweredPlan.plan) that only
    Python's cyclic collector frees: after a 10,086-node memory_frontier, one full collection
    of ~0.9 s for its 22 plans, where reference counting frees them in ~0.1 s. A shallow
    copy, not dataclasses.replace, which reads every field: liveness not worked out yet
    (ir/liveness.py) stays so."""
    plan = copy(plan)
    plan.lowered = {}
    return plan


def _lower(plan: Plan, private_saved: tuple[int, ...]) -> LoweredPlan:
    plan = detached(plan)  # the plan keeps its lowering; the lowering does not keep the plan
    groupings = _groupings(plan)
    given = plan.graph  # a row's: it may share its first nodes with the rows before
    journal = [] if given.shares_prefix_of is not None else None
    resume = journal_for(given) if journal is not None else None
    strided = [] if journal is not None else None  # what its strided copies pass found
    earlier = resume.strided if resume is not None else None
    dtypes = first = None  # a row's dtypes, its shared values' from the rows before
    if journal is not None:
        dtypes, first = row_dtypes(given, resume.dtypes if resume is not None else None)
    plan, graph, origin, interpreted, sources = _prepared(plan, earlier, strided, dtypes)
    # alias bases and storage roots, shared by the passes that ask them; a row's start from
    # those of the graph it shares its first values with (sources_known)
    known = None if journal is None else sources_known(given.shares_prefix_of, resume)
    bases = Bases() if known is None else Bases(known[0])
    roots = Roots() if known is None else Roots(known[1])
    kernels, needed, runs = _grouped(groupings, graph, origin, bases, roots, resume, journal)
    if journal:
        journal[0].strided = strided[0] if strided else None
        journal[0].known = known
        journal[0].dtypes = first
    steps = schedule_steps(kernels, runs)
    buffers, written, op_kinds, read = _buffers(kernels, steps, needed)
    private = [graph.inputs[i] for i in private_saved]
    pinned = None if plan.shared is None else plan.shared.setdefault(("row_local",), {})
    local = row_local_values(graph, kernels, runs, needed, pinned)
    slots = None if plan.shared is None else plan.shared.setdefault(("attention_slots",), {})
    layout = plan_layout(
        graph, kernels, buffers, private, steps, local, roots, written, read, slots, op_kinds
    )
    lowered = LoweredPlan(
        plan, private_saved, kernels, runs, steps, needed, buffers, layout, origin, interpreted
    )
    lowered.donations = donation_pairs(lowered)
    lowered.op_kinds = op_kinds
    if journal:
        lowered.grouping = journal[0]
        offer_journal(given, journal[0])
    if sources is not None:  # 16-bit values: the interpreter rounds where the loops do
        lowered.interpreted = reference_plan(interpreted, rounding_points(kernels), sources)
    return lowered


def _buffers(kernels: list[Kernel], steps: list[int], needed: set[Value]):
    """(the values that get storage, in kernel order: those needed of the kernels that run
    code, constants aside; the step each is written at; LoweredPlan.op_kinds; each value read
    -> the step of its latest read, as ir/layout.py lifetimes starts from), the steps, ops
    and reads taken in the same walk (plan_layout asks the steps of its buffers only, and a
    second walk of every kernel's inputs for lifetimes cost a row of a 10,000-node memory
    frontier ~1-2 ms, mostly cache misses on kernels and nodes this walk has just read)."""
    buffers, written, ops, read = [], [], {}, {}
    add, at = buffers.append, written.append
    for kernel, step in zip(kernels, steps, strict=True):
        for node in kernel.computed:  # steps rise (schedule_steps): the last read wins
            for inp in node.inputs:
                read[inp] = step
        kind = kernel.kind
        if kind in RUN_KINDS:
            for n in kernel.all_nodes:
                if n in needed and n.op != "const":
                    add(n)
                    at(step)
            if kind == "op":  # its node (an epilogue's follow it in all_nodes)
                node = kernel.nodes[0]
                dtypes = ops.get(node.op)
                if dtypes is None:
                    dtypes = ops[node.op] = {}
                dtypes.setdefault(node.type.dtype, step)
    kinds = sorted((at, op, dtype) for op, d in ops.items() for dtype, at in d.items())
    return buffers, written, tuple((op, dtype) for _, op, dtype in kinds), read


def sources_known(source, journal) -> tuple[Bases, Roots]:
    """(alias bases, storage roots) of every value of `source`, the graph a row shares its
    first values with: worked out once a frontier (the journal of the row before has them),
    they answer for the row's shared values, which are source's own (each follows from the
    value and those it reads, never changed), and a row's lowering asks them of every
    value it reads."""
    if journal is not None and journal.known is not None:
        return journal.known
    bases, roots = Bases(), Roots()
    for value in chain(source.inputs, source.nodes):
        _ = bases[value], roots[value]  # filled on the first ask
    return bases, roots


def _prepared(
    plan: Plan, earlier: tuple | None = None, found: list | None = None, dtypes: set | None = None
):
    """(plan, its graph, origin, the plan the reference interpreter runs, and for a plan with
    16-bit values each node of the graph -> the node of that plan it computes where they
    differ, else None): widened for 16-bit floats and given its strided copies, as fusion
    groups it. earlier, found: ir/strided_copies.py copy_strided_reshapes's, for a row.
    dtypes: value_dtypes of plan's graph, where the caller knows them (a row: row_dtypes)."""
    origin, sources = None, None
    dtypes = value_dtypes(plan.graph) if dtypes is None else dtypes
    half = half_among(dtypes)
    if half:  # the same inputs and outputs; a plan of its own for the casts
        graph, origin = widen_with_origin(plan.graph)
        shared = plan.shared  # a symbolic plan's sizes still share one driver
        copied = plan.copied  # the same inputs: in the same layouts
        plan = plan_liveness(graph, plan.donated)
        plan.shared, plan.copied = shared, copied
        sources = {}
    interpreted = plan
    # float32 read by float64 GEMMs (none without a float64 value: the scan is skipped)
    if not half and "f64" in dtypes and reads_wide_copies(plan.graph, half):
        graph, origin = wide_copies_read_as_is(plan.graph)
        shared, copied = plan.shared, plan.copied
        plan = plan_liveness(graph, plan.donated)
        plan.shared, plan.copied = shared, copied
    plan, origin = read_in_place(plan, origin, sources)  # F-order arguments: no copy
    later = None if sources is None else {}
    # a symbolic plan's sizes copy or read in place the operands its first lowered size did
    pins = None if plan.shared is None else plan.shared.setdefault(("strided_in_place",), {})
    graph, origin = copy_strided_reshapes(plan.graph, origin, later, earlier, found, pins)
    if later:  # a node copy_strided_reshapes made -> the node of `interpreted` it computes
        sources.update((v, sources.get(s, s)) for v, s in later.items())
    if graph is not plan.graph:  # each copy a buffer the plan places (ir/strided_copies.py)
        plan = replace_graph(plan, graph)
    return plan, graph, origin, interpreted, sources


def _groupings(plan: Plan) -> list | None:
    """The groupings kept for the sizes of plan's symbolic plan (None: plan has none). One
    list for every backward variant: the grouping does not depend on which saved inputs
    temporaries may take over."""
    return None if plan.shared is None else plan.shared.setdefault(("grouping",), [])


def _grouped(
    groupings: list | None, graph, origin, bases: Bases, roots: Roots, resume=None, journal=None
):
    """(kernels, values that need a buffer, row runs): fusion, epilogues and row runs, or,
    for a size of a symbolic plan, the grouping of a size grouped before whose sizes answer
    every question those passes ask alike (ir/grouping_reuse.py). resume: a Journal to resume
    from; journal: a list that gets this grouping's (ir/grouping_resume.py); see
    group_kernels."""
    if groupings is not None:
        key, shapes = grouping_key(graph, origin)
        found = find(groupings, key)
        if found is not None:
            return read_back(found, graph, shapes)
    record = None if journal is None else recorder(journal)
    made: list[int] = []  # how many kernels the grouping took from `resume`
    homes: list[dict] = []  # each node -> its kernel, as grouping placed it
    kernels = group_kernels(graph, origin, bases, resumer(resume, made), record, homes)
    same = unchanged(resume, kernels, made)  # those the resumed journal's, unchanged
    reads = resume.reads_out if same else None  # what its first kernels read from others
    noted: list | None = [] if journal else None
    reads_known = (same, reads) if reads is not None and len(reads) >= len(same) else None
    needed = materialized(graph, kernels, bases, homes[0], reads_known, noted)
    if journal:
        journal[0].reads_out = noted[0]
    known = (same, resume.absorbed) if same else None
    absorbed: dict | None = {} if journal else None
    kernels = absorb_epilogues(kernels, roots, known, absorbed)
    if journal:  # where the next row resumes from, which GEMMs took their loops too
        journal[0].absorbed = absorbed
    runs = row_runs(kernels)
    if groupings is not None and len(groupings) < KEPT:
        grouping = written(key, graph, kernels, needed, runs, shapes)
        if grouping is not None:
            groupings.append(grouping)
    return kernels, needed, runs


def group_ahead(plan: Plan, shared: dict) -> None:
    """Group `plan` (a probe traced at another size of a symbolic plan whose sizes share
    `shared`) into its sizes' groupings, so that the first new size finds one even where the
    first size's dims meet by chance (the transformer's 8 rows x 128 = its 1,024 hidden)."""
    groupings = shared.setdefault(("grouping",), [])
    with _lock:
        _, graph, origin, _, _ = _prepared(detached(plan))
        _grouped(groupings, graph, origin, Bases(), Roots())


def replace_graph(plan: Plan, graph) -> Plan:
    """plan's liveness for `graph` (the same inputs and outputs), still sharing the driver of
    its symbolic plan's sizes (codegen keys that driver by its code)."""
    new = plan_liveness(graph, plan.donated)
    new.shared, new.copied, new.in_place = plan.shared, plan.copied, plan.in_place
    graph.reasons = plan.graph.reasons
    return new


def literal_nodes(kernels: list[Kernel]) -> set[Value]:
    """`full` nodes that loops read as literals: never buffers."""
    return {n for k in kernels if k.kind == "literal" for n in k.nodes if n.op == "full"}


def literal_outputs(lowered: LoweredPlan) -> dict[int, Value]:
    """Output index -> the `full` node giving its value, for outputs that are literals.
    (Every literal is a `full` node: where no output's base is one, the kernels are not
    walked; a 10,000-node plan has ~8,000 and ~1,100 outputs, a memory frontier 22 such.)"""
    bases = [alias_base(o) for o in lowered.plan.graph.outputs]
    if not any(base.op == "full" for base in bases):
        return {}
    literals = literal_nodes(lowered.kernels)
    return {i: base for i, base in enumerate(bases) if base in literals}


def schedule_steps(kernels: list[Kernel], runs: list[tuple[int, int]]) -> list[int]:
    """One step per kernel, except that the stages of a row kernel share the first's step:
    their rows interleave, so their buffers live together."""
    steps = list(range(len(kernels)))
    for start, end in runs:
        steps[start:end] = [start] * (end - start)
    return steps


ROW_AXES = ((1,), (0,), (0, 1))  # along a row, down the columns, everything


def _row_stage(kernel: Kernel, rows: int | None) -> bool:
    """A loop over (rows, columns) or (rows, 1) whose reductions sum or max along a row, down
    the columns or over everything (the last two into partial rows per chunk of rows)."""
    if kernel.kind != "loop":
        return False
    shape = internal_shape(kernel.shape)
    if len(shape) != 2 or shape[0] < 2 or _sums_many(kernel):
        return False
    if rows is not None and shape[0] != rows:
        return False
    return all(
        r.attrs["axes"] in ROW_AXES and (shape[1] > 1 or r.attrs["axes"] != (1,))
        for r in kernel.reductions
    )


def _across_rows(kernel: Kernel) -> set[Value]:
    """The kernel's reductions over the rows: final only once every row has run."""
    return {r for r in kernel.reductions if 0 in r.attrs["axes"]}


def _reads_any(kernel: Kernel, values: set[Value]) -> bool:
    """Whether the kernel reads one of values (through aliases too)."""
    return bool(values) and any(alias_base(i) in values for n in kernel.computed for i in n.inputs)


def _sums_many(kernel: Kernel) -> bool:
    """A loop of nothing but two or more adds: codegen splits it into shared two-term and
    in-place adds (codegen/render/add_chains.py), so it stays out of row kernels."""
    chain = kernel.recomputed + kernel.nodes
    return not kernel.reductions and len(chain) > 1 and all(n.op == "add" for n in chain)


def row_runs(kernels: list[Kernel]) -> list[tuple[int, int]]:
    """[start, end) ranges of kernels that fuse into one row kernel: at least two row stages,
    with only literals and aliases (which emit no code) between them."""
    runs, start, rows, stages, across = [], None, None, 0, set()
    for index, kernel in enumerate([*kernels, None]):
        if kernel is not None and kernel.kind != "loop":  # no row stage
            if start is None or kernel.kind in ("literal", "alias"):
                continue  # no run open to close (most kernels: ops, views), or no code in one
        if kernel is not None and _row_stage(kernel, rows) and not _reads_any(kernel, across):
            if start is None:
                start, rows = index, internal_shape(kernel.shape)[0]
            stages += 1
            across |= _across_rows(kernel)
            continue
        if start is not None and stages >= 2:
            runs.append((start, index))
        start, rows, stages, across = None, None, 0, set()
        if kernel is not None and _row_stage(kernel, None):
            start, rows, stages = index, internal_shape(kernel.shape)[0], 1
            across = _across_rows(kernel)
    return runs
