"""Size-dependent choices pinned across the sizes of one symbolic plan (ir/symbolic.py).

Rendering picks some implementations by size: backplan's GEMM or BLAS, a parallel loop or a
serial one, a row or attention kernel's parallel variant. Each is right at every size; only its
speed depends on the size. The plans instantiated from one symbolic plan must render one driver
(codegen/render/lift.py), so while one of them renders, every choice is recorded in order in the
plans' shared dict and the next size makes the same choices in the same order (its plan has the
same steps). Outside such a rendering `decide` returns the value it is given.

>>> with pinned({}) as choices:
...     decide("own_gemm", True)
True
>>> with pinned(choices):
...     decide("own_gemm", False)  # another size: the first size's choice
True
>>> with pinned(choices):
...     chosen("own_gemm", lambda: 1 / 0)  # pinned: the cost model is not asked again
True
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_state = threading.local()


@contextmanager
def pinned(choices: dict | None):
    """Within: decide() records into (or replays from) choices; None leaves choices free."""
    before = getattr(_state, "choices", None), getattr(_state, "counts", None)
    _state.choices, _state.counts = choices, {}
    try:
        yield choices
    finally:
        _state.choices, _state.counts = before


def decide(kind: str, value):
    """`value`, or the choice the first rendering of this symbolic plan made at this point."""
    choices = getattr(_state, "choices", None)
    if choices is None:
        return value
    index = _state.counts.get(kind, 0)
    _state.counts[kind] = index + 1
    return choices.setdefault((kind, index), value)


_FREE = object()  # no choice recorded at this point yet


def chosen(kind: str, compute):
    """decide(kind, compute()), asking compute() only where no earlier size's choice is pinned
    at this point: the cost models behind a GEMM's or an attention kernel's variant (and the
    free cores they read) are asked once per symbolic plan, not at every new size. compute
    has no side effects: where a choice is pinned its answer went unused before too."""
    choices = getattr(_state, "choices", None)
    if choices is None:
        return compute()
    index = _state.counts.get(kind, 0)
    _state.counts[kind] = index + 1
    found = choices.get((kind, index), _FREE)
    return choices.setdefault((kind, index), compute()) if found is _FREE else found
