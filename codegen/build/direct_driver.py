"""A plan's driver compiled in a fraction of a second: its statements emitted as LLVM IR directly.

A compiled driver is straight-line calls: loops by the address of their entry, library
functions (GEMM, rows, conv...) on array views of the arena at constant offsets. Numba spends
10-55 ms typing and lowering each such statement (BENCHMARKS.md, 31), so a 200-statement driver
took 7-15 CPU s in a background process, and a short script never ran it. Here the driver's
source (the text the Python-run driver runs) is read statement by statement (`plan`) into calls
whose arguments are constants or views of the driver's arguments, and one LLVM function is
emitted that makes those calls (Numba's native calling convention and array structures, each
callee's own compiled code by the symbol codegen/build/native_calls.py or loop_calls.py
publishes for it), optimised at level 1: no Numba typing, lowering or CPython wrapper. It
takes the tuple of the driver's arguments through ctypes and reads each array's data pointer
where CPython and NumPy keep them (checked once per process).

A size-generic driver (one driver for every batch size of a symbolic plan,
codegen/render/lift.py) reads its sizes, offsets and scales from the arrays `lit_i` and
`lit_f`: their values at this plan's size are written into the code as constants, as the
shapes of its arguments are (a direct driver is made for one size).

Anything the reader does not know (a statement other than a call, a view, a label check or a
split driver's part) makes the plan `Unsupported`: the plan keeps its
Python-run driver and its background build as before. A label check that fails (`bad != -1`),
or a callee returning an error status, makes the compiled call return, and the call is run
again by the Python-run driver, which raises the error with its message (the calls before it
wrote only the plan's own buffers).

The driver is made for calls like the plan's first, once per process, and kept in the cache
folder as a signed object file (as loop batches are, codegen/build/loop_batch.py), named by a
digest of what its code depends on; a later process loads it, each callee's symbol published
first (cache_signing.ready_to_load). CompiledPlan calls it only with arguments of those types
and shapes (a plan is made for one signature).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import threading
from dataclasses import dataclass, field, replace

import numpy as np

from backplan.codegen.build import loop_calls, native_calls
from backplan.codegen.build.driver_numbers import (
    ARRAY_DIMENSIONS_AT,
    Check,
    Emitter,
    Runtime,
    combined,
    is_runtime,
    negative,
    product,
)
from backplan.codegen.build.driver_numbers import key as places_key
from backplan.codegen.build.driver_numbers import value as at_size


class Unsupported(Exception):
    """The driver has a statement this reader does not emit."""


@dataclass(frozen=True)
class View:
    """A C-contiguous view of driver argument `argument`'s buffer: `offset` elements in (the
    offset and sizes: numbers, or Runtime numbers a driver for every size reads)."""

    argument: int
    offset: int
    shape: tuple
    read_only: bool
    dtype: np.dtype | None = None  # .view(np.int16) of a float16 buffer; None: the argument's


@dataclass(frozen=True)
class Scalar:
    """A constant argument: `kind` is its Numba type's name (int64, float32, boolean...)."""

    kind: str
    value: object


@dataclass
class Call:
    """One call of the driver: `callee` an AddressCall (a loop) or a library dispatcher;
    `checked`: its result must be -1 (a label or index check) or the call fails; `checks`:
    bounds of its views the driver checks before calling (driver_numbers.Check)."""

    callee: object
    arguments: list
    checked: bool
    line: int
    checks: list = field(default_factory=list)


_REINTERPRETED = ("int16", "uint16", "int32", "uint32", "int64", "uint64", "float16")
_NUMPY_SCALARS = {
    "float32": "float32", "float64": "float64", "intp": "int64", "int64": "int64",
    "int32": "int32", "bool_": "boolean",
}  # fmt: skip


@dataclass(frozen=True)
class Argument:
    """What the direct driver knows of an argument of `run`: a C-contiguous array."""

    shape: tuple
    dtype: np.dtype
    read_only: bool
    values: tuple | None = None  # a size-generic driver's lit_i / lit_f: their numbers


def described(arrays: list, literals: int = 0) -> list[Argument]:
    """The arguments of a driver call, as a direct driver for calls like it is built; Unsupported
    where one is not a C-contiguous array. literals: how many of the last arrays are a
    size-generic driver's numbers (lit_i, lit_f), whose values the driver is made for."""
    if not all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays):
        raise Unsupported("an argument is not a C-contiguous array")
    first = len(arrays) - literals
    return [
        Argument(a.shape, a.dtype, not a.flags.writeable, tuple(a.tolist()) if i >= first else None)
        for i, a in enumerate(arrays)
    ]


