"""Vectorisable exp, log, tanh, sigmoid and erf for generated Numba kernels.

Numba lowers `math.exp` and `math.tanh` to scalar libm calls, which stop a loop from
vectorising (tanh about 35x slower than `np.tanh`). The functions here are plain arithmetic:
range reduction, a polynomial, and exponent-field bit tricks, with no branches the vectoriser
cannot flatten. A loop such as ``for i in range(n): out[i] = tanh_f32(x[i])`` compiles to
packed AVX-512 (or AVX2) instructions.

Each function is compiled with its own fast-math flags (only ``contract``, which allows fused
multiply-add) and is inlined by LLVM (``forceinline``), not by Numba (``inline="always"``).
Numba-level inlining would compile the body under the caller's flags, and a caller with
``fastmath=True`` lets LLVM reassociate the two-step ``x - n*ln2_hi - n*ln2_lo`` reduction
into one product (measured: exp_f32 4.6 ulp instead of 1.0 near overflow) and drop the NaN
and infinity tests (log_f32(inf) returned 88.7 and log_f32(nan) 89.1). Instructions inlined
by LLVM keep their own flags, so these functions stay accurate inside a ``fastmath=True``
kernel and still vectorise there.

Accuracy is stated in each docstring as the largest error measured against the correctly
rounded result (float32: against float64 math; float64: against 80-bit long double or
mpmath), over dense sweeps of the useful range plus random inputs, and for float32 over every
bit pattern. For comparison, NumPy 2.4's own float32 exp and log are off by up to 2.4 and 3.8
ulp. Polynomial coefficients are near-minimax fits: weighted least squares on Chebyshev nodes
with Lawson reweighting, targets from mpmath at 45 digits.

Example (inside any @numba.njit function)::

    from backplan.codegen.kernels.mathlib import tanh_f32
    for i in range(x.size):
        out[i] = tanh_f32(x[i])
"""

import math

import numpy as np
from numba import types
from numba.extending import intrinsic

from backplan.codegen.jit import compiled_njit

_FLAGS = {"contract"}


def _scalar_function(fn):
    """Compile `fn` for use inside kernels: LLVM-inlined, FMA allowed, nothing else relaxed."""
    return compiled_njit(forceinline=True, fastmath=_FLAGS, error_model="numpy", cache=True)(fn)


def _bitcast(source, target):
    """An intrinsic that reinterprets the bits of a `source` scalar as a `target` scalar."""

    @intrinsic
    def reinterpret(typingctx, value):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(target))

        return target(source), codegen

    return reinterpret


_bits_f32 = _bitcast(types.float32, types.int32)
_from_bits_f32 = _bitcast(types.int32, types.float32)
_bits_f64 = _bitcast(types.float64, types.int64)
_from_bits_f64 = _bitcast(types.int64, types.float64)


def _f32(*values):
    return tuple(np.float32(v) for v in values)


def _f64(*values):
    return tuple(np.float64(v) for v in values)


