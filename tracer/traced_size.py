"""Sizes the user's code reads while a dynamic axis is traced, and the guards they leave.

A plan for every size of a dynamic axis is traced at a few sizes and fitted (tracer/dynamic.py).
Python code that turns a size into a decision (`if x.shape[0] > 8`, `min(n, 100)`) or into a
number that is not a + c·size (`n // 4 * 4`, `n % 2`) can agree at every traced size and differ
at another: the fitted plan would then be silently wrong there. While a dynamic signature is
traced, `x.shape` read by the user's code holds TracedSize ints: each behaves as its int, and
records how it was computed and what the code saw (a comparison's result, a floor division's
quotient). fit_guards turns those records into guards: each size the plan is instantiated at
must give every comparison the result it had when traced, and every such number its fitted
value; a size that does not is traced on its own (as torch.compile's guards re-specialise)."""

from __future__ import annotations

import operator
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from backplan.ir.symbolic import Affine, SymbolicError, fit_number

from .source import LIBRARY, _facts, loc_text, user_frame_loc


class _State(threading.local):
    """.log: the SizeLog being recorded in this thread. A class default, not getattr(local,
    "log", None): every traced tensor's shape read asks, and a missing attribute raises and
    catches an AttributeError each time."""

    log: SizeLog | None = None


_getframe = sys._getframe


class SizeLog:
    """One trace's reads: `sources` the sizes read (in order), `seen` each decision or number
    (expression, value, user line) in order."""

    def __init__(self):
        self.sources: list[int] = []
        self.seen: list[tuple] = []
        self.lost: list = []  # user lines where a size left as a plain int (len(x))

    def shape(self, shape: tuple) -> tuple:
        """The shape as the user's code sees it: each size a TracedSize of a new source."""
        out = []
        for size in shape:
            self.sources.append(size)
            out.append(TracedSize(size, self, ("size", len(self.sources) - 1)))
        return tuple(out)


_state = _State()


def active_log() -> SizeLog | None:
    return _state.log


@contextmanager
def reading_sizes():
    """Record the sizes user code reads inside (one trace of a dynamic signature)."""
    outer = active_log()
    log = _state.log = SizeLog()
    try:
        yield log
    finally:
        _state.log = outer


def from_user(depth: int) -> bool:
    """Whether the frame `depth` above the caller is the user's (not backplan's own code)."""
    frame = _getframe(depth + 1)
    return _facts(frame)[0] != LIBRARY


def plain(value):
    """An op attribute without TracedSize (plans hold plain ints; fitting compares types)."""
    if isinstance(value, TracedSize):
        return int(value)
    if isinstance(value, tuple | list):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(plain(value.start), plain(value.stop), plain(value.step))
    return value


_AFFINE = {"add", "sub", "neg", "pos"}


def _binary(name: str, op, reflected: bool = False):
    def method(self, other):
        if isinstance(other, float):
            return _to_float(self, name, op, other, reflected)
        if not isinstance(other, int):
            return getattr(int, f"__{'r' if reflected else ''}{name}__")(self, other)
        a, b = (other, self) if reflected else (self, other)
        value = op(int(a), int(b))
        if not from_user(1):
            return value
        if name == "truediv":  # a float: held to its traced value exactly
            self._log.seen.append(((name, _expr(a), _expr(b)), value, user_frame_loc()))
            return value
        expr = (name, _expr(a), _expr(b))
        scaled = name == "mul" and not (isinstance(a, TracedSize) and isinstance(b, TracedSize))
        return self._result(value, expr, record=name not in _AFFINE and not scaled)

    return method


def _to_float(self, name: str, op, other: float, reflected: bool) -> float:
    """`n * 0.5`, `n / 2.0`: a float the user's code may decide on (`> 4`) and that no later
    operation reports, so its value at each size must be the traced one."""
    a, b = (other, self) if reflected else (self, other)
    value = op(float(int(a)) if a is self else a, float(int(b)) if b is self else b)
    if from_user(2):
        self._log.seen.append(((name, _expr(a), _expr(b)), value, user_frame_loc()))
    return value


