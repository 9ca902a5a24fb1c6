"""Numba looks for SciPy's BLAS the first time it compiles or loads anything, by importing
`scipy.linalg.cython_blas`. That import first runs `scipy/linalg/__init__.py`, about 0.2 s
(SciPy's array-API layer walks all of NumPy, f2py and numpy.testing included), and a warm
process never uses any of it: Numba and our GEMM only need the extension module's table of BLAS
function pointers. So load that one extension module, from the file the normal import would
load, under its own name: Numba's import (and its ABI check, `ensure_blas`) then finds it in
`sys.modules`. `import scipy.linalg` still works as before whenever anything asks for it.
Called when the first plan is loaded (codegen/kernels/blas.py), not by `import backplan`: loading
the
extension also starts OpenBLAS, which a process that never compiles should not pay for.

>>> from backplan.codegen.kernels.scipy_blas import preload_cython_blas
>>> preload_cython_blas()
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

MODULE = "scipy.linalg.cython_blas"


def preload_cython_blas() -> None:
    """Load `scipy.linalg.cython_blas` without its package, unless SciPy's linalg is already
    imported; anything unexpected (no SciPy, another layout) leaves the normal import to Numba."""
    if MODULE in sys.modules or "scipy.linalg" in sys.modules:
        return
    path = _extension_path()
    if path is None:
        return
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[MODULE]  # Numba's own import will say what is wrong


def _extension_path() -> str | None:
    spec = importlib.util.find_spec("scipy")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "linalg", "cython_blas" + suffix)
            if os.path.isfile(path):
                return path
    return None
