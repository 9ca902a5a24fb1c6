"""A donated training step writes the new parameters and both Adam moments into the buffers it
was given, also where the update is fused after the gradient's GEMM (its epilogue): no new
parameter or moment memory per step, and the same values as the reference interpreter."""

from __future__ import annotations

import numpy as np

import backplan as bp
from backplan.runtime.backend import use_backend


def loss_fn(params, x, y):
    return bp.mean((bp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def setup():
    rng = np.random.default_rng(0)
    params = {
        "w1": bp.tensor((rng.standard_normal((8, 16)) * 0.3).astype(np.float32)),
        "w2": bp.tensor((rng.standard_normal((16, 1)) * 0.3).astype(np.float32)),
    }
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = rng.standard_normal((32, 1)).astype(np.float32)
    return params, x, y


def make_step(opt):
    @bp.compile(donate_argnums=(0, 1))
    def step(params, state, x, y):
        loss, grads = bp.value_and_grad(lambda p: loss_fn(p, x, y))(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    return step


def addresses(tree) -> dict:
    return {i: t._data.__array_interface__["data"][0] for i, t in enumerate(bp.tree.leaves(tree))}


def run_steps(backend: str, n: int = 3):
    params, x, y = setup()
    opt = bp.optim.adam(1e-2)
    state = opt.init(params)
    step = make_step(opt)
    moved = []
    with use_backend(backend):
        for _ in range(n):
            before = addresses((params, state))
            params, state, loss = step(params, state, x, y)
            after = addresses((params, state))
            moved.append(sorted(i for i in before if before[i] != after[i]))
    return params, state, float(loss.item()), moved


def test_parameters_and_moments_are_updated_in_their_donated_buffers():
    params, state, loss, moved = run_steps("numba")
    assert moved[1:] == [[], []]  # after the first step, every leaf stays where it was
    ref_params, ref_state, ref_loss, _ = run_steps("reference")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-4, atol=1e-6)
    for name in params:
        np.testing.assert_allclose(
            params[name].numpy(), ref_params[name].numpy(), rtol=1e-4, atol=1e-6
        )
    for got, want in zip(bp.tree.leaves(state), bp.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(
            np.asarray(got.numpy()), np.asarray(want.numpy()), rtol=1e-4, atol=1e-6
        )
