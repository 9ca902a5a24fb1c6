"""matmul: BLAS (codegen/kernels/blas.py) or backplan's own GEMM (codegen/kernels/gemm), as
chosen per shape class. A 2-D product whose operands are C-contiguous where they live takes
them as (1-D base array, element offset): the plan's driver passes a base and integers and
makes no view of its own (codegen/render/placement.py); the views are made here, in code
compiled once for every plan."""

import math

from backplan.codegen.jit import AS_PYTHON, njit
from backplan.codegen.kernels.blas import batched_gemm_f32, batched_gemm_f64, gemm_f32, gemm_f64
from backplan.codegen.kernels.gemm import batched_gemm as own_batched_gemm
from backplan.codegen.kernels.gemm import gemm as own_gemm
from backplan.codegen.kernels.gemm import vector_width
from backplan.codegen.kernels.gemm.narrow import narrow_gemm_at
from backplan.codegen.kernels.gemm.parallel import batched_gemm_parallel as own_batched_gemm_par
from backplan.codegen.kernels.gemm.parallel import gemm_parallel as own_gemm_par
from backplan.codegen.kernels.views import as_read_only, contiguous_view, strided_view
from backplan.codegen.render.opaque import (
    OpEmitter,
    emits,
    narrow_gemm_chosen,
    own_gemm_chosen,
    own_gemm_parts,
    placed_operands,
)
from backplan.ir.fusion import alias_base
from backplan.ir.graph import Value
from backplan.ir.strided_copies import reads_strided_operand


@njit(cache=True)
def operands_at(trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):
    """op(a) (m, k) as stored ((k, m) when transposed), op(b) (k, n) as stored and out (m, n),
    each the C-contiguous matrix at its element offset of a flat C-contiguous base: what every
    placed GEMM below multiplies. Views built directly (views.contiguous_view), not by slicing
    and reshape: Numba compiled a slice and reshape check per base type (two variants, about
    0.5 s of a cold first call) for sizes the plan's layout already fixed."""
    return (
        contiguous_view(a, a_offset, (k if trans_a else m, m if trans_a else k)),
        contiguous_view(b, b_offset, (n if trans_b else k, k if trans_b else n)),
        contiguous_view(out, out_offset, (m, n)),
    )


@njit(cache=True)
def gemm_at_f32(trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):
    """out (m, n) = op(a) @ op(b); a is (m, k) or, transposed, (k, m); b is (k, n) or (n, k)."""
    op_a, op_b, c = operands_at(
        trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset
    )
    gemm_f32(trans_a, trans_b, op_a, op_b, c, 0.0)


@njit(cache=True)
def gemm_at_f64(trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):
    op_a, op_b, c = operands_at(
        trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset
    )
    gemm_f64(trans_a, trans_b, op_a, op_b, c, 0.0)


@njit(cache=True)
def own_gemm_at(width, trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):
    """The own GEMM (codegen/kernels/gemm) on placed operands, as gemm_at_f32."""
    op_a, op_b, c = operands_at(
        trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset
    )
    own_gemm(width, trans_a, trans_b, 1.0, op_a, op_b, 0.0, c)


@njit(cache=True)
def own_gemm_at_par(
    parts, width, trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset
):
    """own_gemm_at with C cut in `parts` blocks for as many threads (gemm/parallel.py)."""
    op_a, op_b, c = operands_at(
        trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset
    )
    own_gemm_par(parts, width, trans_a, trans_b, 1.0, op_a, op_b, 0.0, c)


@njit(cache=True)
def strided_operands_at(trans_a, trans_b, m, n, k, a, a_offset, a_strides, b, b_offset, b_strides):
    """op(a) and op(b) as operands_at makes them, each a view of its flat base at its element
    offset with these element strides (any: negative for a reversed view, 0 for a broadcast
    one, a multiple of the row for a sliced one)."""
    itemsize = a.itemsize
    return (
        strided_view(
            a,
            a_offset,
            (k if trans_a else m, m if trans_a else k),
            (a_strides[0] * itemsize, a_strides[1] * itemsize),
        ),
        strided_view(
            b,
            b_offset,
            (n if trans_b else k, k if trans_b else n),
            (b_strides[0] * itemsize, b_strides[1] * itemsize),
        ),
    )


