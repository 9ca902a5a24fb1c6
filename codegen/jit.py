"""njit and prange for generated and library kernels.

BACKPLAN_KERNELS_AS_PYTHON=1 runs every kernel as plain Python instead: slow, but a traceback
then points at a readable line of the generated source, with the IR line above it.
"""

import os

import numba

AS_PYTHON = os.environ.get("BACKPLAN_KERNELS_AS_PYTHON") == "1"

# Parallel kernels run between BLAS calls. OpenMP's threads spin-wait after each parallel loop
# while OpenBLAS's threads spin too, and on a small machine they starve each other (measured:
# an MLP step 5-10x slower). Numba's workqueue layer sleeps instead. A user's own choice, made
# with NUMBA_THREADING_LAYER, is left alone.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"


def njit(*args, **kwargs):
    if not AS_PYTHON:
        return numba.njit(*args, **kwargs)
    if args and callable(args[0]):
        return args[0]
    return lambda fn: fn


prange = range if AS_PYTHON else numba.prange
