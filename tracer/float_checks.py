"""Checks of a traced Python float, run on every call with its value.

A compiled function's Python float arguments are traced (a new learning rate does not
retrace), so a check made while tracing, such as bp.optim.sgd(lr) refusing a negative or NaN
rate, cannot see the value. It registers here instead, and the compiled function runs it on
each call, before the plan, with the value the call passed."""

from __future__ import annotations

from collections.abc import Callable

from .source import loc_text, user_frame_loc


def check_float_when_called(tensor, check: Callable[[float], None]) -> bool:
    """Have check(value) run on every call when `tensor` is a traced float argument (it raises
    ValueError to refuse); False, with nothing registered, for anything else."""
    trace = getattr(tensor, "_trace", None)
    if trace is None or not tensor._weak or tensor._value not in trace.floats:
        return False
    trace.float_checks.append((tensor._value, check))
    return True


def float_checks_of(trace) -> tuple:
    """(graph input index, argument name, check) of each registered check."""
    index = {v: i for i, v in enumerate(trace.graph.inputs)}
    return tuple((index[v], trace.floats[v], check) for v, check in trace.float_checks)


def run_float_checks(checks: tuple, tensors: list, name: str) -> None:
    """Each check with its argument's value; a refusal names the argument and the call."""
    for i, argument, check in checks:
        try:
            check(float(tensors[i]._data))
        except ValueError as exc:
            raise ValueError(
                f"{exc} (argument {argument} of {name}(), a traced float, called at "
                f"{loc_text(user_frame_loc())})"
            ) from None
