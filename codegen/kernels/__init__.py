"""Hand-written kernels, one module per op family, each beside the emitter that calls it from
generated code; the math loops inline (mathlib, scalar_functions); backplan's own GEMM."""
