"""What compiled code depends on besides its own source: every file of the code generator.

Numba's disk cache keys a function on its own file only and does not notice edits to the
library code it calls and inlines; so cache keys and Numba's source stamps (cache_signing.py)
also cover these files.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings

CODEGEN_VERSION = "1"
# The code generator's top folder: every room under it is part of the fingerprint.
CODEGEN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Files no compiled code depends on (they only print): editing them keeps every cache.
# Nor do these compile or generate code: a plan's Python side, its recorded rendering facts,
# when and where its driver is built, where the prebuilt library's files are found, and what
# loads and compiles leave resident (process_memory.py, which only measures).
NOT_FINGERPRINTED = frozenset(
    os.path.join(*path.split("/"))
    for path in (
        "build/compile_notice.py",
        "build/progress.py",
        "build/plan_facts.py",
        "build/driver_build.py",
        "build/driver_builder.py",
        "build/driver_tier.py",
        "build/object_symbols.py",
        "run/compiled.py",
        "build/prebuilt_library.py",
        "build/process_memory.py",
    )
)


# The lowering in ir/ that decides what a plan's driver does beyond its IR text (which loops
# fuse, which run as one loop over rows, where buffers live): a driver cached under the same
# IR but made by another lowering would run the other lowering's loops.
LOWERING_FILES = (
    "lowering.py",
    "fusion.py",
    "epilogue.py",
    "layout.py",
    "memory_plan.py",
    "donation.py",
    "strided_copies.py",
    "widen.py",
)


def _codegen_paths() -> list[str]:
    here = CODEGEN_ROOT
    paths = [
        os.path.join(folder, name)
        for folder, _, files in os.walk(here)
        for name in files
        if name.endswith(".py")
        and os.path.relpath(os.path.join(folder, name), here) not in NOT_FINGERPRINTED
    ]
    return sorted(paths)


def _fingerprinted_paths() -> list[str]:
    ir_root = os.path.join(os.path.dirname(CODEGEN_ROOT), "ir")
    return _codegen_paths() + [os.path.join(ir_root, name) for name in LOWERING_FILES]


def _stamps() -> tuple:
    """Each fingerprinted file's modification time and size (a stat each: under 1 ms)."""
    stamps = []
    for path in _fingerprinted_paths():
        try:
            info = os.stat(path)
        except OSError:
            stamps.append((path, None))
            continue
        stamps.append((path, info.st_mtime_ns, info.st_size))
    return tuple(stamps)


# The files as this process imported them (with the package, `import backplan` imports this
# module). The code a process compiles is the code it imported, but a fingerprint reads the files:
# after an upgrade or a checkout under a running process, the files' fingerprint would label
# the process's older code, and every later process would load that older code from the
# shared cache as the new version's (seen: a changed float32 tanh served stale from the cache).
_IMPORTED_STAMPS = _stamps()


@functools.cache
def _stale_process_salt() -> bytes:
    """b"" while the files are those this process imported; else a salt of this process's own,
    so its kernels are neither read from nor written to any other process's cache entries."""
    if _stamps() == _IMPORTED_STAMPS:
        return b""
    from backplan.codegen.build.cache_signing import CacheWarning

    warnings.warn(
        "backplan's files changed on disk after this process imported them (an upgrade or a "
        "checkout): it compiles what it imported without reading or writing the shared kernel "
        "cache; restart the process to use the cache again",
        CacheWarning,
        stacklevel=2,
    )
    return os.urandom(16)


@functools.cache
def codegen_fingerprint() -> str:
    """Numba's cache of a generated kernel keys on the kernel's own source and does not notice
    edits to the library code it inlines, so the key covers those files too."""
    here = CODEGEN_ROOT
    digest = hashlib.sha256(CODEGEN_VERSION.encode())
    for path in _codegen_paths():
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, here).encode() + f.read())
    ir_root = os.path.join(os.path.dirname(here), "ir")
    for name in LOWERING_FILES:
        with open(os.path.join(ir_root, name), "rb") as f:
            digest.update(b"ir/" + name.encode() + f.read())
    digest.update(_gemm_blocking().encode())
    digest.update(_stale_process_salt())
    return digest.hexdigest()[:16]


def _gemm_blocking() -> str:
    """The GEMM's block sizes, read from this machine's caches and compiled in as constants:
    a cache folder shared by machines with other caches must not hand one the other's code."""
    from backplan.codegen.kernels.gemm.blocking import machine_block_sizes

    return repr(machine_block_sizes())


# The files a loop kernel's compiled code depends on (what its source imports and inlines).
KERNEL_DEPENDENCIES = (
    "flags.py",
    "jit.py",
    "render/kernel_source.py",
    "build/lean_pipeline.py",
    "build/loop_optimisation.py",
    "kernels/half.py",
    "kernels/mathlib.py",
    "kernels/scalar_functions.py",
    "kernels/views.py",
)


# What a loop kernel that runs a GEMM (a GEMM with its epilogue) depends on besides those.
GEMM_DEPENDENCIES = tuple(
    f"kernels/gemm/{name}"
    for name in (
        "api.py",
        "blocking.py",
        "dot_driver.py",
        "dot_kernel.py",
        "driver.py",
        "kernel.py",
        "pack.py",
        "pair_pack.py",
        "scratch.py",
        "symbols.py",
        "transpose_pack.py",
    )
)


@functools.cache
def kernel_fingerprint(gemm: bool = False) -> str:
    """Like codegen_fingerprint, over the kernels' dependencies only: editing the plan emitter
    keeps every shared kernel cached. gemm: for the kernels that call backplan's GEMM."""
    here = CODEGEN_ROOT
    digest = hashlib.sha256(CODEGEN_VERSION.encode())
    for name in KERNEL_DEPENDENCIES + (GEMM_DEPENDENCIES if gemm else ()):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(name.encode() + f.read())
    if gemm:
        digest.update(_gemm_blocking().encode())
    digest.update(_stale_process_salt())
    return digest.hexdigest()[:16]
