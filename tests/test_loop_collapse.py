"""A fused loop merges neighbouring loop dimensions every access indexes alike. A strided
access (a transpose) keeps each of its dimensions as its own loop, and a dimension it
broadcasts over must never merge with its loop dimension 0: the merged loop would walk the
broadcast rows with dimension 0's stride, reading past the array (garbage, nan)."""

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend


def broadcast_transpose(x, w):
    t = bp.broadcast_to(bp.transpose(x, (0, 1, 3, 2)), w.shape)
    return t * w


def broadcast_transpose_loss(x, w):
    return bp.sum(bp.tanh(broadcast_transpose(x, w)))


def arrays(copies):
    rng = np.random.default_rng(copies)
    x = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    w = rng.standard_normal((2, copies, 4, 3)).astype(np.float32)
    return bp.tensor(x), bp.tensor(w)


def on(backend, fn, *args):
    with use_backend(backend):
        return fn(*args)


@pytest.mark.parametrize("copies", [3, 5])
def test_a_broadcast_axis_after_a_strided_axis_0_is_its_own_loop(copies):
    args = arrays(copies)
    step = bp.compile(broadcast_transpose)
    want = on("reference", step, *args).numpy()
    got = on("numba", step, *args).numpy()
    np.testing.assert_array_equal(got, want)
    x, w = (a.numpy() for a in args)
    np.testing.assert_allclose(want, np.transpose(x, (0, 1, 3, 2)) * w, rtol=1e-6)


def test_its_gradient_matches_the_reference():
    args = arrays(3)
    step = bp.value_and_grad(bp.compile(broadcast_transpose_loss), argnums=(0, 1))
    (value, grads), (want_value, want_grads) = (on(b, step, *args) for b in ("numba", "reference"))
    np.testing.assert_allclose(value.numpy(), want_value.numpy(), rtol=1e-5)
    for grad, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(grad.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
