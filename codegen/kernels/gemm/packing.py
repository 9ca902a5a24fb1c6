"""The bytes of backplan's GEMM packing panels a plan can make resident, which explain prints
beside the peak (report.packing_bytes).

Each thread running backplan's blocked GEMM packs into a buffer it keeps for the process
(scratch.py: BUFFER_BYTES each, malloc'ed once, never freed): op(A)'s block of at most MC rows
by KC at its start, op(B)'s block of KC by at most NC columns after the whole A part, the edge
tile last. Only the pages a product writes become resident, so a plan holds, per thread, the
A part its largest product packs, the B part likewise, and the tile, each rounded up to pages.
Counted as if every operand were packed (a product reading A or B in place packs less): never
under what the process holds. A GEMM on N cores packs on N threads, each a block of the
product, no more than the whole product would; BLAS and the narrow GEMM use none of it.

>>> bounds(64, 512, 300, 4, (8, 32), (256, 128, 2048))  # 64 x 256 and 256 x 512 floats
(65536, 524288, 4096)
"""

from __future__ import annotations

import re

from backplan.codegen.kernels.gemm.choice import ROW_DOTS, conv_gemm_width
from backplan.codegen.kernels.gemm.driver import KC, MC, NC
from backplan.codegen.kernels.gemm.isa import vector_width
from backplan.codegen.kernels.gemm.kernel import TILES

PAGE = 4096
_CORES = re.compile(r" on (\d+) cores")


def packing_bytes(gemms: dict, nodes=()) -> int:
    """Resident bytes of packing panels the plan's GEMMs can touch (gemms: each matmul node ->
    the GEMM its statements call, in words: codegen/render/gemm_names.py; nodes: the plan's
    others, whose convolutions run one GEMM per group on their columns, codegen/kernels/
    conv.py): the most any thread packs, page-rounded, times the threads packing at once."""
    products = []  # (m, n, k, dtype, threads)
    for node, words in gemms.items():
        if words.startswith("backplan's") and "narrow" not in words:
            found = _CORES.search(words)
            m, n = node.shape[-2:]
            cores = int(found.group(1)) if found else 1
            products.append((m, n, node.inputs[0].shape[-1], node.dtype, cores))
    products += [(*p, 1) for p in _own_conv_products(nodes)]
    a_part = b_part = tile = threads = 0
    for m, n, k, dtype, cores in products:
        size = 8 if dtype == "f64" else 4  # 16-bit operands are widened into f32 panels
        a, b, t = bounds(m, n, k, size, _tile(size), (KC, MC, NC))
        a_part, b_part, tile = max(a_part, a), max(b_part, b), max(tile, t)
        threads = max(threads, cores)
    return (a_part + b_part + tile) * threads


def _own_conv_products(nodes) -> list:
    """(m, n, k, dtype) of each convolution's product that runs on backplan's GEMM."""
    from backplan.codegen.kernels.conv import _product_shape  # conv imports the GEMM

    found = []
    for node in nodes:
        if node.op in ("conv2d", "conv2d_input_grad", "conv2d_weight_grad"):
            m, n, k = _product_shape(node, node.op)
            nt = node.op == "conv2d_weight_grad"
            if conv_gemm_width(m, n, k, node.dtype, trans_b=nt) > ROW_DOTS:
                found.append((m, n, k, node.dtype))
    return found


def bounds(m: int, n: int, k: int, size: int, tile: tuple, blocks: tuple) -> tuple:
    """(A part, B part, tile) bytes one thread packs for an m x n x k product, page-rounded:
    A's block of min(m, MC) rows rounded up to the tile's mr, B's of min(n, NC) columns
    rounded up to nr, both min(k, KC) deep."""
    mr, nr = tile
    kc, mc, nc = blocks
    depth = min(k, kc)
    if not (m and n and k):
        return 0, 0, 0
    rows = -(-min(m, mc) // mr) * mr
    cols = -(-min(n, nc) // nr) * nr
    return _pages(rows * depth * size), _pages(cols * depth * size), _pages(mr * nr * size)


def _tile(size: int) -> tuple:
    lanes, mr, nv = TILES[vector_width()]["f32" if size == 4 else "f64"]
    return mr, lanes * nv


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE
