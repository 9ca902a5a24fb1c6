"""The numbers a direct driver reads when it runs, so that one driver serves every batch size.

A size-generic driver (codegen/render/lift.py) reads its sizes, offsets and scales from the
arrays `lit_i` and `lit_f`, and its arguments' shapes change with the batch size. A direct
driver made for one size writes all of them into its code as constants (codegen/build/
direct_driver.py). Made for every size, it reads them (the places: a literal, an argument's
axis) from the arrays when it runs instead; its name then holds none of their values (`key`),
so a new size, in this process or a later one, runs it with no compile. Which numbers differ
between sizes cannot be told from two or three sizes (an arena offset can be 0 at three sizes
and not at a fourth: the layout packs buffers by size), so every one of them is read.

A `Runtime` number keeps its value at the size the driver was read for (the reader checks
views with it) and how to compute it from the driver's arguments; views whose bounds are
runtime numbers are checked again when the driver runs (`Check`), and a check that fails makes
the call run as Python, as a bad label does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    """A number computed when the driver runs: `op` "lit" (operands: the argument and index of
    a lit_i / lit_f read), "dim" (the argument and axis of an array's size), or "neg", "add",
    "sub", "mul", "div" (floor division; 0 where the divisor is 0) of numbers. value: its value
    at the size the driver was read for; floating: a lit_f read or a number made from one."""

    op: str
    operands: tuple
    value: object
    floating: bool = False


@dataclass(frozen=True)
class Check:
    """`low <= high`, checked when the driver runs (a view's bounds at another size)."""

    low: object
    high: object


def value(number):
    """The number at the size the driver was read for."""
    return number.value if isinstance(number, Runtime) else number


def is_runtime(number) -> bool:
    return isinstance(number, Runtime)


def negative(number):
    if not isinstance(number, Runtime):
        return -number
    return Runtime("neg", (number,), -number.value, number.floating)


def combined(op: str, a, b):
    """a op b, a constant where both are; op is add, sub, mul or div (integers)."""
    x, y = value(a), value(b)
    result = {"add": x + y, "sub": x - y, "mul": x * y, "div": x // y if y else 0}[op]
    if not (isinstance(a, Runtime) or isinstance(b, Runtime)):
        return result
    return Runtime(op, (a, b), result)


def product(numbers) -> object:
    total = 1
    for number in numbers:
        total = combined("mul", total, number)
    return total


def varying(seen: list) -> frozenset:
    """The places whose numbers differ between the argument lists `seen` (one per size, as
    direct_driver.described gives them): a driver for every size binds none of them as a
    loop's constant size (its other sizes are bound, and checked when it runs)."""
    places: set = set()
    if len({len(arguments) for arguments in seen}) != 1:
        return frozenset()
    for i, column in enumerate(zip(*seen, strict=True)):
        first = column[0]
        for other in column[1:]:
            places.update(
                ("dim", i, axis)
                for axis, (m, n) in enumerate(zip(first.shape, other.shape, strict=False))
                if m != n
            )
            places.update(
                ("lit", i, k)
                for k, (x, y) in enumerate(
                    zip(first.values or (), other.values or (), strict=False)
                )
                if x != y
            )
    return frozenset(places)


def every_place(arguments: list) -> frozenset:
    """Every literal and every argument size of a driver call (arguments as
    direct_driver.described gives them): a driver reading all of them when it runs is the same
    code at every size, named without any of their values (`key`)."""
    places = set()
    for i, a in enumerate(arguments):
        places.update(("dim", i, axis) for axis in range(len(a.shape)))
        if a.values is not None:
            places.update(("lit", i, k) for k in range(len(a.values)))
    return frozenset(places)


def key(arguments: list, places: frozenset) -> list:
    """What a driver for these arguments, with `places` read when it runs, depends on: each
    argument's shape and literal values, those read when it runs left out (None)."""
    described = []
    for i, a in enumerate(arguments):
        shape = tuple(None if ("dim", i, axis) in places else s for axis, s in enumerate(a.shape))
        values = a.values
        if values is not None:
            values = tuple(None if ("lit", i, k) in places else v for k, v in enumerate(values))
        described.append((shape, a.dtype.str, values))
    return described


class Emitter:
    """Writes Runtime numbers as LLVM values: lit reads from the arrays' data (`data`), sizes
    from each array's dimensions (`items`: each argument's object, an i8 pointer)."""

    def __init__(self, context, builder, items, data):
        self.context, self.builder, self.items, self.data = context, builder, items, data
        # each number computed once: the driver's calls are one chain of blocks, each
        # dominating the ones after it (a failed call leaves the chain for its end)
        self._made: dict = {}

    def integer(self, number):
        """An i64 (intp) value."""
        from numba import types

        if not isinstance(number, Runtime):
            return self.context.get_constant(types.intp, int(number))
        raw = self.raw(number)
        if number.floating:
            return self.builder.fptosi(raw, self.context.get_value_type(types.intp))
        return raw

    def typed(self, number, kind: str, wanted):
        """The number as Numba type `wanted`, made the `kind` the driver's source casts it to
        first (np.float32(lit_f[k]) passed on as a float32)."""
        from numba import types

        raw = self.raw(number)
        have = types.float64 if number.floating else types.intp
        middle = getattr(types, kind)
        return self.context.cast(
            self.builder, self.context.cast(self.builder, raw, have, middle), middle, wanted
        )

    def raw(self, number):
        from numba import types

        if not isinstance(number, Runtime):
            return self.context.get_value_type(types.intp)(int(number))
        made = self._made.get(number)
        if made is None:
            made = self._made[number] = self._computed(number)
        return made

    def _computed(self, number: Runtime):
        from llvmlite import ir
        from numba import types

        builder, intp = self.builder, self.context.get_value_type(types.intp)
        op, operands = number.op, number.operands
        if op == "lit":
            argument, index = operands
            return builder.load(builder.gep(self.data[argument], [intp(index)]))
        if op == "dim":
            argument, axis = operands
            field = builder.gep(self.items[argument], [intp(ARRAY_DIMENSIONS_AT)])
            dims = builder.load(builder.bitcast(field, intp.as_pointer().as_pointer()))
            return builder.load(builder.gep(dims, [intp(axis)]))
        if op == "neg":
            inner = self.raw(operands[0])
            if number.floating:
                return builder.fsub(ir.Constant(inner.type, -0.0), inner)
            return builder.neg(inner)
        a, b = (self.integer(x) for x in operands)
        if op == "add":
            return builder.add(a, b)
        if op == "sub":
            return builder.sub(a, b)
        if op == "mul":
            return builder.mul(a, b)
        zero = builder.icmp_signed("==", b, intp(0))
        quotient = builder.sdiv(a, builder.select(zero, intp(1), b))
        return builder.select(zero, intp(0), quotient)

    def holds(self, checks: list):
        """An i1: every check holds."""
        from llvmlite import ir

        result = ir.Constant(ir.IntType(1), 1)
        for check in checks:
            fits = self.builder.icmp_signed("<=", self.integer(check.low), self.integer(check.high))
            result = self.builder.and_(result, fits)
        return result


# Where NumPy keeps an array's dimensions pointer, in bytes from the object's address
# (PyArrayObject_fields.dimensions; checked with the data pointer, direct_driver._check_layout).
ARRAY_DIMENSIONS_AT = 32
