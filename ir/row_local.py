"""Values a row kernel keeps one row at a time: the memory plan reserves them CHUNKS rows, not
all of them (a layer norm + GELU step's scratch arena: [4096, 1024] values the kernel wrote one
row of, reserved whole and counted whole while the process touched one row, VmHWM half the
printed peak).

A value qualifies when one stage of a row run (ir/lowering.py row_runs) computes it whole and
only later stages of the same run read it, element for element in the same row: each row's
value is read back in the iteration that wrote it. Not an output, read by no other kernel
(nor by a node of the run that another kernel recomputes) nor through a view. A serial row
kernel keeps such a value in the first reserved row; a parallel one runs its rows in CHUNKS
chunks, chunk c in row c (codegen/render/emit.py _rows), so the reservation holds for either,
whatever the thread count when the plan renders. A run of at most CHUNKS rows saves nothing:
its values keep their whole buffers. The sizes of one symbolic plan (ir/symbolic.py) keep the
first size's answer for each run (`pinned`), so a size on the other side of CHUNKS rows runs the
same row kernels (the test's bfloat16 softmax at 8 and 17 rows: a new loop kernel and driver
at 17 before); either answer is exact, it only moves the peak by at most CHUNKS rows.

A row's statistic (a (rows, 1) value: a layer norm's sum, mean and 1/std, a softmax row's max
and sum) qualifies the same way when only later stages of its run read it, each at its own
row. Kept whole, the bench ln_gelu step stored ten of them per row into ten 16 KiB rows of the
arena that nothing read back (the later stages read the row's value from a local since
codegen forwards it): stores whose addresses all agreed in their low 12 bits with each other
and with the kernel's row streams (4 KiB aliasing, L1 set conflicts), the address kernel 0.3-0.4
ms of 4.7 slower (BENCHMARKS.md, 36).
"""

from __future__ import annotations

from .fusion import Kernel, alias_base, internal_shape
from .graph import Graph, Value

CHUNKS = 16  # a parallel row kernel's chunks of rows (one partial row, one local row each)


def row_local_values(
    graph: Graph,
    kernels: list[Kernel],
    runs: list[tuple[int, int]],
    needed: set,
    pinned: dict | None = None,
) -> dict[Value, int]:
    """value -> rows its buffer holds (CHUNKS), for the values each row run keeps one row at
    a time. pinned: a symbolic plan's answers to "more than CHUNKS rows?" per run, shared by
    its sizes (the first size lowered answers)."""
    outputs = {alias_base(o) for o in graph.outputs}
    inputs = set(graph.inputs)
    local: dict[Value, int] = {}
    for start, end in runs:
        loops = [k for k in kernels[start:end] if k.kind == "loop"]
        rows = internal_shape(loops[0].shape)[0]
        many = rows > CHUNKS
        if pinned is not None:
            many = pinned.setdefault((graph.name, len(graph.nodes), start, end), many)
        if not many:
            continue
        shape_of = {n: internal_shape(k.shape) for k in loops for n in k.computed}
        # a node of the run that a kernel outside it computes too (a 16-bit value's widening,
        # recomputed where it is read) reads its inputs' whole buffers there
        outside = {
            n for i, k in enumerate(kernels) if not start <= i < end for n in k.computed
        } & shape_of.keys()
        candidates = {
            n
            for k in loops
            for n in k.nodes
            if n in needed
            and n not in outputs
            and n not in inputs
            and n.op != "const"
            and len(internal_shape(n.shape)) == 2
            and internal_shape(n.shape)[1] > 1  # a (rows, 1) value's readers index it by row
            and shape_of[n] == internal_shape(n.shape)
        }
        for node in graph.nodes:
            for value in node.inputs:
                base = alias_base(value)
                if base not in candidates:
                    continue
                read_whole_rows = node not in outside and shape_of.get(node) == internal_shape(
                    base.shape
                )
                if value is not base or not read_whole_rows:
                    candidates.discard(base)
        local.update(dict.fromkeys(candidates, CHUNKS))
        local.update(dict.fromkeys(_row_statistics(graph, loops, rows, needed, outside), CHUNKS))
    return local


def _row_statistics(graph: Graph, loops: list[Kernel], rows: int, needed: set, outside) -> set:
    """The (rows, 1) values a run's stages compute (reductions over a row included) that only
    the run's own stages read, each element in the iteration of its row: not outputs nor
    inputs, read by no kernel outside the run and through no view."""
    stage_of = {n: i for i, k in enumerate(loops) for n in k.computed}
    outputs = {alias_base(o) for o in graph.outputs}
    found = {
        n
        for k in loops
        for n in k.nodes + k.reductions
        if n in needed
        and n not in outputs
        and n.op != "const"
        and internal_shape(n.shape) == (rows, 1)
    }
    for node in graph.nodes:
        for value in node.inputs:
            base = alias_base(value)
            if base not in found:
                continue
            later_stage = node not in outside and stage_of.get(node, -1) >= stage_of[base]
            if value is not base or not later_stage or internal_shape(node.shape)[0] != rows:
                found.discard(base)
    return found
