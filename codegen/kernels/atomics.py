"""Atomic operations on 64-bit words at raw addresses, and sleeping on one: what compiled code
needs to share work with other threads without a lock or a parallel region.

Every operation is sequentially consistent. `futex_wait` / `futex_wake` are Linux's futex
calls on the low 32 bits of a word (little-endian), made through libc's `syscall`: a thread
waiting for work sleeps in the kernel instead of spinning on a shared core (FUTEX_AVAILABLE
says whether this platform has them). `spin_pause` is the CPU's spin-wait hint.
"""

import platform
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

_ORDER = "seq_cst"
_I64 = ir.IntType(64)
# SYS_futex per architecture (asm/unistd.h); FUTEX_WAIT / FUTEX_WAKE with FUTEX_PRIVATE_FLAG.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 128, 129
FUTEX_AVAILABLE = sys.platform.startswith("linux") and _SYS_FUTEX is not None


def _word(builder, address):
    return builder.inttoptr(address, _I64.as_pointer())


@intrinsic
def atomic_load(typingctx, address):
    """The word at address."""

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_word(builder, args[0]), _ORDER, 8)

    return types.int64(types.intp), codegen


@intrinsic
def atomic_store(typingctx, address, value):
    """Write value to the word at address."""

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[1], signature.args[1], types.int64)
        builder.store_atomic(value, _word(builder, args[0]), _ORDER, 8)
        return context.get_dummy_value()

    return types.none(types.intp, value), codegen


@intrinsic
def atomic_add(typingctx, address, value):
    """Add value to the word at address; the word as it was before."""

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", _word(builder, args[0]), value, _ORDER)

    return types.int64(types.intp, value), codegen


@intrinsic
def compare_and_swap(typingctx, address, expected, value):
    """Write value to the word at address if it holds expected; whether it did."""

    def codegen(context, builder, signature, args):
        expected = context.cast(builder, args[1], signature.args[1], types.int64)
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        outcome = builder.cmpxchg(_word(builder, args[0]), expected, value, _ORDER, _ORDER)
        return builder.extract_value(outcome, 1)

    return types.boolean(types.intp, expected, value), codegen


@intrinsic
def spin_pause(typingctx):
    """The spin-wait hint (x86 PAUSE); nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if platform.machine() == "x86_64":
            pause = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.none(), codegen


def _syscall(builder, *values):
    syscall = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_I64, [_I64], var_arg=True), "syscall"
    )
    return builder.call(syscall, [ir.Constant(_I64, _SYS_FUTEX), *values])


@intrinsic
def futex_wait(typingctx, address, expected):
    """Sleep while the low 32 bits of the word at address equal expected's (returns at once
    when they differ, on a wake-up, or on a signal: callers check their condition again)."""

    def codegen(context, builder, signature, args):
        if not FUTEX_AVAILABLE:
            raise NotImplementedError("futex_wait needs Linux")
        expected = context.cast(builder, args[1], signature.args[1], types.int64)
        low = builder.and_(expected, ir.Constant(_I64, 0xFFFFFFFF))
        wait = ir.Constant(_I64, _FUTEX_WAIT_PRIVATE)
        _syscall(builder, args[0], wait, low, ir.Constant(_I64, 0))
        return context.get_dummy_value()

    return types.none(types.intp, expected), codegen


@intrinsic
def futex_wake(typingctx, address, count):
    """Wake up to count threads sleeping in futex_wait on address."""

    def codegen(context, builder, signature, args):
        if not FUTEX_AVAILABLE:
            raise NotImplementedError("futex_wake needs Linux")
        count = context.cast(builder, args[1], signature.args[1], types.int64)
        _syscall(builder, args[0], ir.Constant(_I64, _FUTEX_WAKE_PRIVATE), count)
        return context.get_dummy_value()

    return types.none(types.intp, count), codegen


@intrinsic
def sched_yield(typingctx):
    """Give the core to another runnable thread (libc sched_yield)."""

    def codegen(context, builder, signature, args):
        yield_fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield"
        )
        builder.call(yield_fn, [])
        return context.get_dummy_value()

    return types.none(), codegen
