"""A leaf's first gradient is the backward plan's output itself, not a copy of it
(Tensor._accumulate_grad). That is only right if nothing writes that buffer afterwards: not the
next call of the same plan (which reuses big outputs nobody holds), not a second backward
accumulating into .grad, not a gradient shared by two leaves."""

import numpy as np

import backplan as bp
from backplan.runtime.backend import use_backend


def _loss(w, x):
    return bp.sum(bp.tanh(x @ w) ** 2)


def _grad_w(w, x):
    t = np.tanh(x @ w)
    return x.T @ (2 * t * (1 - t * t))


def test_a_kept_grad_survives_the_next_calls_of_the_same_plan():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((128, 160))  # 160 KiB of float64: a reused output's size
    xs = [rng.standard_normal((9, 128)) for _ in range(3)]
    f = bp.compile(_loss)
    w = bp.tensor(w0, requires_grad=True)
    kept = []
    with use_backend("numba"):
        for x in xs:
            w.zero_grad()
            f(w, bp.tensor(x)).backward()
            kept.append(w.grad)
    for grad, x in zip(kept, xs, strict=True):
        np.testing.assert_allclose(grad.numpy(), _grad_w(w0, x), rtol=1e-8, atol=1e-12)
        assert not grad.numpy().flags.writeable


def test_accumulating_and_shared_gradients_stay_apart():
    rng = np.random.default_rng(1)
    a0, b0 = rng.standard_normal((40, 50)), rng.standard_normal((40, 50))
    a, b = bp.tensor(a0, requires_grad=True), bp.tensor(b0, requires_grad=True)
    f = bp.compile(lambda a, b: bp.sum((a + b) ** 2))
    with use_backend("numba"):
        f(a, b).backward()
        first_a = a.grad
        f(a, b).backward()
    want = 2 * (a0 + b0)
    np.testing.assert_allclose(first_a.numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(a.grad.numpy(), 2 * want, rtol=1e-12)
    np.testing.assert_allclose(b.grad.numpy(), 2 * want, rtol=1e-12)
