"""The blocked GEMM: C = alpha * op(A) @ op(B) + beta * C, one core, any strides.

Loops (BLIS order): column blocks of C (nc), then k blocks (kc), then row blocks (mc), then
nr-wide column panels of B, then mr-row panels of A: the kernel's B panel stays in L1 while A
panels stream from L2. Tiles cut by the edge of C go through a small buffer.

A is read where it lies when its rows have unit stride (op(A) = A or A.T): the kernel
broadcasts A[i + r, p] from lda elements apart instead of from a packed panel; only a last
panel of fewer than mr rows is packed (zero padded). Packing A was a transposing copy per k
block that the in-place kernel, as fast as the packed one from L1 (267-277 GFLOP/s either way),
does not need: on one pinned Zen 5 core, thread CPU, 7 interleaved rounds, the GEMM took
0.96x the time on the mlp's NN and TN products (128x512x784, 128x512x512, 512x512x128,
784x512x128), 0.98x on its NT dX, 0.87x on mlp_deep's 256x128x128, 0.93-0.99x on the
transformer's, and 0.78-0.86x on small odd shapes.

B is packed when C has more rows than one row block: read in place, rows of a B with 512 or
1024 columns fall 2-4 KiB apart, into a handful of L1 sets, and the panel does not stay in L1.
Packed, on an Intel AVX-512 core, 7-9 interleaved rounds: mlp dW 0.72 -> 0.94 of OpenBLAS, tf
fwd (1024 rows) 0.76 -> 0.91. With one row block B is read in place: packing it costs more
than it saves (128x256x256 1.41 in place against 1.26 packed; 32x128x128 0.81 against 0.45).
A B of LARGE_B_BYTES or more read in place is first read row by row (touch_rows), so that it
comes into the caches as contiguous rows, not as panels 2-4 KiB apart a miss at a time: the
mlp's step, its two forward products 1,177 / 734 -> 994-1,007 / 640-654 us (cycle counter per
call, one Zen 4 core, load 20).
The 256-bit tile reads B in place only up to IN_PLACE_ROWS_256 rows of C: its 16-column panel
read in place ran at 85-105 GFLOP/s depending on where the operands lay (emulated AVX2 on a
Zen 4 core, thread CPU, six allocations each: 128x512x512 86.0-100.5 in place against
95.9-100.2 packed, 128x512x784 84.8-98.0 against 93.3-95.4, 128x128x256 90.3-104.7 against
97.2-100.9), while with 64 rows packing costs more (64x512x512 87.9-103.3 against 88.6-94.5;
32x512x144 84.9-97.4 against 68.9-74.6).

On the 256-bit tile (6 x 16) a row block of 6k + 2 or 6k + 4 rows, A in place, ends in one or
two 4-row tiles (8 accumulators) instead of a 6-row tile through the edge buffer (the mlp's 128
rows: 21 tiles + 2 rows, now 20 + 4 + 4): emulated AVX2 on one Zen 4 core (bench/isa_env.py),
thread CPU, 5 interleaved rounds, the mlp's products 99-102 -> 103-106 GFLOP/s.

A column-major C (C.T of a row-major result: symbols.py computes a wide-C NT product that
way) has its full tiles over A's rows in place stored transposed by the kernel
(kernel.store_tile_transposed); other tiles of such a C go through the edge tile.

A and B may be bfloat16 (uint16 bits) with C float32: pack.py widens them into the float32
panels, so the products and the sums are float32, as a float32 GEMM of the widened operands.
Where the CPU has AVX512_BF16 the bfloat16 GEMM runs dot_driver.py instead (symbols.py).
"""

import numpy as np

from backplan.codegen.jit import njit
from backplan.codegen.kernels.by_address import by_address
from backplan.codegen.kernels.gemm.blocking import machine_block_sizes
from backplan.codegen.kernels.gemm.kernel import (
    REMAINDER_ROWS,
    TILES,
    micro_kernel_256,
    micro_kernel_256_a_columns,
    micro_kernel_256_a_columns_4,
    micro_kernel_256_a_rows,
    micro_kernel_256_a_rows_4,
    micro_kernel_512,
    micro_kernel_512_a_columns,
    micro_kernel_512_a_rows,
    micro_kernel_512_a_rows_c_columns,
)
from backplan.codegen.kernels.gemm.pack import pack_a, pack_b
from backplan.codegen.kernels.lifetimes import keep_value

