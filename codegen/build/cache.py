"""The disk cache of generated modules.

Each plan's source is written to `<cache dir>/<key>.py` and imported, so Numba's own
cache=True keeps the machine code beside it and a second process starts warm. The key is a hash
of named parts; a sidecar `<key>.json` records them so a miss can say which part changed.
The source is regenerated from the IR every time and compared with the file: code is only ever
run if it is exactly what backplan generated now, and a tampered, corrupt or half-written entry
is simply rewritten (writes go to a temporary file, then rename, so concurrent processes never
see a partial file). Numba's machine code beside it is signed (cache_signing.py) and checked
before it is unpickled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import threading
import types

import llvmlite
import numba
import numpy as np

from backplan.codegen.build import cache_health, code_cache, loop_calls, native_calls
from backplan.codegen.build.cache_signing import CacheError, check_private_folder, key_path
from backplan.codegen.build.fingerprint import codegen_fingerprint, kernel_fingerprint  # noqa: F401 (used via cache.)

_importing = threading.Lock()  # one thread at a time writes and imports entries


def cache_path() -> str:
    """Where the cache folder is, without creating it (for questions that must not write)."""
    return os.environ.get("BACKPLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "backplan",
        "kernels",
    )


def cache_dir() -> str:
    """The cache folder, created 0700 (with the `__pycache__` Numba writes into); a folder that
    other users can write to, or one holding the signing key, is refused with CacheError."""
    path = cache_path()
    numba_files = os.path.join(path, "__pycache__")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.makedirs(numba_files, mode=0o700, exist_ok=True)
    for folder in (path, numba_files):
        check_private_folder(folder, "the kernel cache folder")
    key = os.path.realpath(key_path())
    if key.startswith(os.path.join(os.path.realpath(path), "")):
        raise CacheError(
            f"backplan's cache key {key} lies inside the kernel cache folder {path}; the key "
            "must live elsewhere: set XDG_CONFIG_HOME or BACKPLAN_CACHE_DIR to separate them"
        )
    return path


@functools.cache
def _cpu() -> str:
    """The host CPU's name and a hash of its features (asked of LLVM once per process), and
    the target Numba compiles for where NUMBA_CPU_NAME or NUMBA_CPU_FEATURES names another (an
    AVX2 machine emulated on an AVX-512 one must not load the AVX-512 host's plans)."""
    from llvmlite import binding
    from numba.core import config

    features = binding.get_host_cpu_features().flatten()
    key = f"{binding.get_host_cpu_name()}:{hashlib.sha256(features.encode()).hexdigest()[:12]}"
    if config.CPU_NAME is None and config.CPU_FEATURES is None:
        return key
    target = f"{config.CPU_NAME}|{config.CPU_FEATURES}"
    return f"{key}:{hashlib.sha256(target.encode()).hexdigest()[:12]}"


def key_parts(ir_text: str, flags: str) -> dict[str, str]:
    return {
        "ir": hashlib.sha256(ir_text.encode()).hexdigest()[:24],
        "codegen": codegen_fingerprint(),
        "numba": numba.__version__,
        "llvmlite": llvmlite.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "cpu": _cpu(),
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:12],
    }


def entry_key(parts: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def miss_reason(parts: dict[str, str], directory: str, own: str = "") -> str:
    """Which named parts differ from the closest entry for the same IR, if there is one (own:
    the file name of this entry's key, written since the miss). It reads every entry's key
    file: about 0.3 s in a folder of 7,000 plans, so it runs only when someone asks."""
    best = None
    for name in os.listdir(directory):
        if not name.endswith(".json") or name == own:
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                other = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(other, dict) and other.get("ir") == parts["ir"]:
            changed = sorted(k for k in parts if other.get(k) != parts[k])
            if best is None or len(changed) < len(best):
                best = changed
    if best is None:
        return "new plan: this IR was never compiled here"
    return "changed: " + ", ".join(f"{k}" for k in best)


_write_atomic = cache_health.write_atomic


def writable_cache_dir() -> str | None:
    """The cache folder (made again if it was deleted), or None when it cannot be written: then
    this process compiles in memory (codegen/build/cache_health.py; one CacheWarning says why)."""
    path = cache_path()
    if cache_health.is_unwritable(path):
        return None
    try:
        directory = cache_dir()
    except CacheError:
        raise  # a folder others can write to is refused, never silently used or skipped
    except OSError as error:
        cache_health.note_unwritable(path, error)
        return None
    return directory if cache_health.probe(directory) else None


def write_entry(directory: str | None, files: dict[str, str]) -> None:
    """Write files (name -> text) into the cache folder; a failure (disk full, folder gone or
    made read-only meanwhile) is noted and the process goes on in memory."""
    if directory is None:
        return
    try:
        for name, text in files.items():
            _write_atomic(os.path.join(directory, name), text)
    except OSError as error:
        cache_health.note_unwritable(directory, error)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def load_module(source: str, parts: dict[str, str]):
    """Import the module for this source; returns (module, hit?, why), why() saying why it
    missed (None on a hit): worked out when asked, since it reads the whole folder."""
    directory = writable_cache_dir()
    key = entry_key(parts)
    path = os.path.join(directory or cache_path(), f"bp_{key}.py")
    hit = _read(path) == source
    reason = None
    if not hit:
        if directory is None:
            reason = functools.partial(
                str, "the cache folder cannot be written: compiled in memory"
            )
        elif os.path.exists(path):
            reason = functools.partial(str, "entry rewritten")
        else:
            reason = functools.partial(miss_reason, parts, directory, f"bp_{key}.json")
        write_entry(
            directory,
            {f"bp_{key}.py": source, f"bp_{key}.json": json.dumps(parts, sort_keys=True)},
        )
    name = f"backplan_kernels_{key}"
    with _importing:
        module = sys.modules.get(name)
        if module is None or getattr(module, "__source_text__", None) != source:
            # Run the source we generated (not whatever the file holds) under the file's name,
            # so Numba's cache, which keys on the file, still works. Published only once whole:
            # another thread must never see a module whose `run` is not defined yet.
            module = types.ModuleType(name)
            module.__file__ = path
            module.__source_text__ = source
            exec(code_cache.compiled(source, path, directory), module.__dict__)
            native_calls.wrap_callees(module.__dict__)  # its driver calls them by address
            if loop_calls.mode() == "address":
                loop_calls.wrap_loops(module.__dict__)  # and its loops too
            sys.modules[name] = module
    return module, hit, reason