@njit(cache=True)
def own_gemm_strided_at(
    width, trans_a, trans_b, m, n, k, a, a_offset, a_strides, b, b_offset, b_strides, out,
    out_offset,
):  # fmt: skip
    """The own GEMM on operands strided where they live, read in place: a sliced, reversed or
    broadcast view the plan would otherwise copy into its arena (ir/strided_copies.py
    reads_strided_operand); out C-contiguous at its offset, as own_gemm_at's."""
    op_a, op_b = strided_operands_at(
        trans_a, trans_b, m, n, k, a, a_offset, a_strides, b, b_offset, b_strides
    )
    c = contiguous_view(out, out_offset, (m, n))
    own_gemm(width, trans_a, trans_b, 1.0, op_a, op_b, 0.0, c)


@njit(cache=True)
def own_gemm_strided_at_par(
    parts, width, trans_a, trans_b, m, n, k, a, a_offset, a_strides, b, b_offset, b_strides,
    out, out_offset,
):  # fmt: skip
    """own_gemm_strided_at with C cut in `parts` blocks for as many threads."""
    op_a, op_b = strided_operands_at(
        trans_a, trans_b, m, n, k, a, a_offset, a_strides, b, b_offset, b_strides
    )
    c = contiguous_view(out, out_offset, (m, n))
    own_gemm_par(parts, width, trans_a, trans_b, 1.0, op_a, op_b, 0.0, c)


if AS_PYTHON:  # the parallel GEMM runs the micro-kernel intrinsics: its twin is the serial one

    def own_gemm_par(parts, *args):  # noqa: F811
        own_gemm(*args)

    def own_batched_gemm_par(*args):  # noqa: F811
        own_batched_gemm(*args)


__all__ = [
    "as_read_only",
    "batched_gemm_f32",
    "batched_gemm_f64",
    "gemm_at_f32",
    "gemm_at_f64",
    "gemm_f32",
    "gemm_f64",
    "narrow_gemm_at",
    "own_batched_gemm",
    "own_batched_gemm_par",
    "own_gemm",
    "own_gemm_at",
    "own_gemm_par",
    "own_gemm_at_par",
    "own_gemm_strided_at",
    "own_gemm_strided_at_par",
]


def as_gemm_operand(expression: str, dtype: str) -> str:
    """A matmul operand as the GEMM reads it: float16 bits viewed as int16, which tells the
    GEMM (gemm/symbols.py) float16 from bfloat16 (uint16; Numba has neither type)."""
    return f"{expression}.view(np.int16)" if dtype == "f16" else expression


