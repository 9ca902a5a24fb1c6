"""Numbers that remember where they came from, for rendering a symbolic plan's driver once.

A size of a symbolic plan (ir/symbolic.py) renders the first size's driver text with other
numbers in it (codegen/render/lift.py): only its literal vector changes. To get that vector
without rendering again, the first size is rendered once more with each number the lowered plan
holds (a shape's dims, an attribute, a kernel's loop sizes, an arena offset) as a Traced: its
value at this size and an expression over the leaves `L[i]`. Arithmetic builds expressions;
every comparison, truth test or use as a plain int records a guard (a traced number's hash is
one constant, so a lookup compares) (the expression and
the answer this size gave), and its text is a marker, so the lifted driver names each
literal's expression. At another size the guards are evaluated first: where all hold, every
branch the rendering took is the same, and the literals are the expressions evaluated.

Anything a Traced cannot stand for (a NumPy scalar operand, a format spec) raises Untraceable:
the rendering is not recorded and every size renders as before.

>>> with recording() as guards:
...     n = Traced("L[0]", 12)
...     m = n * 4 + 1
...     big = m > 40
>>> m.text, m.value, big, guards.guards
('((L[0]*4)+1)', 49, True, ['(((L[0]*4)+1)>40)'])
>>> with recording() as guards:
...     small = Traced("L[0]", 3) * 1 > 5
>>> small, guards.guards
(False, ['(L[0]<=5)'])
"""

from __future__ import annotations

import operator
import threading

MARK = 9 * 10**15  # a marker's number: MARK + the expression's index (float markers end in .0)


_HASH = hash("traced number")


class Untraceable(Exception):
    """The rendering did something with a traced number that cannot be recorded."""


class Recording:
    """What one traced rendering recorded: guards (expressions true at this size) and the
    expressions whose markers it wrote."""

    def __init__(self):
        self.guards: list[str] = []
        self.marked: list[Traced] = []
        self.floats: dict[float, tuple[str, str]] = {}  # value -> (its marker, expression)
        # float literals rendered from untraced numbers (every loop's zero, ahead of the rest)
        self.plain: set[float] = {0.0}

    def plain_float(self, value: float) -> None:
        """An untraced float literal: a traced one of its value renders its text (one kernel
        parameter for both), one of another value is guarded to stay apart from it."""
        if value not in self.plain:
            self.plain.add(value)
            for _, other in self.floats.values():
                self.guard(f"({other}!={value!r})")

    def guard(self, text: str) -> None:
        self.guards.append(text)

    def mark(self, number: Traced) -> str:
        self.marked.append(number)
        index = MARK + len(self.marked) - 1
        return f"{index}.0" if isinstance(number.value, float) else str(index)

    def mark_float(self, number: Traced) -> str:
        """A float literal's marker: one per value, as a kernel's source has one parameter per
        distinct float literal text (codegen/render/kernel_source.py), with guards that equal
        values stay equal and distinct ones distinct."""
        value, text = float(number.value), f"float({number.text})"
        if value in self.plain:  # the text of an untraced literal: that literal's
            self.guard(f"({text}=={value!r})")
            return repr(value)
        found = self.floats.get(value)
        if found is not None:
            if found[1] != text:
                self.guard(f"({text}=={found[1]})")
            return found[0]
        for _, other in self.floats.values():
            self.guard(f"({text}!={other})")
        for other in self.plain:
            self.guard(f"({text}!={other!r})")
        marker = f"{self.mark(Traced(text, value))}"
        self.floats[value] = (marker, text)
        return marker


_state = threading.local()


class recording:
    """Within: Traced numbers record into a fresh Recording (the one the block gets)."""

    def __enter__(self) -> Recording:
        self.before = getattr(_state, "recording", None)
        _state.recording = Recording()
        return _state.recording

    def __exit__(self, *exc) -> None:
        _state.recording = self.before


def note_float(value) -> None:
    """A float literal rendered from an untraced number, where a rendering is traced."""
    found = getattr(_state, "recording", None)
    if found is not None:
        found.plain_float(float(value))


def _current() -> Recording:
    found = getattr(_state, "recording", None)
    if found is None:
        raise Untraceable("a traced number used outside its recording")
    return found


