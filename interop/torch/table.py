"""The ATen op table: each core ATen overload name (`aten.convolution.default`) maps to a
handler that computes it with backplan ops. Handlers receive the node's arguments with every
torch value already replaced by a backplan tensor, and return a tensor or a tuple of them (None
in the places of outputs backplan does not compute, such as max pooling's indices)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Handler = Callable[..., Any]
TABLE: dict[str, Handler] = {}


@dataclass
class Context:
    """What a handler may need beyond its arguments: the dropout key source."""

    next_key: Callable[[str], Any]
    notes: dict = field(default_factory=dict)


def aten(*names: str, context: bool = False) -> Callable[[Handler], Handler]:
    """Register a handler under one or more overload names (`add.Tensor`, `add.Scalar`). With
    context=True it is called as handler(ctx, *args, **kwargs)."""

    def register(fn: Handler) -> Handler:
        fn.wants_context = context  # type: ignore[attr-defined]
        for name in names:
            if f"aten.{name}" in TABLE:
                raise RuntimeError(f"aten.{name} mapped twice")
            TABLE[f"aten.{name}"] = fn
        return fn

    return register
