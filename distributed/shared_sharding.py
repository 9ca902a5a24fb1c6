"""ZeRO-1's reduce-scatter and all-gather through the node's shared window (node_window.py), for
ranks on one node (shared_exchange.reduction): per dtype, each rank's send buffer in the window
holds the dtype's gradients end to end at their flat offsets (written there by the compiled
plan, sharded_outputs.py, or packed), zeros up to N blocks, then the loss when it rides along;
each rank sums its own block (and the loss) straight from every rank's buffer into its share;
after the update it writes its updated range into the window and reads every rank's. Each rank
sums in rank order: on two ranks the bits of MPI's sum. The buffers alternate between calls as
the unsharded window's do: a rank rewrites one only after every other rank has posted the next
call's, which it does once it has read this call's."""

from __future__ import annotations

import numpy as np

from .half_wire import summed_dtype
from .node_sum import sum_into
from .node_window import READY, CounterRequest, NodeWindow, resident_bytes, segment_bytes
from .shared_exchange import node_window


def _sizes(groups, loss_in_first: bool) -> tuple[list[int], list[np.dtype]]:
    """Per group the send buffer (the group's gradients end to end at their flat offsets,
    zeros to N blocks, then the loss when it rides along; summed dtype), then per group the
    range buffer (one block of the group's dtype)."""
    size = groups[0].size if groups else 1
    sends = [g.block * size + (k == 0 and loss_in_first) for k, g in enumerate(groups)]
    return sends + [g.block for g in groups], [summed_dtype(g.dtype) for g in groups] + [
        np.dtype(g.dtype) for g in groups
    ]


def sharded_window_bytes(groups, loss_dtype) -> int:
    """The memory one rank's segment of the window a ZeRO-1 step of these groups uses holds
    (whole pages)."""
    loss_in_first = bool(groups) and groups[0].dtype == np.dtype(loss_dtype)
    return resident_bytes(segment_bytes(*_sizes(groups, loss_in_first)))


class ShardedWindow:
    """The window of one ZeRO-1 layout and the requests that read it."""

    def __init__(self, exchange, key, groups, loss_in_first: bool):
        self.groups = groups
        self.key = ("ZeRO-1", *key)  # in the step's windows
        self.window: NodeWindow = node_window(exchange, self.key, *_sizes(groups, loss_in_first))

    def send_buffer(self, k: int) -> tuple[np.ndarray, int]:
        """(this rank's send buffer of group k for this call, the call's number)."""
        return self._next(k)

    def range_buffer(self, k: int) -> tuple[np.ndarray, int]:
        """(this rank's range buffer of group k for this call, the call's number)."""
        return self._next(len(self.groups) + k)

    def _next(self, index: int) -> tuple[np.ndarray, int]:
        w = self.window
        w.written[index] += 1
        call = w.written[index]
        return w.buffer(w.rank, index, call % 2), call

    def scatter(self, k: int, call: int, share: np.ndarray, average: bool) -> WindowRequest:
        """Mark the send buffer written; the request sums this rank's block of it into share
        (and the loss, when it rides along, into share's last element), averaged over the
        ranks as it sums when `average` (node_sum.sum_into: rows.average_in_place's bits)."""
        self.window.mark(READY, k, call)
        block = self.groups[k].block
        mine = slice(self.window.rank * block, (self.window.rank + 1) * block)

        def act(buffers):
            sum_into([b[mine] for b in buffers], share[:block], average)
            if share.size > block:  # the loss, after every rank's blocks
                loss = slice(block * self.window.size, None)
                sum_into([b[loss] for b in buffers], share[block:], average)

        return WindowRequest(self.window, k, call, act)

    def gather(self, k: int, call: int, full: np.ndarray, block: int) -> WindowRequest:
        """Mark the range buffer written; the request reads every rank's range into full."""
        index = len(self.groups) + k
        self.window.mark(READY, index, call)

        def read(buffers):
            for q, buffer in enumerate(buffers):
                full[q * block : (q + 1) * block] = buffer[:block]

        return WindowRequest(self.window, index, call, read)


class WindowRequest(CounterRequest):
    """Tested and waited for like an mpi4py request: once every rank has marked buffer `index`
    of this call, `act` runs once on every rank's buffer (in rank order)."""

    def __init__(self, window: NodeWindow, index: int, call: int, act):
        self.window, self.index, self.call, self.act = window, index, call, act
        self.complete = False

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name, so deadline.py waits on either
        if self.complete:
            return True
        w = self.window
        if not w.all_at(READY, self.index, self.call):
            return False
        self.act([w.buffer(q, self.index, self.call % 2) for q in range(w.size)])
        self.complete = True
        return True