def plan(
    source: str, scope: dict, arrays: list[Argument], places: frozenset = frozenset()
) -> list[Call]:
    """The calls of the generated module's `run`, in order, for a call with these arguments.
    scope: the module's namespace (loops as their Python-run AddressCall, library functions
    as their dispatchers). places: the literals and argument sizes read when the driver runs
    (driver_numbers.every_place); every other number is this call's."""
    tree = ast.parse(source)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    run = functions.get("run")
    if run is None:
        raise Unsupported("no run function")
    names = [a.arg for a in run.args.args]
    if len(names) != len(arrays) or run.args.vararg or run.args.kwonlyargs:
        raise Unsupported("run's parameters are not the call's arrays")
    reader = _Reader(scope, functions, arrays, places)
    reader.local = {
        name: View(i, 0, _sizes(i, a.shape, places), a.read_only)
        for i, (name, a) in enumerate(zip(names, arrays, strict=True))
    }
    reader.body(run.body)
    if reader.returned:  # outputs that are views of its arguments: the caller reads them back
        raise Unsupported(f"run returns {len(reader.returned)} arrays (outputs it does not write)")
    return reader.calls


def _sizes(argument: int, shape: tuple, places: frozenset) -> tuple:
    return tuple(
        Runtime("dim", (argument, axis), size) if ("dim", argument, axis) in places else size
        for axis, size in enumerate(shape)
    )


