"""GEMM on operands given as (1-D base array, element offset): the plan's driver passes a base
and integers and makes no view of its own (codegen/render/placement.py); the views are made here, in
code compiled once for every plan."""

from backplan.codegen.jit import njit
from backplan.codegen.kernels.blas import gemm_f32, gemm_f64
from backplan.codegen.kernels.gemm import gemm as own_gemm


@njit(cache=True)
def matrix_at(base, offset, rows, cols):
    """The C-contiguous (rows, cols) matrix at element `offset` of a C-contiguous array (a
    scratch arena, or an input or output array of any number of dimensions)."""
    return base.reshape(-1)[offset : offset + rows * cols].reshape((rows, cols))


@njit(cache=True)
def gemm_at_f32(trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):
    """out (m, n) = op(a) @ op(b); a is (m, k) or, transposed, (k, m); b is (k, n) or (n, k)."""
    gemm_f32(
        trans_a,
        trans_b,
        matrix_at(a, a_offset, k if trans_a else m, m if trans_a else k),
        matrix_at(b, b_offset, n if trans_b else k, k if trans_b else n),
        matrix_at(out, out_offset, m, n),
        0.0,
    )


@njit(cache=True)
def gemm_at_f64(trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):
    gemm_f64(
        trans_a,
        trans_b,
        matrix_at(a, a_offset, k if trans_a else m, m if trans_a else k),
        matrix_at(b, b_offset, n if trans_b else k, k if trans_b else n),
        matrix_at(out, out_offset, m, n),
        0.0,
    )


@njit(cache=True)
def own_gemm_at(width, trans_a, trans_b, m, n, k, a, a_offset, b, b_offset, out, out_offset):
    """The own GEMM (codegen/kernels/gemm) on placed operands, as gemm_at_f32."""
    own_gemm(
        width,
        trans_a,
        trans_b,
        1.0,
        matrix_at(a, a_offset, k if trans_a else m, m if trans_a else k),
        matrix_at(b, b_offset, n if trans_b else k, k if trans_b else n),
        0.0,
        matrix_at(out, out_offset, m, n),
    )


__all__ = ["gemm_at_f32", "gemm_at_f64", "own_gemm_at"]