# exp(r) = 1 + r + r**2 * P(r) on |r| <= ln2/2.
_EXP_F32 = _f32(0.49999994, 0.16666521, 0.04166839, 0.008368731, 0.001381457)
_EXP_F64 = _f64(
    0.5000000000000011, 0.16666666666666413, 0.04166666666652987, 0.008333333333494756,
    0.0013888888943715742, 0.00019841269506164452, 2.4801493001644112e-05,
    2.7557586546455044e-06, 2.76302857566468e-07, 2.500006915093202e-08,
)  # fmt: skip
# expm1(r) = r + r**2 * P(r) on |r| <= ln2/2 (tanh_f32).
_EXPM1_F32 = _f32(
    0.5, 0.16666666, 0.041666362, 0.00833339, 0.001394062, 0.00019845876,
)  # fmt: skip
_TANH_F64 = _f64(
    -0.3333333333333332, 0.13333333333331243, -0.053968253967067524, 0.021869488502169805,
    -0.008863234954138287, 0.0035921217472208115, -0.0014557877677260189,
    0.0005897858107760667, -0.00023824007294280191, 9.458685920652279e-05,
    -3.497635154117063e-05, 1.0431990245435298e-05, -1.7727547115304183e-06,
)  # fmt: skip
# log(1 + f) = f - f**2/2 + f**3 * P(f) on sqrt(1/2) - 1 <= f < sqrt(2) - 1.
_LOG_F32 = _f32(
    0.3333333, -0.25000823, 0.20001234, -0.16623297, 0.14201552, -0.13160595, 0.12763341,
    -0.07635636,
)  # fmt: skip
# log(1 + f) = 2s + s * z * P(z), s = f / (2 + f), z = s**2.
_LOG_F64 = _f64(
    0.6666666666666735, 0.3999999999941026, 0.28571428743464394, 0.22222198453735528,
    0.18183570972972699, 0.15313869818989517, 0.14797860201381147,
)  # fmt: skip
# erf(x) = x + x * P(x**2) on |x| < 1.
_ERF_SMALL_F32 = _f32(
    0.12837917, -0.37612626, 0.112835854, -0.026853813, 0.0051883277, -0.00080101937, 7.85386e-05,
)  # fmt: skip
_ERF_SMALL_F64 = _f64(
    0.1283791670955126, -0.3761263890318352, 0.11283791670944196, -0.026866170643112714,
    0.005223977606125625, -0.0008548325929560467, 0.00012055293582189289,
    -1.4924712373600076e-05, 1.6447132163288681e-06, -1.6206316481995666e-07,
    1.3710985667641836e-08, -7.779468018906645e-10,
)  # fmt: skip
# erfc(t) = exp(-t**2 + P(t - centre)), the log of erfcx, on 1 <= t <= 4 (f32) or 6 (f64).
_ERF_TAIL_F32 = _f32(
    -1.5568179, -0.35269395, 0.05611686, -0.010711251, 0.0024653955, -0.0001519648, 0.00018638029,
)  # fmt: skip
_ERF_TAIL_F64 = _f64(
    -1.862437402141259, -0.2660995882595084, 0.033246945533242596, -0.005225659225450819,
    0.0008736810538343012, -0.00014730895868859175, 2.4384160430629182e-05,
    -3.866915557189241e-06, 6.255165293320248e-07, -5.188985184803042e-08,
    1.0557946959588166e-08, -1.787750255127864e-08, -1.7248844355017377e-08,
    -9.31384211931257e-09, -3.2091220567096205e-09, -6.934022960038851e-10,
    -8.874507602028411e-11, -4.928251356404496e-12,
)  # fmt: skip

_ZERO_F32, _HALF_F32, _ONE_F32, _TWO_F32 = _f32(0.0, 0.5, 1.0, 2.0)
_ZERO_F64, _HALF_F64, _ONE_F64, _TWO_F64 = _f64(0.0, 0.5, 1.0, 2.0)
_INF_F32, _NAN_F32 = _f32(np.inf, np.nan)
_INF_F64, _NAN_F64 = _f64(np.inf, np.nan)

# Cody-Waite split of ln 2 (hi has its low mantissa bits zero): n * hi is exact for every n
# the clamps allow, and hi + lo carries ln 2 to about 2**-24 (f32) or 2**-75 (f64) beyond it.
_LOG2E_F32 = np.float32(1.4426950408889634)
_LN2_HI_F32, _LN2_LO_F32 = _f32(0.693359375, -0.00021219444)
_LOG2E_F64 = np.float64(1.4426950408889634)
_LN2_HI_F64, _LN2_LO_F64 = _f64(0.6931467056274414, 4.7493250390316726e-07)

