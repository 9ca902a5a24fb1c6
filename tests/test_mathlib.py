"""mathlib: accuracy in ulp against correctly rounded references, special values, and that a
loop calling the functions compiles to vector code inside a fastmath=True kernel."""

import re

import numba
import numpy as np
import pytest
from scipy import special

from backplan.codegen.kernels import mathlib
from backplan.ir.registry import all_ops
from backplan.ir.types import FLOAT_DTYPES

DTYPES = {"f32": np.float32, "f64": np.float64}
# Largest error allowed, in ulp of the correctly rounded result (measured maxima are in the
# functions' docstrings; the bounds leave a little room).
MAX_ULP = {"exp": 1.5, "log": 1.5, "tanh": 2.0, "sigmoid": 3.0, "erf": 1.5}
# float32 tanh: one expm1 path, 2.42 ulp measured over every float32 (JAX's is 4.90 ulp)
MAX_ULP_F32 = {**MAX_ULP, "tanh": 2.5}
LONG_DOUBLE_IS_WIDER = np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant
_kernels = {}


def kernel_for(op, dtype):
    """A fastmath=True elementwise loop over one mathlib function, as generated code has.

    Not disk-cached: Numba's cache would not notice edits to mathlib.py and tests would run
    stale code. Compiling all ten takes a few seconds.
    """
    if (op, dtype) not in _kernels:
        function = getattr(mathlib, mathlib.FUNCTIONS[(op, dtype)])

        @numba.njit(fastmath=True, error_model="numpy")
        def kernel(x, out):
            for i in range(x.size):
                out[i] = function(x[i])

        _kernels[(op, dtype)] = kernel
    return _kernels[(op, dtype)]


def apply(op, dtype, values):
    x = np.asarray(values, dtype=DTYPES[dtype])
    out = np.empty_like(x)
    kernel_for(op, dtype)(x, out)
    return out


def ulp_errors(result, exact, dtype):
    """|result - exact| in units of the spacing of `exact` rounded to `dtype`."""
    exact = np.asarray(exact)
    wide = np.longdouble if dtype == "f64" else np.float64
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = exact.astype(DTYPES[dtype])
        spacing = np.spacing(np.abs(rounded)).astype(wide)
        errors = np.abs(result.astype(wide) - exact.astype(wide)) / spacing
    same = (result == rounded) | (np.isnan(result) & np.isnan(rounded))
    return np.where(same, 0.0, errors).astype(np.float64)


def sweep_inputs(op, dtype, rng):
    """Dense sweep of the interesting range, random values, and values spread over all scales."""
    low, high = {
        "exp": (-110, 95) if dtype == "f32" else (-750, 712),
        "log": (0, 1e4),
        "tanh": (-12, 12) if dtype == "f32" else (-22, 22),
        "sigmoid": (-110, 40) if dtype == "f32" else (-750, 50),
        "erf": (-5, 5) if dtype == "f32" else (-7, 7),
    }[op]
    limit = 38 if dtype == "f32" else 308
    parts = [
        np.linspace(low, high, 200_001),
        rng.uniform(low, high, 50_000),
        np.linspace(-1, 1, 50_001),
        10.0 ** rng.uniform(-limit, limit, 50_000) * rng.choice([-1.0, 1.0], 50_000),
    ]
    x = np.concatenate(parts).astype(DTYPES[dtype])
    if op == "log":
        bits = np.int32 if dtype == "f32" else np.int64
        top = np.frombuffer(np.array([np.inf], DTYPES[dtype]).tobytes(), bits)[0]
        random_positive = rng.integers(1, top, 100_000, dtype=bits).view(DTYPES[dtype])
        x = np.concatenate([np.abs(x), random_positive, np.linspace(0.5, 2, 50_001)])
    x = x.astype(DTYPES[dtype])
    return x[np.isfinite(x)]


def exact_values(op, dtype, x):
    """Reference results precise enough to round correctly to `dtype`.

    float32: the IR registry's NumPy/SciPy reference evaluated in float64. float64: the same
    formulas in 80-bit long double (erf is checked separately against mpmath).
    """
    if dtype == "f32":
        with np.errstate(all="ignore"):
            return all_ops()[op].reference(x.astype(np.float64))
    wide = x.astype(np.longdouble)
    with np.errstate(all="ignore"):
        if op == "sigmoid":
            e = np.exp(-np.abs(wide))
            return np.where(wide >= 0, 1 / (1 + e), e / (1 + e))
        return {"exp": np.exp, "log": np.log, "tanh": np.tanh}[op](wide)


def test_table_covers_every_float_dtype_of_registered_elementwise_ops():
    ops = all_ops()
    for op, dtype in mathlib.FUNCTIONS:
        assert ops[op].fusion == "elementwise" and dtype in FLOAT_DTYPES
        assert isinstance(
            getattr(mathlib, mathlib.FUNCTIONS[(op, dtype)]), numba.core.registry.CPUDispatcher
        )
    assert {op for op, _ in mathlib.FUNCTIONS} == {"exp", "log", "tanh", "sigmoid", "erf"}
    # 16-bit floats are widened to float32 before any loop computes (ir/widen.py), so the
    # table has the two arithmetic dtypes, every storage dtype reaching it through float32
    assert {dtype for _, dtype in mathlib.FUNCTIONS} == {"f32", "f64"} <= set(FLOAT_DTYPES)
    assert set(mathlib.COST_NOTES) == set(mathlib.FUNCTIONS)


