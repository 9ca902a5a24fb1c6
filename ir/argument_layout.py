"""How an argument's array is laid out, in the words explain and the signature use: a compiled
plan reads its inputs in C order, so any other layout is copied whole into C order at every
call of a plan that takes it (codegen/run/compiled.py `contiguous`), a copy the step's peak
counts (ir/peak.py, category "copies") and the signature keys on (tracer/signature.py), so a
plan whose peak assumed one layout is never reused for another.

>>> import numpy as np
>>> a = np.ones((4, 3), np.float32)
>>> [layout(x) for x in (a, a.T, a[::-1], np.broadcast_to(a[0], (4, 3)), a[:, ::2])]
['C', 'F-order', 'negative strides', 'broadcast', 'strided']
"""

from __future__ import annotations

import numpy as np

C_ORDER = "C"


def layout(array: np.ndarray) -> str:
    """C_ORDER ("C") for an array a plan reads in place (C-contiguous, however aligned);
    otherwise why it is copied: "F-order" (a transposed matrix, a Fortran array), "broadcast"
    (a zero stride: np.broadcast_to, expand), "negative strides" (a reversed view), "strided"."""
    if array.flags.c_contiguous:
        return C_ORDER
    if array.flags.f_contiguous:
        return "F-order"
    strides = [s for s, n in zip(array.strides, array.shape, strict=True) if n > 1]
    if any(s == 0 for s in strides):
        return "broadcast"
    if any(s < 0 for s in strides):
        return "negative strides"
    return "strided"


def copied_inputs(layouts) -> tuple[tuple[int, str], ...]:
    """(input index, layout) of each input a plan copies, from the inputs' layouts in order."""
    return tuple((i, word) for i, word in enumerate(layouts) if word != C_ORDER)
