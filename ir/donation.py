"""Donation: which outputs of a plan may be written straight into donated input buffers.

`bp.compile(step, donate_argnums=(0, 1))` gives the plan the buffers of the old parameters and
optimizer state; each new value that has the same type as a donated input takes its storage, so
a training step allocates no new parameter memory. Outputs are matched to donated inputs in
order (first unmatched input of the same dtype and shape, as JAX does), and only where it is
safe: the input is read for the last time before the output is written, or by the very loop
that writes it, element for element (every loop body reads all its operands before it stores),
that loop being a kernel of its own or the epilogue of a GEMM that does not read the input (an
optimizer update fused after the gradient's matmul writes new weights and moments in place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fusion import index_map, internal_shape
from .graph import Value
from .layout import lifetimes, storage_root

if TYPE_CHECKING:
    from .lowering import LoweredPlan


def donation_pairs(lowered: LoweredPlan) -> dict[int, int]:
    """{index in layout.outputs (the buffers the caller allocates): donated input index}, for
    the inputs the plan was built to donate (`plan.donated`). The lowering decides them once
    (`lowered.donations`): the compiled plan, explain and the memory accounting read those."""
    if not lowered.plan.donated:
        return {}
    return _pairs(lowered, lowered.plan.donated)


def _pairs(lowered: LoweredPlan, donated: tuple[int, ...]) -> dict[int, int]:
    graph, kernels, steps = lowered.plan.graph, lowered.kernels, lowered.steps
    outputs = list(lowered.layout.outputs)
    last = lifetimes(graph, kernels, steps)
    home = {n: k for k, kernel in enumerate(kernels) for n in kernel.all_nodes}
    output_roots = {storage_root(o) for o in graph.outputs}
    free = [i for i in donated if graph.inputs[i] not in output_roots]
    buffer_index = {v: k for k, v in enumerate(outputs)}
    pairs: dict[int, int] = {}
    for out in graph.outputs:
        k = buffer_index.get(storage_root(out))
        if k is None or k in pairs:
            continue
        root = outputs[k]
        for i in free:
            source = graph.inputs[i]
            if source.type == root.type and _safe(source, root, kernels, steps, home, last):
                pairs[k] = i
                free.remove(i)
                break
    return pairs


def donated_outputs(lowered: LoweredPlan) -> list[tuple[int, int, int]]:
    """(graph output index, donated input index, bytes) for each output written in place,
    in input order: what explain shows."""
    outputs = lowered.plan.graph.outputs
    found = []
    for k, i in sorted(lowered.donations.items(), key=lambda kv: kv[1]):
        buffer = lowered.layout.outputs[k]
        out = next(o for o, v in enumerate(outputs) if storage_root(v) is buffer)
        found.append((out, i, buffer.type.nbytes))
    return found


def _safe(source: Value, out: Value, kernels, steps, home, last) -> bool:
    k = home[out]
    written = steps[k]
    read = last.get(source, -1)
    if read != written:
        return read < written
    if steps.count(written) != 1:
        return False
    kernel = _writing_loop(kernels[k], source, out)
    if kernel is None or kernel.kind != "loop" or kernel.reductions:
        return False
    shape = internal_shape(kernel.shape)
    identity = [d if size != 1 else None for d, size in enumerate(shape)]  # as index_map says
    for node in kernel.computed:
        for value in node.inputs:
            if storage_root(value) is not source:
                continue
            base, dims = index_map(value, shape)
            if base is not source or dims != identity:
                return False
    return True


def _writing_loop(kernel, source: Value, out: Value):
    """The loop that writes out: the kernel itself, or the epilogue of a matmul kernel (an
    optimizer update fused after the gradient's GEMM) when the GEMM does not read the donated
    input: the epilogue then reads and writes it row by row after the GEMM finished that block,
    as a loop does. None when the GEMM reads it, or writes out itself."""
    if kernel.epilogue is None:
        return kernel
    if out not in kernel.epilogue.all_nodes:
        return None
    if any(storage_root(v) is source for node in kernel.nodes for v in node.inputs):
        return None
    return kernel.epilogue
