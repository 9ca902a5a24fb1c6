"""One GEMM shared between the calling thread and helper threads that wait for it.

A prange region hands all the work to Numba's pool and the caller sleeps until every pool
thread is done: each GEMM paid two wake-ups, and on a busy machine a pool thread the
scheduler had not run yet held the whole product back (the two-thread GEMM then ran no faster
than one thread: bench.gemm --threads 2). Here the caller posts the product, cut in chunks of
rows or columns of C, and starts on the chunks itself; helper threads, asleep on a futex until
a product is posted, claim chunks with an atomic counter as they wake. A helper that wakes
late finds fewer chunks or none, so the product never waits for a thread that is not running,
only for chunks already claimed. Every chunk is one call of the single-core GEMM (symbols.py)
with scratch buffers of its own thread.

The chunks: with B read in place by the single-core GEMM (not transposed, unit column stride)
and smaller than driver.LARGE_B_BYTES, row blocks of C of at most MC rows, each packing only its
own rows of A; else column blocks (each packing its columns of B and all of A) unless C has
many more rows than columns. Row chunks of a larger B each read all of it from beyond L2 (and
read it row by row first, driver.touch_rows): the mlp's 128 x 784 @ 784 x 512 as four 32-row
chunks one after another on one core took 1,073 us against 1,008 for four 128-column chunks
(thread CPU); shared by two threads with B warm, either cut ran at 190-222 GFLOP/s.
On a loaded machine the scheduler wakes a helper on the caller's CPU (the two then take turns
on it: 110 GFLOP/s, where the same product with the helper and the caller pinned to different
CPUs ran 216-222); a quiet machine has an idle CPU to wake it on.

The control block is memory owned here, published to compiled code as the symbol
`backplan_gemm_team` (so cached machine code names no address). The helpers are Python
threads running a compiled loop without the GIL, started the first time a plan calling the
shared GEMM is compiled or loaded; after a fork the child starts its own. One product at a
time uses the helpers: a thread that finds them busy runs its product alone.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core.compiler_lock import global_compiler_lock
from numba.core.extending import intrinsic

from backplan.codegen.build import cache_signing
from backplan.codegen.jit import load_cached, njit, start_parallel_runtime
from backplan.codegen.kernels.atomics import (
    atomic_add,
    atomic_load,
    atomic_store,
    compare_and_swap,
    futex_wait,
    futex_wake,
    sched_yield,
    spin_pause,
)
from backplan.codegen.kernels.gemm.api import gemm
from backplan.codegen.kernels.gemm.driver import LARGE_B_BYTES, MC, tile_shape
from backplan.codegen.kernels.gemm.scratch import vector_at
from backplan.codegen.kernels.gemm.symbols import call_gemm_at, gemm_address
from backplan.codegen.kernels.lifetimes import keep_alive
from backplan.codegen.kernels.threads_now import threads_now

SYMBOL = "backplan_gemm_team"
CHUNKS_PER_THREAD = 2  # chunks per taking part thread: a late helper still finds some
SPIN_PAUSES = 2000  # spin-wait hints a helper polls for the next product before sleeping
_YIELD_EVERY = 64  # pauses between sched_yield calls while the caller waits for a chunk

# Words of the control block; the ones every thread writes sit on cache lines of their own.
TICKET = 0  # generation << 40 | chunks << 20 | next chunk to claim
DONE = 8  # chunks finished in the current product
SIGNAL = 16  # futex word: bumped on every product posted
LOCK = 24  # 1 while a caller owns the helpers
GENERATION = 25  # the last product's generation (written by the owner only)
HELPERS = 26  # helper threads running
ALLOWED = 27  # helpers that may take part in the current product
HELPED = 28  # chunks run by helpers since the process started
PARAMS = 32  # the product: GEMM address, 15 integers (symbols.py), by_rows, step
ALPHA, BETA = 56, 57  # float64 words
WORDS = 64
_FIELD = (1 << 20) - 1
_GENERATIONS = (1 << 23) - 1


def _never_freed_words(count: int) -> np.ndarray:
    """count zeroed int64 words on their own cache lines, never freed: a helper polling the
    block while the interpreter shuts down reads memory that is still the block."""
    libc = ctypes.CDLL(None)
    libc.calloc.restype = ctypes.c_void_p
    address = libc.calloc(count * 8 + 64, 1)
    if not address:
        raise MemoryError("no memory for the GEMM helpers' control block")
    aligned = (address + 63) // 64 * 64
    return np.frombuffer((ctypes.c_int64 * count).from_address(aligned), np.int64)


_block = _never_freed_words(WORDS)
binding.add_symbol(SYMBOL, _block.ctypes.data)


@intrinsic
def _block_address(typingctx):
    """Address of the control block."""

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(_block_global(builder), ir.IntType(64))

    return types.intp(), codegen


@intrinsic
def _lead_block_address(typingctx):
    """Address of the control block, for a caller that posts products: compiling or loading
    one starts the helpers."""

    def codegen(context, builder, signature, args):
        start_helpers()
        return builder.ptrtoint(_block_global(builder), ir.IntType(64))

    return types.intp(), codegen


def _block_global(builder):
    module = builder.module
    kind = ir.ArrayType(ir.IntType(64), WORDS)
    return module.globals.get(SYMBOL) or ir.GlobalVariable(module, kind, SYMBOL)


@njit(cache=True, nogil=True, inline="always")
def _word(block, index):
    return block + index * 8


@njit(cache=True, nogil=True)
def _run_chunk(block, index):
    """Chunk `index` of the posted product: one single-core GEMM on a block of C."""
    p = vector_at(_word(block, PARAMS), 18, np.int64(0))
    reals = vector_at(_word(block, ALPHA), 2, np.float64(0))
    fn, width, ta, tb, m, n, k = p[0], p[1], p[2], p[3], p[4], p[5], p[6]
    a, a0, a1, b, b0, b1, c, c0, c1, by_rows, step = (
        p[7], p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15], p[16], p[17]
    )  # fmt: skip
    start = index * step
    if by_rows:
        rows = min(step, m - start)
        a_at = a + start * (a1 if ta else a0)
        args = (width, ta, tb, rows, n, k, a_at, a0, a1, b, b0, b1, c + start * c0, c0, c1)
    else:
        cols = min(step, n - start)
        b_at = b + start * (b0 if tb else b1)
        args = (width, ta, tb, m, cols, k, a, a0, a1, b_at, b0, b1, c + start * c1, c0, c1)
    call_gemm_at(fn, args, reals[0], reals[1])


@njit(cache=True, nogil=True)
def _take_chunks(block, helper):
    """Claim and run chunks of the posted product until none is left."""
    while True:
        ticket = atomic_add(_word(block, TICKET), 1)
        index, chunks = ticket & _FIELD, (ticket >> 20) & _FIELD
        if index >= chunks:
            return
        _run_chunk(block, index)
        if helper:
            atomic_add(_word(block, HELPED), 1)
        atomic_add(_word(block, DONE), 1)


@njit(cache=True, nogil=True)
def _work_posted(block, helper):
    ticket = atomic_load(_word(block, TICKET))
    posted = (ticket & _FIELD) < ((ticket >> 20) & _FIELD)
    return posted and helper < atomic_load(_word(block, ALLOWED))


@njit(cache=True, nogil=True, _nrt=True)
def _serve(helper):
    """A helper thread's loop: wait for a product (polling a while, then asleep), take chunks."""
    block = _block_address()
    signal = _word(block, SIGNAL)
    while True:
        pauses = 0
        while not _work_posted(block, helper):
            if pauses < SPIN_PAUSES:
                spin_pause()
                pauses += 1
                continue
            seen = atomic_load(signal)
            if _work_posted(block, helper):  # posted before `seen` was read
                break
            futex_wait(signal, seen)  # returns at once if a product came after `seen`
        _take_chunks(block, True)