def _compare(name: str, op):
    def method(self, other):
        if not isinstance(other, int | float):
            return getattr(int, f"__{name}__")(self, other)
        value = op(int(self), other if isinstance(other, float) else int(other))
        if from_user(1):
            self._log.seen.append(((name, _expr(self), _expr(other)), value, user_frame_loc()))
        return value

    return method


def _unary(name: str, op):
    def method(self):
        value = op(int(self))
        if not from_user(1):
            return value
        return self._result(value, (name, _expr(self)), record=name not in _AFFINE)

    return method


class TracedSize(int):
    """An int read from a traced tensor's shape, carrying how it was computed."""

    def __new__(cls, value: int, log: SizeLog, expr: tuple):
        self = super().__new__(cls, value)
        self._log, self._expr = log, expr
        return self

    def _result(self, value: int, expr: tuple, record: bool) -> TracedSize:
        if record:
            self._log.seen.append((expr, value, user_frame_loc()))
        return TracedSize(value, self._log, expr)

    def __float__(self) -> float:
        """float(n), math.sqrt(n), np.float32(n): a float held to its traced value exactly."""
        value = float(int(self))
        if from_user(1):
            self._log.seen.append((("float", self._expr), value, user_frame_loc()))
        return value

    def __round__(self, ndigits=None):
        """round(n) is n; round(n, -1) a number of the size recorded like n // 10 * 10."""
        value = int.__round__(int(self), ndigits) if ndigits is not None else int(self)
        if ndigits is None or not from_user(1):
            return value
        return self._result(value, ("round", self._expr, ndigits), record=True)

    def bit_length(self) -> int:
        value = int(self).bit_length()
        if not from_user(1):
            return value
        return self._result(value, ("bit_length", self._expr), record=True)

    def __bool__(self) -> bool:
        value = int(self) != 0
        if from_user(1):
            self._log.seen.append((("ne", self._expr, 0), value, user_frame_loc()))
        return value

    __hash__ = int.__hash__

    def __reduce__(self):  # a copy or pickle is the plain int
        return (int, (int(self),))

    __add__, __radd__ = _binary("add", operator.add), _binary("add", operator.add, True)
    __sub__, __rsub__ = _binary("sub", operator.sub), _binary("sub", operator.sub, True)
    __mul__, __rmul__ = _binary("mul", operator.mul), _binary("mul", operator.mul, True)
    __truediv__ = _binary("truediv", operator.truediv)
    __rtruediv__ = _binary("truediv", operator.truediv, True)
    __floordiv__ = _binary("floordiv", operator.floordiv)
    __rfloordiv__ = _binary("floordiv", operator.floordiv, True)
    __mod__, __rmod__ = _binary("mod", operator.mod), _binary("mod", operator.mod, True)
    __pow__, __rpow__ = _binary("pow", operator.pow), _binary("pow", operator.pow, True)
    __lshift__, __rshift__ = _binary("lshift", operator.lshift), _binary("rshift", operator.rshift)
    __and__, __or__ = _binary("and", operator.and_), _binary("or", operator.or_)
    __xor__ = _binary("xor", operator.xor)
    __neg__, __pos__ = _unary("neg", operator.neg), _unary("pos", operator.pos)
    __abs__, __invert__ = _unary("abs", operator.abs), _unary("invert", operator.invert)
    __lt__, __le__ = _compare("lt", operator.lt), _compare("le", operator.le)
    __gt__, __ge__ = _compare("gt", operator.gt), _compare("ge", operator.ge)
    __eq__, __ne__ = _compare("eq", operator.eq), _compare("ne", operator.ne)

    def __divmod__(self, other):
        return (self // other, self % other) if isinstance(other, int) else NotImplemented


def _expr(x):
    return x._expr if isinstance(x, TracedSize) else x if isinstance(x, float) else int(x)


_OPS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "floordiv": operator.floordiv, "truediv": operator.truediv, "float": float,
    "bit_length": int.bit_length, "round": round, "mod": operator.mod, "pow": operator.pow,
    "lshift": operator.lshift, "rshift": operator.rshift, "and": operator.and_,
    "or": operator.or_, "xor": operator.xor, "neg": operator.neg, "pos": operator.pos,
    "abs": operator.abs, "invert": operator.invert, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne,
}  # fmt: skip


