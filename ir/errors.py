"""Errors every layer shares; the base class lives here because ir imports nothing of ours."""


class BackplanError(Exception):
    """Base class of every error backplan raises on purpose."""


class ShapeError(BackplanError, ValueError):
    """An op got shapes it cannot combine; the message names the op, the shapes and the line."""


class DtypeError(BackplanError, TypeError):
    """An op got a dtype it does not accept."""


class ParseError(BackplanError, ValueError):
    """IR text that does not follow the text form."""


class ExecutionError(BackplanError, RuntimeError):
    """An op failed on real data (an index out of range, say); names the op and the line."""


class VerifyError(BackplanError, AssertionError):
    """A graph or plan that breaks an invariant of the IR (a bug in a pass, or a tampered file)."""


class MemoryBudgetError(BackplanError, ValueError):
    """No plan of a step fits its memory budget (max_peak_bytes, saved_bytes_budget); raised
    before anything compiles, with the smallest peak reachable and the ways out."""
