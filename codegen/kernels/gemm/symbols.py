"""The blocked GEMM compiled once per dtype and called by address, not linked into its callers.

Numba links every function a compiled function calls into the caller's own module and
generates machine code for all of it again: every GEMM entry specialisation, every plan
driver calling the GEMM, carried its own copy of the whole blocked GEMM and its micro-kernels
(measured on the mlp's first step: about 1.3 s of LLVM per caller, 5 callers). Here the GEMM is
one C-callable symbol per dtype (`backplan_gemm_f32`, `backplan_gemm_f64`,
`backplan_gemm_bf16`: bfloat16 operands, float32 result and sums, and `backplan_gemm_f16`:
float16 operands widened while packing, float32 result and sums; `backplan_gemm_bf16_f32` and
`backplan_gemm_f32_bf16`: one bfloat16 operand beside a float32 one, float32 result and sums,
only compiled when a plan reads a bfloat16 saved value in a GEMM; `backplan_gemm_f16_f32` and
`backplan_gemm_f32_f16` the same for float16; `backplan_gemm_f32_f64` and `backplan_gemm_f64_f32`
one float32 operand beside a float64 one, float64 result and sums), compiled or loaded
from the signed cache the first time anything needs it; callers declare the symbol and call it,
which costs them a few instructions to compile.

`backplan_gemm_bf16` is one of two functions, chosen once per process (isa.bf16_gemm_path):
VDPBF16PS dot products on k-pair panels where the CPU has AVX512_BF16 (dot_driver.py), else
operands widened to float32 while packing. Callers name the symbol only, so their compiled
code (and its cache) is the same either way.

The symbol has to exist in the process before code that calls it is compiled or loaded: the
call intrinsic registers it while it is compiled, and the signed cache registers it before it
loads any cached function whose machine code names it (`cache_signing.before_load`).
"""

from __future__ import annotations

import re

import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array

from backplan.codegen.build import cache_signing, compile_notice, progress
from backplan.codegen.jit import load_cached, njit
from backplan.codegen.kernels.gemm import isa, scratch
from backplan.codegen.kernels.gemm.dot_driver import (
    dot_workspace,
    dot_workspace_sizes,
    gemm_blocked_dot,
)
from backplan.codegen.kernels.gemm.driver import (
    KC,
    MC,
    NC,
    gemm_blocked,
    tile_shape,
    workspace,
    workspace_sizes,
)

PREFIX = "backplan_gemm_"
# (width, trans_a, trans_b, m, n, k, a, a_s0, a_s1, b, b_s0, b_s1, c, c_s0, c_s1) as integers
# (addresses and byte strides), then alpha and beta.
_INTEGERS = 15
_ARGUMENTS = (types.intp,) * _INTEGERS + (types.float64, types.float64)
COMPILE_SECONDS = 10  # measured on a 2-core Zen 4/Zen 5 box: 8-13 s per dtype


@intrinsic
def _matrix(typingctx, address, rows, cols, row_stride, col_stride, like):
    """The (rows, cols) array at a raw address with these byte strides, of like's dtype.
    It owns nothing: the caller keeps the memory alive for the call."""
    result_type = types.Array(like, 2, "A")

    def codegen(context, builder, signature, args):
        array = make_array(result_type)(context, builder)
        item = context.get_data_type(like)
        populate_array(
            array,
            data=builder.inttoptr(args[0], item.as_pointer()),
            shape=[args[1], args[2]],
            strides=[args[3], args[4]],
            itemsize=context.get_abi_sizeof(item),
            meminfo=None,
        )
        return array._getvalue()

    return result_type(address, rows, cols, row_stride, col_stride, like), codegen