def _operand(other) -> tuple[str, int | float] | None:
    if isinstance(other, Traced):
        return other.text, other.value
    if type(other) is bool or type(other) is int:
        return str(int(other)), int(other)
    if type(other) is float:
        if other != other or other in (float("inf"), float("-inf")):
            raise Untraceable(f"{other!r} in a traced expression")
        return repr(other), other
    return None  # NotImplemented: a str, None, a tuple compare unequal by type


# x * 1, 1 * x, x + 0, 0 + x, x - 0 and x // 1 are x (math.prod starts at 1): shorter guards
_UNIT = {"*": 1, "+": 0, "-": 0, "//": 1}


def _arith(symbol: str, apply):
    unit = _UNIT.get(symbol)

    def forward(self, other):
        found = _operand(other)
        if found is None:
            _refuse(other)
            return NotImplemented
        if type(found[1]) is int and found[1] == unit:
            return self
        return Traced(f"({self.text}{symbol}{found[0]})", apply(self.value, found[1]))

    def backward(self, other):
        found = _operand(other)
        if found is None:
            _refuse(other)
            return NotImplemented
        if type(found[1]) is int and found[1] == unit and symbol in "*+":
            return self
        return Traced(f"({found[0]}{symbol}{self.text})", apply(found[1], self.value))

    return forward, backward


_OPPOSITE = {"==": "!=", "!=": "==", "<": ">=", "<=": ">", ">": "<=", ">=": "<"}


def _compare(symbol: str, apply):
    def method(self, other):
        found = _operand(other)
        if found is None:
            _refuse(other)
            return NotImplemented
        answer = bool(apply(self.value, found[1]))
        if found[0] != self.text:  # one expression against itself holds at every size
            held = symbol if answer else _OPPOSITE[symbol]  # the comparison that held
            _current().guard(f"({self.text}{held}{found[0]})")
        return answer

    return method


def _refuse(other) -> None:
    """A NumPy scalar (or any other number type) would compute in its own arithmetic."""
    if isinstance(other, int | float | complex) or type(other).__module__ == "numpy":
        raise Untraceable(f"a traced number with a {type(other).__name__}")


class Traced:
    """A number at this size (`value`) and the expression giving it at any size (`text`)."""

    __slots__ = ("text", "value")

    def __init__(self, text: str, value: int | float):
        self.text = text
        self.value = value

    __add__, __radd__ = _arith("+", operator.add)
    __sub__, __rsub__ = _arith("-", operator.sub)
    __mul__, __rmul__ = _arith("*", operator.mul)
    __floordiv__, __rfloordiv__ = _arith("//", operator.floordiv)
    __mod__, __rmod__ = _arith("%", operator.mod)
    __truediv__, __rtruediv__ = _arith("/", operator.truediv)
    __eq__ = _compare("==", operator.eq)
    __ne__ = _compare("!=", operator.ne)
    __lt__ = _compare("<", operator.lt)
    __le__ = _compare("<=", operator.le)
    __gt__ = _compare(">", operator.gt)
    __ge__ = _compare(">=", operator.ge)

    def __neg__(self) -> Traced:
        return Traced(f"(-{self.text})", -self.value)

    def __pos__(self) -> Traced:
        return self

    def __abs__(self) -> Traced:
        return Traced(f"abs({self.text})", abs(self.value))

    def __divmod__(self, other):
        return self // other, self % other

    def pinned(self):
        """The value, with a guard that the expression has it (a use that keeps no expression)."""
        _current().guard(f"({self.text}=={self.value!r})")
        return self.value

    def __bool__(self) -> bool:
        answer = bool(self.value)
        _current().guard(f"({self.text}!=0)" if answer else f"({self.text}==0)")
        return answer

    def __index__(self) -> int:
        if type(self.value) is not int:
            raise TypeError(f"{self.value!r} is not an integer")
        return self.pinned()

    def __int__(self) -> int:
        return int(self.pinned())

    def __float__(self) -> float:
        return float(self.pinned())

    def __hash__(self) -> int:
        # one hash for every traced number: a set or dict lookup then compares (and records)
        # against each traced key, never finds or misses one by its value unrecorded
        return _HASH

    def __str__(self) -> str:
        return _current().mark(self)

    __repr__ = __str__

    def float_text(self) -> str:
        """The marker of this number as a float literal (Recording.mark_float)."""
        return _current().mark_float(self)

    def __format__(self, spec: str) -> str:
        if spec:
            raise Untraceable(f"a traced number formatted as {spec!r}")
        return str(self)
