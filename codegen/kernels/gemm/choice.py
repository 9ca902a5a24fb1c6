"""Own GEMM or BLAS, per shape class, as measured by bench/gemm.py.

Measured on one pinned Zen 4 core (AMD EPYC, AVX-512), medians of 5-7 interleaved rounds of own
over OpenBLAS GFLOP/s on the mlp, transformer and attention shapes (NN, TN, NT and batched), over
three runs each:
    f32, 512-bit tile:   0.95-1.21 (OPENBLAS_CORETYPE unset), 0.96-1.32 (Haswell)  -> own
                         (below 1.0 only tf dX and attention q@k^T, in one run each)
    f32, 256-bit tile:   0.77-0.96 (6-row tiles only)                               -> BLAS
                         since a block's last rows run as 4-row tiles (driver.py): own,
                         see OWN_256 below
    f64, 512-bit tile:   0.83-1.17, no shape class consistently ahead              -> BLAS
Own GEMM runs on one core; with more than one BLAS thread available OpenBLAS splits the work,
so own is picked only when BLAS would run single-threaded too (one CPU in the process's
affinity, or OPENBLAS_NUM_THREADS / OMP_NUM_THREADS = 1). BACKPLAN_GEMM=own|blas overrides.

Small products go to BLAS: on an Intel AVX-512 core (model 207), 7 interleaved rounds, own over
OpenBLAS was 0.63-0.81 for m*n*k of 64K-512K (16x64x64, 32x64x64, 32x128x128), 0.28-0.40 where
n = 10 (a classifier's last layer: the 8x32 tile is two thirds padding), and 0.95-1.41 from
1M (64x128x128) up.

On Zen 5 (LLVM's CPU name znver5; OPENBLAS_CORETYPE=Haswell as on the measured boxes, A read
in place by the own GEMM), one pinned core, thread CPU, 7 interleaved rounds, own / OpenBLAS
time was 0.24-0.62 for every layout of 16x64x64 to 128x512x10 (32K-1M), so there products
from SMALL_OWN_WORK up take the own GEMM: the mlp's 128x512x10 dX 9.2 against 14.2 us,
mlp_deep's 256x128x10 3.8 against 7.2. Narrow products (n < 32) stay on BLAS (NN 128x10x512:
own 21.9, BLAS 20.0 us) except A.T @ B, which the own GEMM computes as its transpose
(symbols.py): 512x10x128 13.2 against 27.2, 128x10x256 6.1 against 14.4 (128x10x32: 2.15
against 2.18). Other CPUs keep the rules above, unmeasured for these sizes, but for a short
k: on one pinned Zen 4 core (znver4, AVX-512, OPENBLAS_CORETYPE unset, 7 interleaved rounds,
load ~25) the products over k = 10 with a wide C, the classifier layer's input gradient, ran
own at 74.9 GFLOP/s against OpenBLAS's 55.3 and torch's 64.5 (128x512x10), 84.4 against 66.5
and 63.2 (256x128x10), so from SMALL_OWN_WORK a product over k <= SHORT_K with C at least 32
wide takes the own GEMM there too (the narrow ones kept BLAS: own / OpenBLAS 0.42-0.61).
"""

from __future__ import annotations

import functools
import os

from backplan.codegen.kernels.gemm.isa import target_cpu_name, vector_width
from backplan.codegen.kernels.gemm.narrow import NARROW_COLUMNS
from backplan.codegen.kernels.gemm.row_dots import ROW_DOT_MAX_OUTPUTS, ROW_DOT_MIN_K

