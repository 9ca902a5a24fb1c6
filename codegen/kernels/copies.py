"""pad_slice and concatenate, as shared loop kernels for the array statements a driver used
to hold: filling a buffer with zeros and copying one array into a strided part of another (the
gradient of a slice, the parts of a concatenation). A setitem into a slice costs about 0.2 s
of compile time in every driver that has one; as kernels they compile once per rank, for every
plan.

Each function gives (loop lines, scalars, bases) in the form canonical_kernel takes
(codegen/render/kernel_source.py): arrays as base b<j> and offset o<j>, strides d<j>_<axis> in
bytes.
"""

from __future__ import annotations

import math
from dataclasses import replace

from backplan.codegen.render.loops import internal_shape
from backplan.codegen.render.opaque import OpEmitter, emits
from backplan.codegen.render.placement import Placement, slice_of
from backplan.ir.fusion import alias_base
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


@emits("pad_slice")
def emit_pad_slice(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    value = node.inputs[0]
    if ctx.kernel_call is not None and node.shape:
        where = ctx.place(node)
        target = slice_placement(node, where, internal_shape(value.shape))
        source = ctx.literal_of(alias_base(value)) or ctx.place(value)
        fill = ctx.kernel_call(*fill_kernel(where))
        return [fill, ctx.kernel_call(*copy_kernel(target, source, node.dtype))]
    slices = ", ".join(
        f"{a}:{'' if b < 0 else b}:{c}"
        for a, b, c in zip(
            node.attrs["starts"], node.attrs["stops"], node.attrs["steps"], strict=True
        )
    )
    return [f"{out}[:] = 0", f"{out}[{slices}] = {ctx.array(node.inputs[0], False)}"]


@emits("concatenate")
def emit_concatenate(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    """Each part copied into its slice of the output: no temporary."""
    axis, lines, offset = node.attrs["axis"], [], 0
    if ctx.kernel_call is not None:
        where = ctx.place(node)
        for value in node.inputs:
            target = part_placement(where, axis, offset, internal_shape(value.shape))
            source = ctx.literal_of(alias_base(value)) or ctx.place(value)
            lines.append(ctx.kernel_call(*copy_kernel(target, source, node.dtype)))
            offset += value.shape[axis]
        return lines
    for value in node.inputs:
        size = value.shape[axis]
        index = ", ".join([":"] * axis + [f"{offset}:{offset + size}"])
        lines.append(f"{out}[{index}] = {ctx.array(value, contiguous=False)}")
        offset += size
    return lines


__all__: list[str] = []  # loop kernels made per plan (canonical_kernel), nothing to import
