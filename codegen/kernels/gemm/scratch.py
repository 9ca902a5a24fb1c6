"""Packing buffers the GEMM keeps between calls instead of allocating ~2 MiB on every call.

A step that calls the GEMM six times used to allocate and free its panels six times, which a
user measuring the step's memory with tracemalloc saw as megabytes per step. The buffers now
live in a table of slots shared by every thread: a call takes a free slot with an atomic
compare-and-swap, allocates that slot's buffer once (libc malloc, kept for the life of the
process), and frees the slot when it returns. Concurrent calls never share a slot; when all are
taken, the call allocates as before. At most SLOTS buffers are ever kept.

Each buffer is a mapping of its own (anonymous mmap, page-aligned): only the pages a GEMM
writes become resident, so the pages a step's products pack into are the ones its plan counts
(packing.py, category `packing` of the peak), and the checked mode can read them back
(mincore, codegen/run/packing_check.py). malloc served a buffer from its heap once glibc's
mmap threshold had grown past its size, whose pages other arrays had made resident before.

The table is memory owned here and published to compiled code as the symbol
`backplan_gemm_scratch_slots`, so the cached machine code of the GEMM names no address.
"""

from __future__ import annotations

import mmap

import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from backplan.codegen.kernels.gemm.driver import KC, MC, NC
from backplan.codegen.kernels.gemm.kernel import TILES

SLOTS = 64
PAGE = 4096
ALIGN = PAGE  # bytes: every buffer starts a page (a mapping of its own)
# The largest workspace (driver.workspace_sizes) of any tile and dtype: one buffer fits any call.
# Written out in Python: calling the jitted workspace_sizes here would compile it at import.
BUFFER_BYTES = max(
    (-(-MC // mr) * mr * KC + -(-NC // (lanes * nv)) * lanes * nv * KC + mr * lanes * nv) * size
    for tiles in TILES.values()
    for dtype, (lanes, mr, nv) in tiles.items()
    for size in [4 if dtype == "f32" else 8]
)
MAPPED_BYTES = -(-BUFFER_BYTES // PAGE) * PAGE  # each buffer's mapping, whole pages
# mmap's flags where the platform has anonymous mappings; elsewhere malloc (_MAPS False)
_MAPS = hasattr(mmap, "MAP_ANONYMOUS")
_PROT = mmap.PROT_READ | mmap.PROT_WRITE if _MAPS else 0
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS if _MAPS else 0
SYMBOL = "backplan_gemm_scratch_slots"
_SEQ_CST = "seq_cst"

# Row i: (taken flag, buffer address); zero is free / not yet allocated.
_table = np.zeros((SLOTS, 2), np.int64)
binding.add_symbol(SYMBOL, _table.ctypes.data)


def _slot_pointer(builder, slot, field):
    """Address of table[slot, field] as an i64*."""
    table_type = ir.ArrayType(ir.IntType(64), SLOTS * 2)
    module = builder.module
    table = module.globals.get(SYMBOL) or ir.GlobalVariable(module, table_type, SYMBOL)
    index = builder.add(builder.mul(slot, ir.Constant(slot.type, 2)), ir.Constant(slot.type, field))
    zero = ir.Constant(ir.IntType(64), 0)
    return builder.gep(table, [zero, index])


@intrinsic
def try_take(typingctx, slot):
    """Mark slot taken if it was free; whether this call got it."""

    def codegen(context, builder, signature, args):
        flag = _slot_pointer(builder, args[0], 0)
        zero, one = ir.Constant(ir.IntType(64), 0), ir.Constant(ir.IntType(64), 1)
        outcome = builder.cmpxchg(flag, zero, one, _SEQ_CST, _SEQ_CST)
        return builder.extract_value(outcome, 1)

    return types.boolean(types.intp), codegen


@intrinsic
def give_back(typingctx, slot):
    """Mark a taken slot free again."""

    def codegen(context, builder, signature, args):
        flag = _slot_pointer(builder, args[0], 0)
        builder.store_atomic(ir.Constant(ir.IntType(64), 0), flag, _SEQ_CST, 8)
        return context.get_dummy_value()

    return types.none(types.intp), codegen


@intrinsic
def buffer_of(typingctx, slot):
    """The page-aligned address of a taken slot's buffer (BUFFER_BYTES), mapped on first use
    and never unmapped; 0 when the mapping fails (nothing is kept then, the next call tries
    again). A mapping of its own, not malloc's: see the module docstring."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        pointer = _slot_pointer(builder, args[0], 1)
        address = builder.load(pointer)
        result = cgutils.alloca_once_value(builder, address)
        with builder.if_then(builder.icmp_unsigned("==", address, ir.Constant(i64, 0))):
            fresh = _mapped(builder, i64)
            builder.store(fresh, pointer)
            builder.store(fresh, result)
        return builder.load(result)

    return types.intp(types.intp), codegen


def _mapped(builder, i64):
    """A fresh mapping of MAPPED_BYTES (mmap; malloc'ed and aligned where the platform has no
    anonymous mappings) as an integer, 0 on failure."""
    pointer = ir.IntType(8).as_pointer()
    size = ir.Constant(i64, MAPPED_BYTES)
    zero = ir.Constant(i64, 0)
    if _MAPS:
        i32 = ir.IntType(32)
        mmap_fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(pointer, [pointer, i64, i32, i32, i32, i64]), "mmap"
        )
        raw = builder.ptrtoint(
            builder.call(
                mmap_fn,
                [
                    ir.Constant(pointer, None), size, ir.Constant(i32, _PROT),
                    ir.Constant(i32, _FLAGS), ir.Constant(i32, -1), zero,
                ],
            ),
            i64,
        )  # fmt: skip
        failed = builder.icmp_signed("==", raw, ir.Constant(i64, -1))  # MAP_FAILED
        return builder.select(failed, zero, raw)
    malloc = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(pointer, [i64]), "malloc"
    )
    raw = builder.ptrtoint(builder.call(malloc, [ir.Constant(i64, MAPPED_BYTES + ALIGN)]), i64)
    aligned = builder.and_(builder.add(raw, ir.Constant(i64, ALIGN - 1)), ir.Constant(i64, -ALIGN))
    return builder.select(builder.icmp_unsigned("==", raw, zero), zero, aligned)


@intrinsic
def vector_at(typingctx, address, length, like):
    """The 1-D array of `length` elements of dtype `like` at a raw address; owns nothing."""
    dtype = like.dtype if isinstance(like, types.DType) else like
    result_type = types.Array(dtype, 1, "C")

    def codegen(context, builder, signature, args):
        from numba.np.arrayobj import make_array, populate_array

        array = make_array(result_type)(context, builder)
        item = context.get_data_type(dtype)
        size = context.get_abi_sizeof(item)
        populate_array(
            array,
            data=builder.inttoptr(args[0], item.as_pointer()),
            shape=[args[1]],
            strides=[ir.Constant(args[1].type, size)],
            itemsize=size,
            meminfo=None,
        )
        return array._getvalue()

    return result_type(address, length, like), codegen


def slots_in_use() -> int:
    """Slots taken right now (0 between calls): for tests."""
    return int(np.count_nonzero(_table[:, 0]))


def buffers_kept() -> int:
    """Slots whose buffer has been allocated: for tests."""
    return int(np.count_nonzero(_table[:, 1]))


def kept_buffers() -> list[tuple[int, int]]:
    """(slot, page-aligned address) of every buffer mapped so far."""
    return [(slot, int(address)) for slot, address in enumerate(_table[:, 1]) if address]
