"""A plan's address loops compiled together: one LLVM module per optimisation level, optimised
and turned into machine code once, instead of one module per loop.

A cold first call (the library built ahead of time) spends most of its CPU compiling the plan's
address loops (codegen/render/kernel_source.py), which a Python-run driver calls through their
native entries (codegen/run/address_calls.py). Each loop compiled on its own pays, besides its
typing and lowering, a module's optimisation and emission; lowered into one library and
finalised once, the bench transformer's 24 loops took 0.88x the CPU (bench/one_module.py).

When a plan is loaded, the loop forms its first call will run are known from its sizes
(`group`). The first of them that needs compiling compiles every one of them not compiled or
cached yet, in one go (`compile_together`), and each gets its entry. The machine code is kept
in the cache folder, signed with this user's key like every cache file
(codegen/build/cache_signing.py): one object file for the batch (`k_batch_<hash>.o`) and, per
loop form, a small signed note (`<kernel>.<form>.batch`) naming that file and the form's symbol,
so a later process (or plan) needing any of those loops loads the batch's object once and
compiles none of them again. No pickle: the note is JSON and the object is LLVM's own bytes,
read only after the signature is checked. A note for another CPU, Numba or llvmlite or kernel
source is ignored and the loop compiled again; a file that fails its check (edited, truncated,
unsigned) is removed with a CacheWarning, as Numba's signed files are.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading

from backplan.codegen.build import batch_lock, cache, cache_health, cache_signing

_lock = threading.Lock()
_LIBRARIES: dict[str, object] = {}  # batch file name -> its loaded library (kept alive)
counts = {"compiled": 0, "loaded": 0}  # loop forms compiled in batches here / loaded from them


def group(calls) -> None:
    """calls: [(AddressCall, small)] that a plan's first call will make; each call keeps the
    list, and the first of them to compile compiles all that still need it."""
    members = list(dict.fromkeys(calls))
    for call, _ in members:
        call.group = members


def compile_together(wanted) -> None:
    """Compile the (AddressCall, small) forms in `wanted` that have no entry yet and are not in
    a cache, in one library per optimisation level; set each one's entry. One process at a
    time compiles a given batch (codegen/build/batch_lock.py); the others then load it."""
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock:
        todo = [(call, small) for call, small in wanted if call.needs_compiling(small)]
        if len(todo) < 2:
            return  # one loop is one module either way: Numba's own compile and cache
        with batch_lock.held([_note_path(call.loop(small)) for call, small in todo]):
            # another process (an MPI rank, a test worker) may have compiled them meanwhile
            todo = [(call, small) for call, small in todo if call.needs_compiling(small)]
            if len(todo) >= 2:
                _compile(todo)


def _compile(todo) -> None:
    """Compile the forms in todo (two or more) into one library per optimisation level, set
    each one's entry and save the batch."""
    from numba.core import event

    loops = [call.loop(small) for call, small in todo]
    with event.trigger_event("numba:compile", data=_announce(len(loops))):
        libraries, lowered = _lower(loops)
        for library in libraries.values():
            library.finalize()
    for (call, small), (library, symbol) in zip(todo, lowered, strict=True):
        call.set_entry(small, library.get_pointer_to_function(symbol), library, symbol)
    with _lock:
        counts["compiled"] += len(todo)
    _save(loops, lowered)


def _lower(loops: list) -> tuple[dict, list]:
    """Type and lower each loop into its level's library, none finalised yet."""
    from numba.core import compiler, event

    from backplan.codegen.build import loop_optimisation

    levels = loop_optimisation.LOOP_OPTIMISATIONS
    libraries, lowered = {}, []
    for loop in loops:
        pipeline = loop._compiler.pipeline_class
        if pipeline not in libraries:
            library_class = loop_optimisation._library_class(levels[pipeline])
            libraries[pipeline] = library_class(loop.targetctx.codegen(), "backplan_loops")
            libraries[pipeline].enable_object_caching()
        flags = compiler.Flags()
        loop.targetdescr.options.parse_as_flags(flags, loop.targetoptions)
        flags = loop._compiler._customize_flags(flags)
        flags.no_compile = True  # finalised with the others
        # Each loop's typing and lowering is a compile of its own to listeners (progress
        # lines, bench/compile_profile.py); the module's optimisation and emission the batch's.
        announced = {"dispatcher": loop, "args": signature(loop), "return_type": None}
        with event.trigger_event("numba:compile", data=announced):
            result = compiler.compile_extra(
                loop.typingctx, loop.targetctx, loop.py_func, args=announced["args"],
                return_type=None, flags=flags, locals={}, library=libraries[pipeline],
                pipeline_class=pipeline,
            )  # fmt: skip
        lowered.append((libraries[pipeline], result.fndesc.llvm_func_name))
    return libraries, lowered


def signature(loop) -> tuple:
    """The Numba argument types of a loop taking addresses, from its parameter names."""
    from numba import types

    from backplan.codegen.run.address_calls import parameter_kinds

    return tuple(getattr(types, kind[0]) for kind in parameter_kinds(loop))


class _Label:
    """What compile listeners see as the dispatcher of a batch (bench/compile_profile.py)."""

    def __init__(self, loops: int):
        def batch():
            pass

        batch.__module__ = "backplan_kernel_batch"
        batch.__qualname__ = f"{loops} loops in one module"
        self.py_func = batch


def _announce(loops: int) -> dict:
    return {"dispatcher": _Label(loops), "args": (), "return_type": None}