# Beyond these, exp rounds to 0 or overflows to inf.
_EXP_MIN_F32, _EXP_MAX_F32 = _f32(-104.0, 89.0)
_EXP_MIN_F64, _EXP_MAX_F64 = _f64(-746.0, 710.0)
# Above these, 2**n from the exp reduction is a normal number (used where exp <= 1 suffices).
_EXP_NORMAL_MIN_F32 = np.float32(-87.0)
_EXP_NORMAL_MIN_F64 = np.float64(-708.0)
# tanh switches from its polynomial to the exp form at |x| = 0.7 (float64); float32 clamps
# |x| at 9.1, beyond which tanh rounds to 1, so expm1(2|x|) stays finite.
_TANH_SWITCH_F64 = np.float64(0.7)
_TANH_CLAMP_F32 = np.float32(9.1)
_TWO_LOG2E_F32 = np.float32(2 * 1.4426950408889634)

_MIN_NORMAL_F32, _TWO_POW_23_F32 = _f32(np.finfo(np.float32).tiny, 2.0**23)
_MIN_NORMAL_F64, _TWO_POW_54_F64 = _f64(np.finfo(np.float64).tiny, 2.0**54)
_SQRT_HALF_BITS_F32 = 0x3F3504F3
_SQRT_HALF_BITS_F64 = 0x3FE6A09E667F3BCD

# Adding 1.5 * 2**(mantissa bits) rounds a float to an integer held in the low mantissa bits.
_ROUND_SHIFTER_F32 = np.float32(1.5 * 2.0**23)
_ROUND_SHIFTER_F64 = np.float64(1.5 * 2.0**52)
_ROUND_SHIFTER_BITS_F32 = int(_ROUND_SHIFTER_F32.view(np.int32))
_ROUND_SHIFTER_BITS_F64 = int(_ROUND_SHIFTER_F64.view(np.int64))

# erf switches from x * P(x**2) to 1 - erfc at |x| = 1; beyond the end erf rounds to +-1.
_ERF_TAIL_END_F32, _ERF_TAIL_CENTRE_F32 = _f32(4.0, 2.5)
_ERF_TAIL_END_F64, _ERF_TAIL_CENTRE_F64 = _f64(6.0, 3.5)


@_scalar_function
def _horner(x, coefficients):
    """sum(c[k] * x**k); the loop over a constant tuple is unrolled by LLVM."""
    result = coefficients[len(coefficients) - 1]
    for k in range(len(coefficients) - 2, -1, -1):
        result = result * x + coefficients[k]
    return result


@_scalar_function
def _round_f32(y):
    """(n, k): y rounded to the nearest integer (ties to even) as float32 and as int, |y| < 2**22.

    Adding 1.5 * 2**23 rounds away the fraction and leaves n in the low mantissa bits, so no
    float-to-int conversion is needed: AVX2 has none for 64-bit lanes, and Numba's integer
    arithmetic is 64-bit.
    """
    shifted = y + _ROUND_SHIFTER_F32
    return shifted - _ROUND_SHIFTER_F32, _bits_f32(shifted) - _ROUND_SHIFTER_BITS_F32


@_scalar_function
def _round_f64(y):
    """(n, k): y rounded to the nearest integer as float64 and as int, |y| < 2**51."""
    shifted = y + _ROUND_SHIFTER_F64
    return shifted - _ROUND_SHIFTER_F64, _bits_f64(shifted) - _ROUND_SHIFTER_BITS_F64


@_scalar_function
def _int_to_float_f32(k):
    """float32(k) for |k| < 2**22 by the same shift, avoiding an int-to-float conversion."""
    return _from_bits_f32(k + _ROUND_SHIFTER_BITS_F32) - _ROUND_SHIFTER_F32


@_scalar_function
def _int_to_float_f64(k):
    """float64(k) for |k| < 2**51; AVX2 has no int64-to-float64 vector conversion."""
    return _from_bits_f64(k + _ROUND_SHIFTER_BITS_F64) - _ROUND_SHIFTER_F64


@_scalar_function
def _pow2_f32(k):
    """2**k for an integer k in [-126, 127], built in the exponent field."""
    return _from_bits_f32((k + 127) << 23)


