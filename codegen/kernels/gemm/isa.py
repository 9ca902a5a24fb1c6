"""Which vector width the GEMM micro-kernel uses, decided once per process.

AVX-512 where the host CPU has it (read from LLVM's host features, the same that Numba compiles
for), AVX2 otherwise. BACKPLAN_GEMM_ISA=avx2 forces the 256-bit path, so tests cover both on an
AVX-512 machine; a 512-bit tile still compiles (and runs correctly, split in halves) on an
AVX2-only CPU, it is only slower.
"""

import functools
import os

ISA_WIDTH = {"avx512": 512, "avx2": 256}


class GemmIsaError(ValueError):
    """BACKPLAN_GEMM_ISA names no known instruction set."""


def _host_has_avx512() -> bool:
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    return bool(features.get("avx512f"))


@functools.cache
def active_isa() -> str:
    """'avx512' or 'avx2': the environment's choice, else the host's best."""
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
