"""Artifacts with a dynamic axis (artifacts/dynamic.py): exported once, loaded, run at three
batch sizes with the values of a plan traced for each size alone (the reference interpreter),
compiled code included; what they cannot take is refused by name."""

import ast
import re

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import kernel_cache
from backplan.runtime.backend import use_backend

RNG = np.random.default_rng(1)
W = bp.tensor(RNG.standard_normal((6, 4)).astype(np.float32), requires_grad=True)


def model(w, x):
    h = bp.tanh(x @ w) * 2.0
    return bp.mean(h.reshape(-1, 2)) + bp.sum(bp.softmax(h, axis=-1) * 3.0)


def expected(x):
    with use_backend("reference"):
        value, grad = bp.value_and_grad(model)(W, x)
    return value.numpy(), grad.numpy()


def test_a_dynamic_export_runs_three_batch_sizes_with_each_sizes_values(tmp_path):
    example = np.ones((5, 6), np.float32)
    dynamic = {"x": {0: "batch"}}
    forward = bp.load(
        bp.export(bp.compile(model), W, example, path=tmp_path / "f.bpz", dynamic=dynamic)
    )
    step = bp.load(
        bp.export(
            bp.value_and_grad(bp.compile(model)),
            W,
            example,
            path=tmp_path / "g.bpz",
            dynamic=dynamic,
        )
    )
    assert "x: f32[batch,6]" in forward.signature
    for n in (5, 8, 13):
        x = RNG.standard_normal((n, 6)).astype(np.float32)
        value, grad = expected(x)
        loss = forward(W, x)
        loss.backward()
        np.testing.assert_allclose(loss.numpy(), value, rtol=1e-5)
        np.testing.assert_allclose(W.grad.numpy(), grad, rtol=1e-4, atol=1e-6)
        W.grad = None
        with use_backend("numba"):
            got_value, got_grad = step(W, x)
        np.testing.assert_allclose(got_value.numpy(), value, rtol=1e-5)
        np.testing.assert_allclose(got_grad.numpy(), grad, rtol=1e-4, atol=1e-6)
        if n == 5:
            before = kernel_cache.counts()
    assert kernel_cache.counts().versions == before.versions  # sizes 8, 13: nothing compiled
    with pytest.raises(bp.ExportError, match=r"f32\[4, 7\]"):
        forward(W, np.ones((4, 7), np.float32))


@pytest.mark.reference
def test_a_dynamic_export_takes_sizes_0_and_1_with_the_compiled_functions_values(tmp_path):
    """Sizes 0 and 1 get plans of their own in the compiled function (a size-1 axis
    broadcasts); the artifact stores them, so one export serves every batch size."""
    example = np.ones((5, 6), np.float32)
    dynamic = {"x": {0: "batch"}}
    compiled = bp.compile(model, dynamic=dynamic)
    joint = bp.value_and_grad(compiled)
    forward = bp.load(bp.export(compiled, W, example, path=tmp_path / "f.bpz"))
    step = bp.load(bp.export(joint, W, example, path=tmp_path / "g.bpz"))
    for n in (0, 1, 2, 5):
        x = RNG.standard_normal((n, 6)).astype(np.float32)
        value, grad = joint(W, x)
        loss = forward(W, x)
        loss.backward()
        np.testing.assert_array_equal(loss.numpy(), compiled(W, x).numpy())
        np.testing.assert_array_equal(W.grad.numpy(), grad.numpy())
        W.grad = None
        got_value, got_grad = step(W, x)
        np.testing.assert_array_equal(got_value.numpy(), value.numpy())
        np.testing.assert_array_equal(got_grad.numpy(), grad.numpy())
    assert np.isnan(forward(W, np.ones((0, 6), np.float32)).item())  # a mean of no rows
    assert forward.cache_info().traces == step.cache_info().traces == 0


CORNERS = np.arange(12, dtype=np.float32).reshape(2, 6)