class _Reader:
    def __init__(
        self, scope: dict, functions: dict, arrays: list[Argument] = (), places=frozenset()
    ):
        self.scope = scope
        self.arrays = arrays  # the call's arguments (lit_i / lit_f with their values)
        self.places = places  # what is read when the driver runs (every_place)
        self.checks: list = []  # bounds to check before the next call
        self.functions = functions  # a split driver's parts (codegen/render/driver_split.py)
        self.local: dict = {}
        self.calls: list[Call] = []
        self.returned = None  # what a part's return statement names

    def body(self, statements: list) -> None:
        skip = False
        for index, node in enumerate(statements):
            if skip:
                skip = False
                continue
            following = statements[index + 1] if index + 1 < len(statements) else None
            skip = self.statement(node, following)

    def statement(self, node, following) -> bool:
        """Read one statement; True when it read the next one too (a label check)."""
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            if not self.part(node.value, []):
                self.calls.append(self.call(node.value, checked=False))
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            if not all(isinstance(t, ast.Name) for t in names):
                raise Unsupported(f"line {node.lineno}: assignment to {ast.unparse(target)}")
            if isinstance(node.value, ast.Call) and self.part(node.value, names):
                return False
            if not isinstance(target, ast.Name):
                raise Unsupported(f"line {node.lineno}: assignment to {ast.unparse(target)}")
            if target.id == "bad" and isinstance(node.value, ast.Call):
                call = self.call(node.value, checked=_is_label_check(following))
                if call.checked:
                    self.minus_one(following, call)
                self.calls.append(call)
                self.local["bad"] = call  # a split driver checks it in its next part
                return call.checked
            value = self.value(node.value)
            if not isinstance(value, View):
                raise Unsupported(f"line {node.lineno}: {target.id} is not an array view")
            self.local[target.id] = value
        elif _is_label_check(node) and isinstance(self.local.get("bad"), Call):
            self.local["bad"].checked = True
            self.minus_one(node, self.local["bad"])
        elif (
            isinstance(node, ast.Return)
            and isinstance(node.value, ast.Call)
            and self.part(node.value, [])
        ):
            self.returned = []  # the last part returns nothing
        elif isinstance(node, ast.Return) and node.value is not None and not _is_none(node.value):
            returned = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            self.returned = [self.value(v) for v in returned]
        elif not isinstance(node, (ast.Pass, ast.Return)):
            raise Unsupported(f"line {node.lineno}: {type(node).__name__} statement")
        return False

    def minus_one(self, check: ast.If, call: Call) -> None:
        """A label check compares with -1, written `-lit_i[k]` in a size-generic driver: the
        code compares with -1, so where k is read when it runs, the call checks it is 1."""
        number = self.value(check.test.comparators[0])
        if not isinstance(number, Scalar) or at_size(number.value) != -1:
            raise Unsupported(f"line {check.lineno}: {ast.unparse(check.test)}")
        if is_runtime(number.value):
            call.checks += [Check(number.value, -1), Check(-1, number.value)]

    def part(self, node: ast.Call, targets: list) -> bool:
        """Read a call of a split driver's part in place (its parameters bound to the values
        passed, what it returns to the names assigned); False for any other call."""
        if not (isinstance(node.func, ast.Name) and node.func.id.startswith("run_part")):
            return False
        function = self.functions.get(node.func.id)
        if function is None or node.keywords or function.args.vararg:
            raise Unsupported(f"line {node.lineno}: a call of {node.func.id}")
        parameters = [a.arg for a in function.args.args]
        if len(parameters) != len(node.args):
            raise Unsupported(f"line {node.lineno}: {node.func.id} with other arguments")
        values = [self.value(a) for a in node.args]
        outer, self.returned = self.local, None
        self.local = dict(zip(parameters, values, strict=True))
        self.body(function.body)
        returned, self.local, self.returned = self.returned or [], outer, None
        if len(returned) != len(targets):
            raise Unsupported(f"line {node.lineno}: {node.func.id} returns {len(returned)}")
        for target, value in zip(targets, returned, strict=True):
            self.local[target.id] = value
        return True

    def call(self, node: ast.Call, checked: bool) -> Call:
        if not isinstance(node.func, ast.Name) or node.keywords:
            raise Unsupported(f"line {node.lineno}: call of {ast.unparse(node.func)}")
        if node.func.id.startswith("run"):
            raise Unsupported(f"line {node.lineno}: a call of {node.func.id}")
        callee = native_calls.unwrapped(self.scope.get(node.func.id))
        if node.func.id.startswith("k_"):
            from backplan.codegen.build import kernel_cache

            callee = kernel_cache.python_call(callee)
        if not (hasattr(callee, "_kinds") or hasattr(callee, "overloads")):
            raise Unsupported(f"line {node.lineno}: {node.func.id} is not a compiled function")
        arguments = [self.value(a) for a in node.args]
        checks, self.checks = self.checks, []
        return Call(callee, arguments, checked, node.lineno, checks)

    def value(self, node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float)):
            return _constant(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = self.value(node.operand)
            if isinstance(inner, Scalar) and inner.kind != "boolean":
                return Scalar(inner.kind, negative(inner.value))
        if isinstance(node, ast.Name) and node.id in self.local:
            return self.local[node.id]
        if isinstance(node, ast.Call):
            return self.call_value(node)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            return self.sliced(self.value(node.value), node.slice, node)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            return self.literal(self.value(node.value), node.slice.value, node)
        raise Unsupported(f"line {node.lineno}: {ast.unparse(node)}")

    def call_value(self, node: ast.Call):
        func = node.func
        if node.keywords:
            raise Unsupported(f"line {node.lineno}: keyword arguments")
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "np"
            and func.attr in _NUMPY_SCALARS
            and len(node.args) == 1
        ):
            inner = self.value(node.args[0])
            if isinstance(inner, Scalar):
                kind = _NUMPY_SCALARS[func.attr]
                if is_runtime(inner.value):  # cast where it is read (Emitter.typed)
                    return Scalar(kind, inner.value)
                return Scalar(kind, _cast(func.attr, inner.value))
        if isinstance(func, ast.Name) and func.id == "as_read_only" and len(node.args) == 1:
            view = self.value(node.args[0])
            if isinstance(view, View):
                return replace(view, read_only=True)
        if isinstance(func, ast.Attribute) and func.attr == "reshape":
            view = self.value(func.value)
            if isinstance(view, View):
                return self.reshaped(view, node)
        if isinstance(func, ast.Attribute) and func.attr == "view" and len(node.args) == 1:
            view = self.value(func.value)
            if isinstance(view, View):
                return self.reinterpreted(view, node)
        raise Unsupported(f"line {node.lineno}: {ast.unparse(node)}")

    def reinterpreted(self, view: View, node: ast.Call) -> View:
        """`.view(np.int16)` of a float16 buffer (a float16 GEMM reads its bits): the same bytes
        as another dtype of the same item size."""
        name = node.args[0]
        if not (
            isinstance(name, ast.Attribute)
            and isinstance(name.value, ast.Name)
            and name.value.id == "np"
            and name.attr in _REINTERPRETED
        ):
            raise Unsupported(f"line {node.lineno}: {ast.unparse(node)}")
        dtype = np.dtype(name.attr)
        if dtype.itemsize != (view.dtype or self.arrays[view.argument].dtype).itemsize:
            raise Unsupported(f"line {node.lineno}: {ast.unparse(node)} of another item size")
        return replace(view, dtype=dtype)

    def reshaped(self, view: View, node: ast.Call) -> View:
        args = (
            node.args[0].elts
            if len(node.args) == 1 and isinstance(node.args[0], ast.Tuple)
            else node.args
        )
        sizes = [self.value(a) for a in args]
        if not all(isinstance(s, Scalar) and s.kind != "boolean" for s in sizes):
            raise Unsupported(f"line {node.lineno}: reshape to {ast.unparse(node)}")
        if any(s.value.floating for s in sizes if is_runtime(s.value)):
            raise Unsupported(f"line {node.lineno}: reshape to {ast.unparse(node)}")
        shape = [s.value if is_runtime(s.value) else int(s.value) for s in sizes]
        count = product(view.shape)
        inferred = [i for i, s in enumerate(shape) if at_size(s) == -1]
        if len(inferred) == 1:
            if is_runtime(shape[inferred[0]]):  # -1 at this size: check it is at every size
                self.checks += [Check(shape[inferred[0]], -1), Check(-1, shape[inferred[0]])]
            known = product(s for i, s in enumerate(shape) if i != inferred[0])
            shape[inferred[0]] = combined("div", count, known)
        if at_size(product(shape)) != at_size(count):
            raise Unsupported(f"line {node.lineno}: reshape of {view.shape} to {shape}")
        if is_runtime(count) or any(is_runtime(s) for s in shape):
            total = product(shape)
            self.checks += [Check(total, count), Check(count, total)]
        return replace(view, shape=tuple(shape))

    def literal(self, view, index, node) -> Scalar:
        """lit_i[k] or lit_f[k] of a size-generic driver: the number at this plan's size."""
        values = self.arrays[view.argument].values if isinstance(view, View) else None
        if values is None or view.offset != 0 or type(index) is not int:
            raise Unsupported(f"line {node.lineno}: {ast.unparse(node)}")
        if not 0 <= index < len(values):
            raise Unsupported(f"line {node.lineno}: {ast.unparse(node)} of {len(values)}")
        number = values[index]
        if ("lit", view.argument, index) in self.places:
            floating = isinstance(number, float)
            read = Runtime("lit", (view.argument, index), number, floating)
            return Scalar("float64" if floating else "int64", read)
        return Scalar("float64", float(number)) if isinstance(number, float) else _constant(number)

    def sliced(self, view, piece: ast.Slice, node) -> View:
        if not isinstance(view, View) or len(view.shape) != 1 or piece.step is not None:
            raise Unsupported(f"line {node.lineno}: {ast.unparse(node)}")
        low = self.value(piece.lower) if piece.lower is not None else Scalar("int64", 0)
        high = (
            self.value(piece.upper) if piece.upper is not None else Scalar("int64", view.shape[0])
        )
        if not (isinstance(low, Scalar) and isinstance(high, Scalar)):
            raise Unsupported(f"line {node.lineno}: {ast.unparse(node)}")
        if any(is_runtime(s.value) and s.value.floating for s in (low, high)):
            raise Unsupported(f"line {node.lineno}: {ast.unparse(node)}")
        low_at, high_at = (s.value if is_runtime(s.value) else int(s.value) for s in (low, high))
        if not 0 <= at_size(low_at) <= at_size(high_at) <= at_size(view.shape[0]):
            raise Unsupported(f"line {node.lineno}: slice {low_at}:{high_at} of {view.shape}")
        if any(map(is_runtime, (low_at, high_at, view.shape[0]))):  # in bounds at every size
            self.checks += [Check(0, low_at), Check(low_at, high_at), Check(high_at, view.shape[0])]
        offset = combined("add", view.offset, low_at)
        return replace(view, offset=offset, shape=(combined("sub", high_at, low_at),))


