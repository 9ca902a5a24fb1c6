"""One way to write a file the library hands out (an artifact, a checkpoint): into a temporary
file beside it, then renamed over it. A reader never sees half a file, and a write that fails
part way (a full disk, a read-only folder, a file size limit) leaves what was there and no
temporary file, with an error naming the call and the path."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def write_replacing(
    path: str,
    write: Callable[[BinaryIO], object],
    fail: Callable[[str, OSError], Exception],
    mode: int | None = None,
) -> str:
    """write(file) into a temporary file beside path, then rename it over path. An OSError
    (making, writing or renaming the file) raises fail(text), text saying which path could not
    be written, why, and that the file there is unchanged; mode: the file's permissions
    (else mkstemp's 0600)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", dir=folder)
    except OSError as exc:
        raise fail(_failed(path, exc), exc) from None
    try:
        with os.fdopen(handle, "wb") as file:
            if mode is not None:
                os.fchmod(file.fileno(), mode)
            write(file)
        os.replace(temporary, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, OSError):
            raise fail(_failed(path, exc), exc) from None
        raise
    return path


def _failed(path: str, exc: OSError) -> str:
    why = exc.strerror or str(exc)
    return f"cannot write {path} ({why}); the file there, if any, is unchanged"


def default_file_mode() -> int:
    """The permissions open(path, "w") gives a new file: 0666 less the process's umask (read
    from /proc, since setting it to read it races other threads; 022 where that is missing)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


def write_error(api: str) -> Callable[[str, OSError], OSError]:
    """fail for write_replacing: an OSError of the same errno (what a full disk raises, so
    callers that catch it still do) whose text starts with the call, `save_tree: cannot ...`."""
    return lambda text, error: OSError(error.errno, f"{api}: {text}")
