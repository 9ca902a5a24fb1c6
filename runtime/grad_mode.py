"""Whether forward ops record graphs. Thread-local, like torch.no_grad."""

import threading
from contextlib import contextmanager

_state = threading.local()


def is_grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


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
