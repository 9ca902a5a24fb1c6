"""Which vector width the GEMM micro-kernel uses, decided once per process.

AVX-512 where the code Numba generates may use it (the host's features as LLVM reads them, or
NUMBA_CPU_FEATURES when set: kernels/half.py asks the same), AVX2 otherwise. So an AVX2 machine
can be emulated on an AVX-512 one for the whole process: NUMBA_CPU_NAME=znver3 with
NUMBA_CPU_FEATURES listing no avx512 feature (bench/isa_env.py prints such a setting for every
peer) compiles every kernel for AVX2 and gives the GEMM its 256-bit tile. BACKPLAN_GEMM_ISA=avx2
forces the 256-bit tile alone, so tests cover both on an AVX-512 machine; a 512-bit tile still
compiles (and runs correctly, split in halves) on an AVX2-only target, it is only slower.
"""

import functools
import os

ISA_WIDTH = {"avx512": 512, "avx2": 256}


class GemmIsaError(ValueError):
    """BACKPLAN_GEMM_ISA names no known instruction set."""


def _host_has_avx512() -> bool:
    """Whether Numba's target has AVX-512F (NUMBA_CPU_FEATURES when set, else the host's)."""
    from backplan.codegen.kernels.half import target_has

    return target_has("avx512f")


def target_cpu_name() -> str:
    """The CPU Numba compiles for: NUMBA_CPU_NAME when set, else the host's as LLVM names it."""
    from llvmlite import binding
    from numba.core import config

    return config.CPU_NAME or binding.get_host_cpu_name()


@functools.cache
def active_isa() -> str:
    """'avx512' or 'avx2': the environment's choice, else the target's best."""
    forced = os.environ.get("BACKPLAN_GEMM_ISA", "").strip().lower()
    if forced:
        if forced not in ISA_WIDTH:
            raise GemmIsaError(
                f"BACKPLAN_GEMM_ISA={forced!r} is not one of {sorted(ISA_WIDTH)}; "
                "unset it to use the host CPU's best"
            )
        return forced
    return "avx512" if _host_has_avx512() else "avx2"


def vector_width() -> int:
    """Bits per vector register of the active path: the `width` argument of the GEMM."""
    return ISA_WIDTH[active_isa()]


# How a GEMM with bfloat16 operands multiplies: "dot" runs VDPBF16PS on k-pairs (dot_kernel.py),
# "widen" widens the operands to float32 while packing and runs the float32 micro-kernel.
BF16_PATHS = ("dot", "widen")


def _target_has_bf16_dot() -> bool:
    """Whether the code Numba generates may use AVX512_BF16 (kernels/half.py asks the same)."""
    from backplan.codegen.kernels.half import target_has_avx512bf16

    return target_has_avx512bf16()


@functools.cache
def bf16_gemm_path() -> str:
    """'dot' where the target has AVX512_BF16 and the 512-bit path is active, else 'widen';
    BACKPLAN_GEMM_BF16=widen forces the widening path (=dot refuses a host without it: LLVM
    cannot compile the instruction there)."""
    forced = os.environ.get("BACKPLAN_GEMM_BF16", "").strip().lower()
    if forced and forced not in BF16_PATHS:
        raise GemmIsaError(
            f"BACKPLAN_GEMM_BF16={forced!r} is not one of {list(BF16_PATHS)}; "
            "unset it to use VDPBF16PS where the host CPU has AVX512_BF16"
        )
    available = _target_has_bf16_dot()
    if forced == "dot" and not available:
        raise GemmIsaError(
            "BACKPLAN_GEMM_BF16='dot' needs a CPU with AVX512_BF16 (VDPBF16PS), which this "
            "host (or NUMBA_CPU_FEATURES) lacks; unset it to widen bfloat16 operands instead"
        )
    if forced:
        return forced
    return "dot" if available and active_isa() == "avx512" else "widen"
