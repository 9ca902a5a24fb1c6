"""A transposing panel copy built as LLVM IR, for the packs that read across rows.

Packing op(A) = A (rows of A become columns of a panel) and op(B) = B.T reads `lanes` rows at
a time and writes them interleaved. Per-element Numba indexing costs about 1.7 ns per element
here; this loop assembles `lanes` values of each panel row in a vector register from `lanes`
scalar loads and stores them whole (0.26 ns per element for 8 lanes; 32 source rows at once
were 4x slower per element, so wide panels are copied 8 columns at a time). A bfloat16 source
(uint16 bits) is widened to float32 in the register, after the loads: a zero extension and a
shift of the whole row; a float16 source (int16 bits: the GEMM's mark for float16, symbols.py)
by VCVTPH2PS where the code may use F16C, else by the shifts of kernels/half.py.

    dst[p * dst_ld + q] = src[q * ld + p]     for p < kc, q < lanes
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from backplan.codegen.kernels.half import widen_f16_for_target


def _emit(builder, args, scalar, lanes, half=None):
    """half: None (src holds scalar's type), "bf16" / "f16" (16-bit bits widened) or "f32"
    (float32 values widened to scalar, float64)."""
    src_addr, ld, kc, dst_addr, dst_ld = args
    intp = kc.type
    loaded = ir.FloatType() if half == "f32" else (ir.IntType(16) if half else scalar)
    vec, loaded_vec = ir.VectorType(scalar, lanes), ir.VectorType(loaded, lanes)
    src = builder.inttoptr(src_addr, ir.PointerType(loaded))
    dst = builder.inttoptr(dst_addr, ir.PointerType(scalar))
    rows = [builder.gep(src, [builder.mul(ir.Constant(intp, q), ld)]) for q in range(lanes)]
    align = 4 if isinstance(scalar, ir.FloatType) else 8
    done = ir.Constant(intp, 0)
    if lanes == 8 and not half:
        done = _emit_blocks_of_8(builder, rows, kc, dst, dst_ld, vec, align)
    with cgutils.for_range(builder, builder.sub(kc, done)) as loop:
        p = builder.add(loop.index, done)
        row = ir.Constant(loaded_vec, ir.Undefined)
        for q in range(lanes):
            load_align = 4 if half == "f32" else (2 if half else align)
            value = builder.load(builder.gep(rows[q], [p]), align=load_align)
            row = builder.insert_element(row, value, ir.Constant(ir.IntType(32), q))
        if half == "f32":
            row = builder.fpext(row, vec)
        elif half:
            row = _widen(builder, row, lanes, half)
        # offsets in scalars: a vector type of 6 lanes is padded to 8 in memory
        start = builder.gep(dst, [builder.mul(p, dst_ld)])
        builder.store(row, builder.bitcast(start, ir.PointerType(vec)), align=align)


# The three shuffle stages of an 8 x 8 transpose (unpack pairs, then 2-element pairs, then
# 128-bit halves), as masks over the two vectors shuffled: x86 lowers each to one instruction.
_UNPACK = ([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])
_PAIRS = ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


def _shuffle(builder, x, y, mask):
    return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(ir.IntType(32), 8), mask))


def _emit_blocks_of_8(builder, rows, kc, dst, dst_ld, vec, align):
    """The first kc // 8 * 8 panel rows, 8 at a time: 8 vector loads (one per source row),
    an in-register 8 x 8 transpose, 8 vector stores. The scalar loads of the general loop
    cost 0.26 ns per element; the whole 512 x 512 float32 pack of an NT product's B took
    44 us that way. Returns how many panel rows it wrote."""
    intp = kc.type
    eight = ir.Constant(intp, 8)
    blocks = builder.udiv(kc, eight)
    with cgutils.for_range(builder, blocks) as loop:
        p = builder.mul(loop.index, eight)
        r = [
            builder.load(builder.bitcast(builder.gep(row, [p]), ir.PointerType(vec)), align=align)
            for row in rows
        ]
        t = [_shuffle(builder, r[q & ~1], r[q | 1], _UNPACK[q & 1]) for q in range(8)]
        # t[2g + h]: rows 2g, 2g+1 interleaved, h: low or high pairs of each 128-bit half
        u = [None] * 8
        for g in (0, 4):  # source rows 0-3, then 4-7
            for h in (0, 1):
                for w in (0, 1):
                    u[g + 2 * h + w] = _shuffle(builder, t[g + h], t[g + 2 + h], _PAIRS[w])
        # u[g + c]: column c (and c + 4) of source rows g..g+3
        for c in range(4):
            for upper in (0, 1):
                out = _shuffle(builder, u[c], u[4 + c], _HALVES[upper])
                at = builder.add(p, ir.Constant(intp, c + 4 * upper))
                start = builder.gep(dst, [builder.mul(at, dst_ld)])
                builder.store(out, builder.bitcast(start, ir.PointerType(vec)), align=align)
    return builder.mul(blocks, eight)


def _bf16_to_f32(builder, bits, lanes):
    """bfloat16 bit patterns (<lanes x i16>) as float32: the upper halves of float32s."""
    wide = builder.zext(bits, ir.VectorType(ir.IntType(32), lanes))
    sixteen = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [16] * lanes)
    return builder.bitcast(builder.shl(wide, sixteen), ir.VectorType(ir.FloatType(), lanes))


def _widen(builder, bits, lanes, half):
    """16-bit float bit patterns (<lanes x i16>) of dtype half as float32."""
    if half == "f16":
        return widen_f16_for_target(builder, bits)
    return _bf16_to_f32(builder, bits, lanes)


def half_source(source, like) -> str | None:
    """Which narrower floats source holds: bf16 (uint16 bits), f16 (int16 bits), f32 beside a
    float64 like, or None."""
    if not isinstance(source, types.Array):
        return None
    if like.dtype == types.float64 and source.dtype == types.float32:
        return "f32"
    if like.dtype != types.float32:
        return None
    return {types.uint16: "bf16", types.int16: "f16"}.get(source.dtype)


def _addresses(context, builder, signature, args):
    """The first five arguments (source address and stride, rows, destination address and
    stride) as intp values."""
    return [
        context.cast(builder, value, fromty, types.intp)
        for value, fromty in zip(args[:5], signature.args[:5], strict=True)
    ]


def _make(lanes: int):
    @intrinsic
    def transpose_pack(typingctx, src_addr, ld, kc, dst_addr, dst_ld, like, source):
        """dst (kc rows of stride dst_ld) = src (`lanes` rows of stride ld) transposed, in
        elements: dst holds like's dtype (f32 or f64), src source's (the same, or uint16
        bfloat16 / int16 float16 bits into f32)."""
        if not isinstance(like, types.Array) or like.dtype not in (types.float32, types.float64):
            return None
        half = half_source(source, like)
        if not half and (not isinstance(source, types.Array) or source.dtype != like.dtype):
            return None
        scalar = ir.FloatType() if like.dtype == types.float32 else ir.DoubleType()

        def codegen(context, builder, signature, args):
            ints = _addresses(context, builder, signature, args)
            _emit(builder, ints, scalar, lanes, half)
            return context.get_dummy_value()

        return types.void(src_addr, ld, kc, dst_addr, dst_ld, like, source), codegen

    return transpose_pack


transpose_pack_8 = _make(8)
transpose_pack_6 = _make(6)


def _emit_rows(builder, args, lanes, scalar=None, half="bf16"):
    """dst[p * dst_ld + q] = widen(src[p * ld + q]): a row of `lanes` 16-bit values (half:
    "bf16" or "f16") is one vector load, its widening, and one float32 vector store. With
    `scalar` (a float type) the rows are copied as they are: one vector load and store per
    row."""
    src_addr, ld, kc, dst_addr, dst_ld = args
    item = scalar if scalar is not None else ir.IntType(16)
    loaded = ir.VectorType(item, lanes)
    align = 2 if scalar is None else (4 if isinstance(scalar, ir.FloatType) else 8)
    src = builder.inttoptr(src_addr, ir.PointerType(item))
    dst = builder.inttoptr(dst_addr, ir.PointerType(ir.FloatType() if scalar is None else scalar))
    with cgutils.for_range(builder, kc) as loop:
        p = loop.index
        row_ptr = builder.bitcast(builder.gep(src, [builder.mul(p, ld)]), ir.PointerType(loaded))
        row = builder.load(row_ptr, align=align)
        if scalar is None:
            row = _widen(builder, row, lanes, half)
        start = builder.gep(dst, [builder.mul(p, dst_ld)])
        builder.store(row, builder.bitcast(start, ir.PointerType(row.type)), align=max(align, 4))


def _make_rows(lanes: int):
    @intrinsic
    def widen_rows(typingctx, src_addr, ld, kc, dst_addr, dst_ld, source):
        """kc rows of `lanes` 16-bit values (source's: uint16 bfloat16 or int16 float16 bits;
        row stride ld) into float32 rows of stride dst_ld; strides in elements."""
        if not isinstance(source, types.Array) or source.dtype not in (types.uint16, types.int16):
            return None
        half = "f16" if source.dtype == types.int16 else "bf16"

        def codegen(context, builder, signature, args):
            ints = _addresses(context, builder, signature, args)
            _emit_rows(builder, ints, lanes, half=half)
            return context.get_dummy_value()

        return types.void(src_addr, ld, kc, dst_addr, dst_ld, source), codegen

    return widen_rows


widen_rows_6, widen_rows_8 = _make_rows(6), _make_rows(8)
widen_rows_16, widen_rows_32 = _make_rows(16), _make_rows(32)


def _make_copy_rows(lanes: int):
    @intrinsic
    def copy_rows(typingctx, src_addr, ld, kc, dst_addr, dst_ld, like):
        """kc rows of `lanes` values of like's dtype (f32 or f64; row stride ld) into rows of
        stride dst_ld, in elements: the packs of untransposed panels (pack.py), which a loop
        over a strided 2-D view copied one scalar at a time (~1 ns per element)."""
        if not isinstance(like, types.Array) or like.dtype not in (types.float32, types.float64):
            return None
        scalar = ir.FloatType() if like.dtype == types.float32 else ir.DoubleType()

        def codegen(context, builder, signature, args):
            ints = _addresses(context, builder, signature, args)
            _emit_rows(builder, ints, lanes, scalar)
            return context.get_dummy_value()

        return types.void(src_addr, ld, kc, dst_addr, dst_ld, like), codegen

    return copy_rows


copy_rows_4, copy_rows_6, copy_rows_8 = _make_copy_rows(4), _make_copy_rows(6), _make_copy_rows(8)
copy_rows_16, copy_rows_32 = _make_copy_rows(16), _make_copy_rows(32)
