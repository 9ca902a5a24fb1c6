"""Compiler flags shared by generated and library kernels.

fastmath without nnan/ninf: reductions may reassociate (so they vectorise) but NaN and inf keep
their IEEE meaning. error_model="numpy": no zero-division checks, which block vectorisation.
"""

FASTMATH = set({"reassoc", "contract", "arcp", "nsz", "afn"})
JIT_OPTIONS = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}
PARALLEL_MIN_ELEMENTS = (
    1 << 18
)  # below this a prange launch (and waking threads next to BLAS) costs more than it saves
