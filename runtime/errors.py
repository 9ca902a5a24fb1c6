"""Runtime errors; each says what happened, where, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass

from backplan.ir.errors import BackplanError


@dataclass(frozen=True)
class FreedFacts:
    """What a GraphFreedError message is written from (report/freed_message.py), kept for
    tools and tests."""

    region: str  # the first freed region backward() reached
    created_at: str
    freed_by: str  # where the backward() that freed it was called
    saved_buffers: int  # how many buffers the region's plan saved (0: nothing was saved)
    saved_bytes: int
    case: str  # "same graph", "shared", "failed"
    loop: bool  # both graphs were built by the same line
    more_freed: tuple[str, ...]  # further freed regions on the way, by name
    backward_at: str = ""  # where the backward() that raised was called
    more_saved_buffers: int = 0  # what the further freed regions had saved
    more_saved_bytes: int = 0
    earlier_root: str = ""  # the output the freeing backward() started from, described
    now_root: str = ""  # the output this backward() starts from, described
    reached_root: bool = False  # the freed region is the one this backward() starts from
    root_created_at: str = ""  # where this backward()'s starting region was created


class GraphFreedError(BackplanError, RuntimeError):
    """backward() reached a region that an earlier backward() already ran without
    retain_graph=True. Raised every time, even when the region saved nothing, so the answer
    never depends on which ops happened to be in the graph. `.facts` holds what the message
    states."""

    def __init__(self, message: str, facts: FreedFacts | None = None):
        super().__init__(message)
        self.facts = facts


class BackwardError(BackplanError, RuntimeError):
    """backward() was called in a way that has no meaning (non-scalar root without a gradient,
    create_graph, a tensor that does not require grad)."""
