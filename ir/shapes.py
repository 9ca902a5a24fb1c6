"""Shape arithmetic shared by the registry's shape rules."""

from .errors import ShapeError
from .registry import MAX_ELEMENTS


def fmt(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    ndim = max(len(s) for s in shapes)
    out = []
    for axis in range(ndim):
        sizes = {s[axis - ndim + len(s)] for s in shapes if axis - ndim + len(s) >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            raise ShapeError(
                "shapes " + ", ".join(fmt(s) for s in shapes) + " cannot be broadcast together"
            )
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ShapeError(f"axis {axis} is out of range for a tensor with {ndim} dimension(s)")
    return axis % ndim


def normalize_axes(axes, ndim: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, int):
        axes = (axes,)
    out = tuple(sorted({normalize_axis(a, ndim) for a in axes}))
    if len(out) != len(tuple(axes)):
        raise ShapeError(f"repeated axis in {tuple(axes)}")
    return out


def reduced_shape(shape, axes, keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def check_size(shape) -> None:
    n = 1
    for d in shape:
        n *= d
    if n > MAX_ELEMENTS:
        raise ShapeError(f"shape {fmt(shape)} has {n} elements, more than backplan accepts")
