"""A small MLP classifier on synthetic data, written once with backplan ops."""

from __future__ import annotations

import numpy as np

import backplan as bp


def init_mlp(sizes, seed: int = 0, dtype=np.float32) -> dict:
    """He-initialised weights and zero biases, as leaf tensors that require grad."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        scale = np.sqrt(2.0 / fan_in)
        params[f"w{i}"] = bp.tensor(
            (rng.standard_normal((fan_in, fan_out)) * scale).astype(dtype), requires_grad=True
        )
        params[f"b{i}"] = bp.tensor(np.zeros(fan_out, dtype), requires_grad=True)
    return params


def mlp_logits(params: dict, x):
    n_layers = len(params) // 2
    h = x
    for i in range(n_layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n_layers - 1:
            h = bp.relu(h)
    return h


@bp.compile
def mlp_loss(params: dict, x, labels):
    return bp.cross_entropy(mlp_logits(params, x), labels)


def synthetic_classification(n: int, n_features: int, n_classes: int, seed: int = 0):
    """Separable-ish clusters: labels come from a fixed random linear map of the features."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n_features)).astype(np.float32)
    projection = rng.standard_normal((n_features, n_classes)).astype(np.float32)
    labels = np.argmax(x @ projection, axis=1).astype(np.int64)
    return x, labels
