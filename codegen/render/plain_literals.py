"""A driver calling its loops by address (codegen/build/loop_calls.py) passes sizes, offsets
and flags as plain literals (`256`, not `np.intp(256)`) and a scratch arena, already 1-D, as it
is (`scratch_f32`, not `scratch_f32.reshape(-1)`).

Numba types and lowers each `np.intp(...)` or `np.bool_(...)` call of a driver apart, and a
driver has about fifteen per statement: in a deep MLP's 207-statement driver (3,000 of them)
they were a third of its compile (BENCHMARKS.md, 31). A Python int is typed as intp and a
Python bool as a boolean, the types the callee takes, in a compiled driver and from Python
alike; a size-generic driver's `np.intp(lit_i[3])` reads an intp array already. Each reshape
is lowered apart too, about 10 ms of compile (codegen/render/placement.py): the deep MLP's GEMM
calls flattened an arena 131 times.

>>> plain_literals(["k_1(v0, np.intp(12), np.intp(lit_i[0]), np.bool_(False), np.float32(0.5))"])
['k_1(v0, 12, lit_i[0], False, np.float32(0.5))']
>>> plain_literals(["g(as_read_only(scratch_f32.reshape(-1)), v3.reshape(-1))"])
['g(as_read_only(scratch_f32), v3.reshape(-1))']
"""

from __future__ import annotations

import re

_CAST = re.compile(
    r"\bnp\.(?:intp\((\d+|lit_i\[\d+\])\)|bool_\((True|False)\))"
    r"|\b(scratch_\w+)\.reshape\(-1\)"
)


def plain_literals(body: list[str]) -> list[str]:
    """The body's integer and boolean casts of literals as the literals, and its arenas
    unflattened (comments too: they are the IR lines, which hold none)."""
    return [_CAST.sub(lambda m: m.group(1) or m.group(2) or m.group(3), line) for line in body]
