"""Packing: copy a block of op(A) or op(B) into the panel order the micro-kernel reads.

A block of op(A) (mc x kc) becomes ceil(mc / mr) panels, each kc rows of mr values (rows past
the edge are zero), so the kernel reads A with unit stride. B is read in place when its rows are
contiguous; otherwise (transposed, or an edge panel narrower than the tile) a kc x nc block
becomes panels of kc rows of nr values.
"""

from ..jit import njit


@njit(cache=True, nogil=True)
def pack_a(a, trans_a, i0, mc, p0, kc, mr, out):
    """Panels of op(A)[i0:i0+mc, p0:p0+kc]; op(A) = A.T when trans_a."""
    for panel in range((mc + mr - 1) // mr):
        base = panel * kc * mr
        first = i0 + panel * mr
        rows = min(mr, i0 + mc - first)
        if trans_a:
            for p in range(kc):
                for r in range(rows):
                    out[base + p * mr + r] = a[p0 + p, first + r]
                for r in range(rows, mr):
                    out[base + p * mr + r] = 0
        else:
            for r in range(rows):
                for p in range(kc):
                    out[base + p * mr + r] = a[first + r, p0 + p]
            for r in range(rows, mr):
                for p in range(kc):
                    out[base + p * mr + r] = 0


@njit(cache=True, nogil=True)
def pack_b(b, trans_b, p0, kc, j0, nc, nr, out):
    """Panels of op(B)[p0:p0+kc, j0:j0+nc]; op(B) = B.T when trans_b."""
    for panel in range((nc + nr - 1) // nr):
        base = panel * kc * nr
        first = j0 + panel * nr
        cols = min(nr, j0 + nc - first)
        if trans_b:
            for q in range(cols):
                for p in range(kc):
                    out[base + p * nr + q] = b[first + q, p0 + p]
        else:
            for p in range(kc):
                for q in range(cols):
                    out[base + p * nr + q] = b[p0 + p, first + q]
        for p in range(kc):
            for q in range(cols, nr):
                out[base + p * nr + q] = 0