@_scalar_function
def _pow2_f64(k):
    """2**k for an integer k in [-1022, 1023], built in the exponent field."""
    return _from_bits_f64((k + 1023) << 52)


@_scalar_function
def _scale_by_pow2_f32(p, k):
    """p * 2**k for p in [0.5, 2) and integer k in [-150, 128], rounding once into subnormals
    or inf.

    Half of k goes into p's exponent field by integer addition and half is a float multiply,
    so neither factor overflows and no compiler reassociation can merge them.
    """
    half = k >> 1
    p_scaled = _from_bits_f32(_bits_f32(p) + (half << 23))
    return p_scaled * _pow2_f32(k - half)


@_scalar_function
def _scale_by_pow2_f64(p, k):
    """p * 2**k for p in [0.5, 2) and integer k in [-1076, 1025]; see _scale_by_pow2_f32."""
    half = k >> 1
    p_scaled = _from_bits_f64(_bits_f64(p) + (half << 52))
    return p_scaled * _pow2_f64(k - half)


@_scalar_function
def exp_f32(x):
    """e**x in float32; max error 1.01 ulp (every float32 input).

    exp(-inf) = 0, exp(inf) = inf, overflow gives inf, underflow passes through subnormals to
    0, NaN gives NaN.
    """
    clamped = min(max(x, _EXP_MIN_F32), _EXP_MAX_F32)
    n, k = _round_f32(clamped * _LOG2E_F32)
    r = clamped - n * _LN2_HI_F32
    r = r - n * _LN2_LO_F32
    p = r * r * _horner(r, _EXP_F32) + r + _ONE_F32
    y = _scale_by_pow2_f32(p, k)
    return y if x == x else x


@_scalar_function
def exp_f64(x):
    """e**x in float64; max error 1.03 ulp (12M inputs). Special values as exp_f32."""
    clamped = min(max(x, _EXP_MIN_F64), _EXP_MAX_F64)
    n, k = _round_f64(clamped * _LOG2E_F64)
    r = clamped - n * _LN2_HI_F64
    r = r - n * _LN2_LO_F64
    p = r * r * _horner(r, _EXP_F64) + r + _ONE_F64
    y = _scale_by_pow2_f64(p, k)
    return y if x == x else x


@_scalar_function
def _exp_nonpositive_f32(y):
    """e**y for y <= 0, clamped at -87 so 2**n stays normal: exp_f32 without its edge cases."""
    clamped = max(y, _EXP_NORMAL_MIN_F32)
    n, k = _round_f32(clamped * _LOG2E_F32)
    r = clamped - n * _LN2_HI_F32
    r = r - n * _LN2_LO_F32
    return (r * r * _horner(r, _EXP_F32) + r + _ONE_F32) * _pow2_f32(k)


@_scalar_function
def _exp_nonpositive_f64(y):
    """e**y for y <= 0, clamped at -708 so 2**n stays normal: exp_f64 without its edge cases."""
    clamped = max(y, _EXP_NORMAL_MIN_F64)
    n, k = _round_f64(clamped * _LOG2E_F64)
    r = clamped - n * _LN2_HI_F64
    r = r - n * _LN2_LO_F64
    return (r * r * _horner(r, _EXP_F64) + r + _ONE_F64) * _pow2_f64(k)


