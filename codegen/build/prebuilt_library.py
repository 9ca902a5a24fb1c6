"""The library's machine code built ahead of time, once per installation and CPU.

Compiling backplan's own library functions (GEMM, convolution, attention, row kernels, the
scalar helpers) is most of a cold first call: 3-13 CPU s on the bench models, against 0.5-2.3 s
for the rest (tracing, the plan's loop kernels and driver). `python -m backplan cache prebuild`
(backplan/prebuild.py) compiles them once, as an install step, into a folder beside the
installed package (`_prebuilt_library/`, or BACKPLAN_PREBUILT_LIBRARY_DIR); a process whose own
library folder (library_cache.py) has no entry for a function's signature loads it from there
instead of compiling. Nothing there is written afterwards: compiles still go to the user's
library folder.

The files are the signed cache files of cache_signing.py, written by the build as any library
compile writes them, and checked the same way before a byte is unpickled: signed with this
user's key (a file signed by another user, edited or planted is skipped, never deleted: the
folder belongs to the installation), in a folder no one else may write to. An entry is used
only for the same source file stamp and code generator fingerprint, and the same CPU name and
features (Numba's key): a machine of another CPU family, or an edited installation, compiles
as if the folder were empty.
"""

from __future__ import annotations

import os
import warnings

from backplan.codegen.build import library_cache
from backplan.codegen.build.cache_signing import (
    CacheError,
    CacheWarning,
    SignedIndexDataCacheFile,
    add_fallback,
    check_private_folder,
    user_stacklevel,
)

FOLDER = "_prebuilt_library"
READ_ONLY = "the prebuilt library is written only by `python -m backplan cache prebuild`"
_refused: set[str] = set()  # folders already warned about


def prebuilt_folder() -> str:
    """Where the build puts the library and where processes look for it."""
    chosen = os.environ.get("BACKPLAN_PREBUILT_LIBRARY_DIR")
    return chosen or os.path.join(library_cache.PACKAGE_ROOT, FOLDER)


def usable(folder: str) -> bool:
    """The folder exists and only its owner (this user) can write to it; a folder others could
    write to is refused once per process with a warning (its files could run code here). One
    another user built (an installation shared by several users) is skipped without a word:
    its files carry that user's signature, which this user's key cannot check."""
    try:
        if not os.path.isdir(folder) or os.stat(folder).st_uid != os.getuid():
            return False
    except OSError:
        return False
    try:
        check_private_folder(folder, "the prebuilt library folder")
    except CacheError as refused:
        if folder not in _refused:
            _refused.add(folder)
            warnings.warn(
                f"{refused}; compiling the library instead",
                CacheWarning,
                stacklevel=user_stacklevel(),
            )
        return False
    return True


class PrebuiltCacheFile(SignedIndexDataCacheFile):
    """A read-only view of the prebuilt folder: a file that fails its check is skipped (and the
    function compiled into the user's own library folder), never deleted or rewritten."""

    def _discard(self, path: str, why: str) -> None:
        if path not in _refused:
            _refused.add(path)
            warnings.warn(
                f"prebuilt library file {path} {why}; not used",
                CacheWarning,
                stacklevel=user_stacklevel(),
            )

    def _save_index(self, overloads):
        raise CacheError(READ_ONLY)

    def _save_data(self, name, data):
        raise CacheError(READ_ONLY)


def prebuilt_file(py_func, filename_base: str, source_stamp) -> PrebuiltCacheFile | None:
    """The prebuilt cache file of a library function (None for generated modules, for the build
    itself, which writes there as its library folder, and when there is no usable folder)."""
    py_file = py_func.__code__.co_filename
    if not library_cache.is_library_file(py_file):
        return None
    folder = prebuilt_folder()
    if os.path.abspath(library_cache.library_folder()) == os.path.abspath(folder):
        return None
    if not usable(folder):
        return None
    path = os.path.join(folder, library_cache.versioned_inside_package(py_file))
    if not os.path.isdir(path):
        return None
    return PrebuiltCacheFile(path, filename_base, source_stamp)


add_fallback(prebuilt_file)
