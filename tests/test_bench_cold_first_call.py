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


_COLLECTION = r"""
import gc, json, sys
import numba
from backplan.bench import cold_first_call
from backplan.bench.internals import compile_garbage
if sys.argv[1] == "full":
    cold_first_call.full_collection_after_call()
collections = []
gc.callbacks.append(lambda phase, info: phase == "stop" and collections.append(info["generation"]))
before = compile_garbage.compiles()
numba.njit(lambda x: x + 1)(1)
during = list(collections)
after = compile_garbage.collect_if_compiled(before)
print(json.dumps({"during": during, "after": after, "frozen": gc.get_freeze_count()}))
"""


@pytest.mark.parametrize("collect", ["full", "end-of-compile"])
def test_the_collect_switch_puts_back_the_full_collection_after_a_compiling_call(collect):
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _COLLECTION, collect], capture_output=True, text=True, check=True
    )
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    assert ran["frozen"] == 0
    # end-of-compile: a full collection at the compile's end (older objects frozen), none after
    # the call; full: none at the compile's end, one full one after the call
    assert ran["after"] is (collect == "full")
    if collect == "end-of-compile":
        assert ran["during"][-1] == 2


def test_the_table_has_a_row_per_collect_mode_against_one_jax_column():
    runs = [
        {"peer": "backplan", "model": "m", "collect": "full", "first_call_cpu_s": 0.5},
        {"peer": "backplan", "model": "m", "collect": "end-of-compile", "first_call_cpu_s": 0.4},
        {"peer": "jax", "model": "m", "first_call_cpu_s": 0.8, "step_cpu_s": 0.1},
    ]
    rows = cold_first_call.table(runs, ["m"]).splitlines()[2:]
    assert rows == [
        "| m (collect end-of-compile) | 0.400 | 0.100 | 0.800 | 4.00x | 0.50x |",
        "| m (collect full) | 0.500 | 0.100 | 0.800 | 5.00x | 0.62x |",
    ]
    assert cold_first_call.table(runs[1:], ["m"]).splitlines()[2] == (
        "| m | 0.400 | 0.100 | 0.800 | 4.00x | 0.50x |"
    )
