"""A kernel cache folder that cannot be written never fails a user's call (codegen/
cache_health.py): a full disk or a read-only folder makes the process compile in memory with one
bp.CacheWarning naming the folder and the reason; a folder deleted while the process runs is
made again. Faults are simulated portably: writes into the folder raise the errno a full disk
or a read-only mount raises."""

import errno
import os
import tempfile
import types
import warnings

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend


@pytest.fixture
def folder(tmp_path, monkeypatch):
    path = tmp_path / "kernels"
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(path))
    return path


def failing_writes(monkeypatch, folder, code: int) -> None:
    """Every temporary file made inside folder (how the cache, the probe and Numba write)
    fails with code, as on a full disk (ENOSPC) or a read-only mount (EROFS)."""

    def inside(directory) -> bool:
        return directory is not None and os.path.realpath(directory).startswith(str(folder))

    def refuse(original):
        def call(*args, dir=None, **kwargs):  # noqa: A002 - tempfile's own name
            if inside(dir):
                raise OSError(code, os.strerror(code))
            return original(*args, dir=dir, **kwargs)

        return call

    monkeypatch.setattr(tempfile, "mkstemp", refuse(tempfile.mkstemp))
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse(tempfile.TemporaryFile))


def fresh_function(scale: float):
    """A function no other test compiled (its constant is in the plan and the kernel)."""
    return bp.compile(lambda a: (bp.tanh(a * scale + 1.0) * a).sum())


@pytest.mark.parametrize(
    "code, mode",
    [
        (errno.ENOSPC, "background"),
        (errno.ENOSPC, "inline"),
        (errno.EROFS, "inline"),
        (errno.EROFS, "reference"),
        (errno.EACCES, "inline"),
    ],
)
def test_an_unwritable_folder_compiles_in_memory_with_one_warning(folder, monkeypatch, code, mode):
    """In every driver mode: a background build hands its driver over through the folder, so
    with none writable the driver runs as Python (its kernels compiled in memory)."""
    monkeypatch.setenv("BACKPLAN_DRIVER", mode)
    folder.mkdir()
    failing_writes(monkeypatch, folder, code)
    x0 = np.linspace(-1.0, 1.0, 5)
    with warnings.catch_warnings(record=True) as caught, use_backend("numba"):
        warnings.simplefilter("always")
        results = []
        for scale in (3.0 + code / 1000, 5.0 + code / 1000):  # two plans: still one warning
            x = bp.tensor(x0, requires_grad=True)
            loss = fresh_function(scale)(x)
            loss.backward()
            expected = np.sum(np.tanh(x0 * scale + 1.0) * x0)
            results.append((loss.item(), expected, x.grad.numpy()))
    for got, expected, grad in results:
        np.testing.assert_allclose(got, expected, rtol=1e-12)
        assert np.isfinite(grad).all()
    cache_warnings = [w for w in caught if issubclass(w.category, bp.CacheWarning)]
    assert len(cache_warnings) == 1, [str(w.message) for w in caught]
    message = str(cache_warnings[0].message)
    assert str(folder) in message and os.strerror(code) in message
    assert "compiles in memory" in message
    assert [files for _, _, files in os.walk(folder) if files] == []  # nothing written there


def test_a_deleted_module_file_is_written_again_when_numba_caches(folder):
    """Numba caches a function beside its module file; with the folder deleted after the module
    was loaded, asking its cache raised `cannot cache function ...: no locator available`."""
    from backplan.codegen.build.cache import cache_dir

    path = os.path.join(cache_dir(), "k_deleted_while_running.py")
    source = (
        "from backplan.codegen.jit import njit\n\n"
        "@njit(cache=True)\n"
        "def twice(x):\n"
        "    return x * 2.0\n"
    )
    module = types.ModuleType("backplan_kernel_k_deleted_while_running")
    module.__file__ = path
    module.__source_text__ = source
    exec(compile(source, path, "exec"), module.__dict__)
    import shutil

    shutil.rmtree(folder)
    assert module.twice(1.5) == 3.0
    assert open(path).read() == source
    assert any(name.endswith(".bp.nbi") for name in os.listdir(folder / "__pycache__"))