@_scalar_function
def tanh_f32(x):
    """tanh(x) in float32; max error 2.42 ulp (every float32 input), at |x| near 0.0078.

    With E = expm1(2|x|): tanh|x| = E / (E + 2), one path for every x. E is exp's reduction
    2|x| = n ln2 + r with an expm1 polynomial for r (|r| <= ln2/2) and E = 2**n * expm1(r) +
    (2**n - 1), which cannot cancel for 2|x| >= 0 (both terms >= 0 for n >= 1, E = expm1(r)
    at n = 0), so small x keep their relative accuracy without a polynomial of their own; most
    of the error is the rounding of E + 2 there. |x| is clamped at 9.1 (tanh rounds to 1
    beyond 9.01). tanh(+-inf) = +-1, tanh(+-0) = +-0, subnormals pass through (E / 2), NaN
    gives NaN: the clamp's comparison fails and keeps it, and the arithmetic carries it.

    Generated loops are instruction-bound on it (per element every operation runs, and each
    constant a 256-bit loop cannot keep in its 16 registers is loaded again): the earlier
    tanh_f32 (a degree-5 polynomial in x**2 below |x| = 0.7 and 1 - 2e / (1 + e), e =
    exp(-2|x|), above, both evaluated and one selected; 1.29 ulp) took 74 instructions per
    8 elements; this one takes 50. A loop of tanh(x + b) over 256 x 128 float32, thread CPU,
    one Zen 4 core: 30.0 -> 21.6 us compiled for AVX2, 15.7 -> 10.6 us for AVX-512. XLA's
    float32 tanh (JAX 0.10.2 on the CPU: Eigen's rational function, as our tanh_rational_f32)
    is off by up to 4.90 ulp by the same count, NumPy 2.4.6's by 1.37, PyTorch 2.14's by 0.51
    (every float32 in [0, 10], `python -m backplan.bench.tanh_ulps`).

    The policy (docs/ops.md, "How accurate float32 functions are"): at most 2.5 ulp
    (tests/test_mathlib.py), and every compiled form of a float32 tanh (loops run by address
    or inlined in a driver, GEMM epilogues, 16-bit saved copies' sources) is this function bit
    for bit (tests/test_tanh_paths.py).
    """
    magnitude = abs(x)
    m = _TANH_CLAMP_F32 if magnitude > _TANH_CLAMP_F32 else magnitude  # NaN fails, stays
    n, k = _round_f32(m * _TWO_LOG2E_F32)
    r = (m + m) - n * _LN2_HI_F32
    r = r - n * _LN2_LO_F32
    scale = _pow2_f32(k)
    e = scale * (r * r * _horner(r, _EXPM1_F32) + r) + (scale - _ONE_F32)
    return math.copysign(e / (e + _TWO_F32), x)


# tanh(x) = x * P(x**2) / Q(x**2) on |x| <= 7.9053 (Eigen's float tanh); beyond, +-1.
_TANH_RATIONAL_P = _f32(
    4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
    -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16,
)  # fmt: skip
_TANH_RATIONAL_Q = _f32(
    4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06,
)  # fmt: skip
_TANH_RATIONAL_CLAMP = np.float32(7.90531110763549805)
_TANH_RATIONAL_TINY = np.float32(2.0**-12)  # below, tanh(x) rounds to x (x**3 / 3 < ulp / 2)


@_scalar_function
def tanh_rational_f32(x):
    """tanh(x) in float32 for results stored in 16 bits; max relative error 2.95e-7 (4.95
    float32 ulps of the correctly rounded result, bench.tanh_ulps; bfloat16's half ulp is
    2e-3, float16's 4.9e-4), measured on every float32.

    One rational function of the clamped x (degree 13 over degree 6, one division), where
    tanh_f32 evaluates an exp and a division: a bfloat16 ln_gelu loop (forward and backward
    fused) took 1.09-1.10x the float32 loop's thread CPU time with tanh_f32 (then a
    polynomial and the exp form, both evaluated), 0.72-0.74x with this (4096 x 1024, one Zen 4
    core, 15 interleaved rounds); the bf16 ln_gelu step 0.82x -> 0.76x the float32 step's
    process CPU time. Loops call it only where the IR rounds tanh's result to 16 bits
    (codegen/render/loops.py), so a float32 result keeps tanh_f32's 2.42 ulp. Beyond the clamp
    +-1; below 2**-12 x itself (p / q = 0.99999987 at 0 took the smallest normal bfloat16
    below float32's normal range, where VCVTNEPS2BF16 stores zero); NaN gives NaN.
    """
    clamped = min(max(x, -_TANH_RATIONAL_CLAMP), _TANH_RATIONAL_CLAMP)
    z = clamped * clamped
    y = clamped * (_horner(z, _TANH_RATIONAL_P) / _horner(z, _TANH_RATIONAL_Q))
    y = math.copysign(_ONE_F32, x) if abs(x) > _TANH_RATIONAL_CLAMP else y
    return y if abs(x) >= _TANH_RATIONAL_TINY else x  # NaN too


