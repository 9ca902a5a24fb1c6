"""Source of a loop kernel that runs backplan's GEMM block by block and, after each block of rows
of the result, the plan's epilogue loop on those rows (ir/epilogue.py decides which loop).

The block is the GEMM's own row block (ROW_BLOCK rows), so splitting the call costs no extra
packing: the rows are still in cache when the epilogue (bias add, activation, ...) reads them,
and each C element is computed exactly as the whole GEMM computes it. The epilogue's lines are
a row stage of the loop emitter (codegen/render/loops.py), for row i0, views made before the loop.
A reduction down the columns (a recomputed layer's bias gradient) is set to its start before the
first block and takes each row as it comes (the emitter's serial RowPartials), so the caller
passes its `before` lines with the views and puts its `after` lines behind.

    <views; column sums = 0>
    mat_c[block rows] = op(mat_a)[block rows] @ op(mat_b)
    for i0 in block rows: <epilogue for row i0, adding its row into the column sums>

16-bit operands are the exception: the GEMM packs (and widens) B for each call, and a call per
row block packed it once per block (80 rows on Zen 5) where the whole product packs it once.
Their product is computed whole, then the epilogue runs over all its rows. Measured on the bench
shapes (f16 / bf16 GEMM and rounding, thread time, CPU 0, 21 rotated rounds, 2026-11-28):
784x512x128 TN per block 1.14x / 0.75x the f32 GEMM alone, whole 1.04x / 0.57x; 1024x256x256
1.10x / 0.69x against 1.00x / 0.54x; 1024x1024x256 1.09x / 0.77x against 0.99x / 0.53x.
"""

from __future__ import annotations

from backplan.codegen.render.placement import Placement


def gemm_epilogue_lines(
    width: int,
    operands: list[tuple[bool, Placement]],
    out: Placement,
    views: list[str],
    stage: list[str],
    float16: tuple[bool, bool] = (False, False),
    whole: bool = False,
) -> tuple[list[str], dict, dict]:
    """(lines, scalars, bases) in the form canonical_kernel takes. operands: (transposed?,
    placement) of a and b as the matmul reads them; out: the matmul's result, (m, n);
    float16: which operand is float16 bits, viewed as int16 for the GEMM (kernels/matmul.py)
    by views.contiguous_bits_view (Numba's `.view` there kept the kernel's arrays alive);
    whole: one GEMM call for all rows, then the epilogue (16-bit operands: the docstring)."""
    (ta, a), (tb, b) = operands
    m, n = out.shape
    k = a.shape[0] if ta else a.shape[1]
    (view_a, mark_a), (view_b, mark_b) = (
        ("contiguous_bits_view", ", np.int16") if bits else ("contiguous_view", "")
        for bits in float16
    )
    lines = [
        f"mat_a = {view_a}(b0, o0, {'(n2, n0)' if ta else '(n0, n2)'}{mark_a})",
        f"mat_b = {view_b}(b1, o1, {'(n1, n2)' if tb else '(n2, n1)'}{mark_b})",
        "mat_c = contiguous_view(b2, o2, (n0, n1))",
        *views,
    ]
    if whole:
        lines += [
            f"own_gemm({width}, {ta}, {tb}, 1.0, mat_a, mat_b, 0.0, mat_c)",
            "for i0 in range(n0):",
            *["    " + line for line in stage],
        ]
    else:
        lines += _by_row_blocks(width, ta, tb, stage)
    scalars = {"n0": m, "n1": n, "n2": k, "o0": a.offset, "o1": b.offset, "o2": out.offset}
    bases = {"b0": a.base, "b1": b.base, "b2": out.base}
    return lines, scalars, bases


def _by_row_blocks(width: int, ta: bool, tb: bool, stage: list[str]) -> list[str]:
    """The GEMM one ROW_BLOCK of rows at a time, each followed by the epilogue on its rows."""
    rows = "mat_a[:, block:block_end]" if ta else "mat_a[block:block_end]"
    return [
        "for block in range(0, n0, ROW_BLOCK):",
        # not min(): that is an overload Numba compiles apart, 0.02-0.03 CPU s of a cold call
        "    block_end = block + ROW_BLOCK if block + ROW_BLOCK < n0 else n0",
        f"    own_gemm({width}, {ta}, {tb}, 1.0, {rows}, mat_b, 0.0, mat_c[block:block_end])",
        "    for i0 in range(block, block_end):",
        *["        " + line for line in stage],
    ]
