"""Bytes of backplan's GEMM packing buffers a compiled plan makes resident, counted in its peak.

A product on backplan's GEMM packs its operands into buffers each thread keeps for the
process's life (codegen/kernels/gemm/scratch.py); a product on BLAS packs into OpenBLAS's own
buffers, which nothing here counts. Which GEMM a product runs on is the code generator's choice (the
CPU, the threads BLAS would get, the shape: codegen/kernels/gemm/choice.py), and ir cannot
import it: the code generator registers its count here when imported
(codegen/kernels/gemm/packing.py), and the peak (ir/peak.py) reads it for every plan it weighs,
so explain, the memory planner, budgets, bp.max_batch and the checked mode count the same
bytes. Held from the step's first kernel to its end: the buffers are written by the first
product and kept; the plans of a step share them (the largest plan's count)."""

from __future__ import annotations

from collections.abc import Callable

_count: list[Callable | None] = [None]
_in_place: list[Callable | None] = [None]


def register(count: Callable, in_place: Callable | None = None) -> None:
    """count(lowered plan) -> the bytes of packing panels its products can make resident;
    in_place(node, operands) -> see in_place_packing_bytes."""
    _count[0] = count
    _in_place[0] = in_place


def in_place_packing_bytes(node, operands) -> int:
    """The bytes of packing pages a 2-D matmul writes reading its operands where they live
    (operands: (transposed?, element strides) each, ir/strided_copies.operand_strides)
    beyond those it writes on C-contiguous copies of them; 0 where no code generator
    registered a count (the operands are then read in place)."""
    count = _in_place[0]
    return 0 if count is None else count(node, operands)


def packing_bytes(lowered) -> int:
    """The panels' bytes for a lowered plan; 0 where no code generator registered a count."""
    count = _count[0]
    return 0 if count is None else count(lowered)