@emits("matmul")
def emit_matmul(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    own = own_gemm_chosen(ctx, node)
    parts = own_gemm_parts(node)
    placed = _placed_matmul(ctx, node, own, parts) if len(node.shape) == 2 else None
    if placed is None and own and len(node.shape) == 2:
        placed = _strided_matmul(ctx, node, parts)
    if placed is not None:
        return placed
    (a, ta), (b, tb) = ctx.operand_2d(node.inputs[0]), ctx.operand_2d(node.inputs[1])
    a, b = (as_gemm_operand(x, v.dtype) for x, v in zip((a, b), node.inputs, strict=True))
    if len(node.shape) == 2:
        if own and parts > 1:
            return [
                f"own_gemm_par({parts}, {vector_width()}, {ta}, {tb}, 1.0, {a}, {b}, 0.0, {out})"
            ]
        if own:
            return [f"own_gemm({vector_width()}, {ta}, {tb}, 1.0, {a}, {b}, 0.0, {out})"]
        return [f"gemm_{node.dtype}({ta}, {tb}, {a}, {b}, {out}, 0.0)"]
    return _batched_matmul(node, out, (a, ta), (b, tb), own, parts)


def _placed_matmul(ctx: OpEmitter, node: Value, own: bool, parts: int) -> list[str] | None:
    """A 2-D matmul whose operands are C-contiguous where they live: one library call
    taking bases and offsets; None when an operand is not (a copy is made then)."""
    operands = placed_operands(ctx, node)
    if operands is None:
        return None
    out = ctx.place(node, flat=False)
    (ta, a), (tb, b) = operands
    m, n = node.shape
    sizes = f"np.intp({m}), np.intp({n}), np.intp({node.inputs[0].shape[-1]})"
    dtypes = tuple(i.dtype for i in node.inputs)
    arguments = _one_variant(ta, tb, sizes, (a, b, out), dtypes)
    if own and parts > 1:
        return [f"own_gemm_at_par(np.intp({parts}), {vector_width()}, {arguments})"]
    if own:
        return [f"own_gemm_at({vector_width()}, {arguments})"]
    if len(node.inputs[0].shape) == 2 and narrow_gemm_chosen(ctx, node):
        return [f"narrow_gemm_at({arguments})"]
    return [f"gemm_at_{node.dtype}({arguments})"]


def _strided_matmul(ctx: OpEmitter, node: Value, parts: int) -> list[str] | None:
    """A 2-D matmul with an operand strided where it lives (ir/strided_copies.py
    reads_strided_operand): backplan's GEMM reads both where they are, each as (flat base,
    offset, element strides); None when an operand is a literal or 16-bit, or nothing is
    placed (the views are made in the driver then)."""
    if ctx.place is None or not reads_strided_operand(node):
        return None
    operands = []
    for value in node.inputs:
        trans = ctx.absorbs(value)
        source = value.inputs[0] if trans else value
        if ctx.literal_of(alias_base(source)) is not None:
            return None
        where = ctx.place(source, flat=False)
        if len(where.strides) != 2:
            return None
        strides = ", ".join(f"np.intp({s})" for s in where.strides)
        array = f"as_read_only({where.base}.reshape(-1)), np.intp({where.offset}), ({strides})"
        operands.append((trans, array))
    out = ctx.place(node, flat=False)
    (ta, a), (tb, b) = operands
    m, n = node.shape
    arguments = (
        f"np.bool_({ta}), np.bool_({tb}), np.intp({m}), np.intp({n}), "
        f"np.intp({node.inputs[0].shape[-1]}), {a}, {b}, {out.base}.reshape(-1), "
        f"np.intp({out.offset})"
    )
    if parts > 1:
        return [f"own_gemm_strided_at_par(np.intp({parts}), {vector_width()}, {arguments})"]
    return [f"own_gemm_strided_at({vector_width()}, {arguments})"]


def _one_variant(ta, tb, sizes: str, places, dtypes: tuple) -> str:
    """A placed GEMM's arguments typed alike at every call, BLAS or own: the flags as run-time
    booleans, every base flat, the operands read-only. Literal flags, an input's own rank and
    a writable operand each made Numba compile gemm_at_f32 (and gemm_f32 and _gemm inside it)
    again: five variants, about 4 of a small MLP's 9 s first call from a fresh install; the
    own GEMM's entry compiled once per pair of transpose flags (three in the mlp's step)."""
    a, b, out = places
    operands = ", ".join(
        f"as_read_only({as_gemm_operand(f'{w.base}.reshape(-1)', dtype)}), np.intp({w.offset})"
        for w, dtype in zip((a, b), dtypes, strict=True)
    )
    return (
        f"np.bool_({ta}), np.bool_({tb}), {sizes}, {operands}, "
        f"{out.base}.reshape(-1), np.intp({out.offset})"
    )


def _batched_matmul(node: Value, out: str, a_op, b_op, own: bool, parts: int) -> list[str]:
    operands = []
    batch = node.shape[:-2]
    for value, (expr, trans) in zip(node.inputs, (a_op, b_op), strict=True):
        expr = as_gemm_operand(expr, value.dtype)
        source = value.inputs[0] if trans else value
        mat = source.shape[-2:]
        own_batch = source.shape[:-2]
        padded = (1,) * (len(batch) - len(own_batch)) + own_batch
        if math.prod(padded) not in (1, math.prod(batch)) or (
            math.prod(padded) != 1 and padded != batch
        ):
            expr = f"np.ascontiguousarray(np.broadcast_to({expr}, {batch + mat!r}))"
            padded = batch
        operands.append(f"{expr}.reshape(({math.prod(padded)}, {mat[0]}, {mat[1]}))")
    out3 = f"{out}.reshape(({math.prod(batch)}, {node.shape[-2]}, {node.shape[-1]}))"
    call = f"own_batched_gemm({vector_width()}, " if own else f"batched_gemm_{node.dtype}("
    if own and parts > 1:
        call = f"own_batched_gemm_par({vector_width()}, "
    return [f"{call}{a_op[1]}, {b_op[1]}, {operands[0]}, {operands[1]}, {out3})"]