@njit(cache=True, nogil=True, inline="always")
def _gemm_at_addresses(args, alpha, beta, like, operand, operand_b, swappable, f32=False):
    """C of like's dtype; A of operand's (like's, uint16 bfloat16 bits or int16 float16 bits)
    and B of operand_b's (operand's, or like's beside a bfloat16 A). swappable: A and B of
    one dtype, so that a narrow C may be computed as its transpose (A and B swapped); f32:
    all three float32, where an NT product may be too (_transpose_nt)."""
    width, trans_a, trans_b, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1 = args
    nr = tile_shape(width, _matrix(c, m, n, c0, c1, like).itemsize)[1]
    if swappable and trans_a != 0 and trans_b == 0 and n < nr <= m:
        # a narrow C of A.T @ B (a classifier's weight gradient): C.T = B.T @ A, whose tiles
        # are across C's long side, reads both operands in place (driver.py) instead of
        # padding n to the tile's width; own 12.6 against OpenBLAS 25.9 us (512x10x128)
        m, n, a, a0, a1, b, b0, b1, c0, c1 = n, m, b, b0, b1, a, a0, a1, c1, c0
    elif f32 and _transpose_nt(width, trans_a, trans_b, m, n, k, nr, b1, c1):
        m, n, a, a0, a1, b, b0, b1, c0, c1 = n, m, b, b0, b1, a, a0, a1, c1, c0
    a_rows, a_cols = (k, m) if trans_a else (m, k)
    b_rows, b_cols = (n, k) if trans_b else (k, n)
    a_matrix = _matrix(a, a_rows, a_cols, a0, a1, operand)
    b_matrix = _matrix(b, b_rows, b_cols, b0, b1, operand_b)
    c_matrix = _matrix(c, m, n, c0, c1, like)
    slot = _free_slot()
    base = scratch.buffer_of(slot) if slot >= 0 else 0
    if base == 0:  # every kept buffer is taken by another thread, or malloc failed
        if slot >= 0:
            scratch.give_back(slot)
            slot = -1
        work = workspace(width, c_matrix, KC, MC, NC)  # per call, as before buffers were kept
    else:
        work = _kept_workspace(width, base, c_matrix)
    gemm_blocked(
        width, trans_a != 0, trans_b != 0, alpha, a_matrix, b_matrix, beta, c_matrix, work,
        KC, MC, NC,
    )  # fmt: skip
    if slot >= 0:
        scratch.give_back(slot)
    return 0


