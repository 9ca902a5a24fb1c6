"""backplan's own GEMM: packed panels and an LLVM vector micro-kernel, called from compiled plans.

`gemm` and `batched_gemm` take the register width (512 or 256 bits) as their first argument;
`vector_width()` gives the one to use on this host (BACKPLAN_GEMM_ISA=avx2 forces 256).
"""

from backplan.codegen.kernels.gemm.api import batched_gemm, gemm
from backplan.codegen.kernels.gemm.isa import ISA_WIDTH, GemmIsaError, active_isa, vector_width

__all__ = ["ISA_WIDTH", "GemmIsaError", "active_isa", "batched_gemm", "gemm", "vector_width"]