@njit(cache=True, nogil=True, inline="always")
def _round_up(value, multiple):
    return (value + multiple - 1) // multiple * multiple


@njit(cache=True, nogil=True)
def _split(parts, width, trans_b, b, c):
    """(by_rows, step, chunks): how the product is cut (see the module docstring)."""
    m, n = c.shape
    mr, nr = tile_shape(width, c.itemsize)
    pieces = parts * CHUNKS_PER_THREAD
    in_place = not trans_b and b.itemsize == c.itemsize and b.strides[1] == b.itemsize
    shared_b = in_place and b.shape[0] * b.shape[1] * b.itemsize < LARGE_B_BYTES
    if m >= 2 * mr and (shared_b or m >= n or n < 2 * nr):
        step = _round_up((m + pieces - 1) // pieces, mr)
        if in_place:
            step = min(step, MC)  # MC rows or fewer: the chunk reads B in place
        step = max(step, _round_up((m + _FIELD - 1) // _FIELD, mr))
        return True, step, (m + step - 1) // step
    step = _round_up((n + pieces - 1) // pieces, nr)
    step = max(step, _round_up((n + _FIELD - 1) // _FIELD, nr))
    return False, step, (n + step - 1) // step


@njit(cache=True, nogil=True)
def gemm_team(parts, width, trans_a, trans_b, alpha, a, b, beta, c):
    """gemm (api.gemm) on the calling thread and up to parts - 1 helpers; alone when the
    helpers are busy with another thread's product or the caller runs on one thread."""
    block = _lead_block_address()
    helpers = min(parts, threads_now()) - 1
    helpers = min(helpers, atomic_load(_word(block, HELPERS)))
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if helpers < 1 or m * n * k == 0:
        gemm(width, trans_a, trans_b, alpha, a, b, beta, c)
        return
    by_rows, step, chunks = _split(helpers + 1, width, trans_b, b, c)
    if chunks < 2 or not compare_and_swap(_word(block, LOCK), 0, 1):
        gemm(width, trans_a, trans_b, alpha, a, b, beta, c)
        return
    p = vector_at(_word(block, PARAMS), 18, np.int64(0))
    p[0] = gemm_address(c.dtype, a.dtype, b.dtype)
    p[1], p[2], p[3], p[4], p[5], p[6] = width, trans_a, trans_b, m, n, k
    p[7], p[8], p[9] = a.ctypes.data, a.strides[0], a.strides[1]
    p[10], p[11], p[12] = b.ctypes.data, b.strides[0], b.strides[1]
    p[13], p[14], p[15] = c.ctypes.data, c.strides[0], c.strides[1]
    p[16], p[17] = by_rows, step
    reals = vector_at(_word(block, ALPHA), 2, np.float64(0))
    reals[0], reals[1] = alpha, beta
    atomic_store(_word(block, ALLOWED), helpers)
    atomic_store(_word(block, DONE), 0)
    generation = (atomic_load(_word(block, GENERATION)) + 1) & _GENERATIONS
    atomic_store(_word(block, GENERATION), generation)
    atomic_store(_word(block, TICKET), (generation << 40) | (chunks << 20))
    atomic_add(_word(block, SIGNAL), 1)
    futex_wake(_word(block, SIGNAL), helpers)
    _take_chunks(block, False)
    pauses = 0
    while atomic_load(_word(block, DONE)) < chunks:  # chunks a helper is still running
        spin_pause()
        pauses += 1
        if pauses % _YIELD_EVERY == 0:
            sched_yield()
    atomic_store(_word(block, LOCK), 0)
    keep_alive((a, b, c))


_started = False


def helpers_wanted() -> int:
    """Helper threads: one fewer than the threads Numba may run, on the CPUs this process may
    use."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(numba.config.NUMBA_NUM_THREADS, cpus or 1) - 1)


def start_helpers() -> None:
    """Start the helper threads once per process (idempotent, thread-safe). Under Numba's
    compiler lock, which a caller compiling or loading code already holds (symbols.py says
    why not a lock of our own)."""
    global _started
    if _started:
        return
    start_parallel_runtime()  # gemm_team reads Numba's thread count (threads_now.py)
    with global_compiler_lock:
        if _started:
            return
        _started = True  # loading _serve runs the before-load hook, which calls this again
        count = helpers_wanted()
        if count:
            signature = (types.intp,)
            if signature not in _serve.overloads and not load_cached(_serve, signature):
                _serve.compile(signature)
        _spawn(count)


def _spawn(count: int) -> None:
    for helper in range(count):
        name = f"backplan-gemm-helper-{helper}"
        threading.Thread(target=_serve, args=(helper,), name=name, daemon=True).start()
    _block[HELPERS] = count


def helpers_running() -> int:
    """Helper threads started in this process (0 before the first shared GEMM): for tests."""
    return int(_block[HELPERS])


def chunks_helped() -> int:
    """Chunks the helpers have run in this process: for tests and benchmarks."""
    return int(_block[HELPED])


def _after_fork_in_child() -> None:
    """The child has only the forking thread: no product in flight, and helpers of its own
    to start where the parent had some (_serve is compiled already: no compiler lock, which a
    thread of the parent may have held at the fork)."""
    count = int(_block[HELPERS])
    _block[:] = 0
    if count:
        _spawn(count)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
cache_signing.before_load(SYMBOL.encode(), lambda payload: start_helpers())
