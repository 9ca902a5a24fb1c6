"""The bfloat16 micro-kernel: VDPBF16PS (AVX512_BF16) dot products of bf16 pairs into float32.

One `llvm.x86.avx512bf16.dpbf16ps.512` multiplies 16 pairs of bf16 values by 16 pairs and adds
each pair's two products to a float32 lane: two k steps per instruction, at the issue rate of
one float32 FMA (twice the float32 FLOP rate). The operands therefore come packed in k-pairs
(pair_pack.py): per pair p, the A panel holds for each of its MR rows the 32-bit word
(A[r, 2p], A[r, 2p+1]), and the B panel for each of its NR columns (B[2p, j], B[2p+1, j]); an
odd k is padded with a zero. Per pair the kernel broadcasts each row's word of A over a vector
and issues MR * NV dot products against NV vectors of B.

    acc = A_pairs[kp, MR, 2] x B_pairs[kp, NV * 16, 2]
    C[MR, NV * 16] (float32, row stride ldc) = alpha * acc + beta * C    (C unread when beta 0)

Numerics (Intel SDM, VDPBF16PS): the instruction ignores MXCSR: bf16 denormal inputs read as
zero, denormal float32 results are flushed to zero, and each of the two additions rounds to
nearest even. The products of two bf16 values are exact in float32, so away from denormals the
result is that of float32 FMAs over the same k order, except that each pair's odd k is added
before its even k.

Compiling this needs the host to have AVX512_BF16 (LLVM cannot select the instruction
otherwise): isa.bf16_dot_active() decides, and nothing else may call it.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from backplan.codegen.kernels.gemm.kernel import splat, store_tile
from backplan.codegen.kernels.half import BFloat

DOT_MR, DOT_NV, DOT_LANES = 8, 2, 16  # an 8 x 32 float32 tile: 16 of the 32 zmm registers
DOT_NR = DOT_NV * DOT_LANES
INTRINSIC = "llvm.x86.avx512bf16.dpbf16ps.512"


def _dot_function(module):
    floats = ir.VectorType(ir.FloatType(), DOT_LANES)
    pairs = ir.VectorType(BFloat(), 2 * DOT_LANES)
    return cgutils.get_or_insert_function(
        module, ir.FunctionType(floats, [floats, pairs, pairs]), INTRINSIC
    )


def _accumulate(builder, kp, a, b):
    """The pair loop: acc[r][v] = dot(acc[r][v], splat(A word r), B vector v)."""
    intp, words = kp.type, ir.VectorType(ir.IntType(32), DOT_LANES)
    floats, pairs = ir.VectorType(ir.FloatType(), DOT_LANES), ir.VectorType(BFloat(), 32)
    dot = _dot_function(builder.module)
    accs = [
        [cgutils.alloca_once_value(builder, ir.Constant(floats, None)) for _ in range(DOT_NV)]
        for _ in range(DOT_MR)
    ]
    with cgutils.for_range(builder, kp) as loop:
        p = loop.index
        b_row = builder.mul(p, ir.Constant(intp, DOT_NR))
        b_vecs = []
        for v in range(DOT_NV):
            start = builder.gep(b, [builder.add(b_row, ir.Constant(intp, v * DOT_LANES))])
            loaded = builder.load(builder.bitcast(start, words.as_pointer()), align=4)
            b_vecs.append(builder.bitcast(loaded, pairs))
        a_row = builder.mul(p, ir.Constant(intp, DOT_MR))
        for r in range(DOT_MR):
            word = builder.load(builder.gep(a, [builder.add(a_row, ir.Constant(intp, r))]))
            a_vec = builder.bitcast(splat(builder, word, words), pairs)
            for v in range(DOT_NV):
                acc = builder.load(accs[r][v])
                builder.store(builder.call(dot, [acc, a_vec, b_vecs[v]]), accs[r][v])
    return [[builder.load(acc) for acc in row] for row in accs]


@intrinsic
def dot_micro_kernel(typingctx, kp, a_addr, b_addr, c_addr, ldc, alpha, beta):
    """C tile (float32) = alpha * A_pairs @ B_pairs + beta * C tile over kp k-pairs; A and B
    are packed panels of bf16 pairs (addresses), ldc in float32 elements."""
    sig = types.void(kp, a_addr, b_addr, c_addr, ldc, alpha, beta)

    def codegen(context, builder, signature, args):
        ints = [
            context.cast(builder, value, fromty, types.intp)
            for value, fromty in zip(args[:5], signature.args[:5], strict=True)
        ]
        alpha_value, beta_value = (
            context.cast(builder, value, fromty, types.float32)
            for value, fromty in zip(args[5:], signature.args[5:], strict=True)
        )
        kp_value, a_addr_value, b_addr_value, c_addr_value, ldc_value = ints
        word_ptr = ir.PointerType(ir.IntType(32))
        a = builder.inttoptr(a_addr_value, word_ptr)
        b = builder.inttoptr(b_addr_value, word_ptr)
        c = builder.inttoptr(c_addr_value, ir.PointerType(ir.FloatType()))
        sums = _accumulate(builder, kp_value, a, b)
        vec = ir.VectorType(ir.FloatType(), DOT_LANES)
        store_tile(builder, sums, c, ldc_value, alpha_value, beta_value, vec)
        return context.get_dummy_value()

    return sig, codegen