CHOICES = ("own", "blas", "auto")
OWN_CLASSES = {("f32", 512)}  # (dtype, vector width) measured at or ahead of OpenBLAS
MIN_OWN_WORK = 1 << 20  # m * n * k below which BLAS is ahead
MIN_OWN_COLUMNS = 32  # the 512-bit f32 tile's width: narrower products are mostly padding
SMALL_OWN_CPUS = {"znver5"}  # LLVM host CPU names where the own GEMM wins from SMALL_OWN_WORK
SMALL_OWN_WORK = 1 << 18  # there: m * n * k from which the own GEMM is ahead (measured to 32K)
SHORT_K = 16  # elsewhere: a product over this k or shorter takes the own GEMM from SMALL_OWN_WORK
# The 256-bit f32 tile (AVX2 targets), one thread: own from MIN_OWN_WORK for C at least
# MIN_OWN_COLUMNS wide over k > SHORT_K, and a narrow A.T @ B (computed as its transpose,
# symbols.py) from SMALL_OWN_WORK; BLAS for a short k and other narrow products. Measured with
# every kernel compiled for AVX2 (bench/isa_env.py) on one pinned Zen 4 core, OPENBLAS_CORETYPE
# =Haswell, 7 interleaved rounds, load 6-19, GFLOP/s own / OpenBLAS / torch (MKL's AVX2
# kernel): mlp 128x512@512x512 96.5 / 93.1 / 100.0 and its NT 104.2 / 93.0 / 100.0, TN
# 512x128^T@128x512 101.0 / 101.7 / 98.0; mlp_deep 256x128@128x128 108.9 / 98.0 / 98.5, NT
# 108.5 / 98.3 / 98.4, TN 97.1 / 85.3 / 94.2; transformer 1024x256@256x256 111.5 / 105.1 /
# 100.9, TN 103.7 / 95.7 / 97.0, attention 32x(128x64@128x64^T) 102.6 / 85.7 / 82.2;
# narrow A.T @ B 128x512^T@128x10 67.0 / 37.7 / 11.3, 256x128^T@256x10 79.3 / 35.6 / 13.7;
# but k = 10: 128x10@512x10^T 56.8 / 64.8 / 65.4, 256x10@128x10^T 65.8 / 66.0 / 64.0, and
# n = 10: 128x512@512x10 52.6 / 56.1 / 14.7 (BLAS). Two threads keep BLAS (unmeasured).
OWN_256 = ("f32", 256)


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


def key_text() -> str:
    """What the GEMM choices read of the process, for plan cache keys: the choice forced and
    BLAS's threads (one: the own GEMM may run; more: BLAS, or the own GEMM split among them).
    Processes pinned to different CPU counts render different calls for one plan."""
    return f"|gemm:{forced_choice()}:{blas_threads()}"


@functools.cache
def small_products_own() -> bool:
    """Whether the target CPU (NUMBA_CPU_NAME, else the host) is one where the own GEMM was
    measured ahead on small products."""
    return target_cpu_name() in SMALL_OWN_CPUS


def use_own_gemm(m: int, n: int, k: int, trans_b: bool, dtype: str, trans_a: bool = False) -> bool:
    """Whether generated code calls backplan's GEMM for this matmul (else BLAS)."""
    choice = forced_choice()
    if choice != "auto":
        return choice == "own" and dtype in ("f32", "f64")
    if blas_threads() > 1:
        return False
    if (dtype, vector_width()) == OWN_256:
        if k <= SHORT_K:
            return False
        if n < MIN_OWN_COLUMNS:
            return trans_a and not trans_b and m * n * k >= SMALL_OWN_WORK
        return m * n * k >= MIN_OWN_WORK
    if (dtype, vector_width()) not in OWN_CLASSES:
        return False
    if small_products_own():
        narrow_ok = n >= MIN_OWN_COLUMNS or (trans_a and not trans_b)
        return m * n * k >= SMALL_OWN_WORK and narrow_ok
    if k <= SHORT_K and n >= MIN_OWN_COLUMNS:  # C's stores are the work: see the docstring
        return m * n * k >= SMALL_OWN_WORK
    return m * n * k >= MIN_OWN_WORK and n >= MIN_OWN_COLUMNS


def use_narrow_gemm(m: int, n: int, k: int, trans_a: bool, dtype: str) -> bool:
    """Whether a matmul use_own_gemm left to BLAS runs on the narrow GEMM instead (narrow.py):
    float32 op(A) = A in place, C at most 16 columns, where small products take the own GEMM
    (same CPUs, sizes and thread rule). On one pinned Zen 5 core (thread CPU, 7 rounds) the
    mlp's 128x10x512 forward ran 12.5-13.3 us against OpenBLAS's 19.2-20.2.
    BACKPLAN_GEMM=own or blas keeps the product on that GEMM."""
    if forced_choice() != "auto" or trans_a or dtype != "f32" or n > NARROW_COLUMNS:
        return False
    if blas_threads() > 1 or (dtype, vector_width()) not in OWN_CLASSES:
        return False
    return small_products_own() and m * n * k >= SMALL_OWN_WORK


