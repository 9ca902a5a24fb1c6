"""A loop that reads several values made cheaply from one expensive value (tanh-GELU's backward
reads 1 + tanh, 0.5 (1 + tanh) and 1 - tanh**2) reads the expensive value once and recomputes
the rest: fewer buffers written in forward and read in backward, the same numbers."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend


def mlp_gelu(w, b, v, x):
    y = bp.gelu(x @ w + b, approximate="tanh") @ v
    return (y * y).sum()  # the gradient reaches the GELU through y: backward is a loop of its own


def arrays(m, k, n, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    v = rng.standard_normal((n, 3)).astype(dtype)
    x = rng.standard_normal((2, m, k)).astype(dtype)  # (batch, sequence, features)
    return w, b, v, x


def numpy_value_and_grads(w, b, v, x):
    z = x.astype(np.float64) @ w + b
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (z + 0.044715 * z**3))
    h = 0.5 * z * (1 + t)
    y = h @ v
    dh = 2 * y @ v.T
    dz = dh * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z))
    rows = lambda a: a.reshape(int(np.prod(a.shape[:-1])), a.shape[-1])  # noqa: E731
    return (y * y).sum(), rows(x).T @ rows(dz), rows(dz).sum(axis=0), rows(h).T @ rows(2 * y)


def materialized_of_the_gelu_loop(plan) -> list[str]:
    """Ops of the values the loop holding tanh writes to memory."""
    lowered = lower(plan, ())
    (loop,) = [k for k in lowered.kernels if any(n.op == "tanh" for n in k.all_nodes)]
    return sorted(n.op for n in loop.all_nodes if n in lowered.materialized)


def test_the_gelu_backward_reads_tanh_instead_of_three_values_made_from_it():
    tensors = [bp.tensor(a) for a in arrays(9, 7, 33)]
    plan = bp.value_and_grad(mlp_gelu, argnums=(0, 1, 2)).trace(*tensors).plan
    # the GELU itself (read by the next matmul) and tanh; not 1 + tanh, 0.5 (1 + tanh), 1 - t^2
    # (before: ["add", "mul", "mul", "sub", "tanh"])
    assert materialized_of_the_gelu_loop(plan) == ["mul", "tanh"]
    lowered = lower(plan, ())
    readers = [k for k in lowered.kernels if k.kind == "loop" and k.recomputed]
    assert any({"add", "sub"} <= {n.op for n in k.recomputed} for k in readers)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1, 1), (9, 7, 33), (4, 5, 0), (0, 3, 6)])
def test_values_and_gradients_match_numpy_and_the_reference(dtype, shape):
    data = arrays(*shape, dtype=dtype, seed=1)
    got = {}
    for backend in ("numba", "reference"):
        with use_backend(backend):
            value, grads = bp.value_and_grad(mlp_gelu, argnums=(0, 1, 2))(*map(bp.tensor, data))
        got[backend] = [np.asarray(value.numpy()), *(g.numpy() for g in grads)]
    value, dw, db, dv = numpy_value_and_grads(*data)
    expected = [value, dw, db, dv]
    tol = 2e-4 if dtype == np.float32 else 1e-10
    for compiled, reference, exact in zip(got["numba"], got["reference"], expected, strict=True):
        assert compiled.shape == reference.shape == np.shape(exact)
        np.testing.assert_allclose(compiled, exact, rtol=tol, atol=tol)
        np.testing.assert_allclose(compiled, reference, rtol=tol, atol=tol)


def test_inf_and_nan_propagate_as_in_the_reference():
    w, b, v, x = arrays(4, 3, 5, dtype=np.float64, seed=2)
    x[0, 0, 0], x[1, 1, 1], x[0, 2, 2] = np.inf, -np.inf, np.nan
    results = {}
    for backend in ("numba", "reference"):
        with use_backend(backend):
            value, grads = bp.value_and_grad(mlp_gelu, argnums=(0, 1, 2))(
                *map(bp.tensor, (w, b, v, x))
            )
        results[backend] = [np.asarray(value.numpy()), *(g.numpy() for g in grads)]
    for compiled, reference in zip(results["numba"], results["reference"], strict=True):
        np.testing.assert_array_equal(np.isnan(compiled), np.isnan(reference))
        finite = np.isfinite(reference)
        np.testing.assert_allclose(compiled[finite], reference[finite], rtol=1e-9, atol=1e-12)


def _tanh_loop_writes(fn, x) -> list[str]:
    """Ops the loop holding tanh writes, in a forward-only compiled plan of fn(x)."""
    traced = bp.compile(fn).trace(bp.tensor(x))
    return materialized_of_the_gelu_loop(traced.program.plans.forward)


def test_a_loop_reading_one_value_made_from_tanh_keeps_reading_it():
    """Reading tanh instead of 1 + tanh saves no read and writes tanh in place of it: no gain."""

    def fn(x):
        u = 1.0 + bp.tanh(x)
        return u / bp.sum(u, axis=-1, keepdims=True)  # the division waits for the sum: a new loop

    assert _tanh_loop_writes(fn, np.ones((4, 9), np.float32)) == ["add", "sum"]


def test_a_loop_reading_three_values_made_from_tanh_reads_tanh():
    """Before: the first loop wrote 1 + t, 1 - t * t and 0.5 (1 + t); now tanh alone."""

    def fn(x):
        t = bp.tanh(x)
        a, b, c = 1.0 + t, 1.0 - t * t, 0.5 * (1.0 + t)
        scale = bp.sum(x, axis=-1, keepdims=True)  # each value meets it in the next loop
        return a * scale + b / scale - c * scale

    assert _tanh_loop_writes(fn, np.ones((4, 9), np.float32)) == ["sum", "tanh"]
