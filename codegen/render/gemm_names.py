"""Which GEMM a matmul runs, in words, read from the driver statements the code generator wrote
for it (so explain says what the compiled step calls, not a second guess at the choice):
BLAS (sgemm / dgemm), backplan's blocked GEMM (on one core or several; widening 16-bit operands
as it packs them, or a mixed bfloat16 x float32 pair), or its narrow GEMM (few columns)."""

from __future__ import annotations

import re

from backplan.ir.graph import Value
from backplan.ir.types import is_half

_PARTS = re.compile(r"own_(?:batched_)?gemm(?:_at|_strided_at)?_par\((?:np\.intp\()?(\d+)")
_BLAS = {"f32": "sgemm", "f64": "dgemm"}


def gemm_called(lines: list[str], node: Value) -> str:
    """The GEMM the statements `lines` (a matmul's) call; '' when they call none."""
    text = "\n".join(lines)
    batched = "batched_gemm" in text
    if "narrow_gemm_at(" in text:
        return "backplan's narrow GEMM" + _operands(node)
    if "own_" in text:
        found = _PARTS.search(text)
        cores = f" on {found.group(1)} cores" if found and int(found.group(1)) > 1 else ""
        kind = "batched GEMM" if batched else "GEMM"
        return f"backplan's {kind}{_operands(node)}{cores}"
    if "gemm" in text:
        name = _BLAS.get(node.dtype, node.dtype)
        return f"BLAS {'batched ' if batched else ''}{name}"
    return ""


def epilogue_gemm(node: Value) -> str:
    """A matmul + epilogue kernel run as one: backplan's GEMM on one core, the loop after it
    run on each block of rows it finishes."""
    return f"backplan's GEMM{_operands(node)} + epilogue"


def _operands(node: Value) -> str:
    """' (bf16 x f32, mixed)', ' (bf16, widened as packed)', or '' for a float32/64 pair."""
    a, b = (i.dtype for i in node.inputs)
    if a != b:
        return f" ({a} x {b}, mixed)"
    if is_half(a):
        return f" ({a}, widened as packed)"
    return ""