def evaluate(expr, sources: list[int]):
    """An expression's value where the sizes read are `sources`."""
    if not isinstance(expr, tuple):
        return expr
    if expr[0] == "size":
        return sources[expr[1]]
    return _OPS[expr[0]](*(evaluate(e, sources) for e in expr[1:]))


@dataclass(frozen=True)
class Guards:
    """What a size must give for the fitted plan to hold there: each source size read (a
    constant or a + c·size), each decision and number the code saw (its value, or formula)."""

    sources: tuple
    checks: tuple  # (expression, expected value or Affine, user location)

    def hold_at(self, n: int) -> str | None:
        """None when size n gives every check its expected value; else what differs."""
        sources = [s.at(n) if isinstance(s, Affine) else s for s in self.sources]
        for expr, expected, loc in self.checks:
            want = expected.at(n) if isinstance(expected, Affine) else expected
            try:
                got = evaluate(expr, sources)
            except (ArithmeticError, ValueError) as exc:
                got = f"{type(exc).__name__}"
            if got != want:
                return f"{_what(expr, got)} at {loc_text(loc)} (the plan was traced with {want})"
        return None


def fit_guards(logs: list[SizeLog], sizes: list[int], symbol: str) -> Guards:
    """The guards of traces at `sizes` (the first the template); SymbolicError where the
    traces read sizes or decided differently, so no one plan holds for every size."""
    first = logs[0]
    if first.lost:
        raise SymbolicError(
            f"len() of a tensor at {loc_text(first.lost[0])} gives a plain int whose uses "
            "cannot be followed (x.shape[0] can, and keeps one plan for every size)"
        )
    for log, n in zip(logs[1:], sizes[1:], strict=True):
        if len(log.sources) != len(first.sources) or [e for e, _, _ in log.seen] != [
            e for e, _, _ in first.seen
        ]:
            raise SymbolicError(
                f"the function reads its sizes differently at {symbol}={sizes[0]} and {n}"
            )
    sources = tuple(
        fit_number([log.sources[i] for log in logs], sizes, "a size the function reads")
        for i in range(len(first.sources))
    )
    checks = []
    for j, (expr, value, loc) in enumerate(first.seen):
        values = [log.seen[j][1] for log in logs]
        if type(value) in (bool, float):  # decisions, and floats no later operation reports
            if any(v != value for v in values):
                seen = ", ".join(f"{v} at {symbol}={n}" for v, n in zip(values, sizes, strict=True))
                raise SymbolicError(f"{_what(expr, None)} at {loc_text(loc)} is {seen}")
            checks.append((expr, value, loc))
        else:
            where = f"{_what(expr, None)} at {loc_text(loc)}"
            checks.append((expr, fit_number(values, sizes, where), loc))
    return Guards(sources, tuple(checks))


_TEXT = {
    "add": "+", "sub": "-", "mul": "*", "floordiv": "//", "truediv": "/", "mod": "%", "pow": "**",
    "lshift": "<<", "rshift": ">>", "and": "&", "or": "|", "xor": "^", "lt": "<", "le": "<=",
    "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
}  # fmt: skip


def _what(expr, value) -> str:
    """`size // 4` (the size read, the operation and its operand), with a value if given."""
    text = _text(expr)
    return text if value is None else f"{text} is {value}"


def guard_text(expr) -> str:
    """An expression the user's code computed from a size read, as text (`size // 4`)."""
    return _text(expr)


def _text(expr) -> str:
    if not isinstance(expr, tuple):
        return str(expr)
    if expr[0] == "size":
        return "size"
    if len(expr) == 2 or expr[0] == "round":
        return f"{expr[0]}({', '.join(_text(e) for e in expr[1:])})"
    return f"{_text(expr[1])} {_TEXT[expr[0]]} {_text(expr[2])}"
