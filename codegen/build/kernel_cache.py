"""Loop kernels shared by every plan: each canonical kernel (codegen/render/kernel_source.py) is
written
to `<cache dir>/k_<hash>.py`, imported once per process into a registry (hash -> Numba
dispatcher) and compiled with cache=True, so a kernel is compiled once per machine, whichever
plan, model or process first needs it.

A kernel that takes its arrays as addresses (codegen/render/kernel_source.py) has no CPython
wrapper:
a driver running as Python calls its loop's C entry instead (`python_call`,
codegen/run/address_calls.py).

Safe as the plan cache is (codegen/build/cache.py): the source is regenerated and compared with the
file before anything runs, the code run is the source generated now (never the file's text),
writes are atomic, and a tampered, corrupt or half-written file is simply rewritten.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass

from backplan.codegen.build import cache, code_cache, loop_batch
from backplan.codegen.jit import AS_PYTHON
from backplan.codegen.render.kernel_source import KernelSource
from backplan.codegen.run.address_calls import AddressCall

_LOADED: dict[str, object] = {}  # digest -> dispatcher (a plain function when run as Python)
_ADDRESS_LOOPS: dict[str, list] = {}  # digest -> its loops taking addresses (ADDRESS_FORMS)
# An address kernel's loops taking addresses: fully optimised, and compiled quickly for calls
# over few elements (codegen/render/kernel_source.py).
ADDRESS_FORMS = ("kernel_at", "kernel_at_small")
_PYTHON_CALLS: dict[int, object] = {}  # id(dispatcher) -> what a Python-run driver calls


def kernel(digest: str):
    """The loaded kernel with this hash: what a plan's driver module calls."""
    try:
        return _LOADED[digest]
    except KeyError:
        raise RuntimeError(
            f"loop kernel {digest[:20]} was not loaded before the plan using it; load the "
            "plan's kernels with backplan.codegen.build.kernel_cache.load first"
        ) from None


def load(kernels: list[KernelSource]) -> None:
    """Import every kernel not yet in this process (nothing is compiled here: Numba compiles,
    or loads from its disk cache, on the first call with each argument type). Two threads
    making plans at once import a shared kernel once. The loops a Python-run first call of
    these kernels will run are grouped, to compile together (codegen/build/loop_batch.py)."""
    with _loading:
        for source in kernels:
            if source.digest not in _LOADED:
                module = _import(source)
                _LOADED[source.digest] = module.kernel
                loops = [getattr(module, name, None) for name in ADDRESS_FORMS]
                if loops[0] is not None and not AS_PYTHON:
                    _ADDRESS_LOOPS[source.digest] = [loop for loop in loops if loop is not None]
                    _PYTHON_CALLS[id(module.kernel)] = AddressCall(*loops)
        loop_batch.group(first_calls(kernels))


_SIZE = re.compile(r"np\.intp\((\d+)\)")


def first_calls(kernels: list[KernelSource]) -> list:
    """(AddressCall, small) for each call of an address kernel whose sizes are known now (a
    plan's fixed sizes); a kernel called both small and not is only its full loop (small
    calls take it once it is compiled). Calls with sizes known only when they run are left
    out: they compile on their own, as before."""
    wanted: dict = {}
    for source in kernels:
        call = _PYTHON_CALLS.get(id(_LOADED.get(source.digest)))
        if call is None or len(source.arguments) != len(call._kinds):
            continue
        sizes = [_SIZE.fullmatch(source.arguments[i]) for i in call._sizes]
        if all(sizes):
            small = call.is_small([int(size.group(1)) for size in sizes])
            wanted[call] = wanted.get(call, True) and small
    return [(call, small) for call, small in wanted.items()]


_loading = threading.Lock()


def compiled_forms(digest: str) -> list:
    """The functions of a kernel that compile: its loops taking addresses (first calls on a
    Python-run driver: ADDRESS_FORMS) and the form compiled drivers call (the kernel itself)."""
    return [*_ADDRESS_LOOPS.get(digest, ()), _LOADED[digest]]


def python_call(kernel):
    """What a driver running as Python calls for this loaded kernel."""
    return _PYTHON_CALLS.get(id(kernel), kernel)


def _import(source: KernelSource):
    # None: compiled in memory (codegen/build/cache_health.py)
    directory = cache.writable_cache_dir()
    path = os.path.join(directory or cache.cache_path(), f"{source.name}.py")
    if directory is not None and cache._read(path) != source.source:
        cache.write_entry(directory, {f"{source.name}.py": source.source})
    module = types.ModuleType(f"backplan_kernel_{source.name}")
    module.__file__ = path
    module.__source_text__ = source.source  # to write the file again if it is deleted
    sys.modules[module.__name__] = module
    # Run the source generated now under the file's name: Numba's cache keys on the file.
    exec(code_cache.compiled(source.source, path, directory), module.__dict__)
    return module


def is_cached(source: KernelSource) -> bool:
    """Whether the kernel will not need compiling (see cached_digests)."""
    return source.digest in cached_digests([source])


