"""bench.cold_first_call says when its backplan figure includes compiling the library."""

import os

import pytest
from numba.core import event

from backplan.bench import cold_first_call
from backplan.codegen.build import library_cache, loop_batch
from backplan.codegen.build.cache_signing import CacheWarning


def _announce(py_func_owner):
    with event.trigger_event("numba:compile", data={"dispatcher": py_func_owner}):
        pass


class _Owner:
    def __init__(self, func):
        self.py_func = func


def test_a_library_compile_is_counted_and_a_plan_batch_or_user_function_is_not():
    def users_own():
        pass

    with cold_first_call.library_compiles() as compiled:
        _announce(_Owner(library_cache.is_library_file))
        _announce(loop_batch._Label(3))
        _announce(_Owner(users_own))
    _announce(_Owner(library_cache.inside_package))  # after the block: not counted
    assert compiled == ["is_library_file"]


def test_a_missing_or_empty_prebuilt_folder_is_named(tmp_path, monkeypatch):
    folder = tmp_path / "prebuilt"
    monkeypatch.setenv("BACKPLAN_PREBUILT_LIBRARY_DIR", str(folder))
    assert str(folder) in cold_first_call.prebuilt_missing()
    folder.mkdir(mode=0o700)
    assert "no prebuilt library" in cold_first_call.prebuilt_missing()
    (folder / "entry.nbi").write_bytes(b"x")
    os.chmod(folder, 0o700)
    assert cold_first_call.prebuilt_missing() is None
    os.chmod(folder, 0o777)
    with pytest.warns(CacheWarning, match="writable by other users"):
        assert "not usable" in cold_first_call.prebuilt_missing()


def test_the_warning_counts_the_runs_that_compiled_and_names_the_functions():
    runs = [
        {"peer": "backplan", "library_compiles": ["gemm_blocked", "pack_b"]},
        {"peer": "jax", "library_compiles": []},
        {"peer": "backplan", "library_compiles": []},
    ]
    (line,) = cold_first_call.warning_lines(runs)
    assert line.startswith("warning: 1 of 2 backplan runs compiled library functions")
    assert "gemm_blocked, pack_b" in line and "cache prebuild" in line
    assert cold_first_call.warning_lines(runs[1:]) == []
