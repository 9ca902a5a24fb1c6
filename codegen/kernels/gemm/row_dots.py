"""C = A @ B.T as dot products of rows, for a small C over a long k: a convolution's weight
gradient of few input channels (the bench CNN's first layer: 16 x 9 over k = 2048), where the
blocked GEMM's tile is mostly padding and OpenBLAS packs both operands for a product it then
runs at 38 GFLOP/s.

Both operands are read where they lie, row by row along k (no packing): four rows of A are
dotted with two rows of B at a time, eight sums in flight sharing six loads a step, each sum a
loop LLVM vectorises (reassociation is allowed: the sums are split over the vector's lanes,
then added). On one pinned Zen 5 core (16 x 9, k = 2048, 7 interleaved rounds): 137.8 GFLOP/s
(two rows by one: 77-106) against OpenBLAS's 38.3 and torch's 43.0.
"""

from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit

ROW_DOT_MAX_OUTPUTS = 256  # C elements up to which row_dots is chosen (choice.py)
ROW_DOT_MIN_K = 256  # and the dot products' length from which


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def row_dots(a, b, out):
    """out[i, j] = sum_p a[i, p] * b[j, p] for 2-D arrays (rows contiguous or not); sums in
    the dtype of out, zero where k is 0. Blocks of 4 rows of A by 2 rows of B: eight sums in
    flight from six loads a step (one row by one: two loads a product)."""
    m, k = a.shape
    n = b.shape[0]
    zero = out.dtype.type(0)
    m4, n2 = m - m % 4, n - n % 2
    for i in range(0, m4, 4):
        for j in range(0, n2, 2):
            s00, s01, s10, s11 = zero, zero, zero, zero
            s20, s21, s30, s31 = zero, zero, zero, zero
            for p in range(k):
                b0, b1 = b[j, p], b[j + 1, p]
                a0, a1, a2, a3 = a[i, p], a[i + 1, p], a[i + 2, p], a[i + 3, p]
                s00 += a0 * b0
                s01 += a0 * b1
                s10 += a1 * b0
                s11 += a1 * b1
                s20 += a2 * b0
                s21 += a2 * b1
                s30 += a3 * b0
                s31 += a3 * b1
            out[i, j], out[i, j + 1] = s00, s01
            out[i + 1, j], out[i + 1, j + 1] = s10, s11
            out[i + 2, j], out[i + 2, j + 1] = s20, s21
            out[i + 3, j], out[i + 3, j + 1] = s30, s31
        if n2 < n:  # B's last row
            s0, s1, s2, s3 = zero, zero, zero, zero
            for p in range(k):
                bj = b[n2, p]
                s0 += a[i, p] * bj
                s1 += a[i + 1, p] * bj
                s2 += a[i + 2, p] * bj
                s3 += a[i + 3, p] * bj
            out[i, n2], out[i + 1, n2], out[i + 2, n2], out[i + 3, n2] = s0, s1, s2, s3
    for last in range(m4, m):  # A's last rows
        for j in range(n):
            s = zero
            for p in range(k):
                s += a[last, p] * b[j, p]
            out[last, j] = s
