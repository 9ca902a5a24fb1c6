"""Where each array of a plan lives, as (1-D base array, element offset, shape, strides), so a
kernel can take the base and a few integers and make its own views: the plan's driver then
holds no slicing or reshaping of its own, and compiles faster (Numba lowers every view the
driver makes anew, about 10 ms each, and a setitem into a slice about 0.2 s).

A base is a scratch arena (`scratch_f32`) or a whole C-contiguous array the driver was given
(an input, an output buffer, a constant), seen as 1-D. Views (reshape, transpose, slice,
broadcast) only move the offset and change shape and strides.
"""

from __future__ import annotations

from dataclasses import dataclass

from backplan.ir.fusion import internal_shape
from backplan.ir.graph import Value
from backplan.ir.layout import BufferLayout


@dataclass(frozen=True)
class Placement:
    base: str  # a 1-D array in the driver
    offset: int  # elements
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # elements

    @property
    def contiguous(self) -> bool:
        """C-contiguous: the view is base[offset:offset + size].reshape(shape). (A loop's
        accesses ask it once each: loops.Access.strided.)"""
        if 0 in self.shape:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Each axis's C-order stride in elements: the product of the sizes after it (one pass
    from the last axis: a new size's rendering asks this ~300 times)."""
    strides, step = [0] * len(shape), 1
    for k in range(len(shape) - 1, -1, -1):
        strides[k] = step
        step *= shape[k]
    return tuple(strides)


class Placer:
    """Placements of a plan's values. `define(name, line)` records a driver statement that a
    later statement may need (a whole array seen as 1-D); the driver emits it before first use."""

    def __init__(self, layout: BufferLayout, names: dict, whole: set, define):
        self.layout = layout
        self.names = names
        self.whole = whole  # values whose driver variable is a whole C-contiguous array
        self.define = define

    def place(self, value: Value, flat: bool = True) -> Placement:
        """flat=False: a whole array the driver was given may stay as it is (any number of
        dimensions), for library functions that see it as 1-D themselves."""
        shape = internal_shape(value.shape)
        offset = self.layout.scratch_offsets.get(value)
        if offset is not None:
            return Placement(f"scratch_{value.dtype}", offset, shape, c_strides(shape))
        home = self.layout.reused_saved.get(value)
        if home is not None:
            start = self.place(home, flat)
            return Placement(start.base, start.offset, shape, c_strides(shape))
        if value in self.whole or value.op not in VIEWS:
            return Placement(self.flat(value, flat), 0, shape, c_strides(shape))
        derived = VIEWS[value.op](value, self.place(value.inputs[0], flat), shape)
        if derived is None:
            return Placement(self.flat(value, flat), 0, shape, c_strides(shape))
        return derived

    def flat(self, value: Value, flat: bool = True) -> str:
        """The 1-D name of a value's own driver variable (a contiguous copy if it is not)."""
        name = self.names[value]
        if value in self.whole and (not flat or len(internal_shape(value.shape)) == 1):
            return name
        expr = name if value in self.whole else f"np.ascontiguousarray({name})"
        self.define(f"{name}_1d", f"{name}_1d = {expr}.reshape(-1)")
        return f"{name}_1d"


def _reshape(node: Value, source: Placement, shape) -> Placement | None:
    if source.contiguous:
        return Placement(source.base, source.offset, shape, c_strides(shape))
    kept = iter([s for n, s in zip(source.shape, source.strides, strict=True) if n != 1])
    if [n for n in source.shape if n != 1] != [n for n in shape if n != 1]:
        return None  # merges strided axes: no single stride per axis
    strides = tuple(next(kept) if n != 1 else 0 for n in shape)
    return Placement(source.base, source.offset, shape, strides)


def _transpose(node: Value, source: Placement, shape) -> Placement:
    perm = node.attrs["perm"] if node.shape else (0,)
    return Placement(source.base, source.offset, shape, tuple(source.strides[p] for p in perm))


def slice_of(node: Value, source: Placement, shape) -> Placement:
    starts, steps = node.attrs["starts"], node.attrs["steps"]
    offset = source.offset + sum(a * s for a, s in zip(starts, source.strides, strict=True))
    strides = tuple(c * s for c, s in zip(steps, source.strides, strict=True))
    return Placement(source.base, offset, shape, strides)


def _broadcast(node: Value, source: Placement, shape) -> Placement:
    shift = len(shape) - len(source.shape)
    strides = [0] * shift + [
        0 if n == 1 and shape[k + shift] != 1 else s
        for k, (n, s) in enumerate(zip(source.shape, source.strides, strict=True))
    ]
    return Placement(source.base, source.offset, shape, tuple(strides))


VIEWS = {
    "reshape": _reshape,
    "transpose": _transpose,
    "slice": slice_of,
    "broadcast_to": _broadcast,
}
