"""Errors raised while tracing a function."""

from backplan.ir.errors import BackplanError


class TracingError(BackplanError, RuntimeError):
    """The traced function did something a static plan cannot express (Python control flow on a
    tensor's value, a tensor escaping its trace); the message names the user's line."""
