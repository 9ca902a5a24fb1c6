"""--threads N: the same thread count for every peer, set explicitly and reported (on top of
pinning the process to N CPUs, affinity.py). Without the flag nothing is changed and the
libraries' own choices are recorded. threadpoolctl (the `bench` extra) limits BLAS and OpenMP
pools; without it they are left at their sizes, confined to the pinned CPUs, and the report
says so."""

from __future__ import annotations

import importlib.util
import os
import sys

from .errors import BenchError

XLA_SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def prepare_jax_threads(threads: int | None, jax_selected: bool) -> dict:
    """XLA reads its flags once, when jax is imported, and sizes its CPU pool from the process's
    CPU affinity (pinned already): with --threads 1 this process's XLA_FLAGS also turn off
    Eigen's multi-threading. XLA offers no flag for other counts."""
    if threads is None or not jax_selected:
        return {}
    if "jax" in sys.modules:
        return {"jax": "not set: jax was imported before the harness could pin it"}
    if threads != 1:
        return {"jax": f"pool confined to the {threads} pinned CPUs (XLA has no count flag)"}
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_SINGLE_THREAD}".strip()
    return {"jax": f"pinned CPU; XLA_FLAGS += {XLA_SINGLE_THREAD!r} (this process only)"}


def apply_threads(threads: int | None) -> dict:
    """Limits every loaded BLAS/OpenMP pool, PyTorch and Numba (backplan's kernels) to
    `threads`; call it after the peers' libraries are imported so their pools are seen."""
    if threads is None:
        return {}
    if threads < 1:
        raise BenchError(f"--threads must be at least 1, got {threads}")
    _import_backplan_pools()
    settings = {"blas_and_openmp": _limit_blas(threads)}
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
        settings["torch"] = f"torch.set_num_threads({threads})"
    if "numba" in sys.modules:
        numba = sys.modules["numba"]
        count = min(threads, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(count)
        settings["numba"] = f"numba.set_num_threads({count})"
    settings["backplan"] = _backplan_sizing()
    return settings


def _backplan_sizing() -> str:
    """What backplan's steps do with those threads when other processes use the CPUs
    (codegen/run/free_cores.py): a table run on a busy machine says so."""
    from .internals import adapting_threads

    if not adapting_threads():
        return "OpenBLAS's threads kept (BACKPLAN_ADAPT_THREADS=0)"
    return "each step runs OpenBLAS on the free cores (fewer when other processes use them)"


def _limit_blas(threads: int) -> str:
    if importlib.util.find_spec("threadpoolctl") is None:
        return (
            "NOT limited: threadpoolctl is not installed (pip install 'backplan[bench]'); "
            f"their threads share the {threads} pinned CPU(s)"
        )
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads)
    return f"threadpoolctl limits={threads}"


def _import_backplan_pools() -> None:
    """backplan's kernels load Numba (and its OpenMP) and SciPy's BLAS lazily; load them now so
    the limits reach their pools too. The run's record shows the counts in effect at the end."""
    for name in ("numba", "scipy.linalg"):
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
