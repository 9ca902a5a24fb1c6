"""The blocked GEMM is compiled once per dtype and called by address: callers (GEMM entries,
plan drivers) must not carry their own copy, and a process loading a cached caller must find
the symbol it names."""

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from backplan.codegen.kernels import gemm as own
from backplan.codegen.kernels.gemm import symbols


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_entry_calls_the_symbol_instead_of_linking_the_gemm(dtype):
    a = np.ones((5, 3), dtype)
    b = np.ones((3, 4), dtype)
    c = np.empty((5, 4), dtype)
    fresh = numba.njit(own.gemm.py_func)  # not from the cache: its whole linked module shows
    fresh(512, False, False, 1.0, a, b, 0.0, c)
    np.testing.assert_array_equal(c, np.full((5, 4), 3, dtype))
    llvm = fresh.inspect_llvm(fresh.signatures[0])
    name = symbols.PREFIX + ("f32" if dtype == np.float32 else "f64")
    assert f'declare i64 @"{name}"' in llvm or f"declare i64 @{name}" in llvm
    assert "gemm_blocked" not in llvm  # the blocked loops live in the symbol only
    assert "pack_a" not in llvm


def test_read_only_and_transposed_operands_share_one_compiled_gemm():
    rng = np.random.default_rng(0)
    a, b = rng.random((7, 33), np.float32), rng.random((33, 9), np.float32)
    a.flags.writeable = False
    c = np.empty((7, 9), np.float32)
    own.gemm(512, False, False, 1.0, a, b, 0.0, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5)
    own.gemm(256, True, True, 2.0, np.ascontiguousarray(a.T), np.ascontiguousarray(b.T), 0.0, c)
    np.testing.assert_allclose(c, 2 * (a.astype(np.float64) @ b), rtol=1e-5)
    compiled = symbols._gemm_f32.signatures
    assert compiled == [symbols._ARGUMENTS]


def test_a_new_process_loads_a_cached_caller_of_the_symbol(tmp_path):
    script = textwrap.dedent(
        """
        import numpy as np
        from backplan.codegen.kernels import gemm as own
        a = np.arange(12, dtype=np.float64).reshape(3, 4)
        c = np.empty((3, 3))
        own.gemm(512, False, True, 1.0, a, a, 0.0, c)
        assert np.allclose(c, a @ a.T), c
        print(len(own.gemm.stats.cache_hits), len(own.gemm.stats.cache_misses))
        """
    )
    runs = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    hits, _ = runs[1].stdout.split()
    assert int(hits) >= 1  # the second process loaded the entry from the cache


def test_compiling_the_gemm_says_so_once():
    """A cold GEMM compile takes seconds: one line on stderr, none when it is loaded."""
    script = textwrap.dedent(
        """
        import numpy as np
        from backplan.codegen.kernels.gemm import symbols
        class NoCache:  # force a compile: nothing to load
            def load_overload(self, *args):
                return None
            def save_overload(self, *args):
                pass
        symbols._FUNCTIONS["f64"]._cache = NoCache()
        symbols.ensure_registered("f64")
        symbols.ensure_registered("f64")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BACKPLAN_QUIET": "0", "BACKPLAN_VERBOSE": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if "GEMM" in line]
    assert len(lines) == 1 and lines[0].startswith("backplan: compiling the f64 GEMM"), lines


def test_two_threads_first_calling_the_gemm_both_get_it_right():
    """Registration happens under Numba's compiler lock while one thread compiles a caller and
    another loads one: both finish (no lock-order deadlock) with correct products."""
    script = textwrap.dedent(
        """
        import threading
        import numba
        import numpy as np
        from backplan.codegen.kernels import gemm as own

        fresh = numba.njit(own.gemm.py_func)  # compiled here: registers during its codegen
        results = {}

        def work(name, fn):
            a = np.arange(35, dtype=np.float64).reshape(5, 7)
            c = np.empty((5, 5))
            fn(512, False, True, 1.0, a, a, 0.0, c)
            results[name] = np.allclose(c, a @ a.T)

        threads = [threading.Thread(target=work, args=(n, f))
                   for n, f in (("cached", own.gemm), ("fresh", fresh))]
        for t in threads: t.start()
        for t in threads: t.join(300)
        assert results == {"cached": True, "fresh": True}, results
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
