"""data_parallel(timeout=...): waiting for other ranks with a deadline. Blocking MPI calls wait
forever for a rank that hangs (and MPICH spins while it waits); here each rank first tells every
other that it reached the step (a one-byte message each way, the roll call), then waits for the
others' messages by testing with short sleeps. Ranks not heard from by the deadline are named in
a RankTimeoutError, which, uncaught, ends every rank (the hung one too) through MPI_Abort."""

from __future__ import annotations

import math
import time

import numpy as np

from .errors import RankTimeoutError

ROLL_CALL_TAG = 0x6270  # "bp": apart from any tag a user's own messages are likely to use
ARRIVAL_TAG = 0x6271  # Arrivals: reached an exchange's waits
SHARE_TAG = 0x6272  # node_window.py: the names of the ranks' shared segments, and whether mapped
FIRST_PAUSE_S = 2e-5
LONGEST_PAUSE_S = 2e-3  # wakes at most 500 times a second: no spinning, little added latency


def unfinished(requests: list, seconds: float, progress=None) -> list[int]:
    """Wait until every request completes or `seconds` pass; the positions still pending.
    progress: called between the waits on a node window's counters, which make no MPI call
    (Arrivals.progress: MPI moves the arrival messages only inside MPI calls)."""
    deadline = time.monotonic() + seconds
    pending = list(range(len(requests)))
    pause = FIRST_PAUSE_S
    while True:
        pending = [i for i in pending if not requests[i].Test()]
        if not pending or time.monotonic() > deadline:
            return pending
        block = getattr(requests[pending[0]], "block", None)  # a node window's: sleeps on it
        if block is not None:
            if progress is not None:
                progress()
            block(max(0.0, min(LONGEST_PAUSE_S, deadline - time.monotonic())))
            continue
        time.sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE_S)


def roll_call(comm, seconds: float, step: str) -> None:
    """Return once every rank has reached this step; raise RankTimeoutError naming the ranks
    not heard from within seconds. MPI keeps messages between two ranks with one tag in order,
    so each call's roll call matches the same call's on every other rank."""
    swap(comm, np.zeros(1, np.uint8), seconds, step, ROLL_CALL_TAG)


def swap(comm, mine: np.ndarray, seconds: float | None, step: str, tag: int) -> np.ndarray:
    """Send `mine` (uint8, the same length on every rank) to every other rank and receive
    theirs: row r of the result is rank r's. Where the ranks must meet without a blocking
    collective (which waits forever for a rank that stopped before it): past `seconds`
    (None: no limit) it raises RankTimeoutError naming the ranks not heard from at `step`."""
    rank, size = comm.Get_rank(), comm.Get_size()
    others = [r for r in range(size) if r != rank]
    rows = np.zeros((size, mine.size), np.uint8)
    rows[rank] = mine
    sends = [comm.Isend(mine, dest=r, tag=tag) for r in others]
    receives = [comm.Irecv(rows[r], source=r, tag=tag) for r in others]
    limit = math.inf if seconds is None else seconds
    missing = [others[i] for i in unfinished(receives, limit)]
    if missing:
        names = ", ".join(str(r) for r in missing)
        raise RankTimeoutError(
            f"rank {rank} of {size} waited {seconds:g} s (data_parallel timeout) at {step}, but "
            f"rank{'s' if len(missing) > 1 else ''} {names} did not arrive (hung, or stopped "
            "before this step); uncaught, this error ends every rank"
        )
    unfinished(sends, limit)
    return rows


class Arrivals:
    """A one-byte message from each rank to every other as it reaches the waits of an exchange
    (posted by every rank at the same point of every call, so MPI's order per pair and tag
    matches each call's messages across ranks). A collective that does not complete says
    nothing of who is missing; these do: past the deadline, the ranks whose message has not
    come never reached the waits (stopped or hung before them)."""

    def __init__(self, comm):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.others = [r for r in range(self.size) if r != self.rank]
        self._token = np.zeros(1, np.int8)
        self._inbox = np.zeros(self.size, np.int8)
        self._sends = [comm.Isend(self._token, dest=r, tag=ARRIVAL_TAG) for r in self.others]
        self._receives = [
            comm.Irecv(self._inbox[r : r + 1], source=r, tag=ARRIVAL_TAG) for r in self.others
        ]

    def progress(self) -> None:
        """Let MPI move the messages along (a test of each): a rank waiting on the node
        window's counters makes no other MPI call, and a message neither its sender nor its
        receiver progressed would name a rank that did reach the waits."""
        if self.others:
            self._sends[0].Testall(self._sends + self._receives)

    def missing(self) -> list[int]:
        """The ranks whose message has not come (yet)."""
        return [r for r, q in zip(self.others, self._receives, strict=True) if not q.Test()]

    def settle(self, seconds: float) -> None:
        """Complete the messages once the exchange did (they came before it could)."""
        unfinished(self._sends + self._receives, seconds)


def wait_or_raise(request, seconds: float, what: str, arrivals: Arrivals | None = None) -> None:
    """request.Wait() with a deadline: past it, a RankTimeoutError saying what did not finish
    and, given the exchange's arrivals, which ranks never reached it."""
    if not unfinished([request], seconds, arrivals.progress if arrivals is not None else None):
        return
    missing = arrivals.missing() if arrivals is not None else []
    if missing:
        names = ", ".join(str(r) for r in missing)
        raise RankTimeoutError(
            f"{what} did not complete within {seconds:g} s (data_parallel timeout): rank "
            f"{arrivals.rank} of {arrivals.size} waited, but rank{'s' if len(missing) > 1 else ''}"
            f" {names} never reached it (stopped or hung after reaching the step); uncaught, "
            "this error ends every rank"
        )
    said = " (every rank reached it: one stopped during the transfer)" if arrivals else ""
    raise RankTimeoutError(
        f"{what} did not complete within {seconds:g} s (data_parallel timeout): a rank "
        f"stopped after reaching the step{said}; uncaught, this error ends every rank"
    )