def _constant(value) -> Scalar:
    if isinstance(value, bool):
        return Scalar("boolean", value)
    if isinstance(value, int):
        return Scalar("int64", value)
    return Scalar("float64", value)


def _cast(name: str, value):
    return bool(value) if name == "bool_" else float(value) if "float" in name else int(value)


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _is_label_check(node) -> bool:
    """`if bad != -1: raise ...`: what the driver writes after a call returning a bad label
    (`-lit_i[k]` for the -1 in a size-generic driver, codegen/render/lift.py)."""
    if not isinstance(node, ast.If) or node.orelse:
        return False
    test = node.test
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "bad"
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.NotEq)
        and re.fullmatch(r"-(1|lit_i\[\d+\])", ast.unparse(test.comparators[0])) is not None
        and all(isinstance(s, ast.Raise) for s in node.body)
    )


@dataclass
class _Target:
    """How a call is emitted: the symbol of the callee's entry, its Numba signature, and the
    Numba types of the values the driver passes."""

    symbol: str
    arguments: tuple
    return_type: object
    given: tuple
    guard: tuple = ()  # where these checks fail (sizes read when it runs), `otherwise` is called
    otherwise: str | None = None


def _binds(call: Call) -> bool:
    """Whether the call is a loop a direct driver compiles at its sizes (direct_loops)."""
    from backplan.codegen.build import direct_loops

    if not hasattr(call.callee, "_kinds"):
        return False
    sizes = [int(at_size(call.arguments[i].value)) for i in call.callee._sizes]
    return direct_loops.worth_specialising(sizes)


def _equal(number, expected: int) -> tuple:
    return (Check(number, expected), Check(expected, number))