@pytest.mark.parametrize("op", ["exp", "log", "tanh", "sigmoid", "erf"])
def test_float32_within_bound_of_correctly_rounded(op):
    x = sweep_inputs(op, "f32", np.random.default_rng(0))
    errors = ulp_errors(apply(op, "f32", x), exact_values(op, "f32", x), "f32")
    worst = int(np.argmax(errors))
    assert errors[worst] <= MAX_ULP_F32[op], f"{op}_f32({x[worst]!r}): {errors[worst]:.2f} ulp"


@pytest.mark.skipif(not LONG_DOUBLE_IS_WIDER, reason="long double is no wider than float64 here")
@pytest.mark.parametrize("op", ["exp", "log", "tanh", "sigmoid"])
def test_float64_within_bound_of_correctly_rounded(op):
    x = sweep_inputs(op, "f64", np.random.default_rng(1))
    errors = ulp_errors(apply(op, "f64", x), exact_values(op, "f64", x), "f64")
    worst = int(np.argmax(errors))
    assert errors[worst] <= MAX_ULP[op], f"{op}_f64({x[worst]!r}): {errors[worst]:.2f} ulp"


def test_erf_float64_within_bound_of_mpmath():
    mpmath = pytest.importorskip("mpmath")
    rng = np.random.default_rng(2)
    x = np.concatenate([np.linspace(-6.5, 6.5, 1_301), rng.uniform(0.9, 1.1, 200), [1e-300]])
    with mpmath.workdps(40):
        exact = np.array([mpmath.erf(mpmath.mpf(float(v))) for v in x], dtype=object)
    exact_long = np.array([np.longdouble(mpmath.nstr(v, 25)) for v in exact])
    errors = ulp_errors(apply("erf", "f64", x), exact_long, "f64")
    worst = int(np.argmax(errors))
    assert errors[worst] <= MAX_ULP["erf"], f"erf_f64({x[worst]!r}): {errors[worst]:.2f} ulp"


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_erf_close_to_scipy(dtype):
    x = sweep_inputs("erf", dtype, np.random.default_rng(3))
    ours = apply("erf", dtype, x)
    # SciPy's own float64 erf is off by up to about 2.6 ulp.
    assert np.max(ulp_errors(ours, special.erf(x), dtype)) <= 4.0


NAN, INF = np.nan, np.inf
SPECIAL_VALUES = [
    ("exp", [-INF, INF, 0.0, -0.0, 1e4, -1e4, NAN], [0.0, INF, 1.0, 1.0, INF, 0.0, NAN]),
    ("log", [0.0, -0.0, -1.0, -INF, INF, 1.0, NAN], [-INF, -INF, NAN, NAN, INF, 0.0, NAN]),
    ("tanh", [INF, -INF, 0.0, -0.0, 1e4, -1e4, NAN], [1.0, -1.0, 0.0, -0.0, 1.0, -1.0, NAN]),
    ("sigmoid", [INF, -INF, 0.0, -0.0, 1e4, -1e4, NAN], [1.0, 0.0, 0.5, 0.5, 1.0, 0.0, NAN]),
    ("erf", [INF, -INF, 0.0, -0.0, 1e4, -1e4, NAN], [1.0, -1.0, 0.0, -0.0, 1.0, -1.0, NAN]),
]


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize(("op", "inputs", "expected"), SPECIAL_VALUES)
def test_special_values_in_vector_body_and_remainder(op, inputs, expected, dtype):
    # 67 copies: most elements go through the vector loop body, the last few through the
    # scalar remainder loop, and both must give the same exact special results.
    x = np.tile(np.array(inputs, DTYPES[dtype]), 67)
    result = apply(op, dtype, x).reshape(67, -1)
    for column, want in enumerate(expected):
        got = result[:, column]
        if np.isnan(want):
            assert np.isnan(got).all(), f"{op}_{dtype}({inputs[column]}) gave {got[~np.isnan(got)]}"
        else:
            assert (got == want).all(), f"{op}_{dtype}({inputs[column]}) gave {got}, want {want}"
            assert (np.signbit(got) == np.signbit(want)).all(), f"{op}_{dtype}: sign of zero"