@functools.cache
def environment() -> str:
    """What a loop's machine code depends on besides its source and form: the target Numba
    compiles for (triple, CPU name and features, NUMBA_CPU_NAME / NUMBA_CPU_FEATURES included,
    as its own cache keys) and the compiler's versions."""
    import llvmlite
    import numba
    from numba.core.registry import cpu_target

    target = "|".join(cpu_target.target_context.codegen().magic_tuple())
    return f"{target}|{numba.__version__}|{llvmlite.__version__}"


def _note_path(loop) -> str:
    module = os.path.splitext(os.path.basename(loop.py_func.__globals__["__file__"]))[0]
    return os.path.join(
        cache.cache_path(), "__pycache__", f"{module}.{loop.py_func.__name__}.batch"
    )


def _digest(loop) -> str:
    return hashlib.sha256(loop.py_func.__globals__["__source_text__"].encode()).hexdigest()


def _save(loops: list, lowered: list) -> None:
    """The batch's object and one note per loop form, when the cache folder can be written."""
    directory = cache.writable_cache_dir()
    if directory is None:
        return
    folder = os.path.join(directory, "__pycache__")
    libraries = list(dict.fromkeys(library for library, _ in lowered))
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        names = {}
        for library in libraries:
            payload = object_payload(library)
            name = f"k_batch_{hashlib.sha256(payload).hexdigest()[:24]}.o"
            write_signed(os.path.join(folder, name), payload)
            names[id(library)] = name
        env = environment()
        for loop, (library, symbol) in zip(loops, lowered, strict=True):
            note = {"source": _digest(loop), "env": env, "batch": names[id(library)]}
            note["symbol"] = symbol
            write_signed(_note_path(loop), json.dumps(note).encode())
    except OSError as error:
        cache_health.note_unwritable(directory, error)


def object_payload(library) -> bytes:
    """A finalised code library's machine code (and the bitcode Numba keeps beside it), as
    unserialize_object reads it back."""
    obj = library.serialize_using_object_code()[2]
    head = json.dumps({"object": len(obj[0]), "bitcode": len(obj[1])}).encode()
    return len(head).to_bytes(4, "little") + head + obj[0] + obj[1]


def write_signed(path: str, payload: bytes) -> None:
    """The payload in a file at path, signed under its name with this user's key."""
    signed = cache_signing.signed(os.path.basename(path), payload)
    cache_health.write_atomic(path, signed.hex())


def has_cached(loop) -> bool:
    """Whether a batch on disk holds this loop form for this process (note_is_usable)."""
    return note_is_usable(_note_path(loop))


def note_is_usable(path: str) -> bool:
    """Whether the batch note at path names machine code this process can load: signed, for
    this target, its batch object on disk. Progress lines and explain count a loop with such a
    note as cached (kernel_cache.cached_digests); a note left by another CPU target, or whose
    object is gone, compiles its loop again and is not counted (a prediction still: the object
    is checked when loaded)."""
    note = read_signed(path) if os.path.exists(path) else None
    if note is None:
        return False
    try:
        note = json.loads(note)
        folder = os.path.dirname(path)
        return note["env"] == environment() and os.path.isfile(os.path.join(folder, note["batch"]))
    except (ValueError, KeyError, TypeError):
        return False


def cached_entry(loop) -> tuple[int, object, str] | None:
    """(native entry, library, symbol) of the loop from a batch on disk (its object loaded once per
    process), or None when there is none this process can use."""
    note = read_signed(_note_path(loop))
    if note is None:
        return None
    try:
        note = json.loads(note)
        if note["source"] != _digest(loop) or note["env"] != environment():
            return None
        library = _library(note["batch"])
        if library is None:
            return None
        pointer = library.get_pointer_to_function(note["symbol"])
    except (ValueError, KeyError, TypeError, RuntimeError):
        return None
    if not pointer:
        return None
    with _lock:
        counts["loaded"] += 1
    return pointer, library, note["symbol"]


def _library(name: str):
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock, _lock:  # as Numba loads from its cache
        if name not in _LIBRARIES:
            if os.path.basename(name) != name or not name.startswith("k_batch_"):
                return None
            payload = read_signed(os.path.join(cache.cache_path(), "__pycache__", name))
            if payload is None or not cache_signing.ready_to_load(payload):
                return None  # the symbols its loops call (the own GEMM) first, or compile
            _LIBRARIES[name] = unserialize_object(payload)
        return _LIBRARIES[name]


def unserialize_object(payload: bytes, name: str = "backplan_loops"):
    """A code library from object_payload's bytes (its symbols resolved first: ready_to_load)."""
    from numba.core.registry import cpu_target

    size = int.from_bytes(payload[:4], "little")
    head = json.loads(payload[4 : 4 + size])
    body = payload[4 + size :]
    obj, bitcode = body[: head["object"]], body[head["object"] :]
    if len(bitcode) != head["bitcode"]:
        raise ValueError("object truncated")
    codegen = cpu_target.target_context.codegen()
    return codegen.unserialize_library((name, "object", (obj, bitcode)))


def read_signed(path: str, kind: str = "kernel cache file") -> bytes | None:
    """The payload of a file this user's key signed under its name, or None. A file that fails
    the check (truncated, edited, planted, signed by another key) is removed with a
    CacheWarning, as Numba's signed files are (cache_signing.discard): never run, and not left
    for every later process to read, reject and compile around in silence."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return None
    try:
        data = bytes.fromhex(text.decode("ascii"))
    except ValueError:  # UnicodeDecodeError included
        cache_signing.discard(path, "is truncated or was not written by backplan (not hex)", kind)
        return None
    payload, why = cache_signing.verified(os.path.basename(path), data)
    if payload is None:
        cache_signing.discard(path, why, kind)
    return payload
