"""Epilogue fusion: a GEMM hands the loop after it (bias add, activation, residual add) to
itself, to run on each block of rows of its result as soon as that block is finished, while it
is still in cache, instead of a separate loop reading the whole result back later.

A lowering step over fusion's kernels. A kernel whose op is `epilogue` in the registry (a 2-D
matmul) absorbs the next kernel that runs code when that kernel is a loop over the same shape
whose reductions, if any, run down the columns, reads the matmul's result only element for
element (its row i needs row i of the result only) and reads nothing computed after the matmul
but views. A column sum is the bias gradient of a layer the backward recomputes (x @ w + b,
tanh, its derivative and the sum fused into one gradient loop): it accumulates row by row into
its output, and the recomputed layer runs as the forward's did, not as a bare GEMM whose result
a loop reads back. A reduction along each row (a softmax's, a layer norm's) stays with the row
kernel it starts (ir/lowering.py row_runs); a sum of everything (a loss) stays apart too: taken,
it moved the planner's smallest peak of docs/explain.md's training step from 704,596 to 720,980
B, and nothing recomputed needs it. The merged kernel
is one schedule step, so nothing the epilogue writes shares storage with anything the GEMM
reads; buffers are those of the unfused plan (`materialized` ran before). Codegen runs the
epilogue inside backplan's own GEMM and, where the plan calls BLAS for that shape, as the loop
it was, right after the call.
"""

from __future__ import annotations

from .fusion import Kernel, index_map, internal_shape
from .layout import Roots
from .registry import get_op

FREE_KINDS = ("literal", "alias", "view")  # kernels that emit no code of their own
ACROSS_ROWS = ((0,),)  # reductions an epilogue takes: down the columns


def absorb_epilogues(
    kernels: list[Kernel],
    roots: Roots | None = None,
    known: tuple[list, dict] | None = None,
    into: dict | None = None,
) -> list[Kernel]:
    """kernels with each GEMM followed by its epilogue loop merged into one kernel. roots:
    storage roots already worked out for their graph (ir/layout.py Roots). known: (for each
    of the first kernels whether it is a grouping's it resumed from, unchanged:
    ir/grouping_resume.py unchanged; that grouping's `into`): a kernel and the next one that
    runs code both unchanged (so are the kernels between, which emit none) are merged or not
    as they were there. into: a dict that gets, for each kernel followed by one that runs
    code, whether it took that one."""
    roots = Roots() if roots is None else roots
    same, earlier = known if known is not None else ((), None)
    merged, absorbed = [], set()
    for index, kernel in enumerate(kernels):
        if index in absorbed:
            continue
        after = _next_running(kernels, index) if kernel.kind == "op" else None  # GEMMs only
        if after is None:
            merged.append(kernel)
            continue
        takes = earlier.get(index) if after < len(same) and same[index] and same[after] else None
        if takes is None:
            takes = _absorbs(kernel, kernels[after], roots)
        if into is not None:
            into[index] = takes
        if takes:
            absorbed.add(after)
            kernel = Kernel(  # dataclasses.replace, without its keyword round trip
                kernel.kind,
                kernel.nodes,
                kernel.shape,
                kernel.reductions,
                kernel.recomputed,
                epilogue=kernels[after],
            )
        merged.append(kernel)
    return merged


def _next_running(kernels: list[Kernel], index: int) -> int | None:
    for later in range(index + 1, len(kernels)):
        if kernels[later].kind not in FREE_KINDS:
            return later
    return None


def _absorbs(gemm: Kernel, loop: Kernel, roots: Roots) -> bool:
    # the loop asked first: about half the GEMMs of a deep plan's gradient part run right
    # before another op, and the kernels are at hand where the GEMM's node may not be
    if loop.kind != "loop" or any(r.attrs["axes"] not in ACROSS_ROWS for r in loop.reductions):
        return False
    if gemm.kind != "op" or gemm.epilogue is not None:
        return False
    (node,) = gemm.nodes
    shape = node.type.shape
    if not get_op(node.op).epilogue or len(shape) != 2 or node.type.dtype not in ("f32", "f64"):
        return False
    if tuple(loop.shape) != tuple(shape):
        return False
    return _reads_rowwise(loop, node, roots)


def _reads_rowwise(loop: Kernel, result, roots: Roots) -> bool:
    """The loop reads the GEMM's result, and only element for element (not through a
    transpose or any other view)."""
    shape = internal_shape(loop.shape)
    identity = [d if size != 1 else None for d, size in enumerate(shape)]  # as index_map says
    reads = False
    for node in loop.computed:
        for value in node.inputs:
            if roots[value] is not result:
                continue
            base, dims = index_map(value, shape)
            if base is not result or dims != identity:
                return False
            reads = True
    return reads
