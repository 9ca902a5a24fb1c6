"""An LSTM unrolled over its time steps inside one traced function (batch 8, 4 inputs, 16 hidden
by default), the loss the mean squared error of the last hidden state: a model whose plan grows
with the number of steps while its distinct kernels do not (the compile-time benchmark)."""

from __future__ import annotations

import numpy as np

import backplan as bp

from .spec import ModelInputs


def loss(params: dict, xs, target):
    """xs: (steps, batch, inputs); gates in the order input, forget, cell, output."""
    hidden = params["wh"].shape[0]
    h = c = None
    for t in range(xs.shape[0]):
        gates = xs[t] @ params["wx"] + params["b"]
        if h is not None:
            gates = gates + h @ params["wh"]
        i = bp.sigmoid(gates[:, :hidden])
        f = bp.sigmoid(gates[:, hidden : 2 * hidden])
        g = bp.tanh(gates[:, 2 * hidden : 3 * hidden])
        o = bp.sigmoid(gates[:, 3 * hidden :])
        c = i * g if c is None else f * c + i * g
        h = o * bp.tanh(c)
    return bp.mean((h - target) ** 2)


def make_inputs(config: dict, seed: int) -> ModelInputs:
    rng = np.random.default_rng(seed)
    n_in, hidden = config["n_in"], config["hidden"]
    scale = 1.0 / np.sqrt(hidden)
    params = {
        "wx": rng.uniform(-scale, scale, (n_in, 4 * hidden)),
        "wh": rng.uniform(-scale, scale, (hidden, 4 * hidden)),
        "b": rng.uniform(-scale, scale, 4 * hidden),
    }
    xs = rng.standard_normal((config["steps"], config["batch"], n_in))
    target = rng.standard_normal((config["batch"], hidden))
    return ModelInputs(params, (xs,), (target,))
