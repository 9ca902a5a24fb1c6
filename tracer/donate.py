"""Donated arguments of a compiled call (`bp.compile(fn, donate_argnums=...)`): which buffers
the plan may overwrite this call, and marking the donated tensors unusable afterwards."""

from __future__ import annotations

import sys

from .errors import TracingError


def donatable(tensors: list, donated: tuple[int, ...]) -> frozenset[int]:
    """The donated inputs whose arrays nothing else can see: held only by their tensor (no
    NumPy view from .numpy(), no tensor sharing it through detach()) and passed once.
    Others still compute correctly; their outputs just get new buffers."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t._data)] = seen.get(id(t._data), 0) + 1
    usable = set()
    for i in donated:
        if seen[id(tensors[i]._data)] == 1 and _held_only_by_tensor(tensors[i]):
            usable.add(i)
    return frozenset(usable)


def _held_only_by_tensor(tensor) -> bool:
    # references: the tensor's slot and getrefcount's own argument
    if sys.getrefcount(tensor._data) > 2:
        return False
    base = tensor._data.base
    return base is None or sys.getrefcount(base) <= 3  # + the view's base and the local


def mark_donated(tensors: list, traced, loc: str) -> None:
    where = f"{traced.donated_to} at {loc}"
    for i in traced.donated:
        tensors[i]._donated = where


def check_donated_inputs(names: list[str], donated: tuple[int, ...], wrt: list[bool]) -> None:
    """A donated input that requires grad would be overwritten while backward still needs it."""
    for i in donated:
        if wrt[i]:
            raise TracingError(
                f"argument {names[i]} is donated (donate_argnums) but requires grad: backward "
                "may read its buffer after the call has overwritten it. Compute gradients "
                "inside the step with bp.value_and_grad (parameters need no requires_grad), or "
                "leave this argument out of donate_argnums."
            )
