"""The micro-kernel: an MR x (NV * lanes) tile of C held in vector registers, built as LLVM IR.

Plain Numba loops keep a GEMM's accumulators in memory (about 3 GFLOP/s); writing the vector
FMAs directly lets LLVM keep the whole tile in registers. Per step p of the k loop the kernel
loads one row of B (NV vectors), broadcasts MR values of packed A and issues MR * NV FMAs.

    acc = A_panel[kc, MR] (packed) x B[kc, NV * lanes] (row stride ldb)
    C[MR, NV * lanes] (row stride ldc) = alpha * acc + beta * C     (C not read when beta == 0)
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

# Tile shapes per vector width: (lanes, MR, NV) per dtype. 512-bit registers: 32 of them, an
# 8 x 32 f32 tile takes 16 accumulators; 256-bit (AVX2): 16 registers, 6 x 16 takes 12.
TILES = {
    512: {"f32": (16, 8, 2), "f64": (8, 8, 2)},
    256: {"f32": (8, 6, 2), "f64": (4, 6, 2)},
}


def _llvm_float(dtype_name: str):
    return ir.FloatType() if dtype_name == "f32" else ir.DoubleType()


def splat(builder, scalar, vec_type):
    undef = ir.Constant(vec_type, ir.Undefined)
    one = builder.insert_element(undef, scalar, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vec_type.count), [0] * vec_type.count)
    return builder.shuffle_vector(one, undef, zeros)


def vector_fma(builder, a, b, c):
    """llvm.fma on vectors (llvmlite's builder.fma takes scalars only)."""
    vec = a.type
    suffix = f"v{vec.count}f{32 if isinstance(vec.element, ir.FloatType) else 64}"
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.{suffix}"
    )
    return builder.call(fn, [a, b, c])


def _align(vec):
    """Alignment promised for vector loads and stores: one element (rows are not aligned)."""
    return 4 if isinstance(vec.element, ir.FloatType) else 8


def _vec_ptr(builder, base, offset, vec_type):
    return builder.bitcast(builder.gep(base, [offset]), ir.PointerType(vec_type))


def _accumulate(builder, kc, a, b, ldb, vec, mr, nv, a_steps=None):
    """The k loop: acc[r][v] += A_panel[p, r] * B[p, v-th vector], in registers after mem2reg.
    A_panel[p, r] is read at p * step + r * row of a_steps (IR values; packed: mr and 1)."""
    intp, lanes = kc.type, vec.count
    step, row = a_steps or (ir.Constant(intp, mr), ir.Constant(intp, 1))
    row_offsets = [builder.mul(ir.Constant(intp, r), row) for r in range(mr)]
    accs = [
        [cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(nv)]
        for _ in range(mr)
    ]
    with cgutils.for_range(builder, kc) as loop:
        p = loop.index
        b_row = builder.mul(p, ldb)
        b_vecs = [
            builder.load(
                _vec_ptr(builder, b, builder.add(b_row, ir.Constant(intp, v * lanes)), vec),
                align=_align(vec),
            )
            for v in range(nv)
        ]
        a_row = builder.mul(p, step)
        for r in range(mr):
            a_val = builder.load(builder.gep(a, [builder.add(a_row, row_offsets[r])]))
            a_vec = splat(builder, a_val, vec)
            for v in range(nv):
                acc = builder.load(accs[r][v])
                builder.store(vector_fma(builder, a_vec, b_vecs[v], acc), accs[r][v])
    return [[builder.load(acc) for acc in row] for row in accs]


def store_tile(builder, sums, c, ldc, alpha, beta, vec):
    """C = alpha * sums + beta * C, with C left unread when beta == 0 (it may hold NaN)."""
    intp, lanes, align = ldc.type, vec.count, _align(vec)
    alpha_vec, beta_vec = splat(builder, alpha, vec), splat(builder, beta, vec)
    targets = [
        [
            _vec_ptr(
                builder,
                c,
                builder.add(builder.mul(ir.Constant(intp, r), ldc), ir.Constant(intp, v * lanes)),
                vec,
            )
            for v in range(len(row))
        ]
        for r, row in enumerate(sums)
    ]
    beta_zero = builder.fcmp_ordered("==", beta, ir.Constant(vec.element, 0.0))
    with builder.if_else(beta_zero) as (overwrite, update):
        with overwrite:
            for row, row_targets in zip(sums, targets, strict=True):
                for total, target in zip(row, row_targets, strict=True):
                    builder.store(builder.fmul(total, alpha_vec), target, align=align)
        with update:
            for row, row_targets in zip(sums, targets, strict=True):
                for total, target in zip(row, row_targets, strict=True):
                    old = builder.load(target, align=align)
                    new = vector_fma(builder, old, beta_vec, builder.fmul(total, alpha_vec))
                    builder.store(new, target, align=align)


