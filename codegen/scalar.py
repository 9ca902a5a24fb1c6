"""The scalar expression each loop op computes, as Numba source. One entry per elementwise
registry op; a test walks the registry so no op lacks one."""

from __future__ import annotations

import math

NP_TYPE = {
    "f32": "np.float32",
    "f64": "np.float64",
    "i64": "np.int64",
    "i32": "np.int32",
    "u8": "np.uint8",
    "bool": "np.bool_",
}


def literal(value, dtype: str) -> str:
    if dtype == "bool":
        return "True" if value else "False"
    if isinstance(value, float) and math.isnan(value):
        return f"{NP_TYPE[dtype]}(np.nan)"
    if isinstance(value, float) and math.isinf(value):
        return f"{NP_TYPE[dtype]}({'np.inf' if value > 0 else '-np.inf'})"
    if dtype in ("u8", "i32", "i64"):
        return f"{NP_TYPE[dtype]}({int(value)})"
    return f"{NP_TYPE[dtype]}({float(value)!r})"


def _pow(a, b, node):
    exponent = node.inputs[1]
    if exponent.op == "full":
        value = exponent.attrs["value"]
        if value == 2:
            return f"({a} * {a})"
        if value == 3:
            return f"({a} * {a} * {a})"
        if value == 1:
            return a
        if value == 0.5 and node.dtype in ("f32", "f64"):
            return f"math.sqrt({a})"
    return f"({a} ** {b})"


def _cast(a, node):
    dtype = node.attrs["dtype"]
    if dtype == "bool":
        return f"({a} != 0)"
    return f"{NP_TYPE[dtype]}({a})"


def _fn(name: str):
    return lambda node, *args: f"{name}_{node.dtype}({', '.join(args)})"


EXPRESSIONS = {
    "add": lambda node, a, b: f"({a} + {b})",
    "sub": lambda node, a, b: f"({a} - {b})",
    "mul": lambda node, a, b: f"({a} * {b})",
    "div": lambda node, a, b: f"({a} / {b})",
    "pow": lambda node, a, b: _pow(a, b, node),
    "maximum": lambda node, a, b: f"({a} if ({a} >= {b} or {a} != {a}) else {b})",
    "minimum": lambda node, a, b: f"({a} if ({a} <= {b} or {a} != {a}) else {b})",
    "lt": lambda node, a, b: f"({a} < {b})",
    "le": lambda node, a, b: f"({a} <= {b})",
    "gt": lambda node, a, b: f"({a} > {b})",
    "ge": lambda node, a, b: f"({a} >= {b})",
    "eq": lambda node, a, b: f"({a} == {b})",
    "ne": lambda node, a, b: f"({a} != {b})",
    "neg": lambda node, a: f"(-{a})",
    "exp": _fn("exp"),
    "log": _fn("log"),
    "tanh": _fn("tanh"),
    "sigmoid": _fn("sigmoid"),
    "erf": _fn("erf"),
    "sqrt": lambda node, a: f"math.sqrt({a})",
    "abs": lambda node, a: f"abs({a})",
    "sign": lambda node, a: f"(1 if {a} > 0 else (-1 if {a} < 0 else {a}))",
    "relu": lambda node, a: f"({a} if not {a} <= 0 else {literal(0, node.dtype)})",
    "gelu": lambda node, a: f"gelu_{node.attrs['approximate']}_{node.dtype}({a})",
    "where": lambda node, c, a, b: f"({a} if {c} else {b})",
    "astype": lambda node, a: _cast(a, node),
    "stop_gradient": lambda node, a: a,
    "broadcast_to": lambda node, a: a,
    "reshape": lambda node, a: a,
}


def expression(node, operands: list[str]) -> str:
    return EXPRESSIONS[node.op](node, *operands)
