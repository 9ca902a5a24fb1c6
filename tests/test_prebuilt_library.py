"""The library built ahead of time (codegen/build/prebuilt_library.py): a process whose own library
folder is empty loads a library function from the prebuilt folder instead of compiling it, and
writes nothing of it to its own folder; a prebuilt file that fails its signature check, or a
prebuilt folder others can write to, is not used (the function compiles, with a warning) and
nothing in the prebuilt folder is deleted. Fresh processes: one compiles into a folder used as
the build's, the others load from it."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, warnings
import numpy as np
from backplan.codegen.kernels import gather

labels = np.array([2, 0, 1], np.int64)
out = np.empty((3, 4), np.float32)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bad = gather.one_hot(labels, out)
stats = gather.one_hot.stats
print(json.dumps({"bad": int(bad), "out": out.tolist(),
                  "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values()),
                  "warnings": [str(w.message) for w in caught]}))
"""
EXPECTED = [[0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0]]


def one_hot_call(library, prebuilt, tmp_path) -> dict:
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels"),
        "BACKPLAN_LIBRARY_CACHE_DIR": str(library),
        "BACKPLAN_PREBUILT_LIBRARY_DIR": str(prebuilt),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def files(folder) -> dict[str, bytes]:
    found = {}
    for where, _, names in os.walk(folder):
        for name in names:
            if name.startswith("gather.one_hot-"):
                with open(os.path.join(where, name), "rb") as f:
                    found[os.path.join(where, name)] = f.read()
    return found


def built(tmp_path):
    """A prebuilt folder holding one_hot, made as `cache prebuild` makes it: a process whose
    library folder it is."""
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir(mode=0o700)
    made = one_hot_call(prebuilt, tmp_path / "unused", tmp_path)
    assert made["misses"] == 1 and made["out"] == EXPECTED
    assert any(name.endswith(".nbc") for name in files(prebuilt))
    return prebuilt


def test_a_process_loads_library_functions_from_the_prebuilt_folder_instead_of_compiling(
    tmp_path,
):
    prebuilt = built(tmp_path)
    own = tmp_path / "own"
    loaded = one_hot_call(own, prebuilt, tmp_path)
    assert loaded["hits"] == 1 and loaded["misses"] == 0, loaded
    assert loaded["out"] == EXPECTED and loaded["bad"] == -1
    assert loaded["warnings"] == []
    assert files(own) == {}  # nothing copied or compiled into the user's own folder


def test_a_tampered_prebuilt_file_is_not_used_nor_deleted(tmp_path):
    prebuilt = built(tmp_path)
    data = next(path for path in files(prebuilt) if path.endswith(".nbc"))
    with open(data, "r+b") as f:  # one byte of the payload, after the signed header
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    before = files(prebuilt)
    own = tmp_path / "own"
    compiled = one_hot_call(own, prebuilt, tmp_path)
    assert compiled["misses"] == 1 and compiled["hits"] == 0, compiled
    assert compiled["out"] == EXPECTED
    assert any("prebuilt library file" in w and "signature" in w for w in compiled["warnings"])
    assert files(prebuilt) == before  # the installation's folder is left as it was
    assert files(own)  # compiled into the user's own folder instead


def test_a_prebuilt_folder_others_can_write_to_is_refused(tmp_path):
    prebuilt = built(tmp_path)
    os.chmod(prebuilt, 0o777)
    compiled = one_hot_call(tmp_path / "own", prebuilt, tmp_path)
    assert compiled["misses"] == 1 and compiled["hits"] == 0, compiled
    assert any("writable by other users" in w for w in compiled["warnings"]), compiled


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_prebuilt_folder_another_user_built_is_skipped_without_a_warning(tmp_path):
    prebuilt = built(tmp_path)
    os.chown(prebuilt, os.getuid() + 4321, -1)
    compiled = one_hot_call(tmp_path / "own", prebuilt, tmp_path)
    assert compiled["misses"] == 1 and compiled["hits"] == 0, compiled
    assert compiled["warnings"] == []  # theirs, signed with their key: not an attack on us


def test_the_compile_line_names_the_prebuild_while_the_library_compiles_without_it(
    tmp_path, monkeypatch
):
    from backplan.codegen.build import compile_notice

    library = [("@train_step", 0.0), ("the library's f32 GEMM", 0.0)]
    monkeypatch.setenv("BACKPLAN_PREBUILT_LIBRARY_DIR", str(tmp_path / "absent"))
    assert "`python -m backplan cache prebuild`" in compile_notice._text(library)
    assert "cache prebuild" not in compile_notice._text(library[:1])  # a plan's own compile
    (tmp_path / "built").mkdir(mode=0o700)
    monkeypatch.setenv("BACKPLAN_PREBUILT_LIBRARY_DIR", str(tmp_path / "built"))
    assert "cache prebuild" not in compile_notice._text(library)


