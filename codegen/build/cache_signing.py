"""Numba's disk cache, signed: nothing from a cache folder is unpickled unless backplan wrote it.

Numba keeps compiled kernels as pickles (an index `.nbi` and data `.nbc` files), and unpickling
runs code, so a cache folder anyone else can write to would be a way to run code in every
process that uses it. Each file backplan's kernels write carries an HMAC-SHA256 under a secret
that lives outside every cache folder (`~/.config/backplan/cache.key`, created 0600), over the
file's name and its bytes. Before a file is unpickled its signature is checked; a file that
fails (planted, edited, truncated, from another user or machine) is deleted and the kernel
compiled again, with a one-line warning. Signed files have their own names (`*.bp.nbi`,
`*.bp.<n>.nbc`), so unsigned files left by older versions are never read.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import io
import os
import pickle
import stat
import sys
import tempfile
import threading
import warnings

from numba.core.caching import CompileResultCacheImpl, FunctionCache, IndexDataCacheFile
from numba.core.runtime import rtsys

from backplan.codegen.build import fingerprint, object_symbols
from backplan.ir.errors import BackplanError

object_symbols.install()  # cached functions load without parsing their linking bitcode

MAGIC = b"backplan-signed-numba-cache-1\n"
_LENGTH_BYTES = 8
_HEADER = len(MAGIC) + _LENGTH_BYTES + hashlib.sha256().digest_size
KEY_BYTES = 32


class CacheError(BackplanError, OSError):
    """A cache folder or key that others could write to (or read the key of): backplan refuses to
    use it rather than run what someone else put there."""


class StaleEntry(Exception):
    """Raised by a before_load hook: the cached function needs something this process cannot
    give it (a function it calls by symbol, codegen/build/native_calls.py); it is compiled
    again instead of loaded."""


class CacheWarning(UserWarning):
    """A cache file that failed its check was removed; the kernel is compiled again."""


def key_path() -> str:
    """Where the per-user secret lives: `$XDG_CONFIG_HOME/backplan/cache.key` (default
    `~/.config/...`), never inside a cache folder."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "backplan", "cache.key")


def check_private_folder(path: str, what: str) -> None:
    """Refuse a folder that is not ours or that others can write to."""
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"{what} {path} is writable by other users (mode {stat.filemode(info.st_mode)}, "
            f"owner uid {info.st_uid}): whatever they put there could run in this process. "
            f"Run `chmod 700 {path}` if it is yours, or point BACKPLAN_CACHE_DIR at a private "
            "folder."
        )


@functools.cache
def secret() -> bytes:
    """The signing key, created on first use (0600, atomically: two processes starting at
    once end up with the same key)."""
    path = key_path()
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    check_private_folder(folder, "the folder of backplan's cache key")
    if not os.path.exists(path):
        _create_key(path)
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise CacheError(
            f"backplan's cache key {path} can be read or written by other users (mode "
            f"{stat.filemode(info.st_mode)}): anyone holding it could sign a cache file. "
            f"Delete it (a new one is made, and the kernels are compiled again)."
        )
    with open(path, "rb") as f:
        key = f.read()
    if len(key) != KEY_BYTES:
        raise CacheError(f"backplan's cache key {path} is damaged; delete it and run again")
    return key


