"""Compiled plans write layer_norm as the primitives of its derivative rule (ir/passes.py
expand_layer_norm): a joint plan (value_and_grad) and both plans of a compiled region (forward
and backward, once the saved values are chosen), so one loop over each row holds its statistics,
the ops around it and their gradients. The values and gradients still equal layer_norm's own
definition and finite differences, on odd shapes, a single column and special values, on both
paths; eager one-op regions keep the single kernel."""

import numpy as np
import pytest
from finite_differences import central_differences

import backplan as bp
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.pipeline import build_joint_plan, build_region_plans
from backplan.ir.types import TensorType


def ln_gelu_loss(x, g, b, up):
    y = bp.gelu(bp.layer_norm(x, g, b, eps=1e-3) * 1.5, approximate="tanh") + x
    return bp.sum(y * up)


def reference(x, g, b, up, eps=1e-3):
    """Loss and gradients of ln_gelu_loss in float64 NumPy, layer_norm by its definition."""
    k, c = np.sqrt(2 / np.pi), 0.044715
    mean = x.mean(-1, keepdims=True)
    centered = x - mean
    rstd = 1 / np.sqrt((centered**2).mean(-1, keepdims=True) + eps)
    xhat = centered * rstd
    pre = 1.5 * (xhat * g + b)
    t = np.tanh(k * (pre + c * pre**3))
    loss = np.sum((0.5 * pre * (1 + t) + x) * up)
    slope = 0.5 * (1 + t) + 0.5 * pre * (1 - t * t) * k * (1 + 3 * c * pre**2)
    d_ln = up * slope * 1.5
    d_xhat = d_ln * g
    n = x.shape[-1]
    dx = up + rstd / n * (n * d_xhat - d_xhat.sum(-1, keepdims=True)
                          - xhat * (d_xhat * xhat).sum(-1, keepdims=True))  # fmt: skip
    axes = tuple(range(x.ndim - 1))
    return loss, dx, (d_ln * xhat).sum(axes), d_ln.sum(axes)


@pytest.mark.parametrize("shape", [(5, 7), (3, 1, 33), (4, 1), (2, 127)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_values_and_gradients_equal_layer_norms_definition(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape) * 3 + 1
    g, b = 1 + 0.1 * rng.standard_normal(shape[-1]), 0.1 * rng.standard_normal(shape[-1])
    up = rng.standard_normal(shape)
    args = [bp.tensor(a.astype(dtype)) for a in (x, g, b, up)]
    value, grads = bp.value_and_grad(bp.compile(ln_gelu_loss), argnums=(0, 1, 2))(*args)
    expected = reference(x, g, b, up)
    _check(value, grads, expected, dtype)


@pytest.mark.parametrize("shape", [(5, 7), (3, 1, 33), (4, 1), (2, 127)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compile_and_backward_equal_layer_norms_definition(shape, dtype):
    rng = np.random.default_rng(sum(shape) + 1)
    x = rng.standard_normal(shape) * 3 + 1
    g, b = 1 + 0.1 * rng.standard_normal(shape[-1]), 0.1 * rng.standard_normal(shape[-1])
    up = rng.standard_normal(shape)
    args = [bp.tensor(a.astype(dtype), requires_grad=i < 3) for i, a in enumerate((x, g, b, up))]
    value = bp.compile(ln_gelu_loss)(*args)
    value.backward()
    _check(value, [a.grad for a in args[:3]], reference(x, g, b, up), dtype)


def _check(value, grads, expected, dtype):
    tol = 2e-4 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(float(value.numpy()), expected[0], rtol=tol, atol=tol)
    for got, want in zip(grads, expected[1:], strict=True):
        assert got.numpy().dtype == dtype
        np.testing.assert_allclose(got.numpy(), want, rtol=tol, atol=tol)


def test_gradient_of_x_matches_finite_differences():
    rng = np.random.default_rng(3)
    x, up = rng.standard_normal((3, 9)), rng.standard_normal((3, 9))
    g, b = np.ones(9), np.zeros(9)
    fn = bp.value_and_grad(bp.compile(ln_gelu_loss))
    _, dx = fn(*(bp.tensor(a) for a in (x, g, b, up)))
    numeric = central_differences(lambda x: reference(x, g, b, up)[0], x)
    np.testing.assert_allclose(dx.numpy(), numeric, rtol=1e-6, atol=1e-7)


def test_special_values_propagate_per_row():
    """A nan or inf in one row makes that row's outputs nan, as layer_norm's definition does,
    and leaves the other rows' gradients finite."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    x[1, 2] = np.inf
    x[2, 0] = np.nan
    g, b, up = np.ones(4, np.float32), np.zeros(4, np.float32), np.ones((3, 4), np.float32)
    fn = bp.value_and_grad(bp.compile(ln_gelu_loss))
    _, dx = fn(*(bp.tensor(a) for a in (x, g, b, up)))
    dx = dx.numpy()
    assert np.isfinite(dx[0]).all()
    assert np.isnan(dx[1]).all() and np.isnan(dx[2]).all()
    np.testing.assert_allclose(dx[0], reference(x[:1].astype(np.float64), g, b, up[:1])[1][0],
                               rtol=2e-4, atol=2e-4)  # fmt: skip


def _graph():
    graph = Graph(name="ln_gelu")
    b = Builder(graph)
    x = graph.add_input(TensorType("f32", (8, 16)))
    up = graph.add_input(TensorType("f32", (8, 16)))
    y = b.gelu(b.layer_norm(x, eps=1e-5), approximate="tanh")
    graph.outputs = [b.sum(b.mul(y, up), axes=(0, 1))]
    return graph


def test_joint_plans_expand_layer_norm_and_share_the_tanh():
    ops = [n.op for n in build_joint_plan(_graph(), [True, False]).graph.nodes]
    assert "layer_norm" not in ops
    assert ops.count("tanh") == 1  # the forward's tanh, read again by the gradient, not saved


def test_region_plans_expand_layer_norm_once_the_saved_values_are_chosen():
    plans = build_region_plans(_graph(), [True, False])
    forward = [n.op for n in plans.forward.graph.nodes]
    backward = [n.op for n in plans.backward.graph.nodes]
    assert "layer_norm" not in forward and "layer_norm" not in backward
    assert forward.count("gelu") == 1  # nothing in a forward alone shares its tanh
    assert "gelu" not in backward and backward.count("tanh") == 1  # value and slope share it
    assert sorted(s.source for s in plans.saved) == [("input", 0), ("input", 1)]  # x rebuilds all
    eager = build_region_plans(_graph(), [True, False], remat=False, expand=False)
    assert [n.op for n in eager.forward.graph.nodes].count("layer_norm") == 1
