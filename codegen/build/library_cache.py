"""Where the machine code of backplan's own library functions (GEMM, convolution, attention, row
kernels, the scalar helpers) is cached: in the kernel cache folder, under `library/` and the
function's path inside the package (`<cache>/library/codegen/kernels/conv/...`), signed like
every other entry, counted by `python -m backplan cache info` and removed by `cache clear`.
Numba's default put it in the installed package's own `__pycache__`, outside the cache folder:
never counted, never cleared, and shared by every user of an installation.

BACKPLAN_LIBRARY_CACHE_DIR names another folder for them (the test suite shares one between
the many cache folders its tests make, so that each fresh folder does not compile the library
again).
"""

from __future__ import annotations

import os

from numba.core.caching import _CacheLocator, _SourceFileBackedLocatorMixin

from backplan.codegen.build import fingerprint
from backplan.codegen.build.cache import cache_dir, cache_path
from backplan.codegen.build.cache_signing import CacheError, add_locator, check_private_folder

PACKAGE_ROOT = os.path.dirname(fingerprint.CODEGEN_ROOT)
FOLDER = "library"


def library_folder() -> str:
    """The folder the library's files go to (created by the first function that caches). A
    kernel cache folder that cannot be made (a read-only mount, a path under a file) still
    names where it would be: the function's cache then fails to make it and notes the folder
    unwritable (codegen/jit.py), where raising here failed the user's call."""
    chosen = os.environ.get("BACKPLAN_LIBRARY_CACHE_DIR")
    if chosen:
        return _private(chosen)
    try:
        return _private(os.path.join(cache_dir(), FOLDER))
    except CacheError:
        raise  # a folder others can write to is refused, never used
    except OSError:
        return os.path.join(cache_path(), FOLDER)


def _private(folder: str) -> str:
    """The folder, made 0700 as the kernel cache folder is (Numba would make it by the umask),
    and refused as that folder is where others may write to it (a `library` link into a shared
    folder, a BACKPLAN_LIBRARY_CACHE_DIR of mode 777): its files are loaded into this process.
    One that cannot be made is left to the function's cache (codegen/jit.py notes it)."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        return folder
    check_private_folder(folder, "the library cache folder")
    return folder


def is_library_file(py_file: str) -> bool:
    return os.path.abspath(py_file).startswith(os.path.join(PACKAGE_ROOT, ""))


def inside_package(py_file: str) -> str:
    """A library file's folder relative to the package (`codegen/kernels`)."""
    return os.path.relpath(os.path.dirname(os.path.abspath(py_file)), PACKAGE_ROOT)


def versioned_inside_package(py_file: str) -> str:
    """The file's path inside the package under a folder named by the codegen fingerprint its
    entries are stamped with (cache_signing.dependency_stamp): two checkouts of different code
    sharing one cache folder (a worktree and the main one, two installed versions) keep their
    own index files instead of each finding the other's stale and overwriting it, which made
    every other process compile the library's GEMM again."""
    return os.path.join(fingerprint.codegen_fingerprint()[:16], inside_package(py_file))


def library_path(py_file: str) -> str:
    """The folder a library file's functions are cached in: its path inside the package,
    under library_folder()."""
    return os.path.join(library_folder(), versioned_inside_package(py_file))


def cache_folder(py_func) -> str:
    """Where Numba writes py_func's cache files, the folder a CacheWarning names: a library
    function's under library_folder() (BACKPLAN_LIBRARY_CACHE_DIR, which the user controls),
    not the package's source folder; a generated module's beside its source, which is in the
    kernel cache folder already."""
    py_file = py_func.__code__.co_filename
    return library_path(py_file) if is_library_file(py_file) else os.path.dirname(py_file)


class LibraryLocator(_SourceFileBackedLocatorMixin, _CacheLocator):
    """Numba's locator for a function of a file inside the backplan package; other files
    (generated plan and kernel modules, which live in the cache folder already) are left to
    Numba's own locators."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = library_path(py_file)

    def get_cache_path(self):
        return self._cache_path

    def ensure_cache_path(self):
        os.makedirs(self._cache_path, mode=0o700, exist_ok=True)
        super().ensure_cache_path()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not is_library_file(py_file):
            return None
        return super().from_function(py_func, py_file)


add_locator(LibraryLocator)

# Its fallback, the library built ahead of time, is in place before any compile too.
from backplan.codegen.build import prebuilt_library  # noqa: E402,F401
