"""Which arguments of a compiled function are static or donated, by position and by name.

Arguments can be passed either way, so every position is resolved to its parameter name once
(as JAX does with static_argnums and static_argnames): the fast path checks positions and
keyword names, the signature binding checks names.
"""

from __future__ import annotations

import inspect

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class ArgumentSpec:
    def __init__(self, fn, static_argnums=(), static_argnames=(), donate_argnums=()):
        names = _positional_names(fn)
        name = getattr(fn, "__qualname__", "the function")
        self.static_names = frozenset(_names_of(static_argnums, names, "static_argnums", name))
        self.static_names |= frozenset(_as_tuple(static_argnames))
        for arg in self.static_names:
            _check_name(fn, arg, name)
        self.static_nums = frozenset(i for i, n in enumerate(names) if n in self.static_names)
        self.donate_nums = tuple(sorted(set(_as_tuple(donate_argnums))))
        self.donate_names = frozenset(_names_of(self.donate_nums, names, "donate_argnums", name))
        both = self.static_names & self.donate_names
        if both:
            raise ValueError(f"{name}: {sorted(both)} cannot be both static and donated")


def _as_tuple(value) -> tuple:
    return (value,) if isinstance(value, int | str) else tuple(value)


def _positional_names(fn) -> list[str]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in POSITIONAL]


def _names_of(nums, names: list[str], option: str, fn_name: str) -> list[str]:
    found = []
    for i in _as_tuple(nums):
        if not isinstance(i, int) or not -len(names) <= i < len(names):
            raise ValueError(
                f"{option}={nums!r}: {fn_name} has {len(names)} named positional parameters "
                f"({', '.join(names) or 'none'}); give positions among them"
            )
        found.append(names[i])
    return found


def _check_name(fn, arg: str, fn_name: str) -> None:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if arg not in parameters:
        raise ValueError(
            f"static_argnames names {arg!r}, which is not a parameter of {fn_name} "
            f"(parameters: {', '.join(parameters)})"
        )