def _transposed_columns(builder, sums, lanes):
    """The tile's columns, two to a vector: sums[r][v] (mr rows, nv vectors of `lanes`) turned
    into (column q, 1, vector) with column q's mr values then column q + 1's. Each level of
    two-source shuffles (one vpermt2ps each) joins two vectors holding the same columns of
    different rows and splits the columns in halves; mr a power of two, 2 * mr == lanes."""
    out = []
    for v in range(len(sums[0])):
        # each vector's contents as (row, column) labels, column-major
        level = [([(r, q) for q in range(lanes)], sums[r][v]) for r in range(len(sums))]
        while len({q for _, q in level[0][0]}) > 2:
            groups = {}  # vectors holding the same columns, in row order
            for labels, vector in level:
                groups.setdefault(tuple(sorted({q for _, q in labels})), []).append(
                    (labels, vector)
                )
            level = []
            for columns, members in groups.items():
                half = len(columns) // 2
                for (labels_x, x), (labels_y, y) in zip(members[0::2], members[1::2], strict=True):
                    where = {label: at for at, label in enumerate(labels_x + labels_y)}
                    rows = sorted({row for row, _ in labels_x + labels_y})
                    for part in (columns[:half], columns[half:]):
                        labels = [(row, q) for q in part for row in rows]
                        mask = ir.Constant(
                            ir.VectorType(ir.IntType(32), lanes), [where[lb] for lb in labels]
                        )
                        level.append((labels, builder.shuffle_vector(x, y, mask)))
        for labels, vector in level:
            out.append((v * lanes + labels[0][1], labels[-1][1] - labels[0][1], vector))
    return out


def store_tile_transposed(builder, sums, c, ldc, alpha, beta, vec):
    """C = alpha * sums.T + beta * C: tile column q lands in C's row q (ldc apart), its mr
    values contiguous. The kernel of C.T = op(B).T @ op(A).T when C's rows are the long side
    (symbols.py): the tile is transposed in registers and stored as half vectors, instead of
    element by element through the edge tile."""
    intp, lanes, align = ldc.type, vec.count, _align(vec)
    mr = len(sums)
    half = ir.VectorType(vec.element, mr)
    alpha_vec, beta_vec = splat(builder, alpha, half), splat(builder, beta, half)
    pieces = []  # (C row, mr values)
    for first, apart, vector in _transposed_columns(builder, sums, lanes):
        for at, row in enumerate((first, first + apart)):
            mask = ir.Constant(
                ir.VectorType(ir.IntType(32), mr), list(range(at * mr, at * mr + mr))
            )
            values = builder.shuffle_vector(vector, ir.Constant(vec, ir.Undefined), mask)
            target = _vec_ptr(builder, c, builder.mul(ir.Constant(intp, row), ldc), half)
            pieces.append((values, target))
    beta_zero = builder.fcmp_ordered("==", beta, ir.Constant(vec.element, 0.0))
    with builder.if_else(beta_zero) as (overwrite, update):
        with overwrite:
            for values, target in pieces:
                builder.store(builder.fmul(values, alpha_vec), target, align=align)
        with update:
            for values, target in pieces:
                old = builder.load(target, align=align)
                new = vector_fma(builder, old, beta_vec, builder.fmul(values, alpha_vec))
                builder.store(new, target, align=align)


