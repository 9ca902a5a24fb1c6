"""MLP classifiers written once with backplan ops: dense layers, an activation, softmax
cross-entropy. Used by the mlp, mlp_tiny, mlp_deep and mlp_infer benchmarks."""

from __future__ import annotations

import numpy as np

import backplan as bp

from .spec import ModelInputs

ACTIVATIONS = {"relu": bp.relu, "tanh": bp.tanh}


def logits(params: dict, x, *, activation: str = "relu"):
    act = ACTIVATIONS[activation]
    n_layers = len(params) // 2
    h = x
    for i in range(n_layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n_layers - 1:
            h = act(h)
    return h


def loss(params: dict, x, labels, *, activation: str = "relu"):
    return bp.cross_entropy(logits(params, x, activation=activation), labels)


def layer_sizes(config: dict) -> list[int]:
    hidden = [config["width"]] * config["depth"]
    return [config["n_in"], *hidden, config["n_out"]]


def make_inputs(config: dict, seed: int) -> ModelInputs:
    """He-scaled normal weights, small random biases, normal inputs, uniform labels."""
    rng = np.random.default_rng(seed)
    sizes = layer_sizes(config)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
        params[f"b{i}"] = rng.standard_normal(fan_out) * 0.1
    x = rng.standard_normal((config["batch"], config["n_in"]))
    labels = rng.integers(0, config["n_out"], config["batch"]).astype(np.int64)
    return ModelInputs(params, (x,), (labels,))
