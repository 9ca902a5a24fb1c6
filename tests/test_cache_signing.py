"""Nothing in the kernel cache folder is unpickled unless backplan signed it: a planted pickle
never runs, a truncated file is removed and recompiled once with a one-line warning, and a
cache folder or key that others could write to is refused."""

import json
import os
import pickle
import subprocess
import sys

import numba
import pytest
from test_disk_cache import SCRIPT

from backplan.codegen.build import cache, cache_signing

# the Numba-compiled driver's signed cache entries
pytestmark = pytest.mark.usefixtures("compiled_driver")


def run(tmp_path) -> tuple[dict, list[str]]:
    """The script's result in a fresh process, and the warnings it printed about this cache
    folder. The process keeps this user's key: library kernels cached beside the package are
    signed with it."""
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    warned = [
        line
        for line in done.stderr.splitlines()
        if "CacheWarning" in line and str(tmp_path) in line
    ]
    return json.loads(done.stdout.strip().splitlines()[-1]), warned


def numba_files(tmp_path) -> list:
    folder = tmp_path / "kernels" / "__pycache__"
    files = sorted(p for p in folder.iterdir() if p.suffix in (".nbi", ".nbc"))
    assert files and all(".bp." in p.name for p in files)
    return files


class Payload:
    """Unpickling this creates the marker file: proof that a planted pickle ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_never_runs_and_the_next_call_is_correct(tmp_path):
    first, warned = run(tmp_path)
    assert not warned
    for path in numba_files(tmp_path):
        marker = tmp_path / f"ran-{path.name}"
        evil = pickle.dumps(Payload(marker))
        if path.suffix == ".nbi":  # what Numba itself would load: its version, then the payload
            evil = pickle.dumps(numba.__version__) + evil
        forged = cache_signing.MAGIC + len(evil).to_bytes(8, "little") + b"\0" * 32 + evil
        path.write_bytes(forged if "1" in path.name else evil)
    again, warned = run(tmp_path)
    assert not list(tmp_path.glob("ran-*"))
    assert again["value"] == first["value"] and again["grad"] == first["grad"]
    assert warned and all("removed it, compiling again" in line for line in warned)
    healthy, warned = run(tmp_path)
    assert not warned and healthy["numba_cache_hits"] >= 1
    assert healthy["value"] == first["value"]


def test_a_truncated_entry_is_removed_and_recompiled_once(tmp_path):
    first, _ = run(tmp_path)
    files = numba_files(tmp_path)
    for path in files:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    again, warned = run(tmp_path)
    assert again["value"] == first["value"] and again["grad"] == first["grad"]
    assert any("is truncated" in line for line in warned)
    # each warning names the user's line (the script run with -c), not backplan's or Numba's
    assert all(line.startswith("<string>:") for line in warned), warned
    healthy, warned = run(tmp_path)
    assert not warned and healthy["numba_cache_hits"] >= 1


def test_a_cache_folder_others_can_write_to_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(shared))
    with pytest.raises(cache_signing.CacheError, match=r"writable by other users.*chmod 700"):
        cache.cache_dir()
    private = tmp_path / "private"
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(private))
    cache.cache_dir()
    assert (private.stat().st_mode & 0o777) == 0o700


def test_the_key_is_private_and_outside_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    cache_signing.secret.cache_clear()
    try:
        key = cache_signing.secret()
        path = cache_signing.key_path()
        assert len(key) == 32 and (os.stat(path).st_mode & 0o777) == 0o600
        os.chmod(path, 0o644)
        cache_signing.secret.cache_clear()
        with pytest.raises(cache_signing.CacheError, match="can be read or written by other"):
            cache_signing.secret()
        monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "config"))
        with pytest.raises(cache_signing.CacheError, match="lies inside the kernel cache"):
            cache.cache_dir()
    finally:
        cache_signing.secret.cache_clear()


LIBRARY_MODULE = """
from backplan.codegen.jit import compiled_njit


@compiled_njit(cache=True)
def twice(x):
    return 2 * x
"""


def _fresh_twice(path, name):
    """The function from `path` as a fresh dispatcher (what a new process would have)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.twice


def test_cached_library_code_is_stale_once_a_codegen_file_changes(tmp_path, monkeypatch):
    """Numba keys a cached function on its own file only; a library kernel inlines code from
    other codegen files, so a change there must not load the old machine code."""
    path = tmp_path / "library_like.py"
    path.write_text(LIBRARY_MODULE)
    first = _fresh_twice(path, "library_like_1")
    assert first(21) == 42 and sum(first.stats.cache_misses.values()) == 1
    same = _fresh_twice(path, "library_like_2")
    assert same(21) == 42 and sum(same.stats.cache_hits.values()) == 1
    monkeypatch.setattr(cache_signing.fingerprint, "codegen_fingerprint", lambda: "edited")
    edited = _fresh_twice(path, "library_like_3")
    assert edited(21) == 42
    assert sum(edited.stats.cache_hits.values()) == 0
    assert sum(edited.stats.cache_misses.values()) == 1


def test_files_of_one_folder_failing_one_check_warn_once(tmp_path, monkeypatch):
    """A regenerated key fails every cached file the same way: one CacheWarning for the folder,
    every file still removed; BACKPLAN_VERBOSE=1 names each file."""
    monkeypatch.delenv("BACKPLAN_VERBOSE", raising=False)
    paths = [tmp_path / f"k{i}.nbc" for i in range(3)]
    for path in paths:
        path.write_bytes(b"x")
    with pytest.warns(cache_signing.CacheWarning) as quiet:
        for path in paths:
            cache_signing.discard(str(path), "does not carry this user's signature")
    assert len(quiet) == 1 and "failing the same check" in str(quiet[0].message)
    assert not any(path.exists() for path in paths)
    monkeypatch.setenv("BACKPLAN_VERBOSE", "1")
    loud = tmp_path / "verbose"
    loud.mkdir()
    with pytest.warns(cache_signing.CacheWarning) as each:
        for i in range(3):
            (loud / f"k{i}.nbc").write_bytes(b"x")
            cache_signing.discard(str(loud / f"k{i}.nbc"), "is truncated")
    assert [f"k{i}.nbc" in str(w.message) for i, w in enumerate(each)] == [True] * 3
