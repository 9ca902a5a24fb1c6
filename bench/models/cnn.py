"""A small CNN written once with backplan ops: conv 3x3 (padding 1), ReLU, 2x2 max pool, twice,
then a linear layer and softmax cross-entropy. The full size is the digits example's network
(backplan/examples/cnn_digits.py) without its dropout, so the step times compare directly."""

from __future__ import annotations

import numpy as np

import backplan as bp

from .spec import ModelInputs


def logits(params: dict, x):
    h = bp.max_pool2d(bp.relu(bp.conv2d(x, params["conv1_w"], params["conv1_b"], padding=1)), 2)
    h = bp.max_pool2d(bp.relu(bp.conv2d(h, params["conv2_w"], params["conv2_b"], padding=1)), 2)
    return h.reshape(h.shape[0], -1) @ params["fc_w"] + params["fc_b"]


def loss(params: dict, x, labels):
    return bp.cross_entropy(logits(params, x), labels)


def make_inputs(config: dict, seed: int) -> ModelInputs:
    """He-scaled normal weights (fan-in), small random biases, images in [0, 1), uniform
    labels. The image side must be a multiple of 4 (two 2x2 pools)."""
    rng = np.random.default_rng(seed)
    c_in, side, c1, c2 = config["c_in"], config["side"], config["c1"], config["c2"]
    flat = c2 * (side // 4) ** 2

    def he(shape, fan_in):
        return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)

    params = {
        "conv1_w": he((c1, c_in, 3, 3), c_in * 9),
        "conv1_b": 0.1 * rng.standard_normal(c1),
        "conv2_w": he((c2, c1, 3, 3), c1 * 9),
        "conv2_b": 0.1 * rng.standard_normal(c2),
        "fc_w": he((flat, config["n_out"]), flat),
        "fc_b": 0.1 * rng.standard_normal(config["n_out"]),
    }
    x = rng.random((config["batch"], c_in, side, side))
    labels = rng.integers(0, config["n_out"], config["batch"]).astype(np.int64)
    return ModelInputs(params, (x,), (labels,))
