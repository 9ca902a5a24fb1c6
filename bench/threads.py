"""--threads N: the same thread count for every peer, set explicitly and reported. Without the
flag nothing is changed and the libraries' own choices are recorded."""

from __future__ import annotations

import importlib.util
import os
import sys

from .errors import BenchError

XLA_SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def prepare_jax_threads(threads: int | None, jax_selected: bool) -> dict:
    """XLA reads its thread flags once, when jax is imported: with --threads 1 this process's
    XLA_FLAGS gain the single-thread flags first. XLA offers no flag for other counts."""
    if threads is None or not jax_selected:
        return {}
    if "jax" in sys.modules:
        return {"jax": "not set: jax was imported before the harness could set XLA_FLAGS"}
    if threads != 1:
        return {"jax": f"not limited: XLA has no flag for {threads} threads"}
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_SINGLE_THREAD}".strip()
    return {"jax": f"XLA_FLAGS += {XLA_SINGLE_THREAD!r} (this process only)"}


def apply_threads(threads: int | None) -> dict:
    """Limits every loaded BLAS/OpenMP pool, PyTorch and Numba (backplan's kernels) to
    `threads`; call it after the peers' libraries are imported so their pools are seen."""
    if threads is None:
        return {}
    if threads < 1:
        raise BenchError(f"--threads must be at least 1, got {threads}")
    if importlib.util.find_spec("threadpoolctl") is None:
        raise BenchError(
            "--threads needs threadpoolctl to limit BLAS threads: "
            "pip install threadpoolctl (or pip install 'backplan[bench]')"
        )
    _import_backplan_pools()
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads)
    settings = {"blas_and_openmp": f"threadpoolctl limits={threads}"}
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
        settings["torch"] = f"torch.set_num_threads({threads})"
    if "numba" in sys.modules:
        numba = sys.modules["numba"]
        count = min(threads, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(count)
        settings["numba"] = f"numba.set_num_threads({count})"
    return settings


def _import_backplan_pools() -> None:
    """backplan's kernels load Numba (and its OpenMP) and SciPy's BLAS lazily; load them now so
    the limits reach their pools too. The run's record shows the counts in effect at the end."""
    for name in ("numba", "scipy.linalg"):
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
