"""Packing bfloat16 operands in k-pairs, the order VDPBF16PS reads (dot_kernel.py).

Both operands are packed the same way once viewed as `src` = (panel lanes, k): rows of op(A)
for an A panel, columns of op(B) (rows of op(B).T) for a B panel:

    dst[(p * lanes + q) * 2 + h] = src[q, 2p + h]      (zero where q or 2p + h is past src)

so each lane's pair is one 32-bit word and a pair row of the panel is one vector. Two vector
paths, per group of 8 lanes: where src has unit stride along k (op(A) = A, op(B) = B.T) a
lane's pair is already a word in memory and the group is a transpose of 32-bit words; where
src has unit stride along the lanes (op(A) = A.T, op(B) = B) a pair row is two 8-value loads
interleaved by one shuffle. Groups cut by the panel's edge, strided sources and an odd k's last
pair (its second value a zero) are copied by scalar loops.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from backplan.codegen.jit import njit

GROUP = 8  # lanes per vector copy


def _ints(context, builder, signature, args):
    return [
        context.cast(builder, value, fromty, types.intp)
        for value, fromty in zip(args, signature.args, strict=True)
    ]


def _emit_word_transpose(builder, src_addr, ld, pairs, dst_addr, dst_ld):
    """dst row p (8 words) = the words at src + q * ld + 2p, q < 8; in uint16 units."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    words = ir.VectorType(i32, GROUP)
    src = builder.inttoptr(src_addr, i16.as_pointer())
    dst = builder.inttoptr(dst_addr, i16.as_pointer())
    rows = [builder.gep(src, [builder.mul(ir.Constant(ld.type, q), ld)]) for q in range(GROUP)]
    with cgutils.for_range(builder, pairs) as loop:
        p2 = builder.mul(loop.index, ir.Constant(ld.type, 2))
        row = ir.Constant(words, ir.Undefined)
        for q in range(GROUP):
            word_ptr = builder.bitcast(builder.gep(rows[q], [p2]), i32.as_pointer())
            row = builder.insert_element(row, builder.load(word_ptr, align=2), ir.Constant(i32, q))
        start = builder.gep(dst, [builder.mul(loop.index, dst_ld)])
        builder.store(row, builder.bitcast(start, words.as_pointer()), align=4)


def _emit_interleave(builder, src_addr, ld, pairs, dst_addr, dst_ld):
    """dst row p (16 values) = src row 2p and src row 2p + 1 (8 values each) interleaved."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    half, whole = ir.VectorType(i16, GROUP), ir.VectorType(i16, 2 * GROUP)
    mask = ir.Constant(
        ir.VectorType(i32, 2 * GROUP), [q // 2 + (q % 2) * GROUP for q in range(2 * GROUP)]
    )
    src = builder.inttoptr(src_addr, i16.as_pointer())
    dst = builder.inttoptr(dst_addr, i16.as_pointer())
    with cgutils.for_range(builder, pairs) as loop:
        even = builder.mul(builder.mul(loop.index, ir.Constant(ld.type, 2)), ld)
        first, second = (
            builder.load(builder.bitcast(builder.gep(src, [offset]), half.as_pointer()), align=2)
            for offset in (even, builder.add(even, ld))
        )
        row = builder.shuffle_vector(first, second, mask)
        start = builder.gep(dst, [builder.mul(loop.index, dst_ld)])
        builder.store(row, builder.bitcast(start, whole.as_pointer()), align=2)


def _make(emit):
    @intrinsic
    def copy_group(typingctx, src_addr, ld, pairs, dst_addr, dst_ld):
        """One group of 8 lanes over `pairs` k-pairs; strides in uint16 elements."""

        def codegen(context, builder, signature, args):
            emit(builder, *_ints(context, builder, signature, args))
            return context.get_dummy_value()

        return types.void(src_addr, ld, pairs, dst_addr, dst_ld), codegen

    return copy_group


word_transpose_8 = _make(_emit_word_transpose)
interleave_8 = _make(_emit_interleave)


@njit(cache=True, nogil=True)
def _group_by_vector(src, lanes, dst, q0, pairs):
    """Pairs [0, pairs) of lanes q0..q0+7 by a vector copy; False if src's strides allow none."""
    base = src.ctypes.data + q0 * src.strides[0]
    dst_addr = dst.ctypes.data + q0 * 4
    if src.strides[1] == 2 and src.strides[0] % 2 == 0:
        word_transpose_8(base, src.strides[0] // 2, pairs, dst_addr, lanes * 2)
        return True
    if src.strides[0] == 2 and src.strides[1] % 2 == 0:
        interleave_8(base, src.strides[1] // 2, pairs, dst_addr, lanes * 2)
        return True
    return False


@njit(cache=True, nogil=True)
def pack_pairs(src, lanes, dst):
    """dst[(p * lanes + q) * 2 + h] = src[q, 2p + h], zero past src (see the module doc);
    src is (at most lanes, k) uint16, dst holds ceil(k / 2) * lanes * 2 values."""
    rows, k = src.shape
    full_pairs = k // 2
    for q0 in range(0, lanes, GROUP):
        vector = q0 + GROUP <= rows and full_pairs > 0
        if vector and _group_by_vector(src, lanes, dst, q0, full_pairs):
            first_scalar = full_pairs
        else:
            first_scalar = 0
        for p in range(first_scalar, (k + 1) // 2):
            for q in range(q0, q0 + GROUP):
                for h in range(2):
                    kk = 2 * p + h
                    inside = q < rows and kk < k
                    dst[(p * lanes + q) * 2 + h] = src[q, kk] if inside else 0


@njit(cache=True, nogil=True)
def pack_a_pairs(a, trans_a, i0, mc, p0, kc, mr, out):
    """Pair panels of op(A)[i0:i0+mc, p0:p0+kc]; op(A) = A.T when trans_a."""
    size = (kc + 1) // 2 * mr * 2
    for panel in range((mc + mr - 1) // mr):
        first = i0 + panel * mr
        rows = min(mr, i0 + mc - first)
        dst = out[panel * size : (panel + 1) * size]
        if trans_a:
            pack_pairs(a[p0 : p0 + kc, first : first + rows].T, mr, dst)
        else:
            pack_pairs(a[first : first + rows, p0 : p0 + kc], mr, dst)


@njit(cache=True, nogil=True)
def pack_b_pairs(b, trans_b, p0, kc, j0, nc, nr, out):
    """Pair panels of op(B)[p0:p0+kc, j0:j0+nc]; op(B) = B.T when trans_b. A B panel's lanes
    are columns of op(B), rows of op(B).T: the A panels of op(B).T (B when trans_b)."""
    pack_a_pairs(b, not trans_b, j0, nc, p0, kc, nr, out)
