"""A generated module's Python code is compiled once: later processes run the signed code object
kept beside it (codegen/build/code_cache.py), with the values of the first; a code file that
does not check (edited, signed by another key, written for other source) is never run: the
source is compiled again and the file rewritten, with a CacheWarning for one not signed here."""

import builtins
import hashlib
import hmac
import marshal
import os
import textwrap
import warnings

import numpy as np
import pytest
from helpers import script_facts

import backplan as bp
from backplan.codegen.build import cache_signing, code_cache

SOURCE = "value = 6 * 7\n"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A cache folder (its signing key with it) and a generated module's path in it."""
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def compiles(monkeypatch):
    """The file names builtins.compile is asked to compile from now on."""
    seen = []
    real = builtins.compile
    monkeypatch.setattr(
        builtins,
        "compile",
        lambda source, path, *a, **k: seen.append(path) or real(source, path, *a, **k),
    )
    return seen


def run(code) -> dict:
    namespace = {}
    exec(code, namespace)
    return namespace


def test_a_module_compiled_once_runs_its_cached_code_after(folder, compiles):
    path = str(folder / "k_example.py")
    assert run(code_cache.compiled(SOURCE, path, str(folder)))["value"] == 42
    assert compiles == [path]
    assert os.path.exists(folder / "__pycache__" / "k_example.code")
    code = code_cache.compiled(SOURCE, path, str(folder))
    assert compiles == [path]  # not compiled again
    assert run(code)["value"] == 42 and code.co_filename == path


def _plant(folder, path, source, sign):
    """A code file for `path` holding `source`'s code, signed by `sign`."""
    identity = code_cache._identity(SOURCE, path)
    payload = identity + marshal.dumps(compile(source, path, "exec"))
    (folder / "__pycache__").mkdir(exist_ok=True)
    (folder / "__pycache__" / code_cache._name(path)).write_text(
        sign("k_example.code", payload).hex()
    )


def _other_key(name, payload):
    length = len(payload).to_bytes(cache_signing._LENGTH_BYTES, "little")
    mac = hmac.new(
        b"another user's key",
        cache_signing.MAGIC + name.encode() + b"\0" + length + payload,
        hashlib.sha256,
    )
    return cache_signing.MAGIC + length + mac.digest() + payload


@pytest.mark.parametrize("how", ["another key", "edited", "not hex", "other source"])
def test_a_code_file_that_does_not_check_is_never_run(folder, compiles, how):
    path = str(folder / "k_example.py")
    cached = folder / "__pycache__" / "k_example.code"
    planted = "value = 666\n"
    if how == "another key":
        _plant(folder, path, planted, _other_key)
    elif how == "other source":  # signed here, but for another version of the module
        code_cache.compiled(planted, path, str(folder))
    elif how == "not hex":
        _plant(folder, path, planted, cache_signing.signed)
        cached.write_bytes(marshal.dumps(compile(planted, path, "exec")))
    else:
        _plant(folder, path, planted, cache_signing.signed)
        text = cached.read_text()
        cached.write_text(text[:-4] + ("0000" if text[-4:] != "0000" else "1111"))
    compiles.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(code_cache.compiled(SOURCE, path, str(folder)))["value"] == 42
    assert compiles == [path]  # compiled from the source
    said = [str(w.message) for w in caught if issubclass(w.category, bp.CacheWarning)]
    if how == "other source":  # this user's own file, for an older plan: nothing to report
        assert said == []
    else:  # planted or edited: said, as a kernel's cache file is
        assert len(said) == 1 and str(cached) in said[0] and "removed it" in said[0]
    compiles.clear()
    assert run(code_cache.compiled(SOURCE, path, str(folder)))["value"] == 42
    assert compiles == []  # the file was written again, for this source


def test_nothing_is_written_without_a_writable_folder(folder, compiles):
    path = str(folder / "k_example.py")
    assert run(code_cache.compiled(SOURCE, path, None))["value"] == 42
    assert not os.path.exists(folder / "__pycache__" / "k_example.code")


SCRIPT = textwrap.dedent("""
    import builtins, json
    import numpy as np
    import backplan as bp
    from backplan.runtime.backend import use_backend
    compiled_here, real = [], builtins.compile
    def recording(source, path, *args, **kwargs):
        name = __import__("os").path.basename(str(path))
        if name.startswith(("bp_", "k_")):
            compiled_here.append(name)
        return real(source, path, *args, **kwargs)
    builtins.compile = recording
    def loss(w, x):
        return bp.sum(bp.tanh(x @ w) * 2.0)
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    x = np.ones((2, 3), np.float32)
    results = {}
    for backend in ("numba", "reference"):
        with use_backend(backend):
            value, grad = bp.value_and_grad(loss)(bp.tensor(w), bp.tensor(x))
        results[backend] = [float(value.item()), grad.numpy().tolist()]
    print(json.dumps({"compiled": compiled_here, **results}))
""")


def test_a_fresh_process_compiles_no_generated_source_and_computes_the_same(tmp_path):
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path), "BACKPLAN_DRIVER": "python"}
    first = script_facts(SCRIPT, env=env)
    assert any(name.startswith("bp_") for name in first["compiled"])
    assert any(name.startswith("k_") for name in first["compiled"])
    second = script_facts(SCRIPT, env=env)
    assert second["compiled"] == []
    for facts in (first, second):
        assert np.allclose(facts["numba"][0], facts["reference"][0], rtol=1e-5)
        assert np.allclose(facts["numba"][1], facts["reference"][1], rtol=1e-5)
    assert second["numba"] == first["numba"]