def _reads(number, places: frozenset) -> bool:
    """Whether a number read when the driver runs reads one of `places`."""
    if not is_runtime(number):
        return False
    if number.op in ("lit", "dim"):
        return (number.op, *number.operands) in places
    return any(_reads(operand, places) for operand in number.operands)


def _targets(
    calls: list[Call], arrays: list[Argument], linked: list, varying=frozenset()
) -> list[_Target]:
    """Each call's callee compiled (or found) and published under its symbol, outside Numba's
    lowering of the driver; a loop with an axis of a few elements compiled at its sizes
    instead (codegen/build/direct_loops.py), its code library added to `linked` (a size read
    when it runs is bound where it reads none of the `varying` places, and checked: at
    another size the loop's own form runs)."""
    from numba import from_dtype, types

    from backplan.codegen.build import direct_loops

    found = []
    for call in calls:
        given = []
        for value in call.arguments:
            if isinstance(value, View):
                dtype = from_dtype(value.dtype or arrays[value.argument].dtype)
                given.append(types.Array(dtype, len(value.shape), "C", readonly=value.read_only))
            else:
                given.append(getattr(types, value.kind))
        given = tuple(given)
        if hasattr(call.callee, "_kinds"):  # a loop: addresses, sizes and float literals
            kinds = tuple(getattr(types, kind[0]) for kind in call.callee._kinds)
            if len(kinds) != len(given) or call.checked:
                raise Unsupported(f"line {call.line}: loop called with {len(given)} arguments")
            for value, kind in zip(call.arguments, kinds, strict=True):
                if (kind == types.voidptr) != isinstance(value, View):
                    raise Unsupported(f"line {call.line}: a loop argument of the wrong kind")
            sizes = {i: call.arguments[i].value for i in call.callee._sizes}
            at = {i: int(at_size(n)) for i, n in sizes.items()}
            # sizes read when it runs that differed between the sizes seen stay parameters
            bound = {i: at[i] for i, n in sizes.items() if not _reads(n, varying)}
            compiled = None
            if bound and direct_loops.worth_specialising(list(at.values())):
                unrolled = direct_loops.strides_lines(list(at.values()))
                compiled = direct_loops.specialised(call.callee, bound, unrolled)  # None: no source
            guard = tuple(c for i in bound if is_runtime(sizes[i]) for c in _equal(sizes[i], at[i]))
            symbol = None
            if compiled is None or guard:
                symbol = loop_calls.publish(call.callee, loop_calls.driver_form(call.callee))
            if compiled is None:
                found.append(_Target(symbol, kinds, types.none, given))
                continue
            # at these sizes; where they are read when it runs, at other sizes the loop's own
            linked.append(compiled.library)
            specialised = compiled.fndesc.llvm_func_name
            found.append(_Target(specialised, kinds, types.none, given, guard, symbol))
            continue
        compiled = _existing(call.callee, given) or native_calls.NativeCallee(
            call.callee
        ).compiled_for(given)
        signature = compiled.signature
        returned = signature.return_type
        if call.checked != isinstance(returned, types.Integer) or not (
            call.checked or returned == types.none
        ):
            raise Unsupported(f"line {call.line}: a call returning {returned}")
        if len(signature.args) < len(given):
            raise Unsupported(f"line {call.line}: too many arguments")
        address = native_calls.publish(compiled)
        found.append(_Target(address, tuple(signature.args), returned, given))
    return found


def _existing(dispatcher, given: tuple):
    """A version of the library function compiled already for these arguments, an array's
    read-only flag aside (the same machine values: a call writing into a buffer the user got
    back read-only after an earlier call passes it writeable again); None if none is."""
    from numba import types

    def same(a, b) -> bool:
        if isinstance(a, types.Array) and isinstance(b, types.Array):
            return (a.dtype, a.ndim, a.layout) == (b.dtype, b.ndim, b.layout)
        return a == b

    for key, compiled in list(dispatcher.overloads.items()):
        if len(key) == len(given) and all(map(same, key, given)):
            return compiled
    return None