_QUIET_NANS = {  # quiet NaNs of both signs, with and without a payload
    "f32": np.array([0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFD00001], np.uint32),
    "f64": np.array([0x7FF8 << 48, 0xFFF8 << 48, (0x7FF8 << 48) | 12345, 0xFFF9 << 48], np.uint64),
}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("op", ["tanh", "erf"])
def test_quiet_nan_passes_through_with_generated_code_flags(op, dtype):
    # tanh and erf select between two halves and let the polynomial half carry a NaN (no
    # select of its own): under the flags generated kernels use (NaN kept, not fastmath=True),
    # a quiet NaN comes back bit for bit, sign and payload, in the vector body and the rest.
    from backplan.codegen.flags import FASTMATH

    function = getattr(mathlib, mathlib.FUNCTIONS[(op, dtype)])

    @numba.njit(fastmath=FASTMATH, error_model="numpy")
    def kernel(x, out):
        for i in range(x.size):
            out[i] = function(x[i])

    bits = np.tile(_QUIET_NANS[dtype], 67)
    x = np.concatenate([bits.view(DTYPES[dtype]), np.array([0.5, 3.0, -0.5, -3.0], DTYPES[dtype])])
    out = np.empty_like(x)
    kernel(x, out)
    assert (out[: bits.size].view(bits.dtype) == bits).all(), f"{op}_{dtype} changed a NaN"
    want = np.tanh(x[bits.size :]) if op == "tanh" else special.erf(x[bits.size :])
    assert np.max(ulp_errors(out[bits.size :], want.astype(np.float64), dtype)) <= 4.0


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_subnormals_in_and_out(dtype):
    info = np.finfo(DTYPES[dtype])
    tiny = np.array([info.smallest_subnormal, 3 * info.smallest_subnormal, info.tiny / 3])
    tiny = np.concatenate([tiny, -tiny]).astype(DTYPES[dtype])
    assert (apply("tanh", dtype, tiny) == tiny).all()
    erf_exact = exact_values("erf", "f32", tiny) if dtype == "f32" else tiny * (2 / np.sqrt(np.pi))
    assert np.max(np.abs(apply("erf", dtype, tiny) - erf_exact) / info.smallest_subnormal) <= 1
    positive = tiny[:3]
    assert (
        np.max(
            ulp_errors(apply("log", dtype, positive), np.log(positive.astype(np.longdouble)), dtype)
        )
        <= 1
    )
    # exp and sigmoid results that are themselves subnormal: correct to a subnormal ulp.
    x = np.linspace(-103, -87.5, 301) if dtype == "f32" else np.linspace(-744, -708.5, 301)
    x = x.astype(DTYPES[dtype])
    exact = np.exp(x.astype(np.longdouble))
    for op in ("exp", "sigmoid"):
        error = np.abs(apply(op, dtype, x) - exact) / info.smallest_subnormal
        assert np.max(error) <= 1, f"{op}_{dtype} subnormal results off by {np.max(error)}"


GELU_K, GELU_C = 0.7978845608028654, 0.044715


@numba.njit(fastmath=True, error_model="numpy")
def fused_gelu_f32(x, tanh_form, erf_form):
    k, c, half, one = np.float32(GELU_K), np.float32(GELU_C), np.float32(0.5), np.float32(1)
    inv_sqrt2 = np.float32(0.7071067811865476)
    total = np.float32(0)
    for i in range(x.size):
        v = x[i]
        tanh_form[i] = half * v * (one + mathlib.tanh_f32(k * (v + c * v * v * v)))
        erf_form[i] = half * v * (one + mathlib.erf_f32(v * inv_sqrt2))
        total += tanh_form[i]
    return total


def test_fused_kernel_matches_registry_reference():
    x = np.random.default_rng(4).standard_normal(100_003).astype(np.float32) * 4
    tanh_form, erf_form = np.empty_like(x), np.empty_like(x)
    total = fused_gelu_f32(x, tanh_form, erf_form)
    gelu = all_ops()["gelu"].reference
    for ours, approximate in ((tanh_form, "tanh"), (erf_form, "none")):
        want = gelu(x.astype(np.float64), approximate=approximate)
        # float32 rounding of the argument and of 1 + tanh (or erf) near -1, scaled by |x|/2.
        allowed = 1e-6 * np.abs(want) + 2e-7 * np.abs(x)
        assert np.all(np.abs(ours - want) <= allowed), approximate
    assert abs(total - tanh_form.astype(np.float64).sum()) <= 1e-4 * np.abs(tanh_form).sum()


@pytest.mark.parametrize(("op", "dtype"), sorted(mathlib.FUNCTIONS))
def test_loop_vectorises_without_libm_calls(op, dtype):
    kernel = kernel_for(op, dtype)
    apply(op, dtype, [0.5])
    llvm = kernel.inspect_llvm(kernel.signatures[0])
    element = "float" if dtype == "f32" else "double"
    assert re.search(rf"<\d+ x {element}>", llvm), f"{op}_{dtype}: loop did not vectorise"
    calls = re.findall(r"call [^\n]*?@([\w.]+)\(", llvm)
    libm = re.compile(r"(llvm\.)?(exp|exp2|expm1|log|log1p|tanh|erf)(f|\..*)?$")
    not_inlined = [name for name in calls if libm.match(name) or "codegen7mathlib" in name]
    assert not not_inlined, f"{op}_{dtype}: scalar calls left in the loop: {not_inlined}"
    if dtype == "f32":
        assert not re.search(r"\bf(add|sub|mul|div) [^\n]*double", llvm), f"{op}_f32 uses float64"
