"""The backward engine: walks regions from the root, runs each region's backward plan once,
routes gradients upstream, and only then writes leaf .grad, so a failed backward changes nothing.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

import numpy as np

from backplan.ir.lowering import BackwardMode

from .freed import freed_error
from .region import FreedBy, Region, location_text
from .walk import regions_in_order

__all__ = ["backward", "regions_in_order"]


# Leaf .grad is read, added to and written back; two graphs sharing a leaf must not interleave
# (a joint step's hand-over, runtime/joint_step.py, takes it too).
leaf_grads_lock = threading.Lock()


def backward(root: Region, index: int, gradient: np.ndarray, mode: BackwardMode, loc) -> None:
    """Run every region reachable from `root` output `index` once, in order. In CONSUME mode
    (backward() without retain_graph) each frees its saved buffers as it goes and is marked
    freed by this call; RETAIN leaves them. loc: where backward() was called (a SourceLoc, or
    its text), made into text only for a message.
    Backward passes that reach a common region run one after the other (the second one then
    sees what the first freed); passes over distinct graphs run concurrently. Region locks are
    taken in one global order, so two passes never wait on each other in a cycle."""
    if all(edge.region is None for edge in root.input_edges):
        _backward_one(root, index, gradient, mode, loc)
        return
    order = regions_in_order(root)
    with ExitStack() as held:
        for region in sorted(order, key=id):
            held.enter_context(region.lock)
        _backward_locked(order, root, index, gradient, mode, loc)


def _backward_locked(order, root, index, gradient, mode, loc) -> None:
    freed = [region for region in order if region.freed_by is not None]
    if freed:
        raise freed_error(freed, root, index, location_text(loc))
    pending: dict[Region, dict[int, np.ndarray]] = {root: {index: gradient}}
    leaf_grads: dict[int, tuple[object, np.ndarray]] = {}
    ran: list[Region] = []
    try:
        for region in order:
            cotangents = pending.pop(region, None)
            if cotangents is None:
                continue
            ran.append(region)
            grads = region.run_backward(cotangents, mode)
            for edge, grad in zip(region.input_edges, grads, strict=True):
                _route(edge, grad, pending, leaf_grads)
    except BaseException:
        if (
            mode is BackwardMode.CONSUME
        ):  # regions that ran may have released or reused saved buffers
            _mark_freed(ran, FreedBy(loc, root, index, failed=True))
        raise
    if mode is BackwardMode.CONSUME:
        _mark_freed(order, FreedBy(loc, root, index))
    with leaf_grads_lock:
        for leaf, grad in leaf_grads.values():
            leaf._accumulate_grad(grad)


def _backward_one(region: Region, index: int, gradient, mode, loc) -> None:
    """_backward_locked for a graph of one region, all of whose inputs are leaves (a compiled
    step's loss): one lock, no routing between regions."""
    with region.lock:
        if region.freed_by is not None:
            raise freed_error([region], region, index, location_text(loc))
        try:
            grads = region.run_backward({index: gradient}, mode)
        except BaseException:
            if mode is BackwardMode.CONSUME:
                region.mark_freed(FreedBy(loc, region, index, failed=True))
            raise
        if mode is BackwardMode.CONSUME:
            region.mark_freed(FreedBy(loc, region, index))
        _to_leaves(region.input_edges, grads)


def _to_leaves(edges, grads) -> None:
    leaf_grads: dict[int, tuple[object, np.ndarray]] = {}
    for edge, grad in zip(edges, grads, strict=True):
        leaf = edge.leaf  # a leaf passed twice sums first
        held = leaf_grads.get(id(leaf))
        leaf_grads[id(leaf)] = (leaf, grad if held is None else held[1] + grad)
    with leaf_grads_lock:
        for leaf, grad in leaf_grads.values():
            leaf._accumulate_grad(grad)


def _mark_freed(regions: list[Region], by: FreedBy) -> None:
    for region in regions:
        region.mark_freed(by)


def _route(edge, grad, pending, leaf_grads) -> None:
    if edge.leaf is not None:
        key = id(edge.leaf)
        if key in leaf_grads:
            grad = leaf_grads[key][1] + grad
        leaf_grads[key] = (edge.leaf, grad)
        return
    slots = pending.setdefault(edge.region, {})
    slots[edge.index] = grad if edge.index not in slots else slots[edge.index] + grad
