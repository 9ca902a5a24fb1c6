"""Runtime errors; each says what happened, where, and how to fix it."""

from backplan.ir.errors import BackplanError


class GraphFreedError(BackplanError, RuntimeError):
    """backward() reached a region whose saved buffers an earlier backward() already freed.
    Raised every time, even when the region saved nothing, so the answer never depends on which
    ops happened to be in the graph."""


class BackwardError(BackplanError, RuntimeError):
    """backward() was called in a way that has no meaning (non-scalar root without a gradient,
    create_graph, a tensor that does not require grad)."""