IN_PLACE_ROWS_256 = 64  # rows of C up to which the 256-bit tile reads B in place (see above)
# Elements; from this machine's cache sizes (blocking.py): 256, 128, 2048 on Zen 4. Compiled in
# as constants: the cache keys of the GEMM and of the kernels calling it name them.
KC, MC, NC = machine_block_sizes()
_MR512_F32, _NR512_F32 = TILES[512]["f32"][1], TILES[512]["f32"][0] * TILES[512]["f32"][2]
_MR512_F64, _NR512_F64 = TILES[512]["f64"][1], TILES[512]["f64"][0] * TILES[512]["f64"][2]
_MR256_F32, _NR256_F32 = TILES[256]["f32"][1], TILES[256]["f32"][0] * TILES[256]["f32"][2]
_MR256_F64, _NR256_F64 = TILES[256]["f64"][1], TILES[256]["f64"][0] * TILES[256]["f64"][2]


@njit(cache=True, nogil=True)
def tile_shape(width, itemsize):
    """(mr, nr) of the micro-kernel for a vector width in bits and an element size in bytes."""
    if width == 512:
        return (_MR512_F32, _NR512_F32) if itemsize == 4 else (_MR512_F64, _NR512_F64)
    return (_MR256_F32, _NR256_F32) if itemsize == 4 else (_MR256_F64, _NR256_F64)


@njit(cache=True, nogil=True, inline="always")  # one copy per call site, not a variant each
def _kernel(width, kc, a_addr, b_addr, ldb, c_addr, ldc, alpha, beta, like):
    if width == 512:
        micro_kernel_512(kc, a_addr, b_addr, ldb, c_addr, ldc, alpha, beta, like)
    else:
        micro_kernel_256(kc, a_addr, b_addr, ldb, c_addr, ldc, alpha, beta, like)


@njit(cache=True, nogil=True, inline="always")
def _kernel_a_in_place(
    width, columns, kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like
):
    """_kernel with A read where it lies: op(A) row-major (columns False: NN) or A row-major
    and transposed (columns True: TN), lda elements apart."""
    if width == 512:
        if columns:
            micro_kernel_512_a_columns(kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like)
        else:
            micro_kernel_512_a_rows(kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like)
    elif columns:
        micro_kernel_256_a_columns(kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like)
    else:
        micro_kernel_256_a_rows(kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like)


@njit(cache=True, nogil=True, inline="always")
def _kernel_a_in_place_4(columns, kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like):
    """The 256-bit kernel's 4-row tile, A in place (see _kernel_a_in_place)."""
    if columns:
        micro_kernel_256_a_columns_4(kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like)
    else:
        micro_kernel_256_a_rows_4(kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like)


@njit(cache=True, nogil=True)
def four_row_start(width, mr, mc, a_in_place):
    """Where a row block's 4-row tiles start (mc: none): the 256-bit tile's 6 rows leave 2 or
    4 at the end of most blocks (128 = 21 * 6 + 2), which the 6-row kernel ran through the
    edge buffer at a 6-row tile's cost; two 4-row tiles (for 2 left: 6 + 2 = 4 + 4) or one
    run them in place."""
    left = mc % mr
    tiled = 8 if left == 2 else 4  # the rows the 4-row tiles take
    if width != 256 or not a_in_place or mr != 6 or left not in (2, 4) or mc < tiled:
        return mc
    return mc - tiled


# A B of this many bytes or more (a quarter of a 1 MiB L2) is taken not to be in L2 when a
# product starts: read in place, its blocks are first read row by row (touch_rows), and
# gemm/team.py shares such a product out by columns, not rows that each read all of B
LARGE_B_BYTES = 256 << 10
_LINE = 64  # bytes


