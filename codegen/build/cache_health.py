"""A kernel cache folder that cannot be written never fails a user's call.

A full disk, a read-only folder or one deleted while the process runs used to raise OSError (or
Numba's `cannot cache function ...: no locator available`) from the first compiled call. Now:

- a folder that does not exist (deleted meanwhile) is made again, and a deleted module's source
  is written again from the text this process generated, so caching goes on;
- a folder that cannot be written (no space, read-only, not permitted) makes this process
  compile in memory: nothing more is written there, Numba caches nothing, plans run their driver
  as Python instead of building it in a background process (which hands it over through the
  folder), and one `bp.CacheWarning` names the folder and the reason.

Everything here is about the folder; what goes in it is codegen/cache.py's and Numba's.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import warnings

from backplan.codegen.build.cache_signing import CacheWarning, user_stacklevel

PROBE_BYTES = 4096  # a full disk may still make an empty file: write some bytes too

_lock = threading.Lock()
_unwritable: dict[str, str] = {}  # folder -> why it cannot be written (warned once)
_probed: set[str] = set()


def is_unwritable(folder: str) -> bool:
    return os.path.realpath(folder) in _unwritable


def note_unwritable(folder: str, error: OSError) -> None:
    """From now on this process compiles in memory for folder; warn the first time, and not
    again for a folder inside it or around it (the library's folder inside the cache folder:
    one full disk, one warning)."""
    key = os.path.realpath(folder)
    reason = error.strerror or str(error)
    if os.path.isfile(folder):  # makedirs says "File exists", which reads as no problem
        reason = "it is a file, not a folder"
    with _lock:
        if key in _unwritable:
            return
        warned = any(_nested(key, other) for other in _unwritable)
        _unwritable[key] = reason
    if warned:
        return
    warnings.warn(
        f"the kernel cache folder {folder} cannot be written ({reason}, errno "
        f"{errno.errorcode.get(error.errno, error.errno)}); this process compiles in memory, so "
        "the next run compiles again (free space, fix the folder's permissions or point "
        f"{_variable_of(key)} elsewhere)",
        CacheWarning,
        stacklevel=user_stacklevel(),
    )


def _nested(a: str, b: str) -> bool:
    """Whether one of two folders lies inside the other."""
    a, b = os.path.join(a, ""), os.path.join(b, "")
    return a.startswith(b) or b.startswith(a)


def any_unwritable() -> bool:
    """Whether this process compiles in memory for some folder (nothing it compiles is kept)."""
    return bool(_unwritable)


def _variable_of(folder: str) -> str:
    """The setting that chose folder: BACKPLAN_LIBRARY_CACHE_DIR for the library functions'
    folder when it is set (codegen/build/library_cache.py), else BACKPLAN_CACHE_DIR."""
    library = os.environ.get("BACKPLAN_LIBRARY_CACHE_DIR")
    if library and os.path.join(folder, "").startswith(os.path.join(os.path.realpath(library), "")):
        return "BACKPLAN_LIBRARY_CACHE_DIR"
    return "BACKPLAN_CACHE_DIR"


def probe(folder: str) -> bool:
    """Whether bytes can be written in folder (asked once per folder per process; a write that
    fails later is noted where it fails)."""
    key = os.path.realpath(folder)
    if key in _unwritable:
        return False
    if key in _probed:
        return True
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        note_unwritable(folder, error)
        return False
    _probed.add(key)
    return True


def write_atomic(path: str, text: str) -> None:
    """Write text to path through a temporary file and a rename, so no reader ever sees half."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def restore_source(py_func) -> bool:
    """Write a generated function's module file again (its folder too, with Numba's
    `__pycache__`) when it was deleted, from the source text this process ran; False when
    that is not known or cannot be written."""
    path = py_func.__code__.co_filename
    text = py_func.__globals__.get("__source_text__")
    if text is None or os.path.exists(path):
        return False
    folder = os.path.dirname(path)
    try:
        os.makedirs(os.path.join(folder, "__pycache__"), mode=0o700, exist_ok=True)
        write_atomic(path, text)
    except OSError as error:
        note_unwritable(folder, error)
        return False
    return True