def _create_key(path: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cache.key.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process made the key first: use theirs
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def _mac(name: str, length: bytes, payload: bytes) -> bytes:
    message = MAGIC + name.encode() + b"\0" + length + payload
    return hmac.new(secret(), message, hashlib.sha256).digest()


def signed(name: str, payload: bytes) -> bytes:
    """The file's bytes: header (magic, payload length, HMAC) then Numba's own bytes."""
    length = len(payload).to_bytes(_LENGTH_BYTES, "little")
    return MAGIC + length + _mac(name, length, payload) + payload


def verified(name: str, data: bytes) -> tuple[bytes | None, str]:
    """(payload, "") when data is a file backplan signed under this name, else (None, why)."""
    if len(data) < _HEADER or not data.startswith(MAGIC):
        return None, "is truncated or was not written by backplan"
    length = data[len(MAGIC) : len(MAGIC) + _LENGTH_BYTES]
    payload = data[_HEADER:]
    if len(payload) != int.from_bytes(length, "little"):
        return None, "is truncated"
    mac = data[len(MAGIC) + _LENGTH_BYTES : _HEADER]
    if not hmac.compare_digest(mac, _mac(name, length, payload)):
        return None, "does not carry this user's signature (edited, planted or copied)"
    return payload, ""


# (folder, reason) pairs a CacheWarning has named in this process: a regenerated key or a
# damaged folder fails every file the same way, and one line says so
_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def discard(path: str, why: str, kind: str = "kernel cache file") -> None:
    """Remove a cache file that failed its check, saying so (kind names what the file held): it
    is never run, and not left for every later process to read and reject again. The first
    file of a folder failing a check warns; later ones only under BACKPLAN_VERBOSE=1."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    key = (os.path.dirname(path), why)
    with _WARNED_LOCK:
        first = key not in _WARNED
        _WARNED.add(key)
    if not first and not _verbose():
        return
    more = "; other files of this folder failing the same check are removed without a warning "
    warnings.warn(
        f"{kind} {path} {why}; removed it, compiling again"
        + (more + "(BACKPLAN_VERBOSE=1 names each)" if first else ""),
        CacheWarning,
        stacklevel=user_stacklevel(),
    )


def _verbose() -> bool:
    """BACKPLAN_VERBOSE=1 (compile_notice.verbose's setting; that module imports this one)."""
    return os.environ.get("BACKPLAN_VERBOSE", "") not in ("", "0")


# Modules a cache warning passes through on its way out: Numba loading a cache file, imports
_NOT_THE_USERS = {"numba", "llvmlite", "importlib", "threading", "concurrent"}
_NOT_THE_USERS |= {"functools", "contextlib", "runpy", "warnings"}


def user_stacklevel() -> int:
    """warnings.warn's stacklevel, from the function that calls it, of the first frame
    outside backplan and what it runs through (the user's line that compiled or loaded the
    kernel); 2, the caller's caller, where no frame is the user's."""
    frame, level = sys._getframe(1), 1  # the function that warns
    while True:
        frame = frame.f_back
        while frame is not None and _bootstrap(frame):  # warnings does not count these
            frame = frame.f_back
        if frame is None:
            return 2
        level += 1
        top = (frame.f_globals.get("__name__") or "").partition(".")[0]
        if not top.startswith("backplan") and top not in _NOT_THE_USERS:  # generated kernel
            return level  # modules are backplan_kernels_*


def _bootstrap(frame) -> bool:
    """A frame of the import machinery, which warnings.warn skips as it counts stacklevel."""
    filename = frame.f_code.co_filename
    return "importlib" in filename and "_bootstrap" in filename


class SignedIndexDataCacheFile(IndexDataCacheFile):
    """Numba's index and data files with a signature checked before any byte is unpickled."""

    def __init__(self, cache_path, filename_base, source_stamp):
        super().__init__(cache_path, filename_base + ".bp", source_stamp)

    def _read_verified(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        payload, why = verified(os.path.basename(path), data)
        if payload is None:
            self._discard(path, why)
        return payload

    def _discard(self, path: str, why: str) -> None:
        discard(path, why)

    def _write_signed(self, path: str, payload: bytes) -> None:
        with self._open_for_write(path) as f:
            f.write(signed(os.path.basename(path), payload))

    def _load_index(self):
        payload = self._read_verified(self._index_path)
        if payload is None:
            return {}
        try:
            stream = io.BytesIO(payload)
            if pickle.load(stream) != self._version:
                return {}
            stamp, overloads = pickle.loads(stream.read())
        except Exception as exc:  # signed by us yet unreadable: treat like a damaged file
            self._discard(self._index_path, f"could not be read ({type(exc).__name__})")
            return {}
        return overloads if stamp == self._source_stamp else {}

    def _save_index(self, overloads):
        payload = pickle.dumps(self._version, protocol=-1)
        payload += self._dump((self._source_stamp, overloads))
        self._write_signed(self._index_path, payload)

    def load(self, key):
        name = self._load_index().get(key)
        if name is None:
            return None
        path = self._data_path(name)
        payload = self._read_verified(path)
        if payload is None:
            return None
        if not ready_to_load(payload):
            return None  # compiled again, and saved over it
        try:
            return pickle.loads(payload)
        except Exception as exc:
            self._discard(path, f"could not be read ({type(exc).__name__})")
            return None

    def _save_data(self, name, data):
        self._write_signed(self._data_path(name), self._dump(data))


_BEFORE_LOAD: list = []


def before_load(marker: bytes, hook) -> None:
    """Call hook(payload) before loading any cached function whose bytes contain marker: the
    machine code names a symbol (codegen/kernels/gemm/symbols.py) that must exist before it
    loads."""
    _BEFORE_LOAD.append((marker, hook))


def ready_to_load(payload: bytes) -> bool:
    """Run the before_load hooks whose marker the machine code names; False when one says the
    code cannot be loaded in this process (compile it again instead)."""
    try:
        for marker, hook in _BEFORE_LOAD:
            if marker in payload:
                hook(payload)
    except StaleEntry:
        return False
    return True


def dependency_stamp(py_func) -> str:
    """What a function's machine code depends on besides its own file. A shared loop kernel's
    name is a hash that already covers its dependencies; anything else backplan compiles
    (library kernels, the GEMM, plan drivers) may inline code from any codegen file."""
    if py_func.__module__.startswith("backplan_kernel_k_"):
        return ""
    return fingerprint.codegen_fingerprint()


class _CacheImpl(CompileResultCacheImpl):
    """Numba's, with backplan's library functions cached in the kernel cache folder: that
    locator (codegen/build/library_cache.py) puts itself first with add_locator."""

    _locator_classes = [*CompileResultCacheImpl._locator_classes]


_FALLBACKS: list = []


def add_fallback(find) -> None:
    """find(py_func, filename_base, source_stamp) -> a cache file to load from when a function's
    own cache has no entry for a signature (the library built ahead of time,
    codegen/build/prebuilt_library.py), or None; saves still go to the function's own cache."""
    _FALLBACKS.append(find)


def add_locator(locator_class) -> None:
    """Try locator_class before Numba's own locators (once)."""
    if locator_class not in _CacheImpl._locator_classes:
        _CacheImpl._locator_classes.insert(0, locator_class)


class SignedFunctionCache(FunctionCache):
    """FunctionCache whose files are signed, and whose entries are stale when a codegen file
    they may depend on changed; library functions cache in the kernel cache folder;
    everything else is Numba's."""

    _impl_class = _CacheImpl

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = SignedIndexDataCacheFile(
            cache_path=self._cache_path,
            filename_base=self._impl.filename_base,
            source_stamp=(self._impl.locator.get_source_stamp(), dependency_stamp(py_func)),
        )
        stamp, base = self._cache_file._source_stamp, self._impl.filename_base
        found = (find(py_func, base, stamp) for find in _FALLBACKS)
        self._fallbacks = [cache_file for cache_file in found if cache_file is not None]

    def load_overload(self, sig, target_context):
        """Numba's load without its refresh of the target context first. The refresh imports
        and installs every typing and lowering registry, most of a warm process's first call
        (tests/test_warm_start.py), and only compiling needs them: Numba's compiler refreshes
        before it starts, and a lowering that misses an implementation refreshes then. What
        loaded machine code needs is its symbols: the runtime's (NRT, set up here), the C
        helpers and math functions (set up with the context), the parallel runtime
        (jit.start_parallel_runtime) and the GEMM (a before-load hook)."""
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)

    def _load_overload(self, sig, target_context):
        """Numba's, then each fallback's file for the same key (source stamp, CPU, bytecode)."""
        data = super()._load_overload(sig, target_context)
        if data is not None or not self._enabled or not self._fallbacks:
            return data
        key = self._index_key(sig, target_context.codegen())
        for cache_file in self._fallbacks:
            data = cache_file.load(key)
            if data is not None:
                return self._impl.rebuild(target_context, data)
        return None
