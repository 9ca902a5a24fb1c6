"""The blocked bfloat16 GEMM on VDPBF16PS: C (float32) = alpha * op(A) @ op(B) + beta * C.

The loops of driver.gemm_blocked (column blocks nc, k blocks kc, row blocks mc, then panels),
with both operands packed into k-pair panels (pair_pack.py) for the dot-product micro-kernel
(dot_kernel.py): B is always packed, since a pair interleaves two of its rows. The float32
GEMM's block sizes are kept: a bf16 pair panel of kc values takes half a float32 panel's bytes.
"""

import numpy as np

from backplan.codegen.jit import njit
from backplan.codegen.kernels.gemm.dot_kernel import DOT_MR, DOT_NR, dot_micro_kernel
from backplan.codegen.kernels.gemm.driver import scaled_only, store_edge
from backplan.codegen.kernels.gemm.pair_pack import pack_a_pairs, pack_b_pairs

_ALIGN = 32  # uint16 elements: each buffer starts on a 64-byte line


@njit(cache=True, nogil=True)
def dot_workspace_sizes(kc_max, mc_max, nc_max):
    """uint16 elements of the A and B pair panels, float32 elements of the edge tile."""
    kc_even = kc_max + kc_max % 2
    mc = (mc_max + DOT_MR - 1) // DOT_MR * DOT_MR
    nc = (nc_max + DOT_NR - 1) // DOT_NR * DOT_NR
    a_size = (mc * kc_even + _ALIGN - 1) // _ALIGN * _ALIGN
    b_size = (nc * kc_even + _ALIGN - 1) // _ALIGN * _ALIGN
    return a_size, b_size, DOT_MR * DOT_NR


@njit(cache=True, nogil=True)
def dot_workspace(kc_max, mc_max, nc_max):
    a_size, b_size, tile_size = dot_workspace_sizes(kc_max, mc_max, nc_max)
    return np.empty(a_size, np.uint16), np.empty(b_size, np.uint16), np.empty(tile_size, np.float32)


@njit(cache=True, nogil=True)
def _tiles(a_pack, b_pack, tile, c, i0, mc, j0, nc, kp, alpha, beta):
    """Every micro-kernel tile of the packed (mc x nc) block of C at (i0, j0)."""
    size = c.itemsize
    c_rows = c.strides[1] == size and c.strides[0] % size == 0
    ldc = c.strides[0] // size
    for jr in range(0, nc, DOT_NR):
        j = j0 + jr
        cols = min(DOT_NR, nc - jr)
        b_addr = b_pack.ctypes.data + (jr // DOT_NR) * kp * DOT_NR * 4
        for ir in range(0, mc, DOT_MR):
            i = i0 + ir
            rows = min(DOT_MR, mc - ir)
            a_addr = a_pack.ctypes.data + (ir // DOT_MR) * kp * DOT_MR * 4
            if rows == DOT_MR and cols == DOT_NR and c_rows:
                c_addr = c.ctypes.data + i * c.strides[0] + j * size
                dot_micro_kernel(kp, a_addr, b_addr, c_addr, ldc, alpha, beta)
            else:
                dot_micro_kernel(kp, a_addr, b_addr, tile.ctypes.data, DOT_NR, 1.0, 0.0)
                store_edge(tile, DOT_NR, c, i, j, rows, cols, alpha, beta)


@njit(cache=True, nogil=True)
def gemm_blocked_dot(trans_a, trans_b, alpha, a, b, beta, c, work, kc_max, mc_max, nc_max):
    """C (float32) = alpha * op(A) @ op(B) + beta * C, A and B bfloat16 bits (uint16), with
    preallocated `work` (see dot_workspace)."""
    if scaled_only(a, trans_a, c, alpha, beta):
        return
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    a_pack, b_pack, tile = work
    for jc in range(0, n, nc_max):
        nc = min(nc_max, n - jc)
        for pc in range(0, k, kc_max):
            kc = min(kc_max, k - pc)
            beta_p = beta if pc == 0 else 1.0
            pack_b_pairs(b, trans_b, pc, kc, jc, nc, DOT_NR, b_pack)
            for ic in range(0, m, mc_max):
                mc = min(mc_max, m - ic)
                pack_a_pairs(a, trans_a, ic, mc, pc, kc, DOT_MR, a_pack)
                _tiles(a_pack, b_pack, tile, c, ic, mc, jc, nc, (kc + 1) // 2, alpha, beta_p)
