"""x[key]: basic indexing becomes slice + reshape; integer arrays become take (gather)."""

from __future__ import annotations

import math

import numpy as np

from backplan.ir.errors import ShapeError

from . import ops
from .source import located
from .tensor import Tensor


@located
def getitem(x: Tensor, key) -> Tensor:
    key = _expand(key if isinstance(key, tuple) else (key,), x.ndim)
    starts, stops, steps, keep_shape = [], [], [], []
    arrays = []  # (axis in the sliced tensor, index tensor)
    axis = 0
    for item in key:
        if item is None:
            keep_shape.append(1)
            continue
        dim = x.shape[axis]
        if isinstance(item, slice):
            start, stop, step = item.indices(dim)
            if not range(start, stop, step):  # empty, as x[::-1] of a size-0 axis: (-1, -1, -1)
                start, stop, step = 0, 0, 1
            starts.append(start)
            stops.append(stop)
            steps.append(step)
            keep_shape.append(len(range(start, stop, step)))
        elif isinstance(item, float | np.floating):
            raise IndexError(
                f"index {item!r} on axis {axis} is a float; indices are integers, slices, None, "
                "..., or integer arrays and tensors"
            )
        elif _is_int(item):
            index = int(item)
            if not -dim <= index < dim:
                raise IndexError(f"index {index} is out of range for axis {axis} of size {dim}")
            index %= dim
            starts.append(index)
            stops.append(index + 1)
            steps.append(1)
        else:
            arrays.append((len(starts), len(keep_shape), ops._index_tensor(item)))
            starts.append(0)
            stops.append(dim)
            steps.append(1)
            keep_shape.append(dim)
        axis += 1
    out = x
    if (tuple(starts), tuple(stops), tuple(steps)) != ((0,) * x.ndim, x.shape, (1,) * x.ndim):
        out = _slice(x, starts, stops, steps)
    out = ops.reshape(out, tuple(keep_shape))
    return _gather(out, arrays) if arrays else out


def _slice(x, starts, stops, steps):
    from .dispatch import apply

    return apply("slice", [x], starts=tuple(starts), stops=tuple(stops), steps=tuple(steps))


def _gather(out: Tensor, arrays) -> Tensor:
    positions = [pos for _, pos, _ in arrays]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise IndexError(
            "integer-array indices must be next to each other (x[:, i, j], not x[i, :, j])"
        )
    first = positions[0]
    if len(arrays) == 1:
        return ops.take(out, arrays[0][2], axis=first)
    sizes = [out.shape[p] for p in positions]
    merged = ops.reshape(
        out, out.shape[:first] + (math.prod(sizes),) + out.shape[first + len(sizes) :]
    )
    flat = None
    for size_after, (_, pos, index) in zip(_strides(sizes), arrays, strict=True):
        dim = out.shape[pos]
        index = ops.where(ops.less(index, 0), ops.add(index, dim), index)
        term = ops.mul(index, size_after)
        flat = term if flat is None else ops.add(flat, term)
    return ops.take(merged, flat, axis=first)


def _strides(sizes):
    strides, acc = [], 1
    for size in reversed(sizes):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def _is_int(item) -> bool:
    return isinstance(item, int | np.integer) and not isinstance(item, bool)


def _expand(key: tuple, ndim: int) -> tuple:
    if any(isinstance(k, bool) for k in key):
        raise IndexError("boolean indices are not supported; use bp.where")
    if any(isinstance(k, list) for k in key):
        key = tuple(np.asarray(k) if isinstance(k, list) else k for k in key)
    ellipses = [i for i, k in enumerate(key) if k is Ellipsis]
    if len(ellipses) > 1:
        raise IndexError("an index can only have a single ellipsis")
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if used > ndim:
        raise ShapeError(f"too many indices ({used}) for a tensor with {ndim} dimension(s)")
    fill = (slice(None),) * (ndim - used)
    if ellipses:
        i = ellipses[0]
        return key[:i] + fill + key[i + 1 :]
    return key + fill
