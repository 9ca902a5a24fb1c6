"""A plan's driver is a thin list of calls: loop kernels take base arrays and integer offsets
and make their own views (codegen/render/placement.py), so the driver slices, reshapes and assigns
into nothing; the gradient of a slice (zero fill, copy into a part) and a concatenation are
calls of shared kernels. The results still match the reference interpreter, and kernels are
still shared across sizes."""

import re

import numpy as np

import backplan as bp
from backplan.codegen.render.emit import generate
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend

# A driver statement: a call whose arguments are names, bools, np.intp(integer) or a float
# literal a loop kernel takes as a parameter (np.float32(0.5)); a whole array seen as 1-D
# (`v3.reshape(-1)`, read-only for a library GEMM's operands, so one compiled variant serves
# every call); or the return.
NUMBER = r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?"
FLAT = r"\w+\.reshape\(-1\)"
ARGUMENT = (
    rf"(?:\w+|np\.intp\(-?\d+\)|np\.bool_\((?:True|False)\)|np\.float(?:32|64)\({NUMBER}\)"
    rf"|{NUMBER}|{FLAT}|as_read_only\({FLAT}\))"
)
CALL = re.compile(rf"(?:bad = )?\w+\(({ARGUMENT}(?:, {ARGUMENT})*)?\)")
FLATTEN = re.compile(r"v\d+_1d = v\d+\.reshape\(-1\)")


def gated(w, xs):
    """An LSTM-like cell: slices of one product (their gradient pads each slice back), a
    concatenation, a reduction over a transposed view."""
    h = bp.zeros((xs.shape[1], w.shape[1] // 4), dtype="float32")
    for t in range(xs.shape[0]):
        z = bp.concatenate([xs[t], h], axis=1) @ w
        size = h.shape[1]
        i, f, g = z[:, :size], z[:, size : 2 * size], z[:, 2 * size : 3 * size]
        h = bp.sigmoid(i) * bp.tanh(g) + bp.sigmoid(f) * h + z[:, 3 * size :]
    return bp.sum(h * h) + bp.sum(bp.transpose(h)[0])


def inputs(rng, steps, batch, n_in, hidden):
    w = rng.standard_normal((n_in + hidden, 4 * hidden)).astype(np.float32) * 0.5
    xs = rng.standard_normal((steps, batch, n_in)).astype(np.float32)
    return bp.tensor(w), bp.tensor(xs)


def driver_statements(source: str) -> list[str]:
    body = source.split("def run", 1)[1].splitlines()[1:]
    return [line.strip() for line in body if line.strip() and not line.strip().startswith("#")]


def test_the_driver_of_a_plan_with_slice_gradients_is_only_calls():
    w, xs = inputs(np.random.default_rng(0), 3, 5, 3, 4)
    plan = bp.value_and_grad(gated).trace(w, xs).plan
    source = generate(lower(plan, ())).source
    assert "pad_slice" in source and "concatenate" in source  # the ops this test is about
    for statement in driver_statements(source):
        if statement.startswith("return "):
            continue
        assert CALL.fullmatch(statement) or FLATTEN.fullmatch(statement), statement


def test_thin_driver_results_match_the_reference_and_share_kernels_across_sizes():
    from backplan.codegen.build import kernel_cache

    rng = np.random.default_rng(1)
    results = {}
    for shape in ((3, 5, 3, 4), (3, 7, 2, 6)):
        w, xs = inputs(rng, *shape)
        with use_backend("numba"):
            vg = bp.value_and_grad(gated)
            value, grad = vg(w, xs)
            compiled = vg.trace(w, xs).runner().compiled
        with use_backend("reference"):
            expected_value, expected_grad = bp.value_and_grad(gated)(w, xs)
        np.testing.assert_allclose(value.numpy(), expected_value.numpy(), rtol=1e-5)
        np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-4, atol=1e-5)
        results[shape] = {k.digest for k in compiled.loop_kernels}
    small, large = results.values()
    assert small == large  # other sizes, other offsets: the same kernels
    assert kernel_cache.counts().loaded >= len(small)


def reversed_and_transposed(x, y):
    """Kernels reading views the driver no longer makes: reversed and strided slices, a
    transpose, a broadcast literal part of a concatenation."""
    a = x[::-1, 1::2] * bp.transpose(y)[:, ::2]
    b = bp.concatenate([a, x[:, :1] + 1.0], axis=1)
    return bp.sum(bp.tanh(b) * b[::-1]) + bp.sum(x[1:, ::-2])


def test_kernels_make_reversed_strided_and_transposed_views_correctly():
    rng = np.random.default_rng(2)
    x = bp.tensor(rng.standard_normal((5, 7)).astype(np.float32))
    y = bp.tensor(rng.standard_normal((6, 5)).astype(np.float32))
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            value, grads = bp.value_and_grad(reversed_and_transposed, argnums=(0, 1))(x, y)
        results[backend] = [value.numpy(), *(g.numpy() for g in grads)]
    for expected, got in zip(results["reference"], results["numba"], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_plan_module_imports_only_the_kernel_modules_its_driver_calls():
    """A warm process imports what its plan's module names: the LSTM-like cell's driver calls a
    GEMM and passes read-only operands (views.as_read_only, which every kernel module also
    exports), so it imports matmul's kernels and not attention's or conv's."""
    from backplan.codegen.render.emit import kernel_imports

    w, xs = inputs(np.random.default_rng(0), 3, 5, 3, 4)
    source = generate(lower(bp.value_and_grad(gated).trace(w, xs).plan, ())).source
    imported = {line.split()[1] for line in source.splitlines() if line.startswith("from ")}
    assert "as_read_only(" in source and "gemm" in source
    assert "backplan.codegen.kernels.matmul" in imported
    assert not imported & {"backplan.codegen.kernels.attention", "backplan.codegen.kernels.conv"}
    views = "from backplan.codegen.kernels.views import as_read_only\n"
    assert kernel_imports({"as_read_only"}) == views
    assert kernel_imports({"as_read_only", "one_hot"}) == (
        "from backplan.codegen.kernels.gather import *  # noqa: F403\n" + views
    )
    assert kernel_imports({"gemm_f32", "unrelated"}) == (
        "from backplan.codegen.kernels.blas import gemm_f32\n"
    )


def test_a_kernel_name_reexported_under_another_name_is_imported_where_it_resolves():
    """matmul's kernels re-export the GEMM's `batched_gemm` as `own_batched_gemm`: imported
    from gemm.api by that name, a plan with a batched 16-bit product failed to import
    (ImportError: cannot import name 'own_batched_gemm')."""
    from backplan.codegen.render.emit import kernel_imports

    called = {"own_batched_gemm", "as_read_only"}
    scope: dict = {}
    exec(kernel_imports(called), scope)
    assert called <= scope.keys()
