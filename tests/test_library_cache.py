"""The library's machine code (GEMM, math helpers, conv, attention...) is cached in the kernel
cache folder under library/ (codegen/build/library_cache.py), signed, counted by `python -m
backplan cache info` and removed by `cache clear`; a second process loads it instead of
compiling. Fresh processes with an empty cache folder and no shared library folder."""

import json
import os
import subprocess
import sys

SCRIPT = """
import json
import numpy as np
import backplan as bp
from backplan.codegen.kernels import matmul

@bp.compile
def f(w, x):
    return bp.tanh(x @ w).sum()

f(bp.tensor(np.ones((3, 2), np.float32)), bp.tensor(np.ones((4, 3), np.float32)))
stats = matmul.gemm_at_f32.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""


def environment(tmp_path) -> dict:
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels")}
    env.pop("BACKPLAN_LIBRARY_CACHE_DIR", None)  # the suite's shared folder: not this test's
    # The driver runs as Python, so that it calls the library's GEMM itself (a compiled driver
    # holds its machine code).
    return {**env, "BACKPLAN_BACKEND": "numba", "BACKPLAN_QUIET": "1", "BACKPLAN_DRIVER": "python"}


def run(args: list[str], env: dict) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def library_files(tmp_path) -> list[str]:
    return [
        os.path.join(folder, name)
        for folder, _, names in os.walk(tmp_path / "kernels" / "library")
        for name in names
    ]


def test_library_code_is_cached_signed_in_the_cache_folder_loaded_counted_and_cleared(tmp_path):
    env = environment(tmp_path)
    first = json.loads(run(["-c", SCRIPT], env).splitlines()[-1])
    files = library_files(tmp_path)
    names = {os.path.basename(f) for f in files}
    assert first["misses"] >= 1
    assert any(name.startswith("matmul.gemm_at_f32-") for name in names), names
    assert all(".bp." in name for name in names), names  # signed files only
    from backplan.codegen.build.fingerprint import codegen_fingerprint

    versioned = tmp_path / "kernels" / "library" / codegen_fingerprint()[:16] / "codegen"
    assert all(f.startswith(str(versioned)) for f in files)
    second = json.loads(run(["-c", SCRIPT], env).splitlines()[-1])
    assert second == {"hits": 1, "misses": 0}  # loaded from the folder, not compiled
    info = run(["-m", "backplan", "cache", "info"], env)
    assert f"library: {len(library_files(tmp_path))} files" in info, info
    run(["-m", "backplan", "cache", "clear"], env)
    assert library_files(tmp_path) == []


def test_checkouts_of_different_codegen_keep_their_own_library_entries(monkeypatch):
    """A library function's entries are stamped with the codegen fingerprint, so two checkouts
    of different code sharing the cache folder must not share its index file: each found the
    other's stale and overwrote it, and every other process compiled the GEMM again."""
    from backplan.codegen.build import fingerprint, library_cache
    from backplan.codegen.kernels import matmul

    py_file = matmul.gemm_at_f32.py_func.__code__.co_filename
    monkeypatch.setattr(fingerprint, "codegen_fingerprint", lambda: "a" * 64)
    first = library_cache.library_path(py_file)
    monkeypatch.setattr(fingerprint, "codegen_fingerprint", lambda: "b" * 64)
    second = library_cache.library_path(py_file)
    assert first != second
    assert second.endswith(os.path.join("b" * 16, "codegen", "kernels"))
