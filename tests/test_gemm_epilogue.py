"""Epilogue fusion (ir/epilogue.py, codegen/render/epilogue.py): the loop after a 2-D matmul (bias
add, activation) runs inside the own GEMM on each finished block of rows. The lowered plan and
explain() show it, the driver has no separate loop, and values, gradients and saved buffers
match the reference interpreter and NumPy in float64, on both register widths and under BLAS."""

import re

import numpy as np
import pytest
from helpers import run_with_own_gemm_as_python

import backplan as bp
from backplan.codegen.build import kernel_cache
from backplan.codegen.kernels.gemm import isa
from backplan.codegen.render.emit import generate
from backplan.ir.fusion import group_kernels
from backplan.ir.lowering import RUN_KINDS, lower
from backplan.runtime.backend import use_backend

ACTIVATIONS = {"relu": (bp.relu, lambda z: np.maximum(z, 0)), "tanh": (bp.tanh, np.tanh)}
# (m, k, n): ones, odd sizes off the register tile, and more rows than one GEMM row block
SHAPES = [(1, 1, 1), (7, 33, 127), (127, 7, 33), (33, 127, 7), (200, 9, 40)]


@pytest.fixture
def own_gemm(monkeypatch):
    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    isa.active_isa.cache_clear()
    yield monkeypatch
    isa.active_isa.cache_clear()


def layer_loss(act):
    def loss(w, b, v, x):
        return bp.sum(act(x @ w + b) @ v)

    return loss


