"""Warm start stays cheap: what `import backplan` and a first call leave out (checked in fresh
interpreters), and kernel-cache questions that list Numba's folder once, however big it is."""

from __future__ import annotations

import os
import sys

from helpers import script_facts

from backplan.codegen.build import kernel_cache
from backplan.codegen.render.kernel_source import KernelSource

# A fresh interpreter: import (no SciPy BLAS loaded yet: it starts OpenBLAS), then a compiled
# float64 matmul through BLAS (its first call makes Numba set up its compiler, which is when
# Numba itself would import all of scipy.linalg).
FRESH_PROCESS = r"""
import json, sys
import numpy as np
import backplan as bp
after_import = sorted(
    m for m in ("scipy.linalg", "scipy.special", "scipy.linalg.cython_blas") if m in sys.modules)
from backplan.runtime.backend import use_backend
a = np.arange(12.0).reshape(3, 4)
b = np.arange(8.0).reshape(4, 2) - 3.0
with use_backend("numba"):
    value, grads = bp.value_and_grad(bp.compile(lambda a, b: ((a @ b) ** 2).sum()))(
        bp.tensor(a), bp.tensor(b))
expected = 2 * (a @ b) @ b.T
after_call = sorted(m for m in ("scipy.linalg", "scipy.special") if m in sys.modules)
import scipy.linalg
from scipy.linalg import cython_blas
print(json.dumps({
    "after_import": after_import,
    "after_call": after_call,
    "value_ok": bool(np.isclose(value.numpy(), ((a @ b) ** 2).sum())),
    "grad_ok": bool(np.allclose(grads.numpy(), expected)),
    "same_blas_module": cython_blas is sys.modules["scipy.linalg.cython_blas"],
    "linalg_works": float(scipy.linalg.solve([[2.0]], [4.0])[0]),
}))
"""


def test_a_fresh_process_runs_blas_without_importing_scipy_linalg_or_special():
    """`import backplan` loads no SciPy BLAS; the first BLAS plan loads only its extension."""
    env = {**os.environ, "BACKPLAN_GEMM": "blas", "BACKPLAN_QUIET": "1"}
    facts = script_facts(FRESH_PROCESS, env=env)
    assert facts["after_import"] == []
    assert facts["after_call"] == []
    assert facts["value_ok"] and facts["grad_ok"]
    assert facts["same_blas_module"]  # scipy.linalg imported later finds the loaded module
    assert facts["linalg_works"] == 2.0


def _kernel(digest: str) -> KernelSource:
    return KernelSource(digest, "", False, ())


def test_cached_digests_lists_numbas_folder_once_for_many_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    numba_files = tmp_path / "__pycache__"
    numba_files.mkdir()
    kernels = [_kernel(f"{i:02d}" + "ab" * 31) for i in range(40)]
    for k in kernels[::3]:  # every third kernel has an index of compiled versions
        (numba_files / f"{k.name}.kernel-19.py311.bp.nbi").write_bytes(b"")
    (numba_files / f"{kernels[1].name}.kernel-19.py311.bp.1.nbc").write_bytes(b"")  # data only
    for i in range(300):  # other entries of a long-lived cache
        (numba_files / f"k_{i:020d}.kernel-19.py311.bp.nbi").write_bytes(b"")
    listed = []
    real_scandir = os.scandir
    monkeypatch.setattr(
        kernel_cache.os, "scandir", lambda path: listed.append(path) or real_scandir(path)
    )
    found = kernel_cache.cached_digests(kernels)
    assert found == {k.digest for k in kernels[::3]}
    assert listed == [str(numba_files)]
    assert kernel_cache.is_cached(kernels[0]) and not kernel_cache.is_cached(kernels[1])


def test_cached_digests_holds_no_list_of_a_large_cache_folder(tmp_path, monkeypatch):
    """A plan's first call asks which kernels are cached; the folder's names are scanned one
    at a time, not listed: 16,790 names held at once were ~1 MiB of a first step's peak."""
    import tracemalloc

    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    numba_files = tmp_path / "__pycache__"
    numba_files.mkdir()
    for i in range(4000):
        (numba_files / f"k_{i:040d}.kernel-19.py311.bp.nbi").write_bytes(b"")
    kernels = [_kernel(f"{i:02d}" + "cd" * 31) for i in range(3)]
    (numba_files / f"{kernels[0].name}.kernel-19.py311.bp.nbi").write_bytes(b"")
    tracemalloc.start()
    try:
        found = kernel_cache.cached_digests(kernels)
        held = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == {kernels[0].digest}
    assert held < 100_000  # 4,000 names of ~70 characters listed at once: ~450,000 B


def test_cached_digests_of_a_missing_cache_folder_is_empty_and_creates_nothing(
    tmp_path, monkeypatch
):
    folder = tmp_path / "never-made"
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(folder))
    assert kernel_cache.cached_digests([_kernel("cd" * 32)]) == set()
    assert not folder.exists()


def test_a_cached_function_touches_the_disk_only_when_numba_first_compiles_it(tmp_path):
    """Decorating makes no cache folder (a warm process decorates ~70 library functions it never
    compiles); the first call compiles and writes signed files as before."""
    (tmp_path / "lazy_cache_module.py").write_text(
        "from backplan.codegen.jit import njit\n\n\n"
        "@njit(cache=True)\ndef add_one(x):\n    return x + 1\n"
    )
    sys.path.insert(0, str(tmp_path))
    no_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no .pyc folder either
    try:
        import lazy_cache_module
    finally:
        sys.dont_write_bytecode = no_bytecode
        sys.path.remove(str(tmp_path))
        sys.modules.pop("lazy_cache_module", None)
    assert not (tmp_path / "__pycache__").exists()
    assert lazy_cache_module.add_one(41) == 42
    written = os.listdir(tmp_path / "__pycache__")
    assert any(n.endswith(".bp.nbi") for n in written), written


# A plan run in a fresh process, then (warm only) a plan this cache has never seen.
CACHED_THEN_NEW = r"""
import json, sys
import numpy as np
import backplan as bp
from backplan.runtime.backend import use_backend
a = np.linspace(-2.0, 2.0, 12).reshape(3, 4)
with use_backend("numba"):
    cached = bp.compile(lambda a: bp.tanh(a * 2.0).sum(axis=0))(bp.tensor(a)).numpy()
facts = {"registries_installed": "numba.np.arraymath" in sys.modules,
         "cached_ok": bool(np.allclose(cached, np.tanh(a * 2.0).sum(axis=0)))}
if sys.argv[1] == "warm":
    with use_backend("numba"):
        new = bp.compile(lambda a: bp.exp(a - 1.0).max(axis=1))(bp.tensor(a)).numpy()
    facts["new_ok"] = bool(np.allclose(new, np.exp(a - 1.0).max(axis=1)))
print(json.dumps(facts))
"""


def test_a_warm_process_loads_cached_code_without_setting_up_numbas_compiler(tmp_path):
    """Loading machine code from the cache skips Numba's registry refresh (most of a warm
    first call); a plan compiled later in the same process still compiles and runs right."""
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path), "BACKPLAN_QUIET": "1"}
    env["BACKPLAN_DRIVER"] = "inline"  # the first process leaves the compiled driver cached
    facts = {run: script_facts(CACHED_THEN_NEW, run, env=env) for run in ("cold", "warm")}
    assert facts["cold"] == {"registries_installed": True, "cached_ok": True}
    assert facts["warm"] == {"registries_installed": False, "cached_ok": True, "new_ok": True}
