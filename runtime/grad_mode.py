"""Whether forward ops record graphs. Thread-local, like torch.no_grad."""

import threading
from contextlib import contextmanager


class _GradState(threading.local):
    """The calling thread's grad mode. The class default answers a thread that never set it,
    without the AttributeError getattr(local, "enabled", True) raised and caught on every op
    and compiled call."""

    enabled: bool = True


_state = _GradState()
# no_grad/enable_grad blocks open now, in any thread: while there are none every thread's mode
# is the default, and is_grad_enabled does not read the thread's own (a threading.local read
# costs ~500 instructions; every op and compiled call asks)
_blocks_open = 0
_blocks_lock = threading.Lock()


def is_grad_enabled() -> bool:
    return _state.enabled if _blocks_open else True


@contextmanager
def _grad_mode(enabled: bool):
    global _blocks_open
    with _blocks_lock:
        _blocks_open += 1
    previous = _state.enabled
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous
        with _blocks_lock:
            _blocks_open -= 1


def no_grad():
    """`with bp.no_grad():` ops record nothing, save nothing, and outputs have no grad_fn."""
    return _grad_mode(False)


def enable_grad():
    return _grad_mode(True)
