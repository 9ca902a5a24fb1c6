"""Donation: which outputs of a plan may be written straight into donated input buffers.

`bp.compile(step, donate_argnums=(0, 1))` gives the plan the buffers of the old parameters and
optimizer state; each new value that has the same type as a donated input takes its storage, so
a training step allocates no new parameter memory. Outputs are matched to donated inputs in
order (first unmatched input of the same dtype and shape, as JAX does), and only where it is
safe: the input is read for the last time before the output is written, or by the very loop
that writes it, element for element (every loop body reads all its operands before it stores).
"""

from __future__ import annotations

from backplan.ir.fusion import Kernel
from backplan.ir.graph import Graph, Value

from .loops import index_map, internal_shape
from .memory import lifetimes, storage_root


def donation_pairs(
    graph: Graph, kernels: list[Kernel], steps: list[int], outputs: list[Value], donated
) -> dict[int, int]:
    """{index in `outputs` (the buffers the caller allocates): donated input index}."""
    if not donated:
        return {}
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


def _safe(source: Value, out: Value, kernels, steps, home, last) -> bool:
    k = home[out]
    written = steps[k]
    read = last.get(source, -1)
    if read != written:
        return read < written
    kernel = kernels[k]
    if kernel.kind != "loop" or kernel.reductions or steps.count(written) != 1:
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
