"""The scalar expression each loop op computes, as Numba source, rendered from the op's
registry entry (`OpDef.scalar`)."""

from __future__ import annotations

import math

from backplan.ir.registry import get_op

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


def _pow(a, b, node) -> str | None:
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
    return None


# Rewrites of one op's expression when an operand is a literal: strength reductions, not new
# definitions (the op's expression is its registry entry's `scalar`).
SPECIALISED = {"pow": _pow}


def expression(node, operands: list[str]) -> str:
    """The registry entry's scalar template, filled in for this node."""
    special = SPECIALISED.get(node.op)
    rewritten = special(*operands, node) if special else None
    if rewritten is not None:
        return rewritten
    template = get_op(node.op).scalar
    if isinstance(template, dict):
        template = template.get(node.dtype, template["*"])
    fields = {
        **node.attrs,
        "dtype": node.dtype,
        "np_type": NP_TYPE[node.dtype],
        "zero": literal(0, node.dtype),
    }
    return template.format(*operands, **fields)
