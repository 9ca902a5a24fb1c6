"""Time mathlib's functions in a Numba loop against NumPy/SciPy and show that the loops vectorise.

Run by hand: ``python -m backplan.bench.mathlib [n ...]`` (default 65536 and 16M elements,
single thread). Prints nanoseconds per element (medians of interleaved rounds of batched calls,
the harness's timing) for ours and NumPy/SciPy, their ratio, and whether the compiled loop uses
packed AVX-512/AVX2 instructions with no scalar libm call left in it. The machine is shared and
noisy: compare ratios.
"""

import re
import sys

import numba
import numpy as np
from scipy import special

from backplan.bench.internals import mathlib
from backplan.bench.measure import interleaved_medians

NUMPY_EQUIVALENTS = {
    "exp": np.exp,
    "log": np.log,
    "tanh": np.tanh,
    "sigmoid": special.expit,
    "erf": special.erf,
}
INPUT_RANGES = {"exp": (-80, 80), "log": (1e-3, 1e3), "tanh": (-6, 6), "sigmoid": (-20, 20)}
GELU_K, GELU_C = 0.7978845608028654, 0.044715


def elementwise_kernel(function):
    @numba.njit(fastmath=True, error_model="numpy")
    def kernel(x, out):
        for i in range(x.size):
            out[i] = function(x[i])

    return kernel


@numba.njit(fastmath=True, error_model="numpy")
def gelu_tanh_f32(x, out):
    k, c, half, one = np.float32(GELU_K), np.float32(GELU_C), np.float32(0.5), np.float32(1)
    for i in range(x.size):
        v = x[i]
        out[i] = half * v * (one + mathlib.tanh_f32(k * (v + c * v * v * v)))


def gelu_tanh_numpy(x, out):
    k, c = x.dtype.type(GELU_K), x.dtype.type(GELU_C)
    np.multiply(x, x, out=out)
    out *= x
    out *= c
    out += x
    out *= k
    np.tanh(out, out=out)
    out += 1
    out *= x
    out *= x.dtype.type(0.5)


def ns_per_element(n, *calls, rounds=5, seconds=0.05):
    """Each call's time per element: medians of interleaved rounds (bench/measure.py), so
    machine noise hits all alike.

    Small arrays are called repeatedly within a sample, so they measure compute throughput
    from cache; 16M-element arrays also measure memory bandwidth.
    """
    inner = max(1, 2_000_000 // n)
    steps = dict(enumerate(calls))
    medians = interleaved_medians(steps, rounds, seconds, inner=inner)
    return [1e6 * medians[index] / n for index in steps]


def vectorisation(kernel):
    """(packed vector instructions, scalar libm calls) in the compiled loop."""
    signature = kernel.signatures[0]
    asm = kernel.inspect_asm(signature)
    packed = len(re.findall(r"\bv\w+p[sd]\b[^\n]*%[yz]mm", asm))
    llvm = kernel.inspect_llvm(signature)
    libm = re.findall(r"call [^@\n]*@(exp|log|tanh|erf|expf|logf|tanhf|erff)\b", llvm)
    return packed, len(libm)


def row(name, kernel, reference, make_input, sizes):
    cells = []
    for n in sizes:
        x = make_input(n)
        out = np.empty_like(x)
        kernel(x, out)
        ours, theirs = ns_per_element(
            n, lambda x=x, out=out: kernel(x, out), lambda x=x, out=out: reference(x, out)
        )
        cells.append(f"{ours:8.3f} {theirs:8.3f} {theirs / ours:6.1f}")
    packed, libm = vectorisation(kernel)
    print(f"{name:14} " + " | ".join(cells) + f" | {packed:6} {libm:5}")


def main(sizes=(65_536, 16_000_000)):
    rng = np.random.default_rng(0)
    header = " | ".join(f"n={n:<8} ours  numpy  ratio" for n in sizes)
    print(f"ns per element, single thread\n{'function':14} {header} | packed libm-calls")
    for (op, dtype), name in mathlib.FUNCTIONS.items():
        low, high = INPUT_RANGES.get(op, (-4, 4))
        dt = np.float32 if dtype == "f32" else np.float64

        def make_input(n, low=low, high=high, dt=dt):
            return rng.uniform(low, high, n).astype(dt)

        def reference(x, out, function=NUMPY_EQUIVALENTS[op]):
            function(x, out=out)

        row(name, elementwise_kernel(getattr(mathlib, name)), reference, make_input, sizes)
    row("gelu_tanh_f32", gelu_tanh_f32, gelu_tanh_numpy, make_gelu_input, sizes)


def make_gelu_input(n):
    return np.random.default_rng(1).standard_normal(n).astype(np.float32)


if __name__ == "__main__":
    main(tuple(int(float(arg)) for arg in sys.argv[1:]) or (65_536, 16_000_000))