@njit(cache=True, nogil=True, inline="always")
def _transpose_nt(width, trans_a, trans_b, m, n, k, nr, b1, c1):
    """Whether float32 C = A @ B.T with the weights B on C's long side (a layer's input
    gradient, G @ W.T) runs as C.T = B @ A.T: B's rows read in place as the kernel's A, only
    A.T packed (m x k instead of n x k: 256 KiB against 1 MiB for the mlp's 128 x 512 @
    512 x 512), the tiles stored transposed (kernel.store_tile_transposed) once per k block.
    Where the elements not packed, k * (n - m), outnumber those stored transposed,
    m * n per k block. On one pinned Zen 5 core (thread CPU, 7 rounds, operands in cache):
    128x512x512 292 against 299 us, 32x512x512 71.6 against 93.8; kept as it was:
    256x1024x256 583 against 561, 128x512x10 16.7 against 9.0, 128x512x128 even.
    512-bit tile, B and C with unit-stride rows, C at least a tile wide."""
    return (
        width == 512 and trans_a == 0 and trans_b != 0 and nr <= m < n and b1 == 4
        and c1 == 4 and k * (n - m) >= m * n * ((k + KC - 1) // KC)
    )  # fmt: skip


@njit(cache=True, nogil=True)
def _free_slot():
    for slot in range(scratch.SLOTS):
        if scratch.try_take(slot):
            return slot
    return -1


@njit(cache=True, nogil=True)
def _kept_workspace(width, base, c):
    """The workspace's three buffers inside a slot's kept buffer at `base`, for GEMMs into
    arrays like c."""
    size = c.itemsize
    a_size, b_size, tile_size = workspace_sizes(width, size, KC, MC, NC)
    b_base = base + a_size * size
    tile_base = b_base + b_size * size
    return (
        scratch.vector_at(base, a_size, c.dtype),
        scratch.vector_at(b_base, b_size, c.dtype),
        scratch.vector_at(tile_base, tile_size, c.dtype),
    )


@njit(cache=True, nogil=True)
def _kept_dot_workspace(base):
    """dot_workspace's buffers inside a slot's kept buffer at `base` (they take fewer bytes
    than the float32 workspace the buffer is sized for)."""
    a_size, b_size, tile_size = dot_workspace_sizes(KC, MC, NC)
    return (
        scratch.vector_at(base, a_size, np.uint16(0)),
        scratch.vector_at(base + a_size * 2, b_size, np.uint16(0)),
        scratch.vector_at(base + (a_size + b_size) * 2, tile_size, np.float32(0)),
    )


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_f32(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    args = (width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1)
    return _gemm_at_addresses(
        args, alpha, beta, np.float32(0), np.float32(0), np.float32(0), True, True
    )


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_f64(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    args = (width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1)
    return _gemm_at_addresses(args, alpha, beta, np.float64(0), np.float64(0), np.float64(0), True)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_bf16(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    args = (width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1)
    return _gemm_at_addresses(args, alpha, beta, np.float32(0), np.uint16(0), np.uint16(0), True)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_f16(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    """float16 operands, read as int16 arrays: Numba has no float16 type, and int16 tells
    the packing (pack.py) float16 bits from bfloat16's uint16."""
    args = (width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1)
    return _gemm_at_addresses(args, alpha, beta, np.float32(0), np.int16(0), np.int16(0), True)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_bf16_f32(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    """A bfloat16 (uint16 bits), B and C float32: a saved activation read in the backward
    beside a float32 gradient or weight, with no float32 copy of it (ir/widen.py). A is
    widened while packing, as in _gemm_bf16's widening path."""
    args = (width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1)
    return _gemm_at_addresses(args, alpha, beta, np.float32(0), np.uint16(0), np.float32(0), False)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_f32_bf16(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    """A and C float32, B bfloat16: computed as C.T = op(B).T @ op(A).T, the bfloat16 operand
    first, so that one blocked GEMM (_gemm_bf16_f32's) serves both orders."""
    args = (width, 1 - tb, 1 - ta, n, m, k, b, b0, b1, a, a0, a1, c, c1, c0)
    return _gemm_at_addresses(args, alpha, beta, np.float32(0), np.uint16(0), np.float32(0), False)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_f16_f32(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    """A float16 (int16 bits), B and C float32: a float32 step's saved value kept in float16,
    read as _gemm_bf16_f32 reads a bfloat16 one (A widened while packing)."""
    args = (width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1)
    return _gemm_at_addresses(args, alpha, beta, np.float32(0), np.int16(0), np.float32(0), False)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_f32_f16(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    """A and C float32, B float16: C.T = op(B).T @ op(A).T, as _gemm_f32_bf16."""
    args = (width, 1 - tb, 1 - ta, n, m, k, b, b0, b1, a, a0, a1, c, c1, c0)
    return _gemm_at_addresses(args, alpha, beta, np.float32(0), np.int16(0), np.float32(0), False)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_f32_f64(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    """A float32, B and C float64: a float64 step's saved value kept in float32, read by a
    weight gradient's GEMM as it is (widened while packing) instead of through a float64 copy
    (ir/wide_reads.py)."""
    args = (width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1)
    return _gemm_at_addresses(args, alpha, beta, np.float64(0), np.float32(0), np.float64(0), False)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_f64_f32(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    """A and C float64, B float32: C.T = op(B).T @ op(A).T, as _gemm_f32_bf16."""
    args = (width, 1 - tb, 1 - ta, n, m, k, b, b0, b1, a, a0, a1, c, c1, c0)
    return _gemm_at_addresses(args, alpha, beta, np.float64(0), np.float32(0), np.float64(0), False)


@njit(cache=True, nogil=True, _nrt=True)
def _gemm_bf16_dot(width, ta, tb, m, n, k, a, a0, a1, b, b0, b1, c, c0, c1, alpha, beta):
    """The bf16 GEMM on VDPBF16PS (`width` is not read: the kernel is 512-bit)."""
    a_rows, a_cols = (k, m) if ta else (m, k)
    b_rows, b_cols = (n, k) if tb else (k, n)
    a_matrix = _matrix(a, a_rows, a_cols, a0, a1, np.uint16(0))
    b_matrix = _matrix(b, b_rows, b_cols, b0, b1, np.uint16(0))
    c_matrix = _matrix(c, m, n, c0, c1, np.float32(0))
    slot = _free_slot()
    base = scratch.buffer_of(slot) if slot >= 0 else 0
    if base == 0:
        if slot >= 0:
            scratch.give_back(slot)
            slot = -1
        work = dot_workspace(KC, MC, NC)
    else:
        work = _kept_dot_workspace(base)
    gemm_blocked_dot(ta != 0, tb != 0, alpha, a_matrix, b_matrix, beta, c_matrix, work, KC, MC, NC)
    if slot >= 0:
        scratch.give_back(slot)
    return 0


# The entries ask for Numba's reference counting (_nrt=True) although a caller's compile may
# run without it: the GEMM is first compiled when a kernel that calls it is, and a function
# compiled inside another one inherits that one's settings where it does not set its own (a
# lean GEMM kernel's compile then failed with "NRT required but not enabled").
_FUNCTIONS = {
    "f32": _gemm_f32,
    "f64": _gemm_f64,
    "bf16": _gemm_bf16,
    "f16": _gemm_f16,
    "bf16_f32": _gemm_bf16_f32,
    "f32_bf16": _gemm_f32_bf16,
    "f16_f32": _gemm_f16_f32,
    "f32_f16": _gemm_f32_f16,
    "f32_f64": _gemm_f32_f64,
    "f64_f32": _gemm_f64_f32,
}
_registered: set[str] = set()


def entry(dtype: str):
    """The dispatcher published as PREFIX + dtype in this process."""
    if dtype == "bf16" and isa.bf16_gemm_path() == "dot":
        return _gemm_bf16_dot
    return _FUNCTIONS[dtype]


def ensure_registered(dtype: str) -> None:
    """Compile (or load from the signed cache) the GEMM for dtype and publish its address
    under its symbol name; idempotent and thread-safe. Numba's compiler lock, not a lock of
    our own: callers compiling or loading code already hold it, and two locks taken in either
    order by two threads would deadlock."""
    if dtype in _registered:
        return
    with global_compiler_lock:
        if dtype in _registered:
            return
        result = _load_or_compile(entry(dtype), dtype)
        address = result.library.get_pointer_to_function(result.fndesc.llvm_cfunc_wrapper_name)
        binding.add_symbol(PREFIX + dtype, address)
        _registered.add(dtype)


def _load_or_compile(dispatcher, dtype: str):
    """The compiled GEMM, from the signed cache when it is there; a compile (once per
    installation and code change, ~10 s) is announced on stderr first."""
    with global_compiler_lock:
        if _ARGUMENTS not in dispatcher.overloads and not load_cached(dispatcher, _ARGUMENTS):
            if progress.verbose():
                progress.say(
                    f"compiling the {dtype} GEMM (once per installation and version, "
                    f"about {COMPILE_SECONDS} s)"
                )
            with compile_notice.compiling(f"the library's {dtype} GEMM"):
                dispatcher.compile(_ARGUMENTS)
        return dispatcher.overloads[_ARGUMENTS]


_NAMED = re.compile(re.escape(PREFIX.encode()) + rb"([A-Za-z0-9_]+)")


def _register_named(payload: bytes) -> None:
    """Register the symbols payload names, whole names only: `backplan_gemm_bf16` is the start
    of `backplan_gemm_bf16_f32`, and each symbol not used is a cold compile not paid. One scan
    of the payload (0.26 ms per MB of machine code against 1.7 for a search per symbol)."""
    for name in dict.fromkeys(_NAMED.findall(payload)):
        dtype = name.decode()
        if dtype in _FUNCTIONS:
            ensure_registered(dtype)


cache_signing.before_load(PREFIX.encode(), _register_named)


def _symbol_dtype(result, operand, operand_b=None) -> str | None:
    """Which GEMM serves C of dtype result with A of dtype operand and B of operand_b (None:
    operand's; the result None: none)."""
    if operand_b is not None and operand_b != operand:
        if result == types.float64 and {operand, operand_b} == {types.float32, types.float64}:
            return "f32_f64" if operand == types.float32 else "f64_f32"
        if result != types.float32 or types.float32 not in (operand, operand_b):
            return None
        half = operand_b if operand == types.float32 else operand
        name = {types.uint16: "bf16", types.int16: "f16"}.get(half)
        if name is None:
            return None
        return f"{name}_f32" if operand == half else f"f32_{name}"
    if result == types.float32 and operand == types.uint16:
        return "bf16"  # bfloat16 bits: Numba has no bfloat16 type
    if result == types.float32 and operand == types.int16:
        return "f16"  # float16 bits, as generated code marks them (codegen/kernels/matmul.py)
    if result == operand and result in (types.float32, types.float64):
        return "f32" if result == types.float32 else "f64"
    return None


def _entry_type():
    """The LLVM type of every GEMM symbol: 15 integers, alpha and beta."""
    integer, real = ir.IntType(64), ir.DoubleType()
    return ir.FunctionType(integer, [integer] * _INTEGERS + [real, real])


def _declared(builder, symbol_dtype: str):
    """The GEMM symbol for symbol_dtype declared in this module (registered first)."""
    ensure_registered(symbol_dtype)
    return cgutils.get_or_insert_function(builder.module, _entry_type(), PREFIX + symbol_dtype)


def _call_entry(context, builder, function, signature, arguments):
    """function(*arguments[1], arguments[2], arguments[3]) cast to the entry's types."""
    values = [
        context.cast(builder, value, kind, types.intp)
        for value, kind in zip(
            cgutils.unpack_tuple(builder, arguments[1]), signature.args[1], strict=True
        )
    ]
    alpha_value = context.cast(builder, arguments[2], signature.args[2], types.float64)
    beta_value = context.cast(builder, arguments[3], signature.args[3], types.float64)
    builder.call(function, [*values, alpha_value, beta_value])
    return context.get_dummy_value()


@intrinsic
def call_gemm(typingctx, like, args, alpha, beta, a_like, b_like):
    """Call the GEMM symbol for C of like's dtype and A, B of a_like's and b_like's (the
    same, or one bfloat16 beside float32) with the 15 integers in `args` (see _INTEGERS)."""
    dtype, source, source_b = (
        t.dtype if isinstance(t, types.DType) else t for t in (like, a_like, b_like)
    )
    symbol_dtype = _symbol_dtype(dtype, source, source_b)
    if symbol_dtype is None:
        return None
    if not isinstance(args, types.BaseTuple) or len(args) != _INTEGERS:
        return None

    def codegen(context, builder, signature, arguments):
        function = _declared(builder, symbol_dtype)
        return _call_entry(context, builder, function, signature, arguments)

    return types.none(like, args, alpha, beta, a_like, b_like), codegen


@intrinsic
def gemm_address(typingctx, like, a_like, b_like):
    """The address of the GEMM symbol call_gemm would call for these dtypes: another thread
    given it calls the same GEMM (gemm/team.py) through `call_gemm_at`."""
    dtype, source, source_b = (
        t.dtype if isinstance(t, types.DType) else t for t in (like, a_like, b_like)
    )
    symbol_dtype = _symbol_dtype(dtype, source, source_b)
    if symbol_dtype is None:
        return None

    def codegen(context, builder, signature, arguments):
        return builder.ptrtoint(_declared(builder, symbol_dtype), ir.IntType(64))

    return types.intp(like, a_like, b_like), codegen


@intrinsic
def call_gemm_at(typingctx, address, args, alpha, beta):
    """Call the GEMM at `address` (gemm_address) with the 15 integers in `args`."""
    if not isinstance(args, types.BaseTuple) or len(args) != _INTEGERS:
        return None

    def codegen(context, builder, signature, arguments):
        function = builder.inttoptr(arguments[0], _entry_type().as_pointer())
        return _call_entry(context, builder, function, signature, arguments)

    return types.none(types.intp, args, alpha, beta), codegen
