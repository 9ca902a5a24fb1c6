"""Saved buffers kept in bfloat16: value_and_grad(saved_dtype=...), and the memory planner's
lever (allow_saved_dtype=...: a budget met by 16-bit saved buffers instead of recomputing)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

BF16 = np.dtype(ml_dtypes.bfloat16)


def _chain(x, w):
    """Each tanh's output is read by its derivative: six f32[64,256] values held. The loss is
    the sum times the mean, so the gradient part runs after the whole forward (it reads that
    sum) and the compiled plan stores what it holds; the gradient of h.sum() alone fuses with
    the forward into one loop storing nothing, which saved_dtype leaves in full precision
    (test_values_the_compiled_plan_never_stores_stay_in_full_precision)."""
    h = x * w
    for _ in range(6):
        h = bp.tanh(h * 1.5)
    total = h.sum()
    return total * total * (1.0 / (64 * 256))


def _arguments():
    rng = np.random.default_rng(7)
    x = bp.tensor(rng.standard_normal((64, 256)).astype(np.float32))
    w = bp.tensor(rng.standard_normal(256).astype(np.float32))
    return x, w


def _computed_saved(report) -> list:
    return [s for s in report.saved_buffers if not s.is_region_input]


def test_value_and_grad_keeps_what_its_gradient_part_reads_in_bfloat16():
    x, w = _arguments()
    full = bp.value_and_grad(_chain, argnums=(0, 1))
    narrow = bp.value_and_grad(_chain, argnums=(0, 1), saved_dtype=bp.bfloat16)
    full_saved = _computed_saved(full.explain(x, w))
    narrow_saved = _computed_saved(narrow.explain(x, w))
    assert {s.dtype for s in full_saved} == {np.dtype(np.float32)}
    assert {s.dtype for s in narrow_saved} == {BF16}
    assert sum(s.nbytes for s in narrow_saved) * 2 == sum(s.nbytes for s in full_saved)
    assert all("saved_dtype" in s.reason for s in narrow_saved)
    assert all("tanh derivative" in s.reason for s in narrow_saved if s.nbytes > 2)
    (v_full, g_full), (v_narrow, g_narrow) = full(x, w), narrow(x, w)
    assert v_full.numpy() == v_narrow.numpy()  # the forward itself is not rounded
    for a, b in zip(g_full, g_narrow, strict=True):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=5e-2, atol=5e-2)
        assert not np.array_equal(a.numpy(), b.numpy())  # it did read rounded values
    text = str(narrow.explain(x, w))
    assert "kept in bfloat16 (saved_dtype)" in text


@pytest.mark.parametrize("kind", ["compile", "value_and_grad"])
def test_planner_chooses_bfloat16_saved_buffers_only_when_the_budget_needs_them(kind):
    x, w = _arguments()
    x.requires_grad = True

    def make(**options):
        if kind == "compile":
            return bp.compile(_chain, **options)
        return bp.value_and_grad(_chain, argnums=(0, 1), **options)

    full = make().explain(x, w)
    narrow = make(saved_dtype=bp.bfloat16).explain(x, w)
    assert narrow.peak_bytes < full.peak_bytes
    # a budget the default plan meets: full precision
    roomy = make(max_peak_bytes=full.peak_bytes, allow_saved_dtype=bp.bfloat16).explain(x, w)
    assert {s.dtype for s in _computed_saved(roomy)} == {np.dtype(np.float32)}
    assert "kept so" in roomy.saved_dtype_note
    # one only bfloat16 saved buffers meet without recomputing: the planner takes them
    tight = make(max_peak_bytes=narrow.peak_bytes, allow_saved_dtype=bp.bfloat16).explain(x, w)
    assert {s.dtype for s in _computed_saved(tight)} == {BF16}
    assert tight.peak_bytes == narrow.peak_bytes and not tight.recomputed
    assert "memory planner chose it to fit max_peak_bytes" in str(tight)
    # without the allowance the same budget recomputes, or is refused and names the lever
    try:
        plain = make(max_peak_bytes=narrow.peak_bytes).explain(x, w)
    except bp.MemoryBudgetError as error:
        assert "allow_saved_dtype=bp.bfloat16" in str(error)
    else:
        assert {s.dtype for s in _computed_saved(plain)} == {np.dtype(np.float32)}


def test_the_frontier_lists_bfloat16_plans_as_rounding_rows_a_budget_runs():
    x, w = _arguments()

    def make(**options):
        return bp.value_and_grad(_chain, argnums=(0, 1), **options)

    plain = make().memory_frontier(x, w)
    front = make(allow_saved_dtype=bp.bfloat16).memory_frontier(x, w)
    assert not any(p.rounds for p in plain.points)
    rounding = [p for p in front.points if p.rounds]
    assert rounding and {p.saved_dtype for p in rounding} == {"bfloat16"}
    assert front.points[0] == plain.points[0]  # the default plan, full precision, first
    assert rounding[0].added_flops == 0  # no recomputation: half the saved bytes
    assert 2 * rounding[0].saved_bytes == front.points[0].saved_bytes
    assert rounding[-1].peak_bytes < plain.points[-1].peak_bytes
    peaks = [p.peak_bytes for p in front.points]
    flops = [p.added_flops for p in front.points]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert flops == sorted(flops)
    assert "bfloat16 (rounds)" in str(front) and "as computed" in str(front)
    value, grads = make()(x, w)
    for point in front.points:  # each row is the plan its peak, as a budget, runs
        budgeted = make(max_peak_bytes=point.peak_bytes, allow_saved_dtype=bp.bfloat16)
        report = budgeted.explain(x, w)
        assert report.peak_bytes == point.peak_bytes
        kept_as = BF16 if point.rounds else np.dtype(np.float32)
        assert {s.dtype for s in _computed_saved(report)} == {kept_as}
        v, g = budgeted(x, w)
        assert v.numpy() == value.numpy()
        tolerance = 5e-2 if point.rounds else 1e-5
        for a, b in zip(grads, g, strict=True):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=tolerance, atol=tolerance)


def test_saved_dtype_and_allow_saved_dtype_exclude_each_other():
    with pytest.raises(ValueError, match="not both"):
        bp.value_and_grad(_chain, saved_dtype=bp.bfloat16, allow_saved_dtype=bp.bfloat16)
    with pytest.raises(ValueError, match="float dtype"):
        bp.compile(_chain, allow_saved_dtype=np.int32)


def _layers(params, x):
    for w in params:
        x = bp.tanh(x @ w)
    return (x * x).mean()


def test_compiled_joint_plan_stores_and_reads_back_the_bfloat16_copies():
    """Fusion must not read the float32 value back in place of its 16-bit copy (which would
    hold the wide value across, unrounded); one scratch arena holds both dtypes."""
    from backplan.ir.lowering import lower
    from backplan.runtime.backend import use_backend

    rng = np.random.default_rng(3)
    # 64 wide, 1,024 rows: narrower, a 16-wide step's bfloat16 copies saved less than the GEMM
    # reading them packs (a whole 32-column panel, codegen/kernels/gemm/packing.py), so its
    # plan kept full precision
    params = [rng.standard_normal((64, 64)).astype(np.float32) * 0.2 for _ in range(3)]
    x = rng.standard_normal((1024, 64)).astype(np.float32)
    grads = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            for dtype in (None, bp.bfloat16):
                step = bp.value_and_grad(_layers, saved_dtype=dtype)
                grads[backend, dtype] = [g.numpy() for g in step(params, x)[1]]
    entry = step.lookup((params, x), {}, count_hit=False)[1]
    assert lower(entry.plan).layout.scratch_elements.get("bf16", 0) >= 2 * 1024 * 64
    for got, want in zip(grads["numba", bp.bfloat16], grads["reference", bp.bfloat16], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(grads["numba", bp.bfloat16][0], grads["numba", None][0], atol=1e-6)


def test_a_float64_step_stores_and_reads_back_its_float32_saved_copies():
    """saved_dtype=float32 on a float64 step: the compiled plan stores each float32 copy and
    its backward reads it (as the reference interpreter does), rather than recomputing the cast,
    and with it the tanh before it, from float64 values held across to the backward (which
    read them unrounded and peaked above the full-precision plan)."""
    from backplan.ir.lowering import lower

    rng = np.random.default_rng(3)
    params = [rng.standard_normal((16, 16)) * 0.5 for _ in range(3)]
    x = rng.standard_normal((32, 16))
    grads = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            for dtype in (None, bp.float32):
                step = bp.value_and_grad(_layers, saved_dtype=dtype)
                grads[backend, dtype] = [g.numpy() for g in step(params, x)[1]]
    entry = step.lookup((params, x), {}, count_hit=False)[1]
    assert lower(entry.plan).layout.scratch_elements.get("f32", 0) >= 2 * 32 * 16
    for got, want in zip(grads["numba", bp.float32], grads["reference", bp.float32], strict=True):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    narrowed, full = grads["numba", bp.float32][0], grads["numba", None][0]
    assert not np.allclose(narrowed, full, rtol=0, atol=1e-12)


def test_a_float64_step_widens_its_bfloat16_saved_copies_in_the_backward():
    """saved_dtype=bfloat16 on a float64 step reads each copy back through float32: that
    widening is the backward's, not computed beside the rounding in the forward's GEMM epilogue
    (which held a float64 copy of each saved value across: a 4-layer tanh MLP of 512 rows
    peaked at 10.9 MB against 9.07 in full precision, now 8.82)."""
    from backplan.ir.lowering import lower

    rng = np.random.default_rng(5)
    shapes = [(64, 128), (128, 128), (128, 128)]
    params = [rng.standard_normal(shape) * 0.3 for shape in shapes]
    x = rng.standard_normal((256, 64))
    step = bp.value_and_grad(_layers, saved_dtype=bp.bfloat16)
    got = [g.numpy() for g in step(params, x)[1]]
    plan = lower(step.lookup((params, x), {}, count_hit=False)[1].plan)
    rounded = 0
    for kernel in plan.kernels:
        computed = set(kernel.computed)
        for node in computed:
            if node.op == "astype" and node.dtype == "bf16":
                rounded += 1
                back = [n for n in computed if n.op == "astype" and n.inputs[0] is node]
                assert not back, f"kernel {kernel.kind} reads back the copy it rounds"
    assert rounded >= 2  # the last tanh, computed in the loop reading it, is never stored
    with use_backend("reference"):
        want = [g.numpy() for g in step(params, x)[1]]
    for ours, theirs in zip(got, want, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-14)


def _softmax_products(p, x):
    return bp.sum(bp.softmax(x @ p[0], axis=-1) * (x @ p[1]))


def test_allowing_bfloat16_never_refuses_a_saved_budget_full_precision_meets():
    """The narrowed default's low peak ends the narrowed chain early (every plan saving less
    peaks higher); below its end the full-precision chain still meets the budget."""
    rng = np.random.default_rng(0)
    p = [(rng.standard_normal((64, 64)) * 0.2).astype(np.float32) for _ in range(2)]
    x = rng.standard_normal((128, 64)).astype(np.float32)
    vg = bp.value_and_grad(_softmax_products)

    def step(p, x):
        return vg(p, x)

    with use_backend("numba"):  # the compiled plan's saved bytes (fused values not stored)
        full = bp.compile(step, saved_bytes_budget=1).explain(p, x)
        allowed = bp.compile(step, saved_bytes_budget=1, allow_saved_dtype=bp.bfloat16)
        report = allowed.explain(p, x)
        assert report.peak_bytes == full.peak_bytes  # the full-precision plan, as without allow
        assert report.saved_bytes - report.saved_input_bytes <= 1
        assert BF16 not in {s.dtype for s in report.saved_buffers}
        # the narrowed chain's default saves nothing in 16 bits here, and peaks within a few
        # rows' statistics of the plan recomputing everything (that one keeps softmax's row
        # statistics one row at a time: ir/row_local.py)
        narrowed = bp.compile(step, saved_bytes_budget=10**9, allow_saved_dtype=bp.bfloat16)
        assert narrowed.explain(p, x).peak_bytes <= full.peak_bytes + 2 * 128 * 4
        value, grads = allowed(p, x)
    ref_value, ref_grads = vg(p, x)  # the reference interpreter
    np.testing.assert_allclose(value.numpy(), ref_value.numpy(), rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-4, atol=1e-6)


def _half_arguments(dtype, layers: int = 3):
    """Layers 64 wide over 1,024 rows: where 16-bit saved copies lower the compiled peak, the
    GEMM's packing pages for the products reading them counted (a 16-wide step's packed more
    than they saved)."""
    rng = np.random.default_rng(11)
    params = [(rng.standard_normal((64, 64)) * 0.2).astype(dtype) for _ in range(layers)]
    return params, rng.standard_normal((1024, 64)).astype(dtype)


@pytest.mark.parametrize("asked", [bp.bfloat16, bp.float16])
@pytest.mark.parametrize("option", ["saved_dtype", "allow_saved_dtype"])
def test_a_16_bit_saved_dtype_on_a_float16_step_is_refused_with_the_dtype_pair(option, asked):
    """Nothing a float16 step holds gets narrower in a 2-byte dtype: the option is refused
    naming both dtypes and the way out, where it was silently ignored (allow_saved_dtype even
    said the plan 'fits its budget with its saved buffers in full precision')."""
    params, x = _half_arguments(np.float16)
    name = np.dtype(asked).name
    vg = bp.value_and_grad(_layers, **{option: asked})
    with pytest.raises(ValueError) as caught:
        vg.explain(params, x)
    text = str(caught.value)
    assert f"{option}=bp.{name} cannot narrow" in text
    assert "held for" not in text and "are float16 (2 bytes)" in text
    assert f"Drop {option}" in text and "float32 arrays" in text
    assert "_layers (test_saved_dtype.py:" in text  # the function and where it is defined
    xt = bp.tensor(x, requires_grad=True)
    with pytest.raises(ValueError, match=f"{option}=bp.{name} cannot narrow"):
        bp.compile(lambda x: _layers(params, x), **{option: asked})(xt)


def test_16_bit_saved_buffers_of_float32_and_float64_steps_are_still_taken():
    """The check refuses only what cannot narrow: bfloat16 on float64 and float16 on float32
    steps store their saved buffers in that dtype (explain lists them). Three layers: on two,
    a float64 step's bfloat16 copies do not lower the compiled peak (its GEMMs read float64
    copies of them), so saved_dtype keeps full precision there (and explain says so)."""
    for step, asked in ((np.float64, bp.bfloat16), (np.float32, bp.float16)):
        params, x = _half_arguments(step, layers=3)
        report = bp.value_and_grad(_layers, saved_dtype=asked).explain(params, x)
        assert np.dtype(asked) in {s.dtype for s in _computed_saved(report)}


def _four_layers(p, x):
    h = x
    for w in p[:3]:
        h = bp.tanh(h @ w)
    return bp.mean((h @ p[3]) ** 2)


def test_float32_saved_copies_of_a_float64_step_peak_no_higher_than_full_precision():
    """Each float32 copy's read-back to float64 is made in the backward loop beside its reader,
    not joined to an earlier layer's loop across the GEMMs between (which held its float64
    buffer over them: a 4-layer tanh MLP's arena 5.78 MB against 5.24 in full precision, so
    allow_saved_dtype never chose the narrower plan under max_peak_bytes)."""
    from backplan.ir.lowering import lower

    rng = np.random.default_rng(11)
    shapes = [(16, 64), (64, 64), (64, 64), (64, 4)]  # where the copies lower the peak, the
    params = [rng.standard_normal(shape) * 0.2 for shape in shapes]  # GEMMs' packing counted
    x = rng.standard_normal((1024, 16))
    arenas, peaks, grads = {}, {}, {}
    for dtype in (None, bp.float32):
        step = bp.value_and_grad(_four_layers, saved_dtype=dtype)
        arenas[dtype] = lower(step.lookup((params, x), {}, count_hit=False)[1].plan).layout
        peaks[dtype] = step.explain(params, x).peak_bytes
        grads[dtype] = [g.numpy() for g in step(params, x)[1]]
        with use_backend("reference"):
            want = [g.numpy() for g in step(params, x)[1]]
        for got, ref in zip(grads[dtype], want, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)
    assert arenas[bp.float32].scratch_elements.get("f32", 0) >= 3 * 1024 * 64  # copies kept
    assert arenas[bp.float32].scratch_bytes <= arenas[None].scratch_bytes
    assert peaks[bp.float32] <= peaks[None]
    assert not np.allclose(grads[bp.float32][0], grads[None][0], rtol=0, atol=1e-12)


def test_a_saved_dtype_plan_runs_narrowed_where_it_peaks_below_full_precision():
    """This 3-layer step's value_and_grad plans peak lower with either 16-bit dtype (the GEMMs
    read the copies as they are), and so do bp.compile's forward and backward() since they
    share one scratch arena (runtime/program.py): both keep their saved buffers narrow. While
    the forward's arena was held through backward(), the float32 activations leaving the saved
    buffers for it made the compiled plans peak higher narrowed (1.14x before that was
    guarded), and full precision ran."""
    params, x = _half_arguments(np.float32)
    grads = [bp.tensor(w, requires_grad=True) for w in params]
    with use_backend("numba"):  # the compiled plans' peaks
        full = {
            "value_and_grad": bp.value_and_grad(_layers).explain(params, x).peak_bytes,
            "compile": bp.compile(_layers).explain(grads, x).peak_bytes,
        }
        reports = {
            (path, dtype): (
                bp.value_and_grad(_layers, saved_dtype=dtype).explain(params, x)
                if path == "value_and_grad"
                else bp.compile(_layers, saved_dtype=dtype).explain(grads, x)
            )
            for path in full
            for dtype in (bp.float16, bp.bfloat16)
        }
    for (path, dtype), report in reports.items():
        note, name = report.saved_dtype_note, np.dtype(dtype).name
        assert report.peak_bytes < full[path], path
        assert f"kept in {name} (saved_dtype)" in note and "stay in full" not in note
        assert BF16 not in {s.dtype for s in _computed_saved(report)} or dtype is bp.bfloat16
        if path == "compile":
            assert np.dtype(dtype) in {s.dtype for s in _computed_saved(report)}
