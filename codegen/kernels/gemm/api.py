"""The entry points generated code calls: one GEMM, or a batch of them in one call.

Both are thin: they pass addresses, sizes and strides to the blocked GEMM, which is compiled
once per dtype and called by address (gemm/symbols.py), so no caller carries a copy of it.
`gemm` is inlined where it is called: as a function of its own Numba compiled it once per
combination of literal flags and operand types at its call sites (two or three per plan).
"""

from backplan.codegen.jit import AS_PYTHON, njit
from backplan.codegen.kernels.gemm.driver import MC
from backplan.codegen.kernels.gemm.symbols import call_gemm
from backplan.codegen.kernels.lifetimes import keep_alive


@njit(cache=True, nogil=True, inline="always")
def gemm(width, trans_a, trans_b, alpha, a, b, beta, c):
    """c = alpha * op(a) @ op(b) + beta * c for 2-D f32 or f64 arrays of any strides; op
    transposes when its flag is set; width (512 or 256) picks the register tile. a and b may
    both be bfloat16 bits (uint16) or both float16 bits (int16: matmul.py marks them so) with
    c f32: products and sums are then float32.

    >>> import numpy as np
    >>> a, b = np.ones((3, 4), np.float32), np.ones((5, 4), np.float32)
    >>> c = np.empty((3, 5), np.float32)
    >>> gemm(256, False, True, 1.0, a, b, 0.0, c); float(c[0, 0])
    4.0
    """
    k = a.shape[0] if trans_a else a.shape[1]
    call_gemm(
        c.dtype,
        (
            width, trans_a, trans_b, c.shape[0], c.shape[1], k,
            a.ctypes.data, a.strides[0], a.strides[1],
            b.ctypes.data, b.strides[0], b.strides[1],
            c.ctypes.data, c.strides[0], c.strides[1],
        ),
        alpha,
        beta,
        a.dtype,
        b.dtype,
    )  # fmt: skip
    keep_alive((a, b, c))  # inlined: a temporary operand's last use was its address


ROW_BLOCK = MC  # rows of C a GEMM with an epilogue finishes at a time: the GEMM's own row block


@njit(cache=True, nogil=True)
def batched_gemm(width, trans_a, trans_b, a, b, c):
    """c[i] = op(a[i]) @ op(b[i]) for 3-D arrays; a or b may have batch size 1 (broadcast)."""
    k = a.shape[1] if trans_a else a.shape[2]
    step_a = a.strides[0] if a.shape[0] > 1 else 0
    step_b = b.strides[0] if b.shape[0] > 1 else 0
    for i in range(c.shape[0]):
        call_gemm(
            c.dtype,
            (
                width, trans_a, trans_b, c.shape[1], c.shape[2], k,
                a.ctypes.data + i * step_a, a.strides[1], a.strides[2],
                b.ctypes.data + i * step_b, b.strides[1], b.strides[2],
                c.ctypes.data + i * c.strides[0], c.strides[1], c.strides[2],
            ),
            1.0,
            0.0,
            a.dtype,
            b.dtype,
        )  # fmt: skip


if AS_PYTHON:  # the kernels are LLVM intrinsics, which plain Python cannot call

    def _widened(x):
        """bfloat16 bits (uint16) or float16 bits (int16) as the float32 values they are."""
        if x.dtype.kind == "i":
            return x.view("float16").astype("float32")
        return (x.astype("uint32") << 16).view("float32") if x.dtype.kind == "u" else x

    def gemm(width, trans_a, trans_b, alpha, a, b, beta, c):  # noqa: F811 - the NumPy twin
        a, b = _widened(a), _widened(b)
        product = alpha * ((a.T if trans_a else a) @ (b.T if trans_b else b))
        c[...] = product if beta == 0 else product + beta * c  # beta 0: c is not read

    def batched_gemm(width, trans_a, trans_b, a, b, c):  # noqa: F811
        a, b = _widened(a), _widened(b)
        c[...] = (a.swapaxes(1, 2) if trans_a else a) @ (b.swapaxes(1, 2) if trans_b else b)
