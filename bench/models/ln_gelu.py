"""Layer norm, scale and shift, tanh-GELU and a residual on one big activation, written once
with backplan ops: y = gelu(layer_norm(x) * g + b) + x, loss = sum(y * upstream). x, g and b
are all differentiated, as for a layer inside a network."""

from __future__ import annotations

import numpy as np

import backplan as bp

from .spec import ModelInputs


def loss(params: dict, upstream, *, eps: float = 1e-5):
    x = params["x"]
    y = bp.gelu(bp.layer_norm(x, eps=eps) * params["g"] + params["b"], approximate="tanh") + x
    return bp.sum(y * upstream)


def make_inputs(config: dict, seed: int) -> ModelInputs:
    rng = np.random.default_rng(seed)
    rows, cols = config["rows"], config["cols"]
    params = {
        "x": rng.standard_normal((rows, cols)),
        "g": 1.0 + 0.1 * rng.standard_normal(cols),
        "b": 0.1 * rng.standard_normal(cols),
    }
    upstream = rng.standard_normal((rows, cols)) / np.sqrt(rows * cols)
    return ModelInputs(params, (), (upstream,))