@_scalar_function
def tanh_f64(x):
    """tanh(x) in float64; max error 1.29 ulp (12M inputs). |x| < 0.7: x + x**3 * P(x**2);
    otherwise 1 - 2e / (1 + e), e = exp(-2|x|); both evaluated, one selected (NaN fails the
    comparison and takes the polynomial, which carries it). Special values as tanh_f32."""
    magnitude = abs(x)
    z = x * x
    small = magnitude * z * _horner(z, _TANH_F64) + magnitude
    e = _exp_nonpositive_f64(-_TWO_F64 * magnitude)
    large = _ONE_F64 - _TWO_F64 * e / (_ONE_F64 + e)
    return math.copysign(large if magnitude >= _TANH_SWITCH_F64 else small, x)


@_scalar_function
def sigmoid_f32(x):
    """1 / (1 + e**-x) in float32; max error 2.40 ulp (every float32 input).

    With e = exp(-|x|): 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, so the tail for
    x < 0 stays accurate down to subnormals. sigmoid(-inf) = 0, sigmoid(inf) = 1, NaN gives NaN.
    """
    e = exp_f32(-abs(x))
    y = (_ONE_F32 if x >= _ZERO_F32 else e) / (_ONE_F32 + e)
    return y if x == x else x


@_scalar_function
def sigmoid_f64(x):
    """1 / (1 + e**-x) in float64; max error 2.28 ulp (12M inputs). Specials as sigmoid_f32."""
    e = exp_f64(-abs(x))
    y = (_ONE_F64 if x >= _ZERO_F64 else e) / (_ONE_F64 + e)
    return y if x == x else x


@_scalar_function
def log_f32(x):
    """Natural log in float32; max error 0.87 ulp (every float32 input, subnormals included).

    log(0) = -inf, log(x < 0) = NaN, log(inf) = inf, NaN gives NaN.
    """
    subnormal = x < _MIN_NORMAL_F32
    scaled = x * _TWO_POW_23_F32 if subnormal else x
    offset = _bits_f32(scaled) - _SQRT_HALF_BITS_F32
    exponent = (offset >> 23) - (23 if subnormal else 0)
    f = _from_bits_f32((offset & 0x007FFFFF) + _SQRT_HALF_BITS_F32) - _ONE_F32
    k = _int_to_float_f32(exponent)
    y = f * f * f * _horner(f, _LOG_F32) - _HALF_F32 * f * f + f
    y = k * _LN2_LO_F32 + y
    y = k * _LN2_HI_F32 + y
    return _log_special_values_f32(x, y)


@_scalar_function
def _log_special_values_f32(x, y):
    """log at 0, below 0, at inf and at NaN, where the bit arithmetic gives garbage."""
    y = -_INF_F32 if x == _ZERO_F32 else y
    y = _NAN_F32 if x < _ZERO_F32 else y
    return y if x < _INF_F32 else x


@_scalar_function
def log_f64(x):
    """Natural log in float64; max error 0.84 ulp (18M inputs). Special values as log_f32.

    With f = m - 1 for the mantissa m in [sqrt(1/2), sqrt(2)) and s = f / (2 + f):
    log(1 + f) = f - (f**2/2 - s * (f**2/2 + R(s**2))), summed so no step cancels.
    """
    subnormal = x < _MIN_NORMAL_F64
    scaled = x * _TWO_POW_54_F64 if subnormal else x
    offset = _bits_f64(scaled) - _SQRT_HALF_BITS_F64
    exponent = (offset >> 52) - (54 if subnormal else 0)
    f = _from_bits_f64((offset & 0x000FFFFFFFFFFFFF) + _SQRT_HALF_BITS_F64) - _ONE_F64
    k = _int_to_float_f64(exponent)
    s = f / (_TWO_F64 + f)
    z = s * s
    r = z * _horner(z, _LOG_F64)
    half_f2 = _HALF_F64 * f * f
    y = k * _LN2_HI_F64 - ((half_f2 - (s * (half_f2 + r) + k * _LN2_LO_F64)) - f)
    return _log_special_values_f64(x, y)


