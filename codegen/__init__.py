"""backplan.codegen: plans to Numba source and compiled, cached kernels. Imports only ir."""
