"""njit and prange for generated and library kernels.

BACKPLAN_KERNELS_AS_PYTHON=1 runs every kernel as plain Python instead: slow, but a traceback
then points at a readable line of the generated source, with the IR line above it.
"""

import errno
import os

import numba
import numba.core.event
from numba.core.caching import NullCache

from backplan.codegen.build import (
    cache_health,
    compile_lock,
    library_cache,  # its locator, before any compile
    process_memory,  # counts what loads and compiles leave resident
    runtime_cache,
)
from backplan.codegen.build.cache_signing import SignedFunctionCache

AS_PYTHON = os.environ.get("BACKPLAN_KERNELS_AS_PYTHON") == "1"

# Parallel kernels run between BLAS calls. OpenMP's threads spin-wait after each parallel loop
# while OpenBLAS's threads spin too, and on a small machine they starve each other (measured:
# an MLP step 5-10x slower). Numba's workqueue layer sleeps instead. A user's own choice, made
# with NUMBA_THREADING_LAYER, is left alone.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

runtime_cache.install()  # Numba's runtime functions from the cache folder, before any compile


def compiled_njit(cache: bool = False, **options):
    """numba.njit(**options), except that cache=True uses the signed disk cache
    (codegen/build/cache_signing.py): nothing Numba cached is unpickled unless backplan wrote it."""

    def decorate(fn):
        dispatcher = numba.njit(**options)(fn)
        if cache:
            dispatcher._cache = SignedCacheOnDemand(dispatcher.py_func)
        return dispatcher

    return decorate


class SignedCacheOnDemand:
    """A function's SignedFunctionCache, made the first time Numba asks it anything. Making one
    touches the disk (Numba creates and deletes a file to test that the folder is writable), and
    most library functions never ask: a warm process loads a plan's driver whose cached machine
    code already holds every library function it calls.

    Loading and saving never fail a call because of the folder (codegen/build/cache_health.py): a
    deleted module file is written again (and the cache made anew for its new stamp), and a
    folder that cannot be written turns this function's cache into Numba's NullCache."""

    def __init__(self, py_func):
        self._py_func = py_func
        self._signed = None
        self._locks: dict[str, str] = {}  # signature -> the compile lock it holds until saved

    def __getattr__(self, name: str):
        return getattr(self._cache(), name)

    def _cache(self):
        if self._signed is None:
            folder = library_cache.cache_folder(self._py_func)
            if cache_health.is_unwritable(folder):
                self._signed = NullCache()
                return self._signed
            try:
                self._signed = SignedFunctionCache(self._py_func)
            except (RuntimeError, OSError) as error:  # RuntimeError: Numba's "no locator"
                if cache_health.restore_source(self._py_func):
                    return self._cache()
                cache_health.note_unwritable(folder, _as_os_error(error))
                self._signed = NullCache()
        return self._signed

    def load_overload(self, sig, target_context):
        """The cached machine code for sig, or None: then this process compiles it, holding
        the function's compile lock (codegen/build/compile_lock.py) until save_overload, and
        a process that waited for another's lock looks again first."""
        data = self._loaded(sig, target_context)
        cache = self._cache()
        if data is None and not isinstance(cache, NullCache):
            lock = compile_lock.lock_path(cache._cache_path, cache._impl.filename_base, sig)
            self._locks[str(sig)] = lock
            if compile_lock.take(lock):
                data = self._loaded(sig, target_context)  # what the holder saved
                if data is not None:
                    compile_lock.release(self._locks.pop(str(sig)))
        return data

    def load_saved(self, sig, target_context):
        """The cached machine code for sig, or None, taking no lock: for a caller that only
        looks (load_cached), so that no lock is held for a compile this process never does
        (a build process, or another rank, would wait WAIT_S for it)."""
        return self._loaded(sig, target_context)

    def _loaded(self, sig, target_context):
        try:
            with process_memory.loading() as look:
                data = self._cache().load_overload(sig, target_context)
                look.found = data is not None
                return data
        except OSError:  # the module file or the folder is gone: compile (saving restores)
            return None

    def save_overload(self, sig, data):
        try:
            self._saved(sig, data)
        finally:
            lock = self._locks.pop(str(sig), None)
            if lock is not None:
                compile_lock.release(lock)

    def release_locks(self, args=None) -> None:
        """A compile that raised saves nothing: its lock goes now, not at the process's end.
        args: the failed compile's argument types; only that signature's lock goes (an outer
        compile of another signature of this function still holds its own), or every lock of
        the function where its signature was given another way."""
        lock = self._locks.pop(str(tuple(args)), None) if args is not None else None
        if lock is not None:
            compile_lock.release(lock)
            return
        while self._locks:
            compile_lock.release(self._locks.popitem()[1])

    def _saved(self, sig, data):
        try:
            self._cache().save_overload(sig, data)
        except OSError as error:
            if not cache_health.restore_source(self._py_func):
                cache_health.note_unwritable(library_cache.cache_folder(self._py_func), error)
                self._signed = NullCache()
                return
            self._signed = None  # the file is new: a cache with its new stamp
            self._saved(sig, data)