def layer_arrays(rng, m, k, n, dtype):
    x = rng.standard_normal((m, k)).astype(dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    v = rng.standard_normal((n, 3)).astype(dtype)
    return w, b, v, x


def numpy_layer(act, w, b, v, x):
    """Value and gradients (w, b, v) in float64 NumPy."""
    w, b, v, x = (a.astype(np.float64) for a in (w, b, v, x))
    z = x @ w + b
    h = act(z)
    dh = np.broadcast_to(v.sum(axis=1), h.shape)
    if act is np.tanh:
        dz = dh * (1 - h * h)
    else:
        dz = dh * (z > 0)
    return (h @ v).sum(), x.T @ dz, dz.sum(axis=0), h.T @ np.ones((len(x), v.shape[1]))


def value_and_grad(loss, arrays, backend):
    with use_backend(backend):
        value, grads = bp.value_and_grad(loss, argnums=(0, 1, 2))(*map(bp.tensor, arrays))
    return [np.asarray(value.numpy())] + [np.asarray(g.numpy()) for g in grads]


def fused_kernels(plan):
    return [k for k in lower(plan, ()).kernels if k.epilogue is not None]


def test_plan_absorbs_bias_and_activation_into_the_gemm(own_gemm):
    rng = np.random.default_rng(0)
    arrays = [bp.tensor(a) for a in layer_arrays(rng, 9, 7, 33, np.float32)]
    loss = layer_loss(bp.relu)
    plan = bp.value_and_grad(loss, argnums=(0, 1, 2)).trace(*arrays).plan
    fused = fused_kernels(plan)
    # the layer's; the backward's dh product takes the bias gradient (a column sum)
    (kernel,) = [k for k in fused if not k.epilogue.reductions]
    assert kernel.nodes[0].op == "matmul"
    assert [n.op for n in kernel.epilogue.nodes][:2] == ["add", "relu"]
    lowered = lower(plan, ())
    unfused = [k for k in group_kernels(plan.graph) if k.kind in RUN_KINDS]
    assert lowered.kernel_count == len(unfused) - len(fused)  # the loops taken are gone
    source = generate(lowered)
    calls = [k for k in source.loop_kernels if "own_gemm(" in k.source]
    assert len(calls) == len(fused)
    bias_add = r"t\d+ = \(w\d+\[i0, i1\] \+ w\d+\[i1\]\)"
    (layer,) = [k for k in calls if re.search(bias_add, k.source)]
    assert "relu" not in layer.source  # the registry's template, not a name, is inlined
    statements = re.findall(r"^    (k_\w+|own_gemm_at|gemm_at_f32)\(", source.source, re.M)
    assert statements[0] == layer.name  # the first product and its loop: one call
    assert layer.name not in statements[1:]
    with use_backend("numba"):
        text = str(bp.value_and_grad(loss, argnums=(0, 1, 2)).explain(*arrays))
    assert re.search(r"k0 \(matmul \+ epilogue\): f0 matmul, f1 add, f2 relu", text)


def test_explain_of_a_compiled_region_shows_the_epilogue_and_saves_the_activation(own_gemm):
    rng = np.random.default_rng(1)
    w, b, v, x = (
        bp.tensor(a, requires_grad=i < 3)
        for i, a in enumerate(layer_arrays(rng, 5, 4, 6, np.float32))
    )
    fn = bp.compile(layer_loss(bp.tanh))
    with use_backend("numba"):
        text = str(fn.explain(w, b, v, x))
    assert "k0 (matmul + epilogue): f0 matmul, f1 add, f2 tanh" in text


def assert_blocked_close(got, expected, dtype, terms):
    """Equal up to the rounding of sums of `terms` products in any blocked order."""
    tol = 8 * np.finfo(dtype).eps * terms
    scale = max(1.0, float(np.max(np.abs(expected), initial=0)))
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["relu", "tanh"])
def test_values_and_gradients_match_reference_and_numpy(own_gemm, dtype, name):
    act, np_act = ACTIVATIONS[name]
    rng = np.random.default_rng(2)
    for m, k, n in SHAPES:
        arrays = layer_arrays(rng, m, k, n, dtype)
        before = [a.copy() for a in arrays]
        ref = value_and_grad(layer_loss(act), arrays, "reference")
        got = value_and_grad(layer_loss(act), arrays, "numba")
        exact = numpy_layer(np_act, *arrays)
        terms = 3 * m + k + n
        for r, e, g in zip(ref, exact, got, strict=True):
            assert g.dtype == dtype
            assert_blocked_close(g, r, dtype, terms)
            assert_blocked_close(g, e, dtype, terms)
        for a, original in zip(arrays, before, strict=True):
            np.testing.assert_array_equal(a, original)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_python_run_driver_calls_the_gemm_kernels_loops_taking_addresses(own_gemm, dtype):
    """Until its compiled driver loads, a plan's driver runs as Python: a GEMM kernel (GEMM
    and epilogue) then runs its loop taking addresses, lean (no reference counting, no
    wrapper), with the reference interpreter's results."""
    own_gemm.setenv("BACKPLAN_DRIVER", "python")
    rng = np.random.default_rng(4)
    for m, k, n in [(7, 33, 127), (200, 9, 40)]:
        arrays = layer_arrays(rng, m, k, n, dtype)
        ref = value_and_grad(layer_loss(bp.tanh), arrays, "reference")
        got = value_and_grad(layer_loss(bp.tanh), arrays, "numba")
        for r, g in zip(ref, got, strict=True):
            assert_blocked_close(g, r, dtype, 3 * m + k + n)
    with use_backend("numba"):
        tensors = [bp.tensor(a) for a in arrays]
        vg = bp.value_and_grad(layer_loss(bp.tanh), argnums=(0, 1, 2))
        kernels = vg.trace(*tensors).runner().compiled.loop_kernels
    gemm_kernels = [k for k in kernels if "own_gemm(" in k.source]
    assert gemm_kernels
    for kernel in gemm_kernels:
        assert "@njit(**ADDRESS_KERNEL_JIT_OPTIONS)\ndef kernel_at(" in kernel.source
        assert "contiguous_view_at(" in kernel.source
        # it ran: a Numba overload, or machine code compiled with the plan's other loops
        ran_alone = kernel_cache.compiled_forms(kernel.digest)[0].overloads
        assert ran_alone or kernel_cache._ran_here(kernel.digest, None)


@pytest.mark.parametrize("act", [bp.tanh, bp.gelu], ids=["tanh", "gelu"])
def test_compiled_region_backward_reads_what_the_epilogue_saved(own_gemm, act):
    """bp.compile's forward plan writes the values its backward needs (tanh saves its
    output, gelu its input: the pre-activation) from inside the GEMM kernel."""
    rng = np.random.default_rng(3)
    arrays = layer_arrays(rng, 33, 7, 127, np.float32)
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            w, b, v = (bp.tensor(a, requires_grad=True) for a in arrays[:3])
            loss = bp.compile(layer_loss(act))(w, b, v, bp.tensor(arrays[3]))
            loss.backward()
            results[backend] = [loss.numpy(), w.grad.numpy(), b.grad.numpy(), v.grad.numpy()]
    for r, g in zip(results["reference"], results["numba"], strict=True):
        assert_blocked_close(g, r, np.float32, 3 * 33 + 7 + 127)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_special_values_propagate_like_the_unfused_plan(own_gemm, dtype):
    rng = np.random.default_rng(4)
    w, b, v, x = layer_arrays(rng, 9, 5, 33, dtype)
    x[1, 2], x[4, 0], b[3] = np.nan, np.inf, -np.inf
    forward = {}
    for choice in ("own", "blas"):
        own_gemm.setenv("BACKPLAN_GEMM", choice)
        with use_backend("numba"):
            forward[choice] = bp.relu(
                bp.compile(lambda w, b, x: x @ w + b)(*map(bp.tensor, (w, b, x)))
            ).numpy()
    with use_backend("numba"):
        fused = bp.compile(lambda w, b, x: bp.relu(x @ w + b))(*map(bp.tensor, (w, b, x))).numpy()
    with np.errstate(invalid="ignore"):
        expected = np.maximum(x.astype(np.float64) @ w + b, 0)
    for got in (fused, forward["blas"], forward["own"]):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(expected))
        finite = np.isfinite(expected)
        assert_blocked_close(got[finite], expected[finite], dtype, 5)