ROW_DOTS = 1  # conv_gemm_width's answer for gemm/row_dots.py (C = A @ B.T as row dot products)
# Convolution products on the 256-bit tile: own from CONV_OWN_MIN_K, row dots as on 512 bits
CONV_OWN_CLASSES = {("f32", 256)}
CONV_OWN_MIN_K = 64


def conv_gemm_width(m: int, n: int, k: int, dtype: str, trans_b: bool = False) -> int:
    """The register tile width (bits) of backplan's GEMM for a convolution's product
    (codegen/kernels/conv.py), or 0 for BLAS. Own for a measured own class unless C is
    narrower than the tile, at any product size and thread count: on one pinned Zen 5 core
    (OPENBLAS_CORETYPE=Haswell, 7 rounds, thread CPU) the small CNN's products ran own / BLAS
    0.35 (32x512x144), 0.50 (144x512x32), 0.61 (32x144x512) and 0.64 (16x2048x9: below
    MIN_OWN_WORK, which matmuls keep from the Intel measurement above), but 1.47 for
    16x9x2048, nine columns wide. Matmuls of that size stay as use_own_gemm decides.
    A weight gradient's A @ B.T with a small C over a long k (that 16x9x2048: 38 GFLOP/s on
    OpenBLAS, 43 on torch) runs as row dot products (ROW_DOTS, gemm/row_dots.py: 138).

    On the 256-bit tile (an AVX2 target: measured with every kernel compiled for znver3 on
    one Zen 4 core, bench/isa_env.py's setting, OPENBLAS_CORETYPE=Haswell, 7 interleaved
    rounds, load ~20) the same CNN's products ran own / OpenBLAS 1.49 (32x512x144, torch 0.93x
    own) and 1.39 (32x144x512), but 0.68 for k = 9 (16x2048x9) and 0.97 for k = 32
    (144x512x32): own from CONV_OWN_MIN_K; the 16x9x2048 weight gradient as row dots 64.9
    GFLOP/s against OpenBLAS 28.8 and torch 30.0."""
    choice = forced_choice()
    if choice != "auto":
        return vector_width() if choice == "own" and dtype in ("f32", "f64") else 0
    width = vector_width()
    if (dtype, width) not in OWN_CLASSES and (dtype, width) not in CONV_OWN_CLASSES:
        return 0
    if n < MIN_OWN_COLUMNS:
        small = m * n <= ROW_DOT_MAX_OUTPUTS and k >= ROW_DOT_MIN_K
        return ROW_DOTS if trans_b and small else 0
    if (dtype, width) not in OWN_CLASSES and k < CONV_OWN_MIN_K:
        return 0
    return width


def own_parallel_parts(m: int, n: int, k: int, dtype: str, threads: int) -> int:
    """Blocks the own GEMM cuts C into where BLAS would run on more than one thread (1: no
    parallel own GEMM; use_own_gemm decides then). A matmul of a measured own class with at
    least MIN_OWN_WORK per block runs as min(threads, BLAS threads) single-core GEMMs side by
    side (gemm/parallel.py). Measured at two threads on the 2-vCPU Zen 4 (bench.gemm
    --threads 2): the mlp's step ran 4.65 ms on OpenBLAS's two threads against 4.83 on the own
    GEMM's one, and under load (other processes on both CPUs) OpenBLAS's two threads fell to
    1-20 GFLOP/s on most bench shapes while the own blocks kept 69-100."""
    parts = min(threads, blas_threads())
    if forced_choice() != "auto" or parts < 2 or n < MIN_OWN_COLUMNS:
        return 1
    if m * n * k < MIN_OWN_WORK * parts or (dtype, vector_width()) not in OWN_CLASSES:
        return 1
    return parts
