"""The node's sum of one bucket over the ranks' window buffers, in one pass: the last addition
and the averaging (a product with 1/N for a power of two, else a division by N: rows.
average_in_place's rounding) in one loop, so the summed bucket is written once and not read
back to be scaled. The same bits as NumPy's add followed by average_in_place: every element is
added in rank order and rounded, then scaled and rounded, in the buffers' dtype. The bench mlp's
2.7 MB: 0.092 ms as add then multiply, 0.067 ms fused (one process, one core, in cache)."""

from __future__ import annotations

import numpy as np
from numba import njit

from .half_sum import (
    BFLOAT16,
    CHUNK,
    FLOAT16,
    _round_bfloat16,
    _round_float16,
    _widen_bfloat16,
    _widen_float16,
)

CHUNK_IN_PLACE = 1 << 14  # elements summed at once in scratch by sum_in_place (L2-sized)
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
    how, factor = _averaging(size, average, out.dtype)
    if size == 2:
        _add(buffers[0], buffers[1], out, how, factor)
        return
    np.add(buffers[0], buffers[1], out=out)
    for buffer in buffers[2:-1]:
        out += buffer
    _add(out, buffers[-1], out, how, factor)


def sum_in_place(buffers: list[np.ndarray], rank: int, average: bool) -> None:
    """buffers[rank] = the sum of buffers in rank order (sum_into's bits), averaged when
    average, written over that rank's own buffer: on two ranks one pass that reads each
    element before it writes it; on more, in chunks summed in scratch, so that buffers[rank]
    is read before it is written."""
    out = buffers[rank]
    if len(buffers) == 2 or out.size == 0:
        sum_into(buffers, out, average)
        return
    how, factor = _averaging(len(buffers), average, out.dtype)
    scratch = np.empty(min(out.size, CHUNK_IN_PLACE), out.dtype)
    for start in range(0, out.size, scratch.size):
        stop = min(out.size, start + scratch.size)
        part = scratch[: stop - start]
        np.add(buffers[0][start:stop], buffers[1][start:stop], out=part)
        for buffer in buffers[2:-1]:
            part += buffer[start:stop]
        _add(part, buffers[-1][start:stop], out[start:stop], how, factor)


@njit(nogil=True, cache=True)
def _add_widened(bits, out, kind, first, weighted, weight, how, factor):
    """out (float32) = bits widened to float32 (bfloat16 or float16 bit patterns, kind), times
    weight when weighted (0 for a weight of 0: rows.scale_by_weight's fill), added to out
    unless first, then * factor or / factor (how); in chunks widened into L1 scratch, each
    case its own branch-free loop (one loop testing them per element ran ~5x slower)."""
    words = np.empty(CHUNK, np.uint32)
    values = words.view(np.float32)
    for start in range(0, out.size, CHUNK):
        m = min(CHUNK, out.size - start)
        if kind == BFLOAT16:
            _widen_bfloat16(bits[start : start + m], words[:m])
        else:
            _widen_float16(bits[start : start + m], words[:m])
        if weighted:
            _scale(values[:m], weight)
        o = out[start : start + m]
        if first:
            if how == TIMES:
                for j in range(m):
                    o[j] = values[j] * factor
            elif how == DIVIDED:
                for j in range(m):
                    o[j] = values[j] / factor
            else:
                for j in range(m):
                    o[j] = values[j]
        elif how == TIMES:
            for j in range(m):
                o[j] = (o[j] + values[j]) * factor
        elif how == DIVIDED:
            for j in range(m):
                o[j] = (o[j] + values[j]) / factor
        else:
            for j in range(m):
                o[j] = o[j] + values[j]


@njit(nogil=True, cache=True)
def _scale(values, weight):
    """values * weight, or 0 for a weight of 0 (rows.scale_by_weight's fill)."""
    if weight == 0:
        values[:] = np.float32(0.0)
    else:
        for j in range(values.size):
            values[j] = values[j] * weight


