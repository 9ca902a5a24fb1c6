"""The backward engine: walks regions from the root, runs each region's backward plan once,
routes gradients upstream, and only then writes leaf .grad, so a failed backward changes nothing.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

import numpy as np

from .errors import GraphFreedError
from .region import FreedBy, Region


def regions_in_order(root: Region) -> list[Region]:
    """Every region reachable from root, each after all regions that feed it gradients:
    reverse depth-first post-order. A region is marked when it is expanded, not when it is
    pushed, so one reached by two paths finishes after every region downstream of it."""
    order, expanded_regions, stack = [], set(), [(root, False)]
    while stack:
        region, expanded = stack.pop()
        if expanded:
            order.append(region)
            continue
        if region in expanded_regions:
            continue
        expanded_regions.add(region)
        stack.append((region, True))
        for upstream in region.next_regions:
            if upstream not in expanded_regions:
                stack.append((upstream, False))
    return order[::-1]


def freed_error(region: Region, root: Region, loc: str) -> GraphFreedError:
    by = region.freed_by
    lines = [
        f"backward() at {loc} reaches region `{region.name}` (created at {region.created_at}), "
        f"whose saved buffers were already freed by the backward() at {by.loc}."
    ]
    if by.root is None:
        lines.append(
            "That backward() failed part-way, after the region had started to reuse "
            "its saved buffers, so they can no longer be trusted."
        )
    elif by.root is not root:
        lines.append(
            f"That region is shared with an earlier graph: the earlier backward() started from "
            f"{by.root_desc} and freed it on the way, because the tensor you reuse was computed "
            "once, outside the loop, and every later graph is built on top of it."
        )
    else:
        lines.append("This is a second backward() through the same graph.")
    lines.append(
        "Fixes: pass retain_graph=True to the earlier backward() to keep the saved buffers; or "
        "recompute the shared part for each backward (inside the loop); or .detach() the reused "
        "tensor if no gradient should flow into it."
    )
    return GraphFreedError("\n".join(lines))


# Leaf .grad is read, added to and written back; two graphs sharing a leaf must not interleave.
_leaf_grads = threading.Lock()


def backward(
    root: Region, index: int, gradient: np.ndarray, retain_graph: bool, loc: str, root_desc: str
) -> None:
    """Backward passes that reach a common region run one after the other (the second one then
    sees what the first freed); passes over distinct graphs run concurrently. Region locks are
    taken in one global order, so two passes never wait on each other in a cycle."""
    order = regions_in_order(root)
    with ExitStack() as held:
        for region in sorted(order, key=id):
            held.enter_context(region.lock)
        _backward_locked(order, root, index, gradient, retain_graph, loc, root_desc)


def _backward_locked(order, root, index, gradient, retain_graph, loc, root_desc) -> None:
    for region in order:
        if region.freed:
            raise freed_error(region, root, loc)
    pending: dict[Region, dict[int, np.ndarray]] = {root: {index: gradient}}
    leaf_grads: dict[int, tuple[object, np.ndarray]] = {}
    for region in order:
        cotangents = pending.pop(region, None)
        if cotangents is None:
            continue
        grads = region.run_backward(cotangents, retain_graph)
        for edge, grad in zip(region.input_edges, grads, strict=True):
            _route(edge, grad, pending, leaf_grads)
    if not retain_graph:
        freed = FreedBy(loc, root, root_desc)
        for region in order:
            region.mark_freed(freed)
    with _leaf_grads:
        for leaf, grad in leaf_grads.values():
            leaf._accumulate_grad(grad)


def _route(edge, grad, pending, leaf_grads) -> None:
    if edge.leaf is not None:
        key = id(edge.leaf)
        if key in leaf_grads:
            grad = leaf_grads[key][1] + grad
        leaf_grads[key] = (edge.leaf, grad)
        return
    slots = pending.setdefault(edge.region, {})
    slots[edge.index] = grad if edge.index not in slots else slots[edge.index] + grad