def test_prebuild_refuses_an_unknown_model_or_dtype_before_compiling_anything(capsys):
    """`cache prebuild --models nosuch` started four child processes that each died on a bare
    KeyError; now nothing starts and the message names what it takes."""
    from backplan.__main__ import main

    assert main(["cache", "prebuild", "--models", "mlp,nosuch"]) == 2
    said = capsys.readouterr().out
    assert "unknown model 'nosuch'" in said and "mlp" in said and "compiling" not in said
    assert main(["cache", "prebuild", "--models", "mlp", "--dtypes", "float32,int32"]) == 2
    said = capsys.readouterr().out
    assert "unknown dtype 'int32'" in said and "float32, float64" in said
    assert main(["cache", "prebuild", "--models", "mlp", "--drivers", "python,compiled"]) == 2
    said = capsys.readouterr().out
    assert "unknown driver 'compiled'" in said and "python, inline" in said


def test_the_compile_harness_says_its_children_load_a_prebuilt_library(tmp_path, monkeypatch):
    from backplan.bench.compile_cli import prebuilt_library_found
    from backplan.bench.report.compile_table import _library_text

    folder = tmp_path / "prebuilt"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("BACKPLAN_PREBUILT_LIBRARY_DIR", str(folder))
    assert prebuilt_library_found() is None  # built nothing yet
    (folder / "codegen").mkdir()
    (folder / "codegen" / "gather.one_hot-63.py311.bp.nbi").write_bytes(b"")
    assert prebuilt_library_found() == str(folder)
    line = _library_text({"library_cache": None, "prebuilt_library": str(folder)})[0]
    assert f"prebuilt library in {folder}" in line
    cold = _library_text({"library_cache": None, "prebuilt_library": None})[0]
    assert "compiled in each cold child" in cold


def test_prebuild_clear_removes_only_the_prebuilt_library_files(tmp_path, monkeypatch, capsys):
    from backplan.__main__ import main

    folder = tmp_path / "prebuilt"
    (folder / "codegen" / "kernels").mkdir(parents=True)
    ours = [
        folder / "codegen" / "kernels" / n
        for n in ("gather.one_hot-63.py311.bp.nbi", "gather.one_hot-63.py311.bp.1.nbc")
    ]
    other = folder / "codegen" / "kernels" / "notes.txt"
    for path in (*ours, other):
        path.write_bytes(b"x")
    monkeypatch.setenv("BACKPLAN_PREBUILT_LIBRARY_DIR", str(folder))
    assert main(["cache", "prebuild", "--clear"]) == 0
    assert "removed 2 files of the prebuilt library" in capsys.readouterr().out
    assert not any(path.exists() for path in ours) and other.exists()


PROBE = (
    "import json, os, numba\n"
    "from backplan.codegen.kernels.gemm.choice import blas_threads\n"
    "print(json.dumps([len(os.sched_getaffinity(0)), numba.get_num_threads(), blas_threads()]))"
)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="one CPU: the passes on all CPUs are the one-CPU passes",
)
def test_prebuild_runs_each_pass_on_every_cpu_and_pinned_to_one(tmp_path, monkeypatch):
    """The CPUs a process may use choose library variants (own_gemm_at_par or own_gemm_at,
    BLAS or the own GEMM): a process pinned to one CPU compiled the one-thread variants in
    its first call when the build had run only on all of them. Each pass's child here runs
    a probe instead of the models, under the pass's pinning: what Numba and the GEMM choice
    see there."""
    from backplan import prebuild

    seen, run = [], subprocess.run

    def probe_instead(command, env, capture_output, text, preexec_fn):
        assert command[-3:] == ["backplan.prebuild", "float32", "mlp"], command
        done = run(
            [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
            preexec_fn=preexec_fn, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        seen.append(json.loads(done.stdout.splitlines()[-1]))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(prebuild.subprocess, "run", probe_instead)
    said = []
    assert prebuild.build(str(tmp_path / "built"), ["mlp"], ("float32",), echo=said.append) == 0
    cpus = len(os.sched_getaffinity(0))
    assert seen[0][:2] == [cpus, cpus] and seen[1] == [1, 1, 1], seen
    assert [line.split(":")[0] for line in said] == [
        "  float32, python driver, all CPUs",
        "  float32, python driver, one CPU",
    ]
