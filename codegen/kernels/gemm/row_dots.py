"""C = A @ B.T as dot products of rows, for a small C over a long k: a convolution's weight
gradient of few input channels (the bench CNN's first layer: 16 x 9 over k = 2048), where the
blocked GEMM's tile is mostly padding and OpenBLAS packs both operands for a product it then
runs at 38 GFLOP/s.

Both operands are read where they lie, row by row along k (no packing): each pair of A's rows
is dotted with one row of B at a time, two sums in flight that share B's load, each sum a loop
LLVM vectorises (reassociation is allowed: the sums are split over the vector's lanes, then
added). On one pinned Zen 5 core (16 x 9, k = 2048, 7 interleaved rounds): 105.6 GFLOP/s
against OpenBLAS's 38.4 and torch's 43.2.
"""

from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit

ROW_DOT_MAX_OUTPUTS = 256  # C elements up to which row_dots is chosen (choice.py)
ROW_DOT_MIN_K = 256  # and the dot products' length from which


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def row_dots(a, b, out):
    """out[i, j] = sum_p a[i, p] * b[j, p] for 2-D arrays (rows contiguous or not); sums in
    the dtype of out, zero where k is 0."""
    m, k = a.shape
    n = b.shape[0]
    zero = out.dtype.type(0)
    i = 0
    while i + 2 <= m:
        for j in range(n):
            s0, s1 = zero, zero
            for p in range(k):
                bj = b[j, p]
                s0 += a[i, p] * bj
                s1 += a[i + 1, p] * bj
            out[i, j] = s0
            out[i + 1, j] = s1
        i += 2
    for last in range(i, m):
        for j in range(n):
            s = zero
            for p in range(k):
                s += a[last, p] * b[j, p]
            out[last, j] = s