class _FailedCompiles(numba.core.event.Listener):
    """Releases the compile locks of a function whose compile raised (a typing error, or
    Numba's own retry with literal arguments), so that no other process waits for it."""

    def on_start(self, event):
        pass

    def on_end(self, event):
        # Event.is_failed is inverted in Numba (`_exc_details is None`): read the details
        failed = getattr(event, "_exc_details", None) is not None
        cache = getattr(event.data["dispatcher"], "_cache", None)
        if failed and isinstance(cache, SignedCacheOnDemand):
            cache.release_locks(event.data.get("args"))


numba.core.event.register("numba:compile", _FailedCompiles())


def _as_os_error(error: Exception) -> OSError:
    if isinstance(error, OSError):
        return error
    return OSError(errno.EACCES, f"Numba cannot cache there: {error}")


def njit(*args, **kwargs):
    """compiled_njit, or the plain Python function under BACKPLAN_KERNELS_AS_PYTHON=1."""
    if AS_PYTHON:
        return args[0] if args and callable(args[0]) else (lambda fn: fn)
    if args and callable(args[0]):
        return compiled_njit(**kwargs)(args[0])
    return compiled_njit(**kwargs)


prange = range if AS_PYTHON else numba.prange


def start_parallel_runtime() -> None:
    """Start Numba's parallel runtime before any cached plan is loaded.

    A function compiled while the parallel kernel it calls was loaded from the disk cache is
    cached without the hook that starts the parallel runtime on load (Numba keeps that hook only
    for parfors compiled in the same process). A later process loading that function from disk
    then calls into a runtime that was never started and crashes. Plans share kernels across
    processes, so this happens in normal use: start the runtime ourselves (idempotent)."""
    if AS_PYTHON:
        return
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()


def load_cached(dispatcher, signature) -> bool:
    """Add the dispatcher's compiled version for `signature` from its (signed) disk cache, as
    Numba's own compile does before compiling; False when the cache has none. Never compiles,
    and takes no compile lock (a miss here is often compiled by a build process)."""
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock:
        compiled = saved_overload(dispatcher, signature)
        if compiled is None:
            return False
        dispatcher.targetctx.insert_user_function(
            compiled.entry_point, compiled.fndesc, [compiled.library]
        )
        dispatcher.add_overload(compiled)
        return True


def saved_overload(dispatcher, signature):
    """The dispatcher's cached machine code for signature, or None; no compile lock taken."""
    cache = dispatcher._cache
    look = getattr(cache, "load_saved", cache.load_overload)
    return look(signature, dispatcher.targetctx)


def is_cached(dispatcher) -> bool:
    """Whether a compiled version of this dispatcher (a plan's driver, a kernel's loop) is in
    Numba's (signed) cache: its index file exists (a prediction: the index may hold other
    argument types)."""
    cache = getattr(dispatcher, "_cache", None)
    index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
    return index is not None and os.path.exists(index)
