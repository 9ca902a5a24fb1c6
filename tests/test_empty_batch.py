"""Zero-size dimensions on the compiled path: an empty batch goes through matmul, elementwise
chains, row composites, reductions and gathers, forward and backward, exactly as eager does
(a 0-byte buffer once broke the memory plan)."""

import numpy as np

import backplan as bp
from backplan.runtime.backend import use_backend


def model(w, b, x, labels):
    h = x @ w + b
    total = bp.sum(bp.tanh(h) * bp.sigmoid(h))
    total = total + bp.sum(bp.softmax(h, axis=-1) * bp.layer_norm(h, b, b))
    total = total + bp.cross_entropy(h, labels, reduction="sum")
    total = total + bp.sum(bp.exp(h).max(axis=1)) + bp.sum(bp.relu(h.T @ h))
    return total, h, bp.mean(h, axis=0), h[labels]


def results(backend, w, b, x, labels) -> list:
    with use_backend(backend):
        bp.zero_grad([w, b])
        outputs = bp.compile(model)(w, b, x, labels)
        outputs[0].backward()
        step = bp.value_and_grad(bp.compile(lambda *a: model(*a)[0]), argnums=(0, 1))
        value, (gw, gb) = step(w, b, x, labels)
        return [o.numpy() for o in outputs] + [w.grad.numpy(), b.grad.numpy(), value, gw, gb]


def test_an_empty_batch_compiles_and_matches_eager_forward_and_backward():
    w = bp.tensor(np.ones((8, 3), np.float32), requires_grad=True)
    b = bp.tensor(np.ones(3, np.float32), requires_grad=True)
    x = bp.tensor(np.zeros((0, 8), np.float32))
    labels = bp.tensor(np.zeros(0, np.int64))
    expected = results("reference", w, b, x, labels)
    got = results("numba", w, b, x, labels)
    assert got[1].shape == (0, 3) and got[3].shape == (0, 3)
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def _all_ways(fn, arrays, wrt):
    """fn's value and gradients with respect to arrays[i] for i in wrt: value_and_grad on both
    backends, bp.compile + .backward() on both, and eager."""
    runs = {}
    for backend in ("numba", "reference"):
        with use_backend(backend):
            tensors = [bp.tensor(a) for a in arrays]
            value, grads = bp.value_and_grad(fn, argnums=tuple(wrt))(*tensors)
            runs[f"value_and_grad {backend}"] = [value.numpy(), *(g.numpy() for g in grads)]
            leaves = [bp.tensor(a, requires_grad=i in wrt) for i, a in enumerate(arrays)]
            out = bp.compile(fn)(*leaves)
            out.backward()
            runs[f"compile {backend}"] = [out.numpy(), *(leaves[i].grad.numpy() for i in wrt)]
    leaves = [bp.tensor(a, requires_grad=i in wrt) for i, a in enumerate(arrays)]
    out = fn(*leaves)
    out.backward()
    runs["eager"] = [out.numpy(), *(leaves[i].grad.numpy() for i in wrt)]
    return runs


def _assert_all_equal(runs, expected):
    for way, got in runs.items():
        for g, e in zip(got, expected, strict=True):
            assert np.shape(g) == np.shape(e), way
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6, err_msg=way)


def test_layer_norm_over_zero_features():
    """1 / features scaled nothing but was worked out while tracing: ZeroDivisionError."""
    for shape in [(3, 0), (0, 0), (2, 3, 0)]:
        x = np.zeros(shape, np.float32)
        g = np.ones(shape[-1], np.float32)

        def fn(x, g, b):
            return bp.sum(bp.layer_norm(x, g, b) + 1.0)

        runs = _all_ways(fn, [x, g, g], wrt=[0, 1, 2])
        _assert_all_equal(runs, [np.float32(0), x, g * 0, g * 0])


def test_flatten_of_an_empty_batch_keeps_the_feature_count():
    x = bp.tensor(np.zeros((0, 2, 3), np.float32))
    assert bp.flatten(x, 1).shape == (0, 6) and bp.flatten(x).shape == (0,)
    w = np.ones((6, 4), np.float32)
    with use_backend("numba"):
        out = bp.compile(lambda x, w: bp.flatten(x, 1) @ w)(x, bp.tensor(w))
    assert out.shape == (0, 4)


def test_embedding_of_zero_width_rows_has_a_zero_width_gradient():
    table = np.zeros((5, 0), np.float32)
    ids = np.array([0, 2, 1])

    def fn(table, ids):
        return bp.sum(bp.embedding(ids, table) * 2.0)

    runs = _all_ways(fn, [table, ids], wrt=[0])
    _assert_all_equal(runs, [np.float32(0), table])


def test_logsumexp_of_an_empty_input_over_several_axes_is_minus_inf():
    x = np.zeros((2, 0, 3), np.float32)
    for backend in ("numba", "reference"):
        with use_backend(backend):
            t = bp.tensor(x)
            assert bp.logsumexp(t, axis=(0, 2)).shape == (0,)
            assert bp.logsumexp(t).numpy() == -np.inf
            assert bp.compile(lambda t: bp.logsumexp(t))(t).numpy() == -np.inf


def test_the_mean_of_nothing_is_nan_and_its_gradient_is_empty_or_zero():
    """As NumPy, PyTorch and JAX: a loss of 0 over an empty batch would hide that it was empty."""
    w = np.ones((3, 5), np.float32)
    x = np.zeros((0, 3), np.float32)
    labels = np.zeros(0, np.int64)

    def loss(w, x, labels):
        logits = x @ w
        return bp.cross_entropy(logits, labels) + bp.mean(logits) + bp.sum(bp.var(x, axis=0))

    runs = _all_ways(loss, [w, x, labels], wrt=[0])
    for way, (value, grad) in runs.items():
        assert np.isnan(value), way
        np.testing.assert_array_equal(grad, np.zeros_like(w), err_msg=way)
    with use_backend("numba"):
        means = bp.compile(lambda x: bp.mean(x, axis=0))(bp.tensor(x)).numpy()
    assert means.shape == (3,) and np.isnan(means).all()
