"""Whether forward ops record graphs. Thread-local, like torch.no_grad."""

import threading
from contextlib import contextmanager


class _GradState(threading.local):
    """The calling thread's grad mode. The class default answers a thread that never set it,
    without the AttributeError getattr(local, "enabled", True) raised and caught on every op
    and compiled call."""

    enabled: bool = True


_state = _GradState()


def is_grad_enabled() -> bool:
    return _state.enabled


@contextmanager
def _grad_mode(enabled: bool):
    previous = is_grad_enabled()
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def no_grad():
    """`with bp.no_grad():` ops record nothing, save nothing, and outputs have no grad_fn."""
    return _grad_mode(False)


def enable_grad():
    return _grad_mode(True)
