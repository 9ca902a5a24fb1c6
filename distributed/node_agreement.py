"""The step's agreement (step.py: one row of numbers per rank, their elementwise maximum on
every rank) through the node's shared memory in place of MPI's allreduce with MAX, for ranks
that map each other's memory (shared_exchange.reduction's probe). Each rank writes its row into
its segment of a small window of the communicator and bumps its counter; the request completes
once every rank's counter reached the call, with the maximum of their rows. MPI's allreduce
was the one MPI call left in a steady step on one node: 0.04-0.25 ms of a 2-rank mlp step's CPU
(its wait spinning in MPICH's progress loop while the other rank was still in its plan); here
the wait sleeps on the counter once it has spun 50 us (node_window.wait_at).

One window per communicator, made with the probe and kept while the process lives (a page per
rank): every step on the communicator posts its agreements through it in the order MPI's
collectives on the communicator would have had, so steps called in different orders on
different ranks still meet (and the agreement names what differs). A rank rewrites its row of
one parity two agreements later, by when every rank has read it (as the buckets' buffers
alternate, node_window.py)."""

from __future__ import annotations

import numpy as np

from .node_window import READY, CounterRequest, NodeWindow

NUMBERS = 8  # the agreement's row: step.py's _agree_start


def agreement_window(comm, seconds, step: str) -> NodeWindow:
    """The communicator's agreement window (made by every rank alike, with the deadline)."""
    return NodeWindow(comm, [NUMBERS], [np.dtype(np.int64)], seconds, step)


class NodeAgreement(CounterRequest):
    """One agreement, tested and waited for like the mpi4py request of an allreduce with MAX:
    `mine` is written now; once complete, `highest` holds every rank's elementwise maximum."""

    def __init__(self, window: NodeWindow, mine: np.ndarray, highest: np.ndarray):
        self.window, self.highest, self.index = window, highest, 0
        window.written[0] += 1
        self.call = window.written[0]
        window.buffer(window.rank, 0, self.call % 2)[:] = mine
        window.mark(READY, 0, self.call)
        self.complete = False

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name, so deadline.py waits on either
        if not self.complete:
            w = self.window
            if not w.all_at(READY, 0, self.call):
                return False
            rows = [w.buffer(q, 0, self.call % 2) for q in range(w.size)]
            np.maximum(rows[0], rows[1], out=self.highest)
            for row in rows[2:]:
                np.maximum(self.highest, row, out=self.highest)
            self.complete = True
        return True