def _emit(context, builder, data, calls, targets, items) -> object:
    """The calls, in order; the value: -1, or the number of the first call that failed.
    data: each driver argument's first element, as a pointer of its item type; items: each
    argument's object (an i8 pointer: its sizes read when it runs). Each call is
    written as Numba calls a compiled function (a result slot, the exception slot, each
    argument as its flattened machine values), with one result slot per type and one exception
    slot for all: a driver of a few hundred calls is a few thousand instructions to write."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.callconv import RETCODE_NONE, RETCODE_OK, excinfo_t

    intp = context.get_value_type(types.intp)
    failed = cgutils.alloca_once_value(builder, intp(-1))
    exception = cgutils.alloca_once(builder, ir.PointerType(excinfo_t), name="excinfo")
    results: dict = {}
    done = builder.append_basic_block("driver_done")
    numbers = Emitter(context, builder, items, data)
    for number, (call, target) in enumerate(zip(calls, targets, strict=True)):
        if call.checks:  # views' bounds at this size: a call out of them runs as Python
            inside = builder.append_basic_block(f"checked_{number}")
            outside = builder.append_basic_block(f"unchecked_{number}")
            builder.cbranch(numbers.holds(call.checks), inside, outside)
            builder.position_at_end(outside)
            builder.store(intp(number), failed)
            builder.branch(done)
            builder.position_at_end(inside)
        function_type = context.call_conv.get_function_type(target.return_type, target.arguments)
        function = cgutils.get_or_insert_function(builder.module, function_type, target.symbol)
        result_type = function_type.args[0].pointee
        if str(result_type) not in results:
            results[str(result_type)] = cgutils.alloca_once(builder, result_type)
        result = results[str(result_type)]
        passed = [result, exception]
        for value, wanted in zip(call.arguments, target.arguments, strict=False):
            passed += _machine_values(context, builder, value, wanted, data, numbers)
        for omitted in target.arguments[len(call.arguments) :]:
            constant = context.get_constant_generic(builder, omitted, omitted.value)
            passed += context.get_arg_packer([omitted]).as_arguments(builder, [constant])
        if [v.type for v in passed] != list(function_type.args):
            raise Unsupported(f"line {call.line}: arguments other than the callee's")
        if target.guard:  # the loop at constant sizes where they hold, else its own form
            other = cgutils.get_or_insert_function(builder.module, function_type, target.otherwise)
            code = _either(builder, numbers.holds(target.guard), function, other, passed)
        else:
            code = builder.call(function, passed)
        bad = builder.and_(
            builder.icmp_signed("!=", code, RETCODE_OK),
            builder.icmp_signed("!=", code, RETCODE_NONE),
        )
        if call.checked:
            returned = builder.load(result)
            wrong = builder.icmp_signed("!=", returned, ir.Constant(returned.type, -1))
            bad = builder.or_(bad, wrong)
        failure = builder.append_basic_block(f"failed_{number}")
        following = builder.append_basic_block(f"call_{number + 1}")
        builder.cbranch(bad, failure, following)
        builder.position_at_end(failure)
        builder.store(intp(number), failed)
        builder.branch(done)
        builder.position_at_end(following)
    builder.branch(done)
    builder.position_at_end(done)
    return builder.load(failed)


def _either(builder, condition, function, other, passed):
    """The return code of function(*passed) where condition holds, else of other(*passed)."""
    chosen = builder.append_basic_block("specialised")
    general = builder.append_basic_block("general")
    joined = builder.append_basic_block("joined")
    builder.cbranch(condition, chosen, general)
    codes = []
    for block, callee in ((chosen, function), (general, other)):
        builder.position_at_end(block)
        codes.append((builder.call(callee, passed), builder.block))
        builder.branch(joined)
    builder.position_at_end(joined)
    code = builder.phi(codes[0][0].type)
    for value, block in codes:
        code.add_incoming(value, block)
    return code


def _machine_values(context, builder, value, wanted, data, numbers: Emitter) -> list:
    """The machine values a callee taking `wanted` receives for a view or a constant, as
    Numba's argument packing flattens them (an array: meminfo, parent, item count, item size,
    data, shape, strides; all but the data pointer constants here, unless a size is read when
    the driver runs)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils

    intp = context.get_value_type(types.intp)
    if isinstance(value, View):
        pointer = builder.gep(data[value.argument], [numbers.integer(value.offset)])
        if wanted == types.voidptr:
            return [builder.bitcast(pointer, cgutils.voidptr_t)]
        if not isinstance(wanted, types.Array) or wanted.ndim != len(value.shape):
            raise Unsupported(f"a view of {len(value.shape)} axes passed as {wanted}")
        model = context.data_model_manager[wanted]
        if tuple(model._fields) != _ARRAY_FIELDS:
            raise Unsupported(f"{wanted} is not laid out as an array")
        fields = context.get_value_type(wanted).elements
        itemsize = context.get_abi_sizeof(context.get_data_type(wanted.dtype))
        return [
            ir.Constant(fields[0], None),
            ir.Constant(fields[1], None),
            numbers.integer(product(value.shape)),
            intp(itemsize),
            builder.bitcast(pointer, fields[4]),
            *[numbers.integer(s) for s in value.shape],
            *[numbers.integer(s) for s in _c_strides(value.shape, itemsize)],
        ]
    if is_runtime(value.value):
        return [numbers.typed(value.value, value.kind, wanted)]
    if isinstance(wanted, types.Boolean):
        argument_type = context.data_model_manager[wanted].get_argument_type()
        return [ir.Constant(argument_type, int(value.value))]
    if isinstance(wanted, (types.Integer, types.Float)):
        return [context.get_constant(wanted, value.value)]
    raise Unsupported(f"a constant passed as {wanted}")


