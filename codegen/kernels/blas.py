"""GEMM from compiled code: one cached helper calling the BLAS that NumPy and SciPy use, with
transpose flags instead of transposed copies."""

import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic
from numba.np.linalg import ensure_blas

from backplan.codegen.jit import AS_PYTHON, njit
from backplan.codegen.kernels.lifetimes import keep_alive
from backplan.codegen.kernels.scipy_blas import preload_cython_blas

preload_cython_blas()  # saves the 0.2 s import of all of scipy.linalg that ensure_blas does
ensure_blas()


_XXGEMM = types.ExternalFunction(
    "numba_xxgemm",
    types.intc(
        types.char,
        types.char,
        types.char,
        types.intp,
        types.intp,
        types.intp,
        types.voidptr,
        types.voidptr,
        types.intp,
        types.voidptr,
        types.intp,
        types.voidptr,
        types.voidptr,
        types.intp,
    ),
)


@intrinsic
def _voidptr(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.intp), codegen


# alpha=1 and beta (0 or 1) for BLAS, frozen into the compiled code: no allocation per call.
_ONE_ZERO_F32 = np.array([1.0, 0.0], np.float32)
_ONE_ONE_F32 = np.array([1.0, 1.0], np.float32)
_ONE_ZERO_F64 = np.array([1.0, 0.0], np.float64)
_ONE_ONE_F64 = np.array([1.0, 1.0], np.float64)


@njit(cache=True)
def _gemm(kind, trans_a, trans_b, a, b, out, scalars):
    """out = op(a) @ op(b) + beta * out, for C-contiguous 2-D arrays (op transposes if asked).
    Row-major data seen as column-major is the transpose, so BLAS computes out^T = b^T a^T."""
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0:
        out[:] = 0
        return
    _XXGEMM(
        kind,
        84 if trans_b else 78,
        84 if trans_a else 78,
        n,
        m,
        k,
        _voidptr(scalars.ctypes.data),
        _voidptr(b.ctypes.data),
        max(b.shape[1], 1),
        _voidptr(a.ctypes.data),
        max(a.shape[1], 1),
        _voidptr(scalars.ctypes.data + scalars.itemsize),
        _voidptr(out.ctypes.data),
        max(n, 1),
    )


@njit(inline="always")
def rows_contiguous(x) -> bool:
    """Whether BLAS can read a 2-D array as it is: unit stride along each row."""
    return x.shape[1] <= 1 or x.strides[1] == x.itemsize


@intrinsic
def _scalars_on_stack(typingctx, alpha, beta, like):
    """The address of two values of `like`'s dtype, alpha then beta, in the calling function's
    stack frame (allocated once, in its entry block): BLAS reads them by pointer, and an
    np.empty(2) for them was an allocation per product."""
    dtype = like.dtype

    def codegen(context, builder, signature, args):
        pair = cgutils.alloca_once(builder, context.get_value_type(dtype), size=2)
        for index, (value, kind) in enumerate(zip(args[:2], signature.args[:2], strict=True)):
            at = builder.gep(pair, [context.get_constant(types.intp, index)])
            builder.store(context.cast(builder, value, kind, dtype), at)
        return builder.ptrtoint(pair, context.get_value_type(types.intp))

    return types.intp(alpha, beta, like), codegen


@njit(cache=True, nogil=True, inline="always")
def gemm_rows(trans_a, trans_b, alpha, a, b, beta, out):
    """out = alpha * op(a) @ op(b) + beta * out for 2-D f32 or f64 arrays whose rows are
    contiguous (rows_contiguous), any row stride: per-head views of a projection, read in
    place. Empty cases are the caller's. Inlined where it is called, passing _gemm_rows_at
    addresses and row strides: as a function taking the arrays, Numba compiled it (and
    _gemm_rows) once per combination of literal flags, layouts and read-only operands at its
    call sites (three each in a small CNN's step, three in the transformer's attention)."""
    scalars = _scalars_on_stack(alpha, beta, out)  # an address, valid until the caller returns
    step = out.itemsize
    _gemm_rows_at(
        trans_a != 0, trans_b != 0, out.shape[0], out.shape[1],
        a.shape[0] if trans_a else a.shape[1],
        a.ctypes.data, max(a.strides[0] // step, a.shape[1], 1),
        b.ctypes.data, max(b.strides[0] // step, b.shape[1], 1),
        out.ctypes.data, max(out.strides[0] // step, out.shape[1], 1),
        scalars, step,
    )  # fmt: skip
    keep_alive((a, b, out))  # their addresses were their last use: alive until BLAS returns


@njit(cache=True, nogil=True)
def _gemm_rows_at(trans_a, trans_b, m, n, k, a, lda, b, ldb, out, ldc, scalars, itemsize):
    """BLAS on row-major matrices at addresses a, b, out with row strides in elements; alpha
    and beta at address scalars, in the matrices' dtype (itemsize 4: float32, else float64)."""
    _XXGEMM(
        115 if itemsize == 4 else 100,
        84 if trans_b else 78,
        84 if trans_a else 78,
        n,
        m,
        k,
        _voidptr(scalars),
        _voidptr(b),
        ldb,
        _voidptr(a),
        lda,
        _voidptr(scalars + itemsize),
        _voidptr(out),
        ldc,
    )


@njit(cache=True)
def gemm_f32(trans_a, trans_b, a, b, out, beta):
    _gemm(115, trans_a, trans_b, a, b, out, _ONE_ONE_F32 if beta != 0 else _ONE_ZERO_F32)


@njit(cache=True)
def gemm_f64(trans_a, trans_b, a, b, out, beta):
    _gemm(100, trans_a, trans_b, a, b, out, _ONE_ONE_F64 if beta != 0 else _ONE_ZERO_F64)


if AS_PYTHON:

    def _gemm_python(trans_a, trans_b, a, b, out, beta):
        product = (a.T if trans_a else a) @ (b.T if trans_b else b)
        out[...] = product if beta == 0 else product + beta * out  # beta 0: out is not read

    gemm_f32 = gemm_f64 = _gemm_python  # noqa: F811 - the plain-Python twins

    def gemm_rows(trans_a, trans_b, alpha, a, b, beta, out):  # noqa: F811
        product = alpha * ((a.T if trans_a else a) @ (b.T if trans_b else b))
        out[...] = product if beta == 0 else product + beta * out


@njit(cache=True)
def batched_gemm_f32(trans_a, trans_b, a, b, out):
    """Batches of C-contiguous matrices (3-D, batch first); a or b may have batch size 1."""
    for i in range(out.shape[0]):
        gemm_f32(
            trans_a, trans_b, a[min(i, a.shape[0] - 1)], b[min(i, b.shape[0] - 1)], out[i], 0.0
        )


@njit(cache=True)
def batched_gemm_f64(trans_a, trans_b, a, b, out):
    for i in range(out.shape[0]):
        gemm_f64(
            trans_a, trans_b, a[min(i, a.shape[0] - 1)], b[min(i, b.shape[0] - 1)], out[i], 0.0
        )
