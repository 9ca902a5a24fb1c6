"""Builder: appends registry ops to a graph with shape inference; derivative rules use it."""

from __future__ import annotations

import os

from .errors import BackplanError, ShapeError
from .graph import Graph, Value
from .registry import get_op
from .shapes import check_size
from .types import TensorType


def make_value(op: str, inputs, attrs: dict, loc=None) -> Value:
    """Check arity and attributes, infer the type; raises ShapeError naming the op and shapes."""
    opdef = get_op(op)
    opdef.check_arity(len(inputs))
    attrs = opdef.normalize_attrs(attrs)
    try:
        type_ = opdef.infer([i.type for i in inputs], attrs)
        check_size(type_.shape)
    except (ShapeError, BackplanError) as exc:
        kinds = ", ".join(str(i.type) for i in inputs)
        where = f" at {_where(loc)}" if loc else ""
        raise type(exc)(f"{op}({kinds}): {exc}{where}") from None
    return Value(op, inputs, attrs, type_, loc)


def _where(loc) -> str:
    """The user's line as every other error names it (runtime/location.loc_text: the file's
    name, and the user functions it went through), not the file's full path."""
    text = getattr(loc, "text", None)
    return text if text is not None else f"{os.path.basename(loc[0])}:{loc[1]}"


class Builder:
    """`b.mul(x, y)` appends a mul node; every registry op is a method."""

    def __init__(self, graph: Graph, loc=None):
        self.graph = graph
        self.loc = loc

    def emit(self, op: str, *inputs: Value, **attrs) -> Value:
        value = make_value(op, inputs, attrs, self.loc)
        self.graph.nodes.append(value)
        return value

    def __getattr__(self, name: str):
        get_op(name)
        return lambda *inputs, **attrs: self.emit(name, *inputs, **attrs)

    def scalar(self, value, dtype: str) -> Value:
        return self.emit("full", value=value, shape=(), dtype=dtype)

    def zeros(self, type_: TensorType) -> Value:
        return self.emit("full", value=0, shape=type_.shape, dtype=type_.dtype)

    def sum_to(self, value: Value, shape: tuple[int, ...]) -> Value:
        """Sum a broadcast cotangent back to an operand's shape."""
        if value.shape == shape:
            return value
        lead = len(value.shape) - len(shape)
        axes = list(range(lead))
        axes += [lead + i for i, d in enumerate(shape) if d == 1 and value.shape[lead + i] != 1]
        summed = self.sum(value, axes=tuple(axes), keepdims=True) if axes else value
        return summed if summed.shape == shape else self.reshape(summed, shape=shape)

    def swap_last2(self, value: Value) -> Value:
        perm = list(range(len(value.shape)))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return self.transpose(value, perm=tuple(perm))

    def keepdims_like(self, value: Value, axes: tuple[int, ...], ndim: int) -> Value:
        """Reshape a reduced value so it broadcasts against the unreduced operand."""
        if len(value.shape) == ndim:
            return value  # reduced with keepdims=True: already broadcasts
        shape, it = [], iter(value.shape)
        for axis in range(ndim):
            shape.append(1 if axis in axes else next(it))
        return value if tuple(shape) == value.shape else self.reshape(value, shape=tuple(shape))


class VjpContext:
    """What a derivative rule may see. input(i)/output() are the only ways to reach forward values,
    and each use is recorded as a saved value with the reason."""

    def __init__(self, node: Value, builder: Builder, lookup, needs: list[bool]):
        self.node = node
        self.b = builder
        self.attrs = node.attrs
        self.needs = needs
        self._lookup = lookup

    def input(self, i: int) -> Value:
        return self._lookup(self.node.inputs[i], f"{self.node.op} derivative reads input {i}")

    def output(self) -> Value:
        return self._lookup(self.node, f"{self.node.op} derivative reads its output")

    def in_type(self, i: int) -> TensorType:
        return self.node.inputs[i].type

    @property
    def out_type(self) -> TensorType:
        return self.node.type
