"""Own GEMM or BLAS, per shape class, as measured by bench/gemm.py.

Measured on one pinned Zen 4 core (AVX-512), f32, medians of 5 interleaved rounds, own/OpenBLAS
GFLOP/s with OPENBLAS_CORETYPE unset (SkylakeX kernels; Haswell measured the same on Zen 4):
    NN and TN (op(B) rows read in place)       1.03-1.29  (mlp, transformer, attention)
    NT with m >= 512 (B packing amortised)     1.01
    NT with m < 512 (packing B costs ~10%)     0.92       -> BLAS
The 256-bit (AVX2) tile measured 0.79-1.01x on the same shapes: BLAS wherever it is active.
Own GEMM runs on one core; with more than one BLAS thread available OpenBLAS splits the work,
so the table applies only when BLAS would run single-threaded (one CPU in the process's
affinity, or OPENBLAS_NUM_THREADS / OMP_NUM_THREADS = 1). BACKPLAN_GEMM=own|blas overrides.
"""

from __future__ import annotations

import os

from .isa import vector_width

CHOICES = ("own", "blas", "auto")
NT_MIN_ROWS = 512  # below this many rows of C, transposed B is packed at a loss


class GemmChoiceError(ValueError):
    """BACKPLAN_GEMM names no known choice."""


def forced_choice() -> str:
    value = os.environ.get("BACKPLAN_GEMM", "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise GemmChoiceError(
            f"BACKPLAN_GEMM={value!r} is not one of {list(CHOICES)}; "
            "unset it to let backplan pick per shape"
        )
    return value


def blas_threads() -> int:
    """Threads OpenBLAS would use: the process's CPUs, capped by the usual variables."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(cpus or 1, int(value))
    return cpus or 1


def shape_prefers_own(m: int, n: int, k: int, trans_b: bool) -> bool:
    """The measured table above, for one core."""
    return not trans_b or m >= NT_MIN_ROWS


def use_own_gemm(m: int, n: int, k: int, trans_b: bool, dtype: str) -> bool:
    """Whether generated code calls backplan's GEMM for this matmul (else BLAS)."""
    choice = forced_choice()
    if choice != "auto":
        return choice == "own"
    if dtype not in ("f32", "f64") or blas_threads() > 1 or vector_width() != 512:
        return False
    return shape_prefers_own(m, n, k, trans_b)
