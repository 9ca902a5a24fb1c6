"""threads_now(): the calling thread's Numba thread count, read inside compiled code.

A library parallel kernel runs its serial code when the count is 1: a prange region on one
thread still hands its work to a pool thread and waits for it (Numba's workqueue layer), which
on a busy 2-vCPU box cost 50 us (median, 130-220 us mean) per region against 0.4 us serial.
The count is the caller's (numba.set_num_threads in that thread): a program that set one
thread no longer pays a pool hand-over per library parallel kernel. Steps do not lower it
when the machine is busy (codegen/run/workspace.SizedLaunch says why).

Numba's own numba.get_num_threads() inside a cached function works too, but adds an error
branch with prints; this calls the runtime's `get_num_threads` symbol by name, which the
parallel runtime registers when it starts (codegen/jit.start_parallel_runtime), so the machine
code stays cacheable.
"""

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from backplan.codegen.jit import AS_PYTHON


@intrinsic
def _threads_now(typingctx):
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()  # registers the symbol for this compile

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(cgutils.intp_t, [])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "get_num_threads")
        return builder.call(fn, [])

    return types.intp(), codegen


if AS_PYTHON:

    def threads_now() -> int:
        return numba.get_num_threads()

else:
    threads_now = _threads_now
