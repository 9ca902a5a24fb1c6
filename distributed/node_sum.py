"""The node's sum of one bucket over the ranks' window buffers, in one pass: the last addition
and the averaging (a product with 1/N for a power of two, else a division by N: rows.
average_in_place's rounding) in one loop, so the summed bucket is written once and not read
back to be scaled. The same bits as NumPy's add followed by average_in_place: every element is
added in rank order and rounded, then scaled and rounded, in the buffers' dtype. The bench mlp's
2.7 MB: 0.092 ms as add then multiply, 0.067 ms fused (one process, one core, in cache)."""

from __future__ import annotations

import numpy as np
from numba import njit

PLAIN, TIMES, DIVIDED = 0, 1, 2  # what is done to each sum: nothing, * factor, / factor


@njit(nogil=True, cache=True)
def _add(a, b, out, how, factor):
    """out[i] = a[i] + b[i], then * factor or / factor (how), each rounded in out's dtype."""
    if how == TIMES:
        for i in range(out.size):
            out[i] = (a[i] + b[i]) * factor
    elif how == DIVIDED:
        for i in range(out.size):
            out[i] = (a[i] + b[i]) / factor
    else:
        for i in range(out.size):
            out[i] = a[i] + b[i]


def sum_into(buffers: list[np.ndarray], out: np.ndarray, average: bool) -> None:
    """out = the sum of buffers (one per rank, at least two) in rank order, divided by their
    number when average (as rows.average_in_place divides)."""
    size = len(buffers)
    how, factor = PLAIN, out.dtype.type(1)
    if average:
        power_of_two = size & (size - 1) == 0
        how = TIMES if power_of_two else DIVIDED
        factor = out.dtype.type(1.0 / size) if power_of_two else out.dtype.type(size)
    if size == 2:
        _add(buffers[0], buffers[1], out, how, factor)
        return
    np.add(buffers[0], buffers[1], out=out)
    for buffer in buffers[2:-1]:
        out += buffer
    _add(out, buffers[-1], out, how, factor)
