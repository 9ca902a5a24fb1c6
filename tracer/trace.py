"""The active trace: the graph ops are recorded into while a function is being traced."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from contextlib import contextmanager

from backplan.ir.graph import Graph, Value
from backplan.ir.types import TensorType

from . import host_random
from .errors import TracingError

_state = threading.local()


class Trace:
    """One function being traced. Tensors from outside it (concrete arrays, or tracers of an
    enclosing trace) are lifted into extra inputs, recorded in `captured`."""

    def __init__(self, name: str):
        self.graph = Graph(name=re.sub(r"\W", "_", name) or "fn")
        self.captured: list = []
        self._lifted: dict[int, Value] = {}
        self.floats: dict[Value, str] = {}  # input of a traced Python float -> its argument
        # checks of a traced float's value, run on every call (check_float_when_called)
        self.float_checks: list[tuple[Value, Callable[[float], None]]] = []
        self.inner_joints: list = []  # report.InnerJoint of each value_and_grad inlined here
        self.inlined_losses: list[Value] = []  # their outputs here (loss, aux): see plan_choices
        self.inlined_gradients: list[Value] = []  # and their gradients (ir/update_order.py)

    def value_of(self, tensor) -> Value:
        if tensor._trace is self:
            return tensor._value
        tensor._check_live()
        if tensor._data is None and tensor._trace not in _stack():
            raise TracingError(
                "a traced tensor escaped the function that traced it (stored in a global or "
                "returned through a side channel); return it from the function instead"
            )
        key = id(tensor)
        if key not in self._lifted:
            value = self.graph.add_input(TensorType(tensor._ir_dtype, tensor.shape))
            self._lifted[key] = value
            self.captured.append(tensor)
        return self._lifted[key]


def _stack() -> list[Trace]:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


# tracing() blocks open now, in any thread: while there are none no thread is tracing, and
# current_trace does not read the thread's stack (a threading.local getattr: ~500
# instructions, and a raised and caught AttributeError in a thread that never traced)
_tracing_open = 0
_tracing_lock = threading.Lock()


def current_trace() -> Trace | None:
    if not _tracing_open:
        return None
    stack = getattr(_state, "stack", None)  # every compiled call asks: no list made here
    return stack[-1] if stack else None


@contextmanager
def tracing(trace: Trace):
    global _tracing_open
    with _tracing_lock:
        _tracing_open += 1
    stack = _stack()
    stack.append(trace)
    try:
        host_random.enter(lambda: bool(_stack()))
        try:
            yield trace
        finally:
            host_random.leave()
            stack.pop()
    finally:
        with _tracing_lock:
            _tracing_open -= 1