def test_a_dynamic_export_of_a_function_reading_a_numpy_array_takes_sizes_0_and_1(tmp_path):
    """A NumPy array the function reads is a new tensor at each trace: sizes 0 and 1, traced
    at export, were refused as capturing other tensors, though their values are the same."""

    def with_corners(w, x):
        return bp.sum(bp.tanh(bp.concatenate([x, CORNERS], 0) @ w))

    compiled = bp.compile(with_corners, dynamic={"x": {0: "batch"}})
    loaded = bp.load(bp.export(compiled, W, np.ones((4, 6), np.float32), path=tmp_path / "c.bpz"))
    for n in (0, 1, 3, 9):
        x = RNG.standard_normal((n, 6)).astype(np.float32)
        want = np.tanh(np.concatenate([x, CORNERS]) @ W.numpy()).sum()
        np.testing.assert_allclose(loaded(W, x).numpy(), want, rtol=1e-5)
    assert loaded.cache_info().traces == 0


def test_a_size_the_function_cannot_take_is_refused_by_the_loaded_artifact_saying_why(tmp_path):
    def second_row(w, x):
        return bp.sum(x[1] @ w) + bp.sum(x @ w)

    compiled = bp.compile(second_row, dynamic={"x": {0: "batch"}})
    loaded = bp.load(bp.export(compiled, W, np.ones((4, 6), np.float32), path=tmp_path / "r.bpz"))
    x = RNG.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_array_equal(loaded(W, x).numpy(), compiled(W, x).numpy())
    for n in (0, 1):
        with pytest.raises(bp.ExportError, match=rf"holds no plan for batch={n}: tracing .*1"):
            loaded(W, np.ones((n, 6), np.float32))


def test_a_loaded_artifact_names_arguments_passing_its_dynamic_axis_at_two_sizes(tmp_path):
    """As bp.compile's TracingError: not 'exported for x = f32[5, 6]', which is no shape the
    artifact needs (it takes any batch)."""

    def paired(w, x, y):
        return bp.mean((x @ w) * y)

    dynamic = {"x": {0: "batch"}, "y": {0: "batch"}}
    example = (np.ones((5, 6), np.float32), np.ones((5, 4), np.float32))
    loaded = bp.load(
        bp.export(bp.compile(paired), W, *example, path=tmp_path / "p.bpz", dynamic=dynamic)
    )
    with pytest.raises(bp.ExportError) as info:
        loaded(W, np.ones((3, 6), np.float32), np.ones((4, 4), np.float32))
    message = str(info.value)
    assert "dynamic axis 'batch'" in message and "f32[5" not in message
    assert "x has 3 on axis 0, y has 4 on axis 0" in message
    assert re.search(r"\(the call at test_export_dynamic\.py:\d+\)$", message)
    with pytest.raises(
        bp.ExportError,
        match=r"x = a tensor f32\[batch \(any size\), 6\], "
        r"but the call passed f32\[3, 5\]",
    ):
        loaded(W, np.ones((3, 5), np.float32), np.ones((3, 4), np.float32))
    x, y = RNG.standard_normal((3, 6)).astype(np.float32), np.ones((3, 4), np.float32)
    np.testing.assert_allclose(loaded(W, x, y).numpy(), paired(W, x, y).numpy(), rtol=1e-6)


def test_a_loaded_dynamic_artifact_explains_the_size_of_the_arguments_it_is_given(tmp_path):
    """explain(*args) of a loaded artifact, as bp.explain of the function exported: the peak
    at the arguments' batch (it gave the exported size's peak whatever they were)."""
    compiled = bp.compile(model, dynamic={"x": {0: "batch"}})
    loaded = bp.load(bp.export(compiled, W, np.ones((5, 6), np.float32), path=tmp_path / "e.bpz"))
    peaks = {}
    for n in (1, 3, 5, 40):
        x = np.ones((n, 6), np.float32)
        peaks[n] = loaded.explain(W, x).peak_bytes
        # a loaded artifact runs its two plans on every call; the function itself, small, one
        # joint plan from its third call (report.call_peaks): its first calls' peak is the same
        assert len(loaded.explain(W, x).call_peaks) == 1
        assert peaks[n] == compiled.explain(W, x).peak_on_call(1).peak_bytes
    assert peaks[1] < peaks[3] < peaks[5] < peaks[40]
    # no arguments: the exported signature, its arguments tensors (a NumPy x is copied at the
    # call, its copy held for the backward: explain(W, x) counts it)
    exported = loaded.explain(W, bp.tensor(np.ones((5, 6), np.float32))).peak_bytes
    assert loaded.explain().peak_bytes == exported == peaks[5] - 5 * 6 * 4
    assert loaded.cache_info().traces == 0