_ARRAY_FIELDS = ("meminfo", "parent", "nitems", "itemsize", "data", "shape", "strides")


def _c_strides(shape: tuple, itemsize: int) -> list:
    """Each axis's stride in bytes (numbers, or Runtime ones where a size is)."""
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        # max(size, 1): a size read when it runs is at least 1 where it is at this size (an
        # empty batch is a size of its own: sizes 0 and 1 are never the symbol)
        step = combined("mul", step, size if is_runtime(size) or size > 1 else 1)
    return strides[::-1]


# Where CPython keeps a tuple's items and NumPy an array's data pointer, in bytes from the
# object's address (PyTupleObject.ob_item, PyArrayObject_fields.data); checked against the
# objects of the call the driver is built from (_check_layout).
TUPLE_ITEMS_AT = 24
ARRAY_DATA_AT = 16


def _check_layout() -> None:
    import ctypes

    held = (np.zeros(3), np.zeros((2, 5), np.float32)[1:])
    for i, array in enumerate(held):
        item = ctypes.c_void_p.from_address(id(held) + TUPLE_ITEMS_AT + 8 * i).value
        data = ctypes.c_void_p.from_address(id(array) + ARRAY_DATA_AT).value
        dims = ctypes.c_void_p.from_address(id(array) + ARRAY_DIMENSIONS_AT).value
        shape = tuple((ctypes.c_ssize_t * array.ndim).from_address(dims)) if dims else ()
        if item != id(array) or (data or 0) != (array.ctypes.data or 0) or shape != array.shape:
            raise Unsupported("this interpreter's tuples or arrays are laid out differently")


def compile_driver(calls: list[Call], arrays: list[Argument], name: str, varying=frozenset()):
    """Native code running the calls on a tuple of the driver's arguments (arrays of the types
    and shapes `arrays` describes), returning -1 or the number of the call that failed: the code
    library holding it as the function `name`. varying: the places read when it runs that
    differed between the sizes seen (driver_numbers.varying), never bound as loop sizes."""
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock:
        return _compiled(calls, arrays, name, varying)


