"""saved_dtype never raises the compiled step's peak: a value the compiled plan never stores (an
elementwise chain and its gradient fused into one loop) is left in full precision, and where
narrowing does not lower the peak the plan keeps full precision and explain says so with both
peaks. Each peak is the one the checked mode counts; values against the reference interpreter."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.ir.peak import joint_calls, predicted_peak
from backplan.runtime.backend import use_backend


def _chain(x, w):
    """Six tanh outputs read by their derivatives; the gradient of a plain sum needs nothing
    of the forward's result, so the compiled plan runs forward and gradient as one loop."""
    h = x * w
    for _ in range(6):
        h = bp.tanh(h * 1.5)
    return h.sum()


def _layers(params, x):
    for w in params:
        x = bp.tanh(x @ w)
    return (x * x).mean()


def _checked_step(fn, args, saved_dtype):
    """(explain's peak, its saved_dtype note, the gradients) of value_and_grad on the numba
    backend, the second call's counted peak checked equal to the predicted one."""
    step = bp.value_and_grad(fn, saved_dtype=saved_dtype)
    with use_backend("numba"), checked_memory():
        step(*args)
        with measure() as measured:
            _, grads = step(*args)
        plan = step.lookup(args, {}, count_hit=False)[1].plan
        assert measured.peak == predicted_peak(joint_calls(plan, 1), "numba").allocated_peak_bytes
        report = step.explain(*args)
    grads = [np.asarray(g) for g in grads] if isinstance(grads, list) else np.asarray(grads)
    return report.peak_bytes, report.saved_dtype_note, grads


@pytest.mark.parametrize(
    "dtype, asked", [(np.float32, bp.bfloat16), (np.float32, bp.float16), (np.float64, bp.float32)]
)
def test_values_the_compiled_plan_never_stores_stay_in_full_precision(dtype, asked):
    """Narrowed, the chain's casts split its one loop into a 2-stage row loop storing the
    16-bit copies: 248,840 B against 199,688 in full precision (64x256 float32)."""
    rng = np.random.default_rng(3)
    args = (rng.standard_normal((64, 256)).astype(dtype), rng.standard_normal(256).astype(dtype))
    full_peak, _, full_grads = _checked_step(_chain, args, None)
    peak, note, grads = _checked_step(_chain, args, asked)
    assert peak == full_peak
    np.testing.assert_array_equal(grads, full_grads)  # nothing was rounded
    name = np.dtype(asked).name
    assert f"saved_dtype={name}: the values the gradient part reads stay in full precision" in note
    higher = int(note.split("would peak ")[1].split(" B higher")[0].replace(",", ""))
    assert higher > 0
    with use_backend("reference"):
        _, want = bp.value_and_grad(_chain, saved_dtype=asked)(*args)
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(grads, np.asarray(want), rtol=tolerance, atol=tolerance)


def test_a_value_computed_in_the_loop_reading_it_stays_wide_beside_narrowed_ones():
    """Three float64 layers with bfloat16 saved buffers: the first two tanh outputs, which the
    GEMMs read, are stored in bfloat16; the last one, computed in the loop that reads it for
    the loss's gradient, stays float64 (narrowed too, it was a stored copy of its own)."""
    rng = np.random.default_rng(5)
    shapes = [(64, 128), (128, 128), (128, 128)]
    params = [rng.standard_normal(shape) * 0.3 for shape in shapes]
    x = rng.standard_normal((256, 64))
    full_peak, _, _ = _checked_step(_layers, (params, x), None)
    peak, note, grads = _checked_step(_layers, (params, x), bp.bfloat16)
    assert peak < full_peak
    assert "kept in bfloat16 (saved_dtype)" in note
    assert "1 of the 3 values the gradient part reads stay in full precision" in note
    with use_backend("reference"):
        _, want = bp.value_and_grad(_layers, saved_dtype=bp.bfloat16)(params, x)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-12, atol=1e-14)


def _compiled_step(params, x, saved_dtype):
    """(explain's peak, its note, the weights' gradients) of bp.compile(saved_dtype=...) +
    backward() on the numba backend, the second call's counted peak equal to the predicted."""
    from backplan.ir.peak import region_calls

    loss = bp.compile(_layers, saved_dtype=saved_dtype)
    weights = [bp.tensor(w, requires_grad=True) for w in params]
    with use_backend("numba"), checked_memory():
        loss(weights, x).backward()
        for w in weights:
            w.grad = None
        with measure() as measured:
            loss(weights, x).backward()
        plans = loss.trace(weights, x).program.plans
        assert measured.peak == predicted_peak(region_calls(plans), "numba").allocated_peak_bytes
        report = loss.explain(weights, x)
    return report.peak_bytes, report.saved_dtype_note, [w.grad.numpy() for w in weights]


def test_compiled_plans_narrow_where_the_shared_arena_makes_it_lower():
    """Three square float32 layers of 64, 128 rows: narrowed, bp.compile's two plans peaked
    at 311,304 B against 294,928 while the forward's arena was held through backward() (it
    took the float32 activations the saved buffers held), so full precision ran. The forward
    and backward() now share one arena (runtime/program.py): narrowed they peak lower, and
    run so, the gradients those of the reference interpreter's plan with the same copies
    (within one rounding of a saved value)."""
    rng = np.random.default_rng(4)
    params = [(rng.standard_normal((64, 64)) * 0.4).astype(np.float32) for _ in range(3)]
    # 1,024 rows: at 128 the GEMMs reading the 16-bit copies packed as much as they saved
    x = bp.tensor(rng.standard_normal((1024, 64)).astype(np.float32))  # not a copied argument
    full_peak, _, _ = _compiled_step(params, x, None)
    for asked in (bp.bfloat16, bp.float16):
        peak, note, grads = _compiled_step(params, x, asked)
        assert peak < full_peak
        assert f"kept in {np.dtype(asked).name} (saved_dtype)" in note
        assert "stay in full precision" not in note
        weights = [bp.tensor(w, requires_grad=True) for w in params]
        with use_backend("reference"):
            bp.compile(_layers, saved_dtype=asked)(weights, x).backward()
        for got, w in zip(grads, weights, strict=True):
            want = w.grad.numpy()  # a saved value on a rounding tie may round the other way
            np.testing.assert_allclose(got, want, rtol=0, atol=2**-8 * np.abs(want).max())
