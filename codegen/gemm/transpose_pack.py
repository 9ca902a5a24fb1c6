"""A transposing panel copy built as LLVM IR, for the packs that read across rows.

Packing op(A) = A (rows of A become columns of a panel) and op(B) = B.T reads `lanes` rows at
a time and writes them interleaved. Per-element Numba indexing costs about 1.7 ns per element
here; this loop assembles each output row of the panel in a vector register from `lanes` scalar
loads and stores it whole.

    dst[p * lanes + q] = src[q * ld + p]     for p < kc, q < lanes
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .kernel import TILES


def _emit(builder, args, scalar, lanes):
    src_addr, ld, kc, dst_addr = args
    intp = kc.type
    ptr = ir.PointerType(scalar)
    vec = ir.VectorType(scalar, lanes)
    src = builder.inttoptr(src_addr, ptr)
    dst = builder.inttoptr(dst_addr, ptr)
    rows = [builder.gep(src, [builder.mul(ir.Constant(intp, q), ld)]) for q in range(lanes)]
    align = 4 if isinstance(scalar, ir.FloatType) else 8
    with cgutils.for_range(builder, kc) as loop:
        p = loop.index
        row = ir.Constant(vec, ir.Undefined)
        for q in range(lanes):
            value = builder.load(builder.gep(rows[q], [p]), align=align)
            row = builder.insert_element(row, value, ir.Constant(ir.IntType(32), q))
        # offsets in scalars: a vector type of 6 lanes is padded to 8 in memory
        start = builder.gep(dst, [builder.mul(p, ir.Constant(intp, lanes))])
        builder.store(row, builder.bitcast(start, ir.PointerType(vec)), align=align)


def _make(width: int, role: str):
    @intrinsic
    def transpose_pack(typingctx, src_addr, ld, kc, dst_addr, like):
        """dst (kc x lanes, contiguous) = src (lanes rows of stride ld) transposed; lanes is the
        tile's mr (role 'a') or nr (role 'b') for like's dtype at this width."""
        if not isinstance(like, types.Array) or like.dtype not in (types.float32, types.float64):
            return None
        name = "f32" if like.dtype == types.float32 else "f64"
        vector_lanes, mr, nv = TILES[width][name]
        lanes = mr if role == "a" else vector_lanes * nv
        scalar = ir.FloatType() if name == "f32" else ir.DoubleType()

        def codegen(context, builder, signature, args):
            ints = [
                context.cast(builder, value, fromty, types.intp)
                for value, fromty in zip(args[:4], signature.args[:4], strict=True)
            ]
            _emit(builder, ints, scalar, lanes)
            return context.get_dummy_value()

        return types.void(src_addr, ld, kc, dst_addr, like), codegen

    return transpose_pack


transpose_pack_a_512, transpose_pack_b_512 = _make(512, "a"), _make(512, "b")
transpose_pack_a_256, transpose_pack_b_256 = _make(256, "a"), _make(256, "b")
