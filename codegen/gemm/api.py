"""The entry points generated code calls: one GEMM, or a batch of them in one call."""

from ..jit import AS_PYTHON, njit
from .driver import KC, MC, NC, gemm_blocked, workspace


@njit(cache=True, nogil=True)
def gemm(width, trans_a, trans_b, alpha, a, b, beta, c):
    """c = alpha * op(a) @ op(b) + beta * c for 2-D f32 or f64 arrays of any strides; op
    transposes when its flag is set; width (512 or 256) picks the register tile.

    >>> import numpy as np
    >>> a, b = np.ones((3, 4), np.float32), np.ones((5, 4), np.float32)
    >>> c = np.empty((3, 5), np.float32)
    >>> gemm(256, False, True, 1.0, a, b, 0.0, c); float(c[0, 0])
    4.0
    """
    work = workspace(width, c, KC, MC, NC)
    gemm_blocked(width, trans_a, trans_b, alpha, a, b, beta, c, work, KC, MC, NC)


ROW_BLOCK = MC  # rows of C a GEMM with an epilogue finishes at a time: the GEMM's own row block


@njit(cache=True, nogil=True)
def gemm_workspace(width, c):
    """The packing buffers of `gemm_into` for GEMMs into arrays like c (see driver.workspace)."""
    return workspace(width, c, KC, MC, NC)


@njit(cache=True, nogil=True)
def gemm_into(width, trans_a, trans_b, a, b, c, work):
    """c = op(a) @ op(b) with buffers from gemm_workspace: loop kernels that run an epilogue
    on each block of rows of c call it once per block (codegen/epilogue.py)."""
    gemm_blocked(width, trans_a, trans_b, 1.0, a, b, 0.0, c, work, KC, MC, NC)


@njit(cache=True, nogil=True)
def batched_gemm(width, trans_a, trans_b, a, b, c):
    """c[i] = op(a[i]) @ op(b[i]) for 3-D arrays; a or b may have batch size 1 (broadcast)."""
    work = workspace(width, c, KC, MC, NC)
    last_a, last_b = a.shape[0] - 1, b.shape[0] - 1
    for i in range(c.shape[0]):
        gemm_blocked(
            width,
            trans_a,
            trans_b,
            1.0,
            a[min(i, last_a)],
            b[min(i, last_b)],
            0.0,
            c[i],
            work,
            KC,
            MC,
            NC,
        )


if AS_PYTHON:  # the kernels are LLVM intrinsics, which plain Python cannot call

    def gemm(width, trans_a, trans_b, alpha, a, b, beta, c):  # noqa: F811 - the NumPy twin
        product = alpha * ((a.T if trans_a else a) @ (b.T if trans_b else b))
        c[...] = product if beta == 0 else product + beta * c  # beta 0: c is not read

    def batched_gemm(width, trans_a, trans_b, a, b, c):  # noqa: F811
        c[...] = (a.swapaxes(1, 2) if trans_a else a) @ (b.swapaxes(1, 2) if trans_b else b)

    def gemm_into(width, trans_a, trans_b, a, b, c, work):  # noqa: F811
        c[...] = (a.T if trans_a else a) @ (b.T if trans_b else b)
