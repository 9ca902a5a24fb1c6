"""backplan.codegen: plans to Numba source and compiled, cached kernels. Imports only ir."""

from .scipy_blas import preload_cython_blas

preload_cython_blas()  # before Numba's first compile: it saves Numba's 0.2 s import of SciPy
