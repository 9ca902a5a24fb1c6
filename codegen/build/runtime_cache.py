"""Numba's runtime functions loaded as machine code from the cache folder instead of compiled.

The first compile or cached load in a process sets up Numba's runtime (NRT): it compiles a small
module of runtime functions (atomic counters, meminfo helpers) with LLVM, 15-21 ms of CPU in
every process, which Numba keeps no cache of: about a tenth of a warm process's first call of an
unrolled LSTM and more of a small model's (BENCHMARKS.md, 31). Here that module's machine code
is kept in the cache folder as a signed object file (as loop batches are,
codegen/build/loop_batch.py), named by a digest of its IR text and the target it was compiled
for, and a later process loads it. Anything unexpected (no folder, a file that fails its
signature, an error loading) compiles the module as Numba does.
"""

from __future__ import annotations

import hashlib
import os

_installed: list = []


def install() -> None:
    """Make Numba set up its runtime through `compiled_runtime` (once per process; before
    Numba's runtime is set up, which happens at the first compile or cached load)."""
    from numba.core.runtime import nrtdynmod

    if _installed:
        return
    original = nrtdynmod.compile_nrt_functions

    def compile_nrt_functions(ctx):
        try:
            return compiled_runtime(ctx, original)
        except Exception:  # noqa: BLE001 - Numba's own way is always there
            return original(ctx)

    _installed.append(original)
    nrtdynmod.compile_nrt_functions = compile_nrt_functions


def compiled_runtime(ctx, original):
    """The runtime functions' code library: loaded from the cache folder where an earlier
    process left it, else compiled as Numba's `original` does and left there."""
    from numba.core.runtime import nrtdynmod

    from backplan.codegen.build import cache, cache_health, loop_batch

    ir_module, library = nrtdynmod.create_nrt_module(ctx)
    text = "\n".join([str(ir_module), loop_batch.environment()])
    name = f"bp_nrt_{hashlib.sha256(text.encode()).hexdigest()[:32]}.o"
    path = os.path.join(cache.cache_path(), "__pycache__", name)
    if os.path.exists(path):
        payload = loop_batch.read_signed(path, "runtime cache file (Numba's runtime functions)")
        if payload is not None:
            return loop_batch.unserialize_object(payload, "nrt")
    folder = cache.writable_cache_dir()
    if folder is None:
        return original(ctx)
    library.add_ir_module(ir_module)
    library.enable_object_caching()  # its machine code kept for the next process
    library.finalize()
    try:
        os.makedirs(os.path.join(folder, "__pycache__"), mode=0o700, exist_ok=True)
        loop_batch.write_signed(
            os.path.join(folder, "__pycache__", name), loop_batch.object_payload(library)
        )
    except OSError as error:
        cache_health.note_unwritable(folder, error)
    return library