@_scalar_function
def _log_special_values_f64(x, y):
    """log at 0, below 0, at inf and at NaN, where the bit arithmetic gives garbage."""
    y = -_INF_F64 if x == _ZERO_F64 else y
    y = _NAN_F64 if x < _ZERO_F64 else y
    return y if x < _INF_F64 else x


@_scalar_function
def erf_f32(x):
    """erf(x) in float32; max error 1.00 ulp (every float32 input).

    |x| < 1: x + x * P(x**2), so x itself is never rounded. Otherwise 1 - erfc(|x|) with
    erfc(t) = exp(-t**2 + G(t)), G a polynomial fit of log(erfcx). Both halves are computed
    and one is selected.
    erf(+-inf) = +-1, erf(+-0) = +-0, NaN gives NaN.
    """
    magnitude = abs(x)
    small = magnitude * _horner(x * x, _ERF_SMALL_F32) + magnitude
    t = min(magnitude, _ERF_TAIL_END_F32)
    log_erfc = _horner(t - _ERF_TAIL_CENTRE_F32, _ERF_TAIL_F32) - t * t
    large = _ONE_F32 - _exp_nonpositive_f32(log_erfc)
    return math.copysign(large if magnitude >= _ONE_F32 else small, x)  # NaN: small


@_scalar_function
def erf_f64(x):
    """erf(x) in float64; max error 1.26 ulp (200k inputs against mpmath). Method as erf_f32."""
    magnitude = abs(x)
    small = magnitude * _horner(x * x, _ERF_SMALL_F64) + magnitude
    t = min(magnitude, _ERF_TAIL_END_F64)
    log_erfc = _horner(t - _ERF_TAIL_CENTRE_F64, _ERF_TAIL_F64) - t * t
    large = _ONE_F64 - _exp_nonpositive_f64(log_erfc)
    return math.copysign(large if magnitude >= _ONE_F64 else small, x)  # NaN: small


FUNCTIONS = {
    (op, dtype): f"{op}_{dtype}"
    for op in ("exp", "log", "tanh", "sigmoid", "erf")
    for dtype in ("f32", "f64")
}
"""(IR op name, IR dtype name) -> name of the function in this module that computes it."""

COST_NOTES = {
    ("exp", "f32"): "~20 vector ops: 2-FMA reduction, degree-4 polynomial, bit tricks; 0.15 ns",
    ("exp", "f64"): "~25 vector ops, as exp_f32 with a degree-9 polynomial; 0.4 ns",
    ("log", "f32"): "~30 vector ops: bit-trick exponent split, degree-7 polynomial; 0.35 ns",
    ("log", "f64"): "~30 vector ops and one division, degree-6 polynomial; 0.55 ns",
    ("tanh", "f32"): "expm1 (degree-7 polynomial) + one division, one path; ~0.17 ns",
    ("tanh", "f64"): "exp + one division + degree-12 polynomial, both evaluated; 0.8 ns",
    ("sigmoid", "f32"): "exp + one division; 0.2 ns",
    ("sigmoid", "f64"): "exp + one division; 0.5 ns",
    ("erf", "f32"): "exp + two degree-6 polynomials, both evaluated; 0.4 ns",
    ("erf", "f64"): "exp + degree-11 and degree-17 polynomials, both evaluated; 1.6 ns",
}
"""What each function costs. The times are per element of a single-threaded AVX-512 loop with
data in cache (Zen 5, `python -m backplan.bench.mathlib`); a loop that streams 16M
float32 elements from memory costs about 0.2 ns per element for the traffic alone."""