def _compiled(calls: list[Call], arrays: list[Argument], name: str, varying: frozenset):
    from llvmlite import ir
    from numba import from_dtype, types
    from numba.core import cgutils
    from numba.core.registry import cpu_target

    from backplan.codegen.build.loop_optimisation import DriverLibrary

    context = cpu_target.target_context
    context.refresh()  # its constants' registries: a process that only loaded from its cache
    linked: list = []
    targets = _targets(calls, arrays, linked, varying)
    codegen = context.codegen()
    library = DriverLibrary(codegen, name)
    for code in dict.fromkeys(linked):
        library.add_linking_library(code)
    library.enable_object_caching()  # kept in the cache folder (_save)
    module = library.create_ir_module(name)
    intp = context.get_value_type(types.intp)
    function = ir.Function(module, ir.FunctionType(intp, [cgutils.voidptr_t]), name)
    builder = ir.IRBuilder(function.append_basic_block("entry"))
    items = builder.bitcast(function.args[0], cgutils.voidptr_t.as_pointer())
    data, objects = [], []
    for i, array in enumerate(arrays):
        item = builder.load(builder.gep(items, [intp(TUPLE_ITEMS_AT // 8 + i)]))
        objects.append(item)
        field = builder.gep(item, [intp(ARRAY_DATA_AT)])
        pointer = builder.load(builder.bitcast(field, cgutils.voidptr_t.as_pointer()))
        element = context.get_data_type(from_dtype(array.dtype))
        data.append(builder.bitcast(pointer, element.as_pointer()))
    builder.ret(_emit(context, builder, data, calls, targets, objects))
    library.add_ir_module(module)
    library.finalize()
    return library


def enabled() -> bool:
    """BACKPLAN_DIRECT_DRIVER (default 1): whether a plan whose driver runs as Python while its
    compiled driver builds in the background runs the direct driver from its second call."""
    value = os.environ.get("BACKPLAN_DIRECT_DRIVER", "1")
    if value not in ("0", "1"):
        raise ValueError(f"BACKPLAN_DIRECT_DRIVER={value!r}; use 1 (the default) or 0")
    return value == "1"


class DirectDriver:
    """The driver emitted directly, called as the compiled driver is (its arguments by
    position, all arrays of the types it was built for: CompiledPlan makes them so); a call
    it does not finish (a label out of range, a callee's error) runs again as Python, which
    raises the error with its message."""

    __slots__ = ("_entry", "_library", "_python", "_count", "cached")

    def __init__(self, library, name: str, python_run, count: int, cached: bool):
        import ctypes

        address = library.get_pointer_to_function(name)
        if not address:
            raise RuntimeError(f"{name} has no native entry")
        self._entry = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.py_object)(address)
        self._library, self._python = library, python_run
        self._count, self.cached = count, cached  # cached: loaded from the cache folder

    def __call__(self, *args):
        if len(args) == self._count and self._entry(args) == -1:
            return None
        return self._python(*args)


def build(
    source: str,
    scope: dict,
    arrays: list[Argument],
    python_run,
    places=frozenset(),
    varying=frozenset(),
    generic=frozenset(),
):
    """(the DirectDriver of the module's `run` for calls with these arguments (`described`),
    None) or (None, why not: a statement it does not read, or what failed). Loaded from the
    cache folder where an earlier process left it, else built and left there. places: the
    numbers it reads when it runs (driver_numbers.every_place: a driver for every size);
    varying: those that differed between the sizes seen (compile_driver). generic: a symbolic
    plan's first size's every_place: where no loop would be bound at this size's numbers (its
    steps are then the same either way), the driver for every size is made at once, and a
    second size builds nothing."""
    try:
        found = cached(source, arrays, python_run, places)
        if found is not None:
            return found, None
        read = None
        if generic and not places:
            calls = plan(source, scope, arrays, generic)
            if not any(map(_binds, calls)):
                places, read = generic, calls
        name = _name(source, arrays, places)
        with _made_lock:
            if name not in _made:
                calls = read if read is not None else plan(source, scope, arrays, places)
                _made[name] = compile_driver(calls, arrays, name, varying)
                _save(_made[name], name)
        return DirectDriver(_made[name], name, python_run, len(arrays), False), None
    except Unsupported as why:
        return None, str(why)
    except Exception as error:  # noqa: BLE001 - the Python-run driver serves the calls
        return None, f"{type(error).__name__}: {error}"


def cached(source: str, arrays: list[Argument], python_run, places=frozenset()):
    """The DirectDriver for calls with these arguments made earlier in this process or loaded
    from the cache folder; None where there is none (a plan's first call then runs as Python)."""
    _check_layout()
    name = _name(source, arrays, places)
    with _made_lock:
        if name not in _made:
            library = _load(name)
            if library is None:
                return None
            _made[name] = library
    return DirectDriver(_made[name], name, python_run, len(arrays), True)


_made: dict = {}  # name -> code library, built or loaded in this process (each symbol once)
_made_lock = threading.Lock()


def _name(source: str, arrays: list[Argument], places=frozenset()) -> str:
    """The driver's symbol, and its cache file's name: a digest of all its machine code
    depends on (the source names its loops by their source's digest; library functions are
    called by symbol, resolved when it loads)."""
    import hashlib

    from backplan.codegen.build import cache, loop_batch

    # read-only: the same code; a size-generic driver's numbers are written in as constants,
    # but for the places it reads when it runs (then named without their values)
    described = repr(
        places_key(arrays, places) if places else [(a.shape, a.dtype.str, a.values) for a in arrays]
    )
    code = _code_text(source)  # a symbolic plan's comments show the size it was rendered at
    text = "\n".join([code, described, loop_batch.environment(), cache.codegen_fingerprint()])
    return f"bp_direct_{hashlib.sha256(text.encode()).hexdigest()[:32]}"


@functools.lru_cache(maxsize=16)
def _code_text(source: str) -> str:
    """The driver's source without its comment lines: the same code for every process that
    rendered a symbolic plan first at another size (codegen/render/lift.py)."""
    from backplan.codegen.render.lift import code_text

    return code_text(source)


def _path(name: str, folder: str) -> str:
    return os.path.join(folder, "__pycache__", f"{name}.o")


def _load(name: str):
    """The driver's code library from the cache folder (its callees' symbols published first),
    or None where none is there for this process."""
    from numba.core.compiler_lock import global_compiler_lock

    from backplan.codegen.build import cache, cache_signing, loop_batch

    path = _path(name, cache.cache_path())
    if not os.path.exists(path):
        return None
    payload = loop_batch.read_signed(path, "driver cache file")
    if payload is None:
        return None
    with global_compiler_lock:
        if not cache_signing.ready_to_load(payload):
            return None
        return loop_batch.unserialize_object(payload, name)


def _save(library, name: str) -> None:
    from backplan.codegen.build import cache, cache_health, loop_batch

    folder = cache.writable_cache_dir()
    if folder is None:
        return
    try:
        os.makedirs(os.path.join(folder, "__pycache__"), mode=0o700, exist_ok=True)
        loop_batch.write_signed(_path(name, folder), loop_batch.object_payload(library))
    except OSError as error:
        cache_health.note_unwritable(folder, error)