@njit(cache=True, nogil=True)
def touch_rows(b, p0, kc, j0, nc):
    """One element of each cache line of B[p0:p0+kc, j0:j0+nc], read row after row, summed
    (the caller keeps the sum, and with it the reads: lifetimes.keep_value). The panels read
    in place take 128 bytes of each row, rows 2-4 KiB apart: a page every row or two, which
    the hardware prefetchers do not follow, so a B that was not in cache arrived one miss at
    a time (the mlp's 784 x 512 weight in its step: 1,177 us for its forward product, 951
    after a sequential read of it that took 59; thread CPU, one Zen 4 core). Read row by
    row, each row is one contiguous stream the prefetchers follow. Every element, summed as
    a vector loop, took longer (1,255 us): the GEMM's symbols are compiled without LLVM's
    loop vectoriser, so that sum ran as a scalar chain."""
    step = max(1, _LINE // b.itemsize)
    t0 = t1 = t2 = t3 = 0.0  # four sums: one chain of adds took 3-4 cycles a line from L2
    end = j0 + nc
    for p in range(p0, p0 + kc):
        j = j0
        while j + 3 * step < end:
            t0 += b[p, j]
            t1 += b[p, j + step]
            t2 += b[p, j + 2 * step]
            t3 += b[p, j + 3 * step]
            j += 4 * step
        while j < end:
            t0 += b[p, j]
            j += step
    return t0 + t1 + t2 + t3


@njit(cache=True, nogil=True)
def scale_c(c, beta):
    """C = beta * C (k == 0 or alpha == 0); beta == 0 writes zeros without reading C."""
    for i in range(c.shape[0]):
        for j in range(c.shape[1]):
            c[i, j] = 0 if beta == 0 else beta * c[i, j]


@njit(cache=True, nogil=True)
def store_edge(tile, nr, c, i, j, rows, cols, alpha, beta):
    """The valid rows x cols corner of an edge tile into C."""
    for r in range(rows):
        for q in range(cols):
            value = alpha * tile[r * nr + q]
            c[i + r, j + q] = value if beta == 0 else value + beta * c[i + r, j + q]


@njit(cache=True, nogil=True)
def workspace_sizes(width, itemsize, kc_max, mc_max, nc_max):
    """Elements of the (A panels, B panels, edge tile) buffers."""
    mr, nr = tile_shape(width, itemsize)
    mc = (mc_max + mr - 1) // mr * mr
    nc = (nc_max + nr - 1) // nr * nr
    return mc * kc_max, nc * kc_max, mr * nr


@njit(cache=True, nogil=True)
def workspace(width, c, kc_max, mc_max, nc_max):
    """(A panels, B panels, edge tile) buffers for GEMMs into arrays like c."""
    a_size, b_size, tile_size = workspace_sizes(width, c.itemsize, kc_max, mc_max, nc_max)
    return np.empty(a_size, c.dtype), np.empty(b_size, c.dtype), np.empty(tile_size, c.dtype)


@njit(cache=True, nogil=True)
def scaled_only(a, trans_a, c, alpha, beta):
    """True when there is nothing to multiply (C empty, k == 0 or alpha == 0): C then holds
    beta * C already. Both blocked GEMMs (this one and dot_driver's) start here."""
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if m == 0 or n == 0:
        return True
    if k == 0 or alpha == 0:
        scale_c(c, beta)
        return True
    return False


# Called by address (by_address.py) from the symbols and the parallel GEMM's blocks: compiled
# once per dtype. Inlined into each symbol, Numba's inliner deep-copied the function's scope
# once per block of its IR (about a quarter of the symbol's cold compile); linked, it was
# optimised and emitted again in every caller. a and b in any layout, read-only; c in any
# layout. _nrt as the symbols' (symbols.py): it compiles inside the compile of its caller.
@by_address(arrays=(7,), read_only=(4, 5), cache=True, nogil=True, _nrt=True)
def gemm_blocked(width, trans_a, trans_b, alpha, a, b, beta, c, work, kc_max, mc_max, nc_max):
    """C = alpha * op(A) @ op(B) + beta * C with preallocated `work` (see `workspace`)."""
    if scaled_only(a, trans_a, c, alpha, beta):
        return
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    a_pack, b_pack, tile = work
    size = c.itemsize
    mr, nr = tile_shape(width, size)
    c_rows = c.strides[1] == size and c.strides[0] % size == 0
    in_place = (  # bfloat16 B (2-byte items) is always packed: packing widens it
        m <= mc_max and not trans_b and b.itemsize == size
        and (width != 256 or m <= IN_PLACE_ROWS_256)
        and b.strides[1] == size and b.strides[0] % size == 0
    )  # fmt: skip
    touch = in_place and k * n * size >= LARGE_B_BYTES
    # A with unit-stride rows is read where it lies (its full mr-row panels; see the module
    # docstring); 16-bit A is packed (packing widens it)
    a_in_place = a.itemsize == size and a.strides[1] == size and a.strides[0] % size == 0
    lda = a.strides[0] // size
    ldc = c.strides[0] // size
    # C column-major (C.T of a row-major result, symbols.py): full tiles over A's rows in
    # place are stored transposed by the kernel, ldc_t apart, instead of through the edge tile
    c_columns = (
        width == 512 and size == 4 and not trans_a and a_in_place
        and c.strides[0] == size and c.strides[1] % size == 0
    )  # fmt: skip
    ldc_t = c.strides[1] // size
    for jc in range(0, n, nc_max):
        nc = min(nc_max, n - jc)
        for pc in range(0, k, kc_max):
            kc = min(kc_max, k - pc)
            beta_p = beta if pc == 0 else 1.0
            if not in_place:
                pack_b(width, b, trans_b, pc, kc, jc, nc, nr, b_pack)
            else:
                if touch:  # B's block row by row, before its panels
                    keep_value(touch_rows(b, pc, kc, jc, nc))
                if nc % nr:
                    last = nc - nc % nr  # the edge panel, zero padded, at its panel's place
                    edge = b_pack[(last // nr) * kc * nr :]
                    pack_b(width, b, trans_b, pc, kc, jc + last, nc % nr, nr, edge)
            for ic in range(0, m, mc_max):
                mc = min(mc_max, m - ic)
                fours = four_row_start(width, mr, mc, a_in_place)
                full = mc - mc % mr if a_in_place else 0  # rows read in place
                if fours < mc:  # the last rows as 4-row tiles, in place
                    full = mc
                if full < mc:  # the rest packed, from the start of a_pack
                    pack_a(width, a, trans_a, ic + full, mc - full, pc, kc, mr, a_pack)
                for jr in range(0, nc, nr):
                    j = jc + jr
                    cols = min(nr, nc - jr)
                    if in_place and cols == nr:
                        b_addr = b.ctypes.data + pc * b.strides[0] + j * size
                        ldb = b.strides[0] // size
                    else:
                        b_addr = b_pack.ctypes.data + (jr // nr) * kc * nr * size
                        ldb = nr
                    for ir in range(0, fours, mr):
                        i = ic + ir
                        rows = min(mr, mc - ir)
                        whole = rows == mr and cols == nr and c_rows
                        c_addr = c.ctypes.data + i * c.strides[0] + j * size
                        if c_columns and rows == mr and cols == nr and ir < full:
                            a_addr = a.ctypes.data + i * a.strides[0] + pc * size
                            micro_kernel_512_a_rows_c_columns(
                                kc, a_addr, lda, b_addr, ldb, c.ctypes.data + i * size
                                + j * c.strides[1], ldc_t, alpha, beta_p, c,
                            )  # fmt: skip
                            continue
                        if not whole:  # through the edge tile, stored by store_edge
                            c_addr, ldc_p, alpha_p, beta_t = tile.ctypes.data, nr, 1.0, 0.0
                        else:
                            ldc_p, alpha_p, beta_t = ldc, alpha, beta_p
                        if ir < full:
                            a_addr = a.ctypes.data + (
                                pc * a.strides[0] + i * size if trans_a
                                else i * a.strides[0] + pc * size
                            )  # fmt: skip
                            _kernel_a_in_place(
                                width, trans_a, kc, a_addr, lda, b_addr, ldb,
                                c_addr, ldc_p, alpha_p, beta_t, c,
                            )  # fmt: skip
                        else:
                            a_addr = a_pack.ctypes.data + ((ir - full) // mr) * kc * mr * size
                            _kernel(
                                width, kc, a_addr, b_addr, ldb, c_addr, ldc_p, alpha_p, beta_t, c
                            )
                        if not whole:
                            store_edge(tile, nr, c, i, j, rows, cols, alpha, beta_p)
                    for ir in range(fours, mc, REMAINDER_ROWS):
                        i = ic + ir
                        a_addr = a.ctypes.data + (
                            pc * a.strides[0] + i * size if trans_a
                            else i * a.strides[0] + pc * size
                        )  # fmt: skip
                        if cols == nr and c_rows:
                            _kernel_a_in_place_4(
                                trans_a, kc, a_addr, lda, b_addr, ldb,
                                c.ctypes.data + i * c.strides[0] + j * size, ldc, alpha, beta_p, c,
                            )  # fmt: skip
                        else:
                            _kernel_a_in_place_4(
                                trans_a, kc, a_addr, lda, b_addr, ldb,
                                tile.ctypes.data, nr, 1.0, 0.0, c,
                            )  # fmt: skip
                            store_edge(tile, nr, c, i, j, REMAINDER_ROWS, cols, alpha, beta_p)
