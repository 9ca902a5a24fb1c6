"""x[..., m, k] @ w[k, n] runs as one flat (batch * m) x k product (ir/passes.py
flatten_shared_matmuls), so the weight's gradient is one product too, never a product per batch
element written out and summed: the plans say so, and values and gradients still equal NumPy
and finite differences on odd, empty and transposed shapes."""

import numpy as np
import pytest
from finite_differences import central_differences

import backplan as bp
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.pipeline import build_joint_plan, build_region_plans
from backplan.ir.types import TensorType


def _graph(x_shape, w_shape, transpose_x=False):
    graph = Graph(name="proj")
    b = Builder(graph)
    x = graph.add_input(TensorType("f32", x_shape))
    w = graph.add_input(TensorType("f32", w_shape))
    if transpose_x:
        x = b.transpose(x, perm=(0, 2, 1))
    y = b.tanh(b.matmul(x, w))
    graph.outputs = [b.sum(y, axes=tuple(range(len(y.shape))))]
    return graph


def _matmul_ranks(graph):
    return [len(n.shape) for n in graph.nodes if n.op == "matmul"]


def test_a_shared_weight_makes_every_product_flat_forward_and_backward():
    plan = build_joint_plan(_graph((8, 5, 3), (3, 4)), [True, True])
    assert _matmul_ranks(plan.graph) == [2, 2, 2]  # y, dx, dw
    batch_sums = [n for n in plan.graph.nodes if n.op == "sum" and n.attrs["axes"] == (0,)]
    assert not batch_sums  # dw is not summed over the batch


def test_region_plans_save_the_flat_input_and_differentiate_it_flat():
    plans = build_region_plans(_graph((2, 3, 7, 5), (5, 6)), [True, True])
    assert _matmul_ranks(plans.forward.graph) == [2]
    assert _matmul_ranks(plans.backward.graph) == [2, 2]


def test_a_transposed_view_is_left_batched():
    """Flattening a view would need a copy of it: the product stays batched."""
    plan = build_joint_plan(_graph((4, 3, 5), (3, 2), transpose_x=True), [True, True])
    assert 3 in _matmul_ranks(plan.graph)


def projection(x, w, c):
    return bp.sum(bp.tanh(x @ w) * c)


def projection_transposed(x, w, c):
    return bp.sum(bp.tanh(x @ bp.transpose(w)) * c)


def reference(x, w, c, transposed):
    w2 = w.T if transposed else w
    t = np.tanh(x @ w2)
    loss = np.sum(t * c)
    dy = (1 - t * t) * c
    dx = dy @ w2.T
    dw = x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])
    return loss, dx, dw.T if transposed else dw


@pytest.mark.parametrize(
    "x_shape, w_shape",
    [((8, 5, 3), (3, 4)), ((2, 3, 7, 33), (33, 1)), ((1, 1, 127), (127, 7)), ((0, 4, 3), (3, 2))],
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_values_and_gradients_equal_numpy(x_shape, w_shape, transposed, dtype):
    rng = np.random.default_rng(len(x_shape) + w_shape[1])
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape[::-1] if transposed else w_shape) / np.sqrt(w_shape[0])
    c = rng.standard_normal(x_shape[:-1] + w_shape[-1:])
    fn = projection_transposed if transposed else projection
    args = [bp.tensor(a.astype(dtype)) for a in (x, w, c)]
    value, (dx, dw) = bp.value_and_grad(bp.compile(fn), argnums=(0, 1))(*args)
    expected = reference(x, w, c, transposed)
    tol = 2e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(float(value.numpy()), expected[0], rtol=tol, atol=tol)
    for got, want in zip((dx, dw), expected[1:], strict=True):
        assert got.numpy().shape == want.shape and got.numpy().dtype == dtype
        np.testing.assert_allclose(got.numpy(), want, rtol=tol, atol=tol)


def test_weight_gradient_matches_finite_differences():
    rng = np.random.default_rng(5)
    x, w, c = (
        rng.standard_normal((3, 4, 5)),
        rng.standard_normal((5, 2)),
        rng.standard_normal((3, 4, 2)),
    )
    _, dw = bp.value_and_grad(bp.compile(projection), argnums=1)(*(bp.tensor(a) for a in (x, w, c)))
    numeric = central_differences(lambda w: reference(x, w, c, False)[0], w)
    np.testing.assert_allclose(dw.numpy(), numeric, rtol=1e-6, atol=1e-8)


def test_special_values_stay_in_their_rows():
    x = np.ones((2, 3, 4), np.float32)
    x[1, 2, 0] = np.nan
    w, c = np.ones((4, 2), np.float32), np.ones((2, 3, 2), np.float32)
    _, dx = bp.value_and_grad(bp.compile(projection))(*(bp.tensor(a) for a in (x, w, c)))
    dx = dx.numpy()
    assert np.isnan(dx[1, 2]).all()
    assert np.isfinite(np.delete(dx.reshape(6, 4), 5, axis=0)).all()


def heads_projection(h, w, c):
    """Attention's output projection: heads moved back beside the features, then one weight."""
    b, heads, t, d = h.shape
    x = bp.reshape(bp.transpose(h, (0, 2, 1, 3)), (b, t, heads * d))
    return bp.sum(bp.tanh(x @ w) * c)


def test_a_reshaped_transpose_is_flattened_and_stays_correct():
    rng = np.random.default_rng(11)
    h, w = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((12, 7)) / 4
    c = rng.standard_normal((2, 5, 7))
    fn = bp.compile(heads_projection)
    args = [bp.tensor(a) for a in (h, w, c)]
    value, (dh, dw) = bp.value_and_grad(fn, argnums=(0, 1))(*args)
    x = h.transpose(0, 2, 1, 3).reshape(2, 5, 12)
    loss, dx, dw_want = reference(x, w, c, False)
    np.testing.assert_allclose(float(value.numpy()), loss, rtol=1e-10)
    np.testing.assert_allclose(dw.numpy(), dw_want, rtol=1e-10, atol=1e-12)
    dh_want = dx.reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(dh.numpy(), dh_want, rtol=1e-10, atol=1e-12)
    graph = Graph(name="heads")
    b = Builder(graph)
    heads = graph.add_input(TensorType("f32", (2, 3, 5, 4)))
    w_in = graph.add_input(TensorType("f32", (12, 7)))
    x_in = b.reshape(b.transpose(heads, perm=(0, 2, 1, 3)), shape=(2, 5, 12))
    graph.outputs = [b.sum(b.tanh(b.matmul(x_in, w_in)), axes=(0, 1, 2))]
    assert _matmul_ranks(build_joint_plan(graph, [True, True]).graph) == [2, 2, 2]
