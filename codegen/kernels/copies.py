"""Shared kernels for the array statements a driver used to hold: filling a buffer with zeros
and copying one array into a strided part of another (the gradient of a slice, the parts of a
concatenation). A setitem into a slice costs about 0.2 s of compile time in every driver that
has one; as kernels they compile once per rank, for every plan.

Each function gives (loop lines, scalars, bases) in the form canonical_kernel takes
(codegen/render/kernel_source.py): arrays as base b<j> and offset o<j>, strides d<j>_<axis> in
bytes.
"""

from __future__ import annotations

import math
from dataclasses import replace

from backplan.codegen.render.placement import Placement, slice_of
from backplan.ir.graph import Value
from backplan.ir.types import np_dtype


def fill_kernel(where: Placement) -> tuple[list[str], dict, dict]:
    """Zeros into a C-contiguous array."""
    count = math.prod(where.shape)
    lines = ["w0 = contiguous_view(b0, o0, (n0,))", "for i0 in range(n0):", "    w0[i0] = 0"]
    return lines, {"n0": count, "o0": where.offset}, {"b0": where.base}


def copy_kernel(
    target: Placement, source: Placement | str, dtype: str
) -> tuple[list[str], dict, dict]:
    """target[...] = source[...], both of the same shape, any strides; source may be a literal
    (its source text), written to every element."""
    itemsize = np_dtype(dtype).itemsize
    rank = len(target.shape)
    sizes = ", ".join(f"n{axis}" for axis in range(rank))
    scalars = {f"n{axis}": size for axis, size in enumerate(target.shape)}
    lines, bases = [], {}
    arrays = (target,) if isinstance(source, str) else (target, source)
    for j, where in enumerate(arrays):
        strides = ", ".join(f"d{j}_{axis}" for axis in range(rank))
        lines.append(f"w{j} = strided_view(b{j}, o{j}, ({sizes},), ({strides},))")
        bases[f"b{j}"] = where.base
        scalars[f"o{j}"] = where.offset
        scalars.update({f"d{j}_{a}": s * itemsize for a, s in enumerate(where.strides)})
    index = ", ".join(f"i{axis}" for axis in range(rank))
    lines += [f"{'    ' * axis}for i{axis} in range(n{axis}):" for axis in range(rank)]
    value = source if isinstance(source, str) else f"w1[{index}]"
    lines.append(f"{'    ' * rank}w0[{index}] = {value}")
    return lines, scalars, bases


def slice_placement(node: Value, where: Placement, shape) -> Placement:
    """Where the slice a pad_slice node writes lies inside its output."""
    return slice_of(node, where, shape)


def part_placement(where: Placement, axis: int, start: int, shape) -> Placement:
    """Where a concatenation's part starting at `start` along `axis` lies in its output."""
    offset = where.offset + start * where.strides[axis]
    return replace(where, offset=offset, shape=tuple(shape))
