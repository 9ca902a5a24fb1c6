"""The scalar expression each loop op computes, as Numba source, rendered from the op's
registry entry (`OpDef.scalar`)."""

from __future__ import annotations

import math

import numpy as np

from backplan.codegen.render.traced_numbers import Traced, note_float
from backplan.ir.registry import get_op
from backplan.ir.types import is_half, np_dtype

NP_TYPE = {  # what a value is stored as in generated code: 16-bit floats as their bit patterns
    "bf16": "np.uint16",
    "f16": "np.uint16",
    "f32": "np.float32",
    "f64": "np.float64",
    "i64": "np.int64",
    "i32": "np.int32",
    "u8": "np.uint8",
    "bool": "np.bool_",
}


def literal(value, dtype: str) -> str:
    if type(value) is Traced and dtype in ("f32", "f64"):  # its marker (render/substitution.py)
        return f"{NP_TYPE[dtype]}({value.float_text()})"
    if is_half(dtype):  # the bit pattern of the value rounded once from float32
        bits = np.array(value, np.float32).astype(np_dtype(dtype)).view(np.uint16)
        return f"np.uint16({int(bits)})"
    if dtype == "bool":
        return "True" if value else "False"
    if isinstance(value, float) and math.isnan(value):
        return f"{NP_TYPE[dtype]}(np.nan)"
    if isinstance(value, float) and math.isinf(value):
        return f"{NP_TYPE[dtype]}({'np.inf' if value > 0 else '-np.inf'})"
    if dtype in ("u8", "i32", "i64"):
        return f"{NP_TYPE[dtype]}({int(value)})"
    note_float(value)
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


def _astype(a, node) -> str | None:
    """Casts into and out of 16-bit storage (ir/widen.py leaves only float32 ones)."""
    source = node.inputs[0].dtype
    if source == node.dtype and is_half(source):
        return a  # a copy (ir/strided_copies.py): 16-bit values move as their stored bits
    if is_half(source):
        return f"{source}_to_f32({a})"
    if is_half(node.dtype):
        return f"f32_to_{node.dtype}({a})"
    return None


# Rewrites of one op's expression when an operand is a literal: strength reductions, not new
# definitions (the op's expression is its registry entry's `scalar`); casts to and from 16 bits.
SPECIALISED = {"pow": _pow, "astype": _astype}


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
