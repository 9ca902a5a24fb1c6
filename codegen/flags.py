"""Compiler flags shared by generated and library kernels.

fastmath without nnan/ninf: reductions may reassociate (so they vectorise) but NaN and inf keep
their IEEE meaning. Without arcp too: with it LLVM turned float32 `a / sqrt(x)` into a reciprocal
square-root estimate, nan at 0 and at inf and wrong for subnormals (sqrt's gradient, 1 / sqrt);
steps without it measured within noise (BENCHMARKS.md). error_model="numpy": no zero-division
checks, which block vectorisation.
"""

import numba

from backplan.codegen.build.lean_pipeline import LeanKernelCompiler
from backplan.codegen.build.loop_optimisation import (
    AddressLoopCompiler,
    DriverCompiler,
    InterleavedLoopCompiler,
    SmallLoopCompiler,
)
from backplan.ir import kernel_workspace

FASTMATH = set({"reassoc", "contract", "nsz", "afn"})
JIT_OPTIONS = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}
# Loop kernels are called from a driver or from Python, never through a C pointer: no C wrapper
# to compile. A kernel that allocates nothing needs no reference counting either. Each cut a
# cold unrolled LSTM's kernel compile by about a tenth (measured A/B, same box).
# Serial generated kernels go through a shorter Numba pipeline (codegen/build/lean_pipeline.py):
# cold first calls about 10% shorter (transformer 2.02-2.08 -> 1.77-1.85 s, paired runs on one
# pinned CPU). Parallel kernels need Numba's parfor passes.
PARALLEL_KERNEL_JIT_OPTIONS = {**JIT_OPTIONS, "no_cfunc_wrapper": True}
KERNEL_JIT_OPTIONS = {**PARALLEL_KERNEL_JIT_OPTIONS, "pipeline_class": LeanKernelCompiler}
LEAN_KERNEL_JIT_OPTIONS = {**KERNEL_JIT_OPTIONS, "_nrt": False}
# A lean kernel's loop taking addresses has no wrapper at all: drivers running as Python call
# its native entry through ctypes (codegen/run/address_calls.py); its twin on array views, which
# compiled drivers call, has none either, and is always inlined there: the float literals it
# takes as parameters are the driver's constants again (a CNN step was 5% slower where they
# were not). The loops taking addresses run only until the compiled driver loads: LLVM
# optimises them for a short compile (codegen/build/loop_optimisation.py), the loop over at most
# SMALL_LOOP_ELEMENTS iterations without vectorising it at all. Vectorising such a loop saves
# a few microseconds a call at most, less than a Python-run driver spends calling it; bigger
# loops keep it: a deep MLP's Python-run steps took 1.6x as long with every loop scalar.
ADDRESS_KERNEL_JIT_OPTIONS = {
    **LEAN_KERNEL_JIT_OPTIONS,
    "no_cpython_wrapper": True,
    "pipeline_class": AddressLoopCompiler,
}
SMALL_LOOP_KERNEL_JIT_OPTIONS = {**ADDRESS_KERNEL_JIT_OPTIONS, "pipeline_class": SmallLoopCompiler}
# A big loop converting 16-bit values or summing into a scalar is optimised with the loop
# vectoriser interleaving too (codegen/build/loop_optimisation.py INTERLEAVED_LOOP).
INTERLEAVED_LOOP_KERNEL_JIT_OPTIONS = {
    **ADDRESS_KERNEL_JIT_OPTIONS,
    "pipeline_class": InterleavedLoopCompiler,
}
SMALL_LOOP_ELEMENTS = 4096
DRIVER_KERNEL_JIT_OPTIONS = {**LEAN_KERNEL_JIT_OPTIONS, "no_cpython_wrapper": True}
DRIVER_KERNEL_JIT_OPTIONS["forceinline"] = True
# A driver calling its loops by address (codegen/build/loop_calls.py) is calls and argument
# conversions: LLVM optimises it lightly (codegen/build/loop_optimisation.py).
ADDRESS_DRIVER_JIT_OPTIONS = {**JIT_OPTIONS, "pipeline_class": DriverCompiler}
# Below this a loop runs serial. A parallel kernel compiles about 3x slower than a serial one,
# and the transformer block (loops of 2**18-2**20 elements) stepped as fast with every loop
# serial (PERFORMANCE-NOTES.md); streams of several MiB gain from the second core's bandwidth.
PARALLEL_MIN_ELEMENTS = 1 << 21


def threads() -> int:
    """Threads a parallel kernel would run on now: numba.set_num_threads (the harness's
    --threads, a user's own choice) lowers it below NUMBA_NUM_THREADS."""
    return numba.get_num_threads()


kernel_workspace.count_threads_with(threads)  # attention's workspace slots (one a thread)


def parallel_pays(elements: int) -> bool:
    """A loop runs under prange only when it is big enough to gain from more threads and there
    are threads to gain from: a parallel kernel costs about 3x the compile time of a serial one."""
    return elements >= PARALLEL_MIN_ELEMENTS and threads() > 1


def flags_text() -> str:
    """What the generated code depends on besides the IR, for cache keys. The thread count
    itself, not only whether there is more than one: attention's workspace has a slot per
    thread, so plans lowered at 2 and at 4 threads place their buffers differently, and under
    one key two such processes sharing a cache folder rewrote each other's file and compiled it
    again on every start."""
    return f"{sorted(FASTMATH)}{PARALLEL_MIN_ELEMENTS}:{threads()}"