def cached_digests(kernels: list[KernelSource], form: str | None = None) -> set[str]:
    """The digests of those kernels that will not need compiling: compiled in this process
    already, or an index of compiled versions is on disk beside the kernel's file (a prediction:
    the index may hold other argument types). form: "kernel" asks about the form compiled
    drivers inline only (None: either form). Numba's folder is listed at most once per call,
    however many kernels are asked about: a long-lived cache holds thousands of files."""
    found, unknown = set(), []
    for source in kernels:
        forms = compiled_forms(source.digest) if source.digest in _LOADED else []
        if form is not None:
            forms = [f for f in forms if getattr(f, "__name__", "") == form]
        if any(getattr(f, "overloads", None) for f in forms) or _ran_here(source.digest, form):
            found.add(source.digest)
        else:
            unknown.append(source)
    if unknown:
        indexed = _indexed_kernel_names({source.name for source in unknown}, form)
        found.update(source.digest for source in unknown if source.name in indexed)
    return found


def _ran_here(digest: str, form: str | None) -> bool:
    """Whether a loop of this address kernel has machine code in this process without a Numba
    overload (compiled with a plan's others, or loaded from such a batch: loop_batch.py)."""
    if form not in (None, *ADDRESS_FORMS) or digest not in _LOADED:
        return False
    call = _PYTHON_CALLS.get(id(_LOADED[digest]))
    libraries = getattr(call, "_libraries", ())
    if form is None:
        return any(libraries)
    return bool(libraries and libraries[form == "kernel_at_small"])


def _indexed_kernel_names(wanted: set[str], form: str | None = None) -> set[str]:
    """Of the kernel names wanted, those with a Numba index file (`<name>.kernel-<line>....nbi`,
    or `.kernel_at-`, `.kernel_at_small-` for the loops of an address kernel) or a note of a
    loop compiled with others (`<name>.kernel_at.batch`) this process can load; form picks one.
    The folder is scanned entry by entry, never held as a list: a long-lived cache holds tens of
    thousands of files, and the list of their names (16,790 names, about 1 MiB of strings) was
    the largest allocation of a plan's first call, above the step's predicted peak. Inside
    `one_listing()` (explain) the folder is listed once and its index entries kept."""
    listing = getattr(_listings, "entries", None)
    if listing is not None:
        if not listing:
            listing.update(_index_entries() or {})
            listing.setdefault("", [])  # listed: an empty or missing folder is not listed again
        entries = ((n, p) for kernel in wanted for n, p in listing.get(kernel, ()))
    else:
        try:
            entries = [(n, p) for n, p in _scanned(lambda kernel: kernel in wanted)]
        except OSError:
            return set()
    forms = (form,) if form else ("kernel", *ADDRESS_FORMS)
    found = set()
    for name, path in entries:
        kernel = name.partition(".kernel")[0]
        if name.endswith(".nbi"):
            if any(f".{f}-" in name for f in forms):
                found.add(kernel)
        elif name[len(kernel) + 1 : -len(".batch")] in forms and loop_batch.note_is_usable(path):
            found.add(kernel)  # a loop compiled with others: codegen/build/loop_batch.py
    return found


def _scanned(keep):
    """(name, path) of the folder's index files and batch notes whose kernel keep accepts,
    one directory entry at a time."""
    directory = os.path.join(cache.cache_path(), "__pycache__")  # asking creates nothing
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if (name.endswith(".nbi") or name.endswith(".batch")) and keep(
                name.partition(".kernel")[0]
            ):
                yield name, entry.path


def _index_entries() -> dict[str, list] | None:
    """Every kernel's index files and batch notes, by kernel name (None: no folder)."""
    found: dict[str, list] = {}
    try:
        for name, path in _scanned(lambda kernel: True):
            found.setdefault(name.partition(".kernel")[0], []).append((name, path))
    except OSError:
        return None
    return found


_listings = threading.local()


@contextmanager
def one_listing():
    """Within it, this thread lists the kernel folder at most once: explain asks which kernels
    are cached for every plan and loop of a step (24 listings of a 51,000-file folder took 4.4
    of a symbolic step's 4.6 s explain). Nothing compiles meanwhile, so the answer holds."""
    if getattr(_listings, "entries", None) is not None:
        yield
        return
    _listings.entries = {}
    try:
        yield
    finally:
        _listings.entries = None


@dataclass(frozen=True)
class KernelCounts:
    """Loop kernels of this process: `loaded` distinct kernels imported, `versions` compiled
    versions held (one per argument types; compiled here or loaded from disk), `compiled` of
    those that Numba compiled here (disk cache misses)."""

    loaded: int
    versions: int
    compiled: int


def counts() -> KernelCounts:
    functions = [*_LOADED.values(), *(loop for loops in _ADDRESS_LOOPS.values() for loop in loops)]
    dispatchers = [d for d in functions if hasattr(d, "overloads")]
    batched = loop_batch.counts  # loop forms compiled together, or loaded from such a batch
    return KernelCounts(
        len(_LOADED),
        sum(len(d.overloads) for d in dispatchers) + batched["compiled"] + batched["loaded"],
        sum(sum(d.stats.cache_misses.values()) for d in dispatchers) + batched["compiled"],
    )