def test_blas_keeps_the_epilogue_a_loop_after_the_call(own_gemm):
    own_gemm.setenv("BACKPLAN_GEMM", "blas")
    rng = np.random.default_rng(5)
    arrays = layer_arrays(rng, 7, 33, 127, np.float32)
    loss = layer_loss(bp.relu)
    plan = bp.value_and_grad(loss, argnums=(0, 1, 2)).trace(*map(bp.tensor, arrays)).plan
    assert fused_kernels(plan)  # decided by the plan; codegen runs it as BLAS + loop
    source = generate(lower(plan, ()))
    assert not any("own_gemm(" in k.source for k in source.loop_kernels)
    first = source.source.split("# %")[1:5]
    assert "gemm_at_f32(" in "".join(first)
    ref = value_and_grad(loss, arrays, "reference")
    got = value_and_grad(loss, arrays, "numba")
    for r, g in zip(ref, got, strict=True):
        assert_blocked_close(g, r, np.float32, 3 * 7 + 33 + 127)


def test_forced_avx2_tile_runs_the_epilogue(own_gemm):
    own_gemm.setenv("BACKPLAN_GEMM_ISA", "avx2")
    isa.active_isa.cache_clear()
    rng = np.random.default_rng(6)
    for dtype in (np.float32, np.float64):
        arrays = layer_arrays(rng, 127, 33, 7, dtype)
        loss = layer_loss(bp.tanh)
        plan = bp.value_and_grad(loss, argnums=(0, 1, 2)).trace(*map(bp.tensor, arrays)).plan
        source = generate(lower(plan, ()))
        assert any("own_gemm(256, " in k.source for k in source.loop_kernels)
        ref = value_and_grad(loss, arrays, "reference")
        got = value_and_grad(loss, arrays, "numba")
        for r, g in zip(ref, got, strict=True):
            assert_blocked_close(g, r, dtype, 3 * 127 + 33 + 7)


def test_a_loop_reading_the_product_transposed_or_summing_rows_or_all_of_it_stays_apart():
    """Column sums run in the epilogue (test_epilogue_column_sums.py); a sum along each row
    starts a row kernel (a softmax's, a layer norm's) and stays with it, as does a loss."""
    rng = np.random.default_rng(7)
    x = bp.tensor(rng.standard_normal((6, 6)).astype(np.float32))
    w = bp.tensor(rng.standard_normal((6, 6)).astype(np.float32))
    for fn in (
        lambda x, w: (x @ w) * bp.transpose(x @ w),  # row i needs column i
        lambda x, w: bp.sum(bp.exp(x @ w), axis=1),  # a reduction along each row
        lambda x, w: bp.sum(bp.exp(x @ w)),  # a reduction over every row
    ):
        plan = bp.compile(fn).trace(x, w).program.plans.forward
        assert fused_kernels(plan) == []


def test_epilogue_kernel_runs_as_plain_python(tmp_path):
    """BACKPLAN_KERNELS_AS_PYTHON=1: the GEMM's NumPy twin stands in inside the kernel."""
    script = (
        "import numpy as np, backplan as bp\n"
        "from backplan.runtime.backend import use_backend\n"
        "w = bp.tensor(np.linspace(-1, 1, 12).reshape(3, 4))\n"
        "b = bp.tensor(np.linspace(-0.5, 0.5, 4))\n"
        "x = bp.tensor(np.linspace(0, 1, 15).reshape(5, 3))\n"
        "with use_backend('numba'):\n"
        "    y = bp.compile(lambda w, b, x: bp.tanh(x @ w + b))(w, b, x)\n"
        "print(' '.join(map(repr, y.numpy().ravel().tolist())))\n"
    )
    printed = run_with_own_gemm_as_python(script, tmp_path)
    expected = np.tanh(
        np.linspace(0, 1, 15).reshape(5, 3) @ np.linspace(-1, 1, 12).reshape(3, 4)
        + np.linspace(-0.5, 0.5, 4)
    )
    np.testing.assert_allclose(np.array(printed.split(), float), expected.ravel(), rtol=1e-6)
