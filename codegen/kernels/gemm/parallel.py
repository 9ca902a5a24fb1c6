"""The GEMM over several cores: gemm_parallel shares one product between the caller and helper
threads (team.py) or, without futexes, cuts C into as many blocks as Numba has threads, along
its longer side (rows of C with their rows of op(A), or columns with their columns of op(B)),
each block the single-core GEMM, packing into a buffer of the kept slots (gemm/scratch.py); a
batch is shared out by entries.
bfloat16 blocks call the published bf16 GEMM (symbols.py: VDPBF16PS where the CPU has it)."""

import numpy as np

from backplan.codegen.jit import njit, prange
from backplan.codegen.kernels.atomics import FUTEX_AVAILABLE
from backplan.codegen.kernels.gemm.api import gemm
from backplan.codegen.kernels.gemm.driver import tile_shape
from backplan.codegen.kernels.gemm.team import gemm_team
from backplan.codegen.kernels.threads_now import threads_now


@njit(cache=True, nogil=True)
def _bounds(part, parts, length, step):
    """[start, stop) of block `part`: equal blocks, rounded up to multiples of step."""
    chunk = (length + parts * step - 1) // (parts * step) * step
    start = min(part * chunk, length)
    return start, min(start + chunk, length)


@njit(cache=True, nogil=True, parallel=True)
def gemm_parallel_region(parts, width, trans_a, trans_b, alpha, a, b, beta, c):
    """gemm (see api.gemm) with C's longer side cut in `parts` blocks for Numba's threads
    (a count passed in: reading the thread count inside would stop Numba caching this).
    Where the platform has futexes, gemm_parallel is team.gemm_team instead."""
    if threads_now() < 2:  # the step found one free core: no pool thread to hand it to
        _block(width, trans_a, trans_b, alpha, a, b, beta, c)
        return
    m, n = c.shape
    mr, nr = tile_shape(width, c.itemsize)
    by_rows = m >= n
    for part in prange(parts):
        if by_rows:
            i0, i1 = _bounds(part, parts, m, mr)
            a_part = a[:, i0:i1] if trans_a else a[i0:i1, :]
            _block(width, trans_a, trans_b, alpha, a_part, b, beta, c[i0:i1, :])
        else:
            j0, j1 = _bounds(part, parts, n, nr)
            b_part = b[j0:j1, :] if trans_b else b[:, j0:j1]
            _block(width, trans_a, trans_b, alpha, a, b_part, beta, c[:, j0:j1])


@njit(cache=True, nogil=True)
def _block(width, trans_a, trans_b, alpha, a, b, beta, c):
    """One thread's block, through the published single-thread GEMM of its dtype (bfloat16
    on VDPBF16PS where the CPU has it), which packs into a buffer the thread takes from the
    kept slots (gemm/scratch.py). A workspace of the block's own, allocated here, was a few
    MB (MC x KC + NC x KC elements, whatever the block's size) per block per call: a batch of
    32 small products made 96 allocations a call."""
    gemm(width, trans_a, trans_b, alpha, a, b, beta, c)


@njit(cache=True, nogil=True, parallel=True)
def batched_gemm_parallel(width, trans_a, trans_b, a, b, c):
    """batched_gemm (see api.batched_gemm) with the batch entries shared out between threads."""
    if threads_now() < 2:
        gemm_serial_batch(width, trans_a, trans_b, a, b, c)
        return
    last_a, last_b = a.shape[0] - 1, b.shape[0] - 1
    for i in prange(c.shape[0]):
        index = np.intp(i)  # the prange index is unsigned: min() with a signed int gives float
        a_i, b_i = a[min(index, last_a)], b[min(index, last_b)]
        _block(width, trans_a, trans_b, 1.0, a_i, b_i, 0.0, c[index])


@njit(cache=True, nogil=True)
def gemm_serial_batch(width, trans_a, trans_b, a, b, c):
    """batched_gemm_parallel's entries one after another on the calling thread."""
    last_a, last_b = a.shape[0] - 1, b.shape[0] - 1
    for i in range(c.shape[0]):
        _block(width, trans_a, trans_b, 1.0, a[min(i, last_a)], b[min(i, last_b)], 0.0, c[i])


# Where the platform has futexes the caller and helpers waiting for work share the chunks
# (gemm/team.py); elsewhere a prange region hands them to Numba's pool.
gemm_parallel = gemm_team if FUTEX_AVAILABLE else gemm_parallel_region
