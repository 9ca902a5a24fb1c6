"""The grad mode and the backend a thread chose stay in that thread; a thread that never chose
reads the defaults (class defaults of the thread-local state: no exception raised and caught
on every call to find them)."""

import threading

from backplan.runtime import backend, grad_mode
from backplan.runtime.backend import backend_in_this_thread, current_backend
from backplan.runtime.grad_mode import is_grad_enabled


def _in_new_thread(fn):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(fn()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_that_never_chose_reads_the_defaults_while_another_chose():
    default = current_backend()
    other = "reference" if default == "numba" else "numba"
    with grad_mode.no_grad(), backend_in_this_thread(other):
        assert not is_grad_enabled() and current_backend() == other
        assert _in_new_thread(lambda: (is_grad_enabled(), current_backend())) == (True, default)
    assert is_grad_enabled() and current_backend() == default


def test_the_defaults_are_class_attributes_not_set_per_thread():
    # a fresh thread finds nothing in its own dict: the class answers, no AttributeError
    assert _in_new_thread(lambda: dict(vars(grad_mode._state))) == {}
    assert _in_new_thread(lambda: dict(vars(backend._this_thread))) == {}
    assert type(grad_mode._state).enabled is True and type(backend._this_thread).name is None


def test_blocks_open_in_one_thread_are_counted_and_closed_even_when_they_raise():
    """is_grad_enabled, current_backend and current_trace skip the thread-local read while no
    thread has a block open (a module count): a block open in one thread makes that thread
    read its own, the others still read the defaults, and a block left by an exception is
    closed in the count."""
    from backplan.tracer import trace as trace_module
    from backplan.tracer.trace import Trace, current_trace, tracing

    assert current_trace() is None
    trace = Trace("t")
    with tracing(trace):
        assert current_trace() is trace and trace_module._tracing_open == 1
        assert _in_new_thread(current_trace) is None
    assert current_trace() is None and trace_module._tracing_open == 0
    for block in (grad_mode.no_grad, lambda: backend_in_this_thread("reference")):
        try:
            with block():
                raise KeyError("inside")
        except KeyError:
            pass
    assert grad_mode._blocks_open == 0 and backend._thread_choices == 0
    assert is_grad_enabled() and current_backend() == _in_new_thread(current_backend)
