"""The core's measured FMA peak, the yardstick for the GEMM table's "% of peak".

A loop of independent vector FMAs on registers only (no loads, no stores): as many accumulators
as hide the FMA latency on every recent x86 core (two pipes x four cycles needs eight; twelve
leave margin and, with the two constants, fit AVX2's sixteen vector registers: sixteen spilled
on an AVX2 target, 67 against 118 GFLOP/s on one Zen 4 core), at the vector width the GEMM
micro-kernel uses. What it reaches is the most any GEMM can reach on this core at this width;
frequency and the hypervisor are in the number.
"""

from __future__ import annotations

from functools import partial

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from backplan.bench.internals import splat, vector_fma
from backplan.bench.measure import best_ms, time_call

ACCUMULATORS = 12


def fma_chain(lanes_f32: int):
    @intrinsic
    def fma_chain(typingctx, iterations, scale, shift):
        """sum over lanes and accumulators of ACCUMULATORS chains acc = acc * scale + shift,
        run `iterations` times; float32 vectors of `lanes_f32` lanes."""
        sig = types.float32(types.intp, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            count, scale_value, shift_value = args
            vec = ir.VectorType(ir.FloatType(), lanes_f32)
            scale_vec = splat(builder, scale_value, vec)
            shift_vec = splat(builder, shift_value, vec)
            accs = [cgutils.alloca_once_value(builder, shift_vec) for _ in range(ACCUMULATORS)]
            with cgutils.for_range(builder, count):
                for acc in accs:
                    builder.store(vector_fma(builder, builder.load(acc), scale_vec, shift_vec), acc)
            total = builder.load(accs[0])
            for acc in accs[1:]:
                total = builder.fadd(total, builder.load(acc))
            scalar = builder.extract_element(total, ir.Constant(ir.IntType(32), 0))
            for lane in range(1, lanes_f32):
                scalar = builder.fadd(
                    scalar, builder.extract_element(total, ir.Constant(ir.IntType(32), lane))
                )
            return scalar

        return sig, codegen

    @njit(nogil=True)
    def run(iterations, scale, shift):
        return fma_chain(iterations, scale, shift)

    return run


def peak_gflops_f32(width: int, seconds: float = 0.002, samples: int = 300) -> float:
    """Best of `samples` runs of about `seconds` each, in f32 GFLOP/s (f64 peaks at half).
    Many short samples: on a shared machine a 50 ms sample always shares the core (bench.gemm
    printed a peak of 61-75 GFLOP/s at load 13 beside GEMMs at 250), one of 300 2 ms samples
    rarely does."""
    lanes = width // 32
    run = fma_chain(lanes)
    run(10, 0.999, 1e-3)
    iterations = 1 << 16
    while time_call(partial(run, iterations, 0.999, 1e-3)) < seconds:
        iterations *= 2
    best = best_ms(partial(run, iterations, 0.999, 1e-3), samples) / 1e3
    return 2.0 * ACCUMULATORS * lanes * iterations / best / 1e9