def sum_widened_into(
    buffers: list[np.ndarray], out: np.ndarray, half: str, average: bool, weights=None
) -> None:
    """out (float32) = the sum of buffers (each rank's bfloat16 or float16 bit patterns, uint16;
    half: "bf16" or "f16") widened to float32, in rank order, each first scaled by its rank's
    weight when ranks hold different rows (weights), divided by their number when average:
    the bits of widening every rank's values, scaling them (rows.scale_by_weight), adding them
    up and averaging (sum_into), with no float32 copy of any rank's bucket."""
    size = len(buffers)
    how, factor = _averaging(size, average, np.dtype(np.float32))
    kind = BFLOAT16 if half == "bf16" else FLOAT16
    for q, buffer in enumerate(buffers):
        weight = np.float32(weights[q] if weights is not None else 1.0)
        last = q == size - 1
        _add_widened(
            buffer,
            out,
            kind,
            q == 0,
            weights is not None,
            weight,
            how if last else PLAIN,
            factor if last else np.float32(1.0),
        )


def sum_widened_in_place(
    buffers: list[np.ndarray], rank: int, half: str, average: bool, weights=None
) -> None:
    """buffers[rank] (16-bit bit patterns, uint16) = sum_widened_into's float32 sum of buffers
    rounded to the 16-bit dtype (half: "bf16" or "f16"), written over that rank's own buffer:
    chunk by chunk, every rank's chunk widened and added in float32 before the sum is rounded
    into its place. The bits of sum_widened_into followed by astype(half), as when summed whole
    (a NaN's payload aside: this rounding keeps it, ml_dtypes' astype makes it canonical)."""
    out = buffers[rank]
    if out.size == 0:  # a rank with no page of a small bucket
        return
    how, factor = _averaging(len(buffers), average, np.dtype(np.float32))
    scale = np.ones(len(buffers), np.float32) if weights is None else np.float32(weights)
    kind = BFLOAT16 if half == "bf16" else FLOAT16
    _sum_widened_rounded(tuple(buffers), out, kind, weights is not None, scale, how, factor)


@njit(nogil=True, cache=True)
def _sum_widened_rounded(buffers, out, kind, weighted, weights, how, factor):
    """out (bit patterns; may be one of buffers) = the buffers (a tuple, one per rank) widened
    to float32, each times its weight when weighted, added in rank order, the last addition
    then * or / factor (how), rounded to the 16-bit dtype: _add_widened's bits rounded once,
    in branch-free loops over L1 chunks (the per-element tests ran ~5x slower)."""
    words_x = np.empty(CHUNK, np.uint32)
    words_y = np.empty(CHUNK, np.uint32)
    x, y = words_x.view(np.float32), words_y.view(np.float32)
    last = len(buffers) - 1
    for start in range(0, out.size, CHUNK):
        m = min(CHUNK, out.size - start)
        _widen(kind, buffers[0][start : start + m], words_x[:m])
        if weighted:
            _scale(x[:m], weights[0])
        for q in range(1, last + 1):
            _widen(kind, buffers[q][start : start + m], words_y[:m])
            if weighted:
                _scale(y[:m], weights[q])
            if q == last and how == TIMES:
                for j in range(m):
                    x[j] = (x[j] + y[j]) * factor
            elif q == last and how == DIVIDED:
                for j in range(m):
                    x[j] = (x[j] + y[j]) / factor
            else:
                for j in range(m):
                    x[j] = x[j] + y[j]
        if kind == BFLOAT16:
            _round_bfloat16(words_x[:m], out[start : start + m])
        else:
            _round_float16(words_x[:m], out[start : start + m])


@njit(nogil=True, cache=True)
def _widen(kind, halves, words):
    if kind == BFLOAT16:
        _widen_bfloat16(halves, words)
    else:
        _widen_float16(halves, words)


def _averaging(size: int, average: bool, dtype: np.dtype) -> tuple[int, object]:
    """(how, factor) of rows.average_in_place's rounding for `size` ranks, in dtype."""
    if not average:
        return PLAIN, dtype.type(1)
    if size & (size - 1) == 0:
        return TIMES, dtype.type(1.0 / size)
    return DIVIDED, dtype.type(size)
