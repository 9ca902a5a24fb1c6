"""Batched, broadcasting matrix multiply; BLAS does the work in every backend."""

import numpy as np

from ..errors import DtypeError, ShapeError
from ..registry import AttrSpec, OpDef, register
from ..shapes import broadcast_shapes, fmt
from ..types import TensorType, np_dtype
from .common import numeric_only, same_dtype


def _matmul_infer(types, attrs):
    a, b = types
    numeric_only(types, "matmul")
    if attrs.get("dtype") == "f64" and {a.dtype, b.dtype} == {"f32", "f64"}:
        return _matmul_type("f64", a, b)  # a float32 value beside float64 (ir/wide_reads.py)
    if attrs.get("dtype") == "f32" and {a.dtype, b.dtype} in ({"bf16", "f32"}, {"f16", "f32"}):
        dtype = a.dtype if a.dtype != "f32" else b.dtype  # a 16-bit saved value beside a
        # float32 operand (ir/widen.py only)
    else:
        dtype = same_dtype(types, "matmul")
    if attrs.get("dtype") is not None:  # set by ir/widen.py only
        if dtype not in ("bf16", "f16") or attrs["dtype"] != "f32":
            raise DtypeError(
                f"dtype={attrs['dtype']} is only for bf16 or f16 operands summed in f32, "
                f"got {dtype}"
            )
        dtype = "f32"
    return _matmul_type(dtype, a, b)


def _matmul_type(dtype: str, a, b) -> TensorType:
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ShapeError("operands need at least 2 dimensions (the tracer handles vectors)")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"inner dimensions differ: {fmt(a.shape)} @ {fmt(b.shape)}")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return TensorType(dtype, batch + (a.shape[-2], b.shape[-1]))


def _matmul_reference(a, b, dtype=None):
    """np.matmul; with dtype (16-bit operands, ir/widen.py) the float32 product of their
    float32 values (the interpreter has widened them)."""
    product = np.matmul(a, b)
    return product if dtype is None else product.astype(np_dtype(dtype))


def _matmul_vjp(ctx, g):
    b = ctx.b
    ga = gb = None
    if ctx.needs[0]:
        ga = b.sum_to(b.matmul(g, b.swap_last2(ctx.input(1))), ctx.in_type(0).shape)
    if ctx.needs[1]:
        gb = b.sum_to(b.matmul(b.swap_last2(ctx.input(0)), g), ctx.in_type(1).shape)
    return [ga, gb]


register(
    OpDef(
        "matmul",
        (2,),
        _matmul_infer,
        _matmul_reference,
        "opaque",
        _matmul_vjp,
        attrs={"dtype": AttrSpec("dtype", required=False)},
        doc="a @ b; saves b when a needs a gradient and a when b does. dtype='f32' (set by "
        "the compiled path, ir/widen.py): bf16 operands read as they are, products and sums "
        "in float32, a float32 result",
        epilogue=True,
        flops=lambda types, out, attrs: 2 * out.size * types[0].shape[-1],
    )
)
