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
