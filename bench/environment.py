"""What the numbers depend on: CPU, library versions, BLAS and its core type, thread counts
and the environment variables that change them. Read only; nothing here changes settings."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys

import numpy as np

from .affinity import current_affinity

# Variables that change BLAS kernels or thread counts; recorded as found.
WATCHED_VARIABLES = (
    "OPENBLAS_CORETYPE",
    "OPENBLAS_NUM_THREADS",
    "OPENBLAS_L2_SIZE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "XLA_FLAGS",
    "BACKPLAN_BACKEND",
)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_signature() -> str:
    """'family 25 model 17': tells apart CPUs that share a model name ("AMD EPYC")."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("cpu family", "model") and name not in fields:
                    fields[name] = value.strip()
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        return platform.machine()
    if not fields:
        return platform.machine()
    return f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def blas_info() -> list[dict]:
    """Every loaded BLAS/OpenMP library (threadpoolctl), or NumPy's build record without it."""
    if importlib.util.find_spec("threadpoolctl") is not None:
        from threadpoolctl import threadpool_info

        keys = (
            "user_api",
            "internal_api",
            "version",
            "num_threads",
            "architecture",
            "threading_layer",
        )
        return [
            {k: lib.get(k) for k in keys if lib.get(k) is not None}
            | {"library": os.path.basename(lib.get("filepath", ""))}
            for lib in threadpool_info()
        ]
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except Exception:  # show_config's layout differs between NumPy versions
        return [{"user_api": "blas", "source": "unknown (install threadpoolctl)"}]
    return [
        {
            "user_api": "blas",
            "internal_api": blas.get("name"),
            "version": blas.get("version"),
            "source": "numpy.show_config (threadpoolctl not installed)",
        }
    ]


def thread_counts() -> dict:
    """Thread counts as each loaded library reports them now."""
    counts = {
        "blas": {
            f"{lib.get('internal_api', '?')} ({lib.get('library')})": lib["num_threads"]
            for lib in blas_info()
            if "num_threads" in lib
        }
    }
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        counts["torch"] = {
            "intra_op": torch.get_num_threads(),
            "inter_op": torch.get_num_interop_threads(),
        }
    if "jax" in sys.modules:
        counts["jax"] = {
            "xla_flags": os.environ.get("XLA_FLAGS"),
            "note": "XLA's CPU pool; not limited unless XLA_FLAGS say so",
        }
    if "numba" in sys.modules:
        counts["numba"] = sys.modules["numba"].get_num_threads()
    return counts


def backplan_backend() -> str:
    """The executor backplan runs compiled plans on, where this version can say."""
    try:
        from backplan.bench.internals import current_backend
    except ImportError:
        return "reference (no backend switch in this version)"
    return current_backend()


def backplan_revision() -> str | None:
    """The git commit backplan runs from (with "+changes" when the tree differs from it), or
    None for an installed copy: the codegen changes fast, and numbers belong to a commit."""
    folder = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", folder, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        changes = subprocess.run(
            ["git", "-C", folder, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head.strip() + (" +changes" if changes.strip() else "")


def load_average() -> float | None:
    """The 1-minute load average: other work on the machine, which the timings cannot see."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def collect(versions: dict[str, str], thread_settings: dict, load_at_start=None) -> dict:
    return {
        "backplan_backend": backplan_backend(),
        "backplan_revision": backplan_revision(),
        "cpu": cpu_name(),
        "cpu_signature": cpu_signature(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "affinity": current_affinity(),
        "load_average_1min": {"start": load_at_start, "end": load_average()},
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {"numpy": np.__version__, **versions},
        "blas": blas_info(),
        "variables": {
            name: os.environ.get(name)
            for name in WATCHED_VARIABLES
            if name == "OPENBLAS_CORETYPE" or name in os.environ
        },
        "threads": {"set_by_harness": thread_settings, "in_effect": thread_counts()},
    }
