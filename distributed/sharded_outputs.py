"""ZeRO-1 on one node with the compiled plan writing its float32 and float64 gradients straight
into this rank's send buffers in the node's window (shared_sharding.py), as WindowOutputs does
for the unsharded step's buckets: the send buffer holds each dtype's gradients end to end at
their flat offsets, so each gradient with an output buffer of its own is a contiguous piece of
it, and packing (sharding._pack_flat) leaves them where they are. Before, the step packed every
gradient into slots after the call: 0.26 ms CPU of the bench mlp's 2-rank ZeRO-1 step."""

from __future__ import annotations

import math

import numpy as np

from .sharding import _layout_signature, flat_groups

WRITTEN = (np.dtype(np.float32), np.dtype(np.float64))  # summed in their own dtype


class ShardedWindowOutputs:
    """Per compiled joint plan and ranks: which of its output buffers are gradients it can
    write into the ZeRO-1 window's send buffers, and where."""

    def __init__(self, compiled, layout, size: int):
        self.compiled = compiled
        per_output, buffers = compiled.output_slots()
        positions, used = layout.output_positions, set()
        groups = flat_groups(_layout_signature(layout), size)
        self.places: list[tuple[int, list]] = []  # (group, [(buffer j, offset, shape)])
        self.leaves = []  # the layout's leaves written so (explain: rank_peak)
        self._into: dict = {}  # the groups' parities -> (window, the views run() passes)
        by_index = {leaf.index: leaf for b in layout.buckets for leaf in b.leaves}
        for k, group in enumerate(groups):
            if group.dtype not in WRITTEN:
                continue
            members = []
            for p, offset, shape in zip(group.params, group.offsets, group.shapes, strict=True):
                j = per_output[positions[p + 1]]  # leaf p + 1: parameter p's gradient
                if j is None or j in used:
                    continue
                size_of, dtype = math.prod(buffers[j][0]), np.dtype(buffers[j][1])
                if dtype != group.dtype or size_of != math.prod(shape):
                    continue
                used.add(j)
                members.append((j, offset, buffers[j][0]))
                self.leaves.append(by_index[p + 1])
            if members:
                self.places.append((k, members))
        # the parameter positions whose gradients a run() writes in place: nothing to pack
        self.written = frozenset(leaf.index - 1 for leaf in self.leaves)

    def run(self, windows: dict, layout, arrays: list) -> list | None:
        """The plan's outputs, those gradients written into this rank's send buffers of the
        window for this call; None when there is no window yet (the first call that exchanges
        makes it) or the plan cannot be called so (compiled.call_own_into)."""
        window = windows.get(("ZeRO-1", layout.fingerprint))  # ShardedWindow's key
        if window is None or not self.places:
            return None
        parities = tuple((window.written[k] + 1) % 2 for k, _ in self.places)  # next call's
        found = self._into.get(parities)
        if found is None or found[0] is not window:
            found = self._into[parities] = (window, self._views(window, parities))
        return self.compiled.call_own_into(arrays, found[1])

    def _views(self, window, parities: tuple[int, ...]) -> dict:
        """{output buffer: its place in this rank's send buffer of the parity}."""
        into = {}
        for (k, members), parity in zip(self.places, parities, strict=True):
            flat = window.buffer(window.rank, k, parity)
            for j, offset, shape in members:
                into[j] = flat[offset : offset + math.prod(shape)].reshape(shape)
        return into