def test_a_loaded_dynamic_artifact_explains_its_bytes_as_formulas(tmp_path):
    """As bp.explain of the function exported: the symbol, and the bytes as formulas of it
    that give the report's own peak at the exported size."""
    example = np.ones((5, 6), np.float32)
    compiled = bp.value_and_grad(bp.compile(model))
    path = bp.export(compiled, W, example, path=tmp_path / "g.bpz", dynamic={"x": {0: "batch"}})
    report = bp.load(path).explain()
    assert report.dynamic.startswith("Dynamic axis batch: one plan for every size")
    original = bp.value_and_grad(bp.compile(model, dynamic={"x": {0: "batch"}}))
    assert report.dynamic == original.explain(W, example).dynamic
    assert report.peak_bytes == original.explain(W, example).peak_bytes


def test_a_function_whose_plan_is_not_a_formula_of_the_size_is_not_exported_dynamic(tmp_path):
    def squared_size(w, x):
        return bp.sum(x @ w) * float(x.shape[0] ** 2)

    with pytest.raises(bp.ExportError, match="cannot export axis batch as dynamic: full at"):
        bp.export(
            bp.compile(squared_size),
            W,
            np.ones((3, 6), np.float32),
            path=tmp_path / "s.bpz",
            dynamic={"x": {0: "batch"}},
        )


def test_loaded_dynamic_artifact_refuses_a_size_its_constant_slice_leaves(tmp_path):
    """x[:4] exported at 8 rows runs every size of 4 or more; at 3 rows the fitted plan would
    read past the argument's end: refused, saying which slice and size."""
    w = np.eye(6, dtype=np.float32)
    big = np.arange(100 * 6, dtype=np.float32).reshape(100, 6)
    path = tmp_path / "head.bpz"
    bp.export(
        bp.compile(lambda w, x: x[:4] @ w), w, big[:8], path=path, dynamic={"x": {0: "batch"}}
    )
    loaded = bp.load(path)
    np.testing.assert_array_equal(np.asarray(loaded(w, big[:17])), big[:4])
    with pytest.raises(bp.ExportError) as info:
        loaded(w, big[:3])
    assert "at size 3" in "".join(getattr(info.value, "__notes__", []))


def test_a_fixed_artifact_refusing_another_batch_says_the_dynamic_export_that_takes_it(tmp_path):
    """The refusal's dynamic= spec, copied into bp.export, gives an artifact taking that size."""
    example, other = np.ones((5, 6), np.float32), RNG.standard_normal((3, 6)).astype(np.float32)
    fixed = bp.load(bp.export(bp.compile(model), W, example, path=tmp_path / "fixed.bpz"))
    with pytest.raises(bp.ExportError, match=r"f32\[3, 6\]") as refused:
        fixed(W, other)
    spec = re.search(r"dynamic=(\{.*?\}\})", str(refused.value)).group(1)
    assert spec == "{'x': {0: 'batch'}}"
    any_batch = bp.load(
        bp.export(
            bp.compile(model), W, example, path=tmp_path / "any.bpz", dynamic=ast.literal_eval(spec)
        )
    )
    np.testing.assert_allclose(any_batch(W, other).numpy(), expected(other)[0], rtol=1e-5)
    with pytest.raises(bp.ExportError) as other_dtype:
        fixed(W, example.astype(np.float64))
    assert "dynamic=" not in str(other_dtype.value)
