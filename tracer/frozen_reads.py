"""The globals and closure variables a traced function reads are taken at the trace, as in
`jax.jit`: a later `scale = 3.0` or `w = new_tensor` would not reach the plan. This notes, at
each trace, the variables the function's own code loads (its closure cells and the globals its
bytecode loads, nested comprehensions and lambdas included) that hold a number, a NumPy array
or a tensor, with the object each held; a call compares them by identity, a few pointer
comparisons, and a rebinding makes the planned function trace again with a RetraceWarning
naming the variable. Changes in place (`arr[:] = 0`, `cfg["k"] = 4`) keep the object and are
not seen; variables read only by other functions the traced one calls are not either."""

from __future__ import annotations

import dis

import numpy as np

from .tensor import Tensor

NUMBERS = (int, float, np.generic)  # bool is an int
WATCHED = (*NUMBERS, np.ndarray, Tensor)
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_MISSING = object()


class FrozenReads:
    """The watched variables of one function as they were at its last trace. changed() runs on
    every call: one identity comparison per variable (a plain loop measured faster than
    itemgetter/map/all for the few variables a function reads)."""

    __slots__ = ("cells", "scope", "globals")

    def __init__(self, cells: tuple, scope: dict, global_values: tuple):
        self.cells = cells  # ((cell, object at the trace, name), ...)
        self.scope = scope  # the function's __globals__
        self.globals = global_values  # ((name, object at the trace), ...)

    def changed(self) -> bool:
        """Whether a variable holds another object than at the trace."""
        try:
            for cell, value, _ in self.cells:
                if cell.cell_contents is not value:
                    return True
        except ValueError:  # the enclosing function deleted it
            return True
        scope = self.scope
        for name, value in self.globals:
            if scope.get(name, _MISSING) is not value:
                return True
        return False

    def which(self) -> str | None:
        """The first variable that holds another value, as the warning names it, or None: a
        number rebound to an equal one (`lr = base * 0.5` each epoch makes a new float) is no
        change, and refresh() then takes the new objects so the next call's check passes."""
        for cell, value, name in self.cells:
            try:
                if not _same(cell.cell_contents, value):
                    return f"the closure variable `{name}`"
            except ValueError:
                return f"the closure variable `{name}`"
        for name, value in self.globals:
            if not _same(self.scope.get(name, _MISSING), value):
                return f"the global `{name}`"
        return None

    def refresh(self) -> None:
        """Take each variable's object now (after which() found every value the same)."""
        self.cells = tuple((cell, cell.cell_contents, name) for cell, _, name in self.cells)
        self.globals = tuple((name, self.scope[name]) for name, _ in self.globals)


def _same(now, then) -> bool:
    """The object traced, or a number of the same type and value (NaN equal to NaN)."""
    if now is then:
        return True
    if type(now) is not type(then) or not isinstance(now, NUMBERS):
        return False
    return bool(now == then or (now != now and then != then))


def frozen_reads(fn) -> FrozenReads | None:
    """The variables fn reads that a trace freezes, with their objects now; None when there
    are none (the call path then checks nothing)."""
    fn = getattr(fn, "__wrapped__", fn)
    fn = getattr(fn, "__func__", fn)  # a bound method
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = tuple(
        (cell, cell.cell_contents, name)
        for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False)
        if _watched_cell(cell)
    )
    scope = getattr(fn, "__globals__", {})
    global_values = tuple(
        (name, scope[name])
        for name in sorted(_global_loads(code))
        if isinstance(scope.get(name), WATCHED)
    )
    if not cells and not global_values:
        return None
    return FrozenReads(cells, scope, global_values)


def _watched_cell(cell) -> bool:
    try:
        return isinstance(cell.cell_contents, WATCHED)
    except ValueError:  # not filled yet
        return False


def _global_loads(code) -> set[str]:
    """Names the code object, and the code objects nested in it, load as globals (co_names
    also holds attribute names, which are no variables)."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _global_loads(const)
    return names
