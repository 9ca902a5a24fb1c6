"""njit and prange for generated and library kernels.

BACKPLAN_KERNELS_AS_PYTHON=1 runs every kernel as plain Python instead: slow, but a traceback
then points at a readable line of the generated source, with the IR line above it.
"""

import os

import numba

AS_PYTHON = os.environ.get("BACKPLAN_KERNELS_AS_PYTHON") == "1"


def njit(*args, **kwargs):
    if not AS_PYTHON:
        return numba.njit(*args, **kwargs)
    if args and callable(args[0]):
        return args[0]
    return lambda fn: fn


prange = range if AS_PYTHON else numba.prange