def test_a_deleted_folder_is_made_again_for_the_next_plan(folder):
    with use_backend("numba"):
        assert fresh_function(7.0)(bp.tensor(np.zeros(3))).item() == pytest.approx(0.0)
        import shutil

        shutil.rmtree(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("error", bp.CacheWarning)
            x0 = np.linspace(0.0, 1.0, 3)
            got = fresh_function(9.0)(bp.tensor(x0)).item()
    np.testing.assert_allclose(got, np.sum(np.tanh(x0 * 9.0 + 1.0) * x0), rtol=1e-12)
    assert any(name.startswith("bp_") for name in os.listdir(folder))


class _FullDisk:
    """A function cache whose writes fail as on a full disk."""

    def save_overload(self, sig, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_library_folder_is_named_with_the_setting_that_chose_it(tmp_path, monkeypatch):
    """A library function (GEMM, conv, row kernels) is cached under BACKPLAN_LIBRARY_CACHE_DIR
    (codegen/build/library_cache.py), not beside its source: a failed write there named the
    package's source folder (.../codegen/kernels/gemm), which the user neither chose nor
    should touch, and told them to move BACKPLAN_CACHE_DIR."""
    from backplan.codegen.build.library_cache import LibraryLocator, cache_folder
    from backplan.codegen.jit import SignedCacheOnDemand
    from backplan.codegen.kernels.gemm import driver

    library = tmp_path / "library"
    monkeypatch.setenv("BACKPLAN_LIBRARY_CACHE_DIR", str(library))
    py_func = driver.scaled_only.py_func
    source_folder = os.path.dirname(py_func.__code__.co_filename)
    from backplan.codegen.build.fingerprint import codegen_fingerprint

    expected = str(library / codegen_fingerprint()[:16] / "codegen" / "kernels" / "gemm")
    assert cache_folder(py_func) == expected
    locator = LibraryLocator(py_func, py_func.__code__.co_filename)
    assert locator.get_cache_path() == expected  # where Numba writes is what the warning says
    cache = SignedCacheOnDemand(py_func)
    cache._signed = _FullDisk()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.save_overload(None, None)
    (warning,) = [w for w in caught if issubclass(w.category, bp.CacheWarning)]
    message = str(warning.message)
    assert f"folder {expected} cannot be written" in message, message
    assert source_folder not in message
    assert "point BACKPLAN_LIBRARY_CACHE_DIR elsewhere" in message


def test_a_cache_folder_that_is_a_file_is_called_a_file(tmp_path):
    """BACKPLAN_CACHE_DIR naming a file made the warning say "File exists", as if all was well."""
    from backplan.codegen.build import cache_health

    path = tmp_path / "kernels"
    path.write_text("not a folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache_health.note_unwritable(str(path), FileExistsError(errno.EEXIST, "File exists"))
    (warning,) = [w for w in caught if issubclass(w.category, bp.CacheWarning)]
    message = str(warning.message)
    assert f"{path} cannot be written (it is a file, not a folder, errno EEXIST)" in message


def test_a_cache_folder_that_cannot_be_made_compiles_in_memory(tmp_path):
    """BACKPLAN_CACHE_DIR on a read-only mount (or under a file: the same failure of
    os.makedirs, portably): saving a library function's machine code (mathlib's tanh) raised
    the OSError of making the folder from inside the handler meant to note it, and the user's
    first compiled call failed. Now it runs, compiled in memory, with one CacheWarning. A fresh
    process: which library functions have asked for their cache is per process."""
    import subprocess
    import sys

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    kernels = blocker / "kernels"
    code = (
        "import numpy as np, backplan as bp\n"
        "f = bp.compile(lambda w, x: bp.sum(bp.tanh(x * w + 1.0) ** 2))\n"
        "w = bp.tensor(np.full(8, 0.5), requires_grad=True)\n"
        "loss = f(w, bp.tensor(np.linspace(-1.0, 1.0, 32).reshape(4, 8)))\n"
        "loss.backward()\n"
        "print(repr(loss.item()), repr(float(w.grad.numpy().sum())))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "BACKPLAN_LIBRARY_CACHE_DIR"}
    env |= {"BACKPLAN_CACHE_DIR": str(kernels), "BACKPLAN_DRIVER": "python"}
    env["BACKPLAN_BACKEND"] = "numba"  # the suite runs on the reference interpreter
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    x = np.linspace(-1.0, 1.0, 32).reshape(4, 8)
    t = np.tanh(x * 0.5 + 1.0)
    loss, grad = (float(v) for v in out.stdout.split())
    np.testing.assert_allclose(loss, np.sum(t**2), rtol=1e-12)
    np.testing.assert_allclose(grad, np.sum(2 * t * (1 - t**2) * x), rtol=1e-9)
    assert out.stderr.count("CacheWarning") == 1, out.stderr
    assert f"{kernels} cannot be written (Not a directory" in out.stderr


def test_a_full_cache_folder_warns_once_for_it_and_the_library_folder_inside(tmp_path, monkeypatch):
    """A full disk under BACKPLAN_CACHE_DIR: the library folder inside it and the folder itself
    each warned, two CacheWarnings for one fault (either may fail first)."""
    from backplan.codegen.build import cache_health

    top = tmp_path / "kernels"
    inside = top / "library" / "0123456789abcdef" / "codegen" / "kernels"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for first, second in ((inside, top), (top, inside)):
        monkeypatch.setattr(cache_health, "_unwritable", {})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache_health.note_unwritable(str(first), full)
            cache_health.note_unwritable(str(second), full)
            cache_health.note_unwritable(str(tmp_path / "elsewhere"), full)
        messages = [str(w.message) for w in caught if issubclass(w.category, bp.CacheWarning)]
        assert len(messages) == 2, messages  # the second folder is another fault
        assert f"folder {first} cannot be written" in messages[0]
        assert cache_health.is_unwritable(str(second))