def prefetch_tile(builder, c, ldc, mr, row_bytes, scalar_bytes):
    """Ask for the C tile's cache lines (for writing) before the k loop: the tile is read or
    written only after it, and a C too big for L2 (a 1024 x 256 f32 result is 1 MiB, written
    again after every k block) otherwise stalls the stores on misses at the end of each call."""
    i8p = ir.PointerType(ir.IntType(8))
    fn = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)]),
        "llvm.prefetch.p0i8",
    )
    write, keep, data = (ir.Constant(ir.IntType(32), v) for v in (1, 3, 1))
    intp = ldc.type
    # every line a row touches holds one of these: rows need not start on a line
    offsets = [*range(0, row_bytes, 64), row_bytes - scalar_bytes]
    for r in range(mr):
        row = builder.gep(c, [builder.mul(ir.Constant(intp, r), ldc)])
        for offset in offsets:
            at = builder.gep(row, [ir.Constant(intp, offset // scalar_bytes)])
            builder.call(fn, [builder.bitcast(at, i8p), write, keep, data])


def _emit_kernel(
    builder, args, scalar, lanes, mr, nv, a_layout="packed", lda=None, c_transposed=False
):
    kc, a_addr, b_addr, ldb, c_addr, ldc, alpha, beta = args
    one = ir.Constant(kc.type, 1)
    a_steps = {"packed": None, "rows": (one, lda), "columns": (lda, one)}[a_layout]
    vec = ir.VectorType(scalar, lanes)
    ptr = ir.PointerType(scalar)
    a, b, c = (builder.inttoptr(addr, ptr) for addr in (a_addr, b_addr, c_addr))
    scalar_bytes = 4 if isinstance(scalar, ir.FloatType) else 8
    if not c_transposed:  # 32 rows of 8 values: the prefetches cost more than they saved
        prefetch_tile(builder, c, ldc, mr, lanes * nv * scalar_bytes, scalar_bytes)
    sums = _accumulate(builder, kc, a, b, ldb, vec, mr, nv, a_steps)
    if c_transposed:
        store_tile_transposed(builder, sums, c, ldc, alpha, beta, vec)
    else:
        store_tile(builder, sums, c, ldc, alpha, beta, vec)


def _make_kernel(width: int):
    @intrinsic
    def micro_kernel(typingctx, kc, a_addr, b_addr, ldb, c_addr, ldc, alpha, beta, like):
        """C tile = alpha * A_panel @ B_rows + beta * C tile, for the `width`-bit tile shape;
        addresses and strides in elements of `like`'s dtype (f32 or f64)."""
        if not isinstance(like, types.Array) or like.dtype not in (types.float32, types.float64):
            return None
        dtype = like.dtype
        name = "f32" if dtype == types.float32 else "f64"
        lanes, mr, nv = TILES[width][name]
        sig = types.void(kc, a_addr, b_addr, ldb, c_addr, ldc, alpha, beta, like)

        def codegen(context, builder, signature, args):
            scalars = [
                context.cast(builder, value, fromty, dtype)
                for value, fromty in zip(args[6:8], signature.args[6:8], strict=True)
            ]
            ints_cast = [
                context.cast(builder, value, fromty, types.intp)
                for value, fromty in zip(args[:6], signature.args[:6], strict=True)
            ]
            _emit_kernel(builder, ints_cast + scalars, _llvm_float(name), lanes, mr, nv)
            return context.get_dummy_value()

        return sig, codegen

    return micro_kernel


def _make_in_place_kernel(
    width: int, a_layout: str, c_transposed: bool = False, rows: int | None = None
):
    @intrinsic
    def micro_kernel_in_place(
        typingctx, kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like
    ):
        """The kernel with A read where it lies, not packed: A_panel[p, r] at element
        r * lda + p ("rows": op(A) row-major, NN) or p * lda + r ("columns": op(A) = A.T of a
        row-major A, TN); `rows` rows of the tile when set, else the tile's mr."""
        if not isinstance(like, types.Array) or like.dtype not in (types.float32, types.float64):
            return None
        dtype = like.dtype
        name = "f32" if dtype == types.float32 else "f64"
        lanes, mr, nv = TILES[width][name]
        mr = rows or mr
        sig = types.void(kc, a_addr, lda, b_addr, ldb, c_addr, ldc, alpha, beta, like)

        def codegen(context, builder, signature, args):
            ints = [
                context.cast(builder, value, fromty, types.intp)
                for value, fromty in zip(args[:7], signature.args[:7], strict=True)
            ]
            scalars = [
                context.cast(builder, value, fromty, dtype)
                for value, fromty in zip(args[7:9], signature.args[7:9], strict=True)
            ]
            kc_, a_, lda_, b_, ldb_, c_, ldc_ = ints
            _emit_kernel(
                builder, [kc_, a_, b_, ldb_, c_, ldc_, *scalars], _llvm_float(name),
                lanes, mr, nv, a_layout, lda_, c_transposed,
            )  # fmt: skip
            return context.get_dummy_value()

        return sig, codegen

    return micro_kernel_in_place


micro_kernel_512 = _make_kernel(512)
micro_kernel_256 = _make_kernel(256)
micro_kernel_512_a_rows = _make_in_place_kernel(512, "rows")
micro_kernel_512_a_columns = _make_in_place_kernel(512, "columns")
micro_kernel_256_a_rows = _make_in_place_kernel(256, "rows")
micro_kernel_256_a_columns = _make_in_place_kernel(256, "columns")
# The 256-bit tile's last rows of a block whose height is not a multiple of its 6: two or four
# rows left are run as one or two 4-row tiles (8 accumulators) instead of a 6-row tile through
# the edge buffer (driver.py)
REMAINDER_ROWS = 4
micro_kernel_256_a_rows_4 = _make_in_place_kernel(256, "rows", rows=REMAINDER_ROWS)
micro_kernel_256_a_columns_4 = _make_in_place_kernel(256, "columns", rows=REMAINDER_ROWS)
# A's rows in place, the tile stored transposed (C column-major: C.T computed as B.T @ A.T)
micro_kernel_512_a_rows_c_columns = _make_in_place_kernel(512, "rows", c_transposed=True)
