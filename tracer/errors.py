"""Errors raised while tracing a function."""

from backplan.ir.errors import BackplanError


class TracingError(BackplanError, RuntimeError):
    """The traced function did something a static plan cannot express (Python control flow on a
    tensor's value, a tensor escaping its trace); the message names the user's line."""


class DonatedError(BackplanError, RuntimeError):
    """A tensor was used after its buffer was donated to a compiled call
    (`bp.compile(fn, donate_argnums=...)`), which wrote a result into it."""
