"""Hand-written NumPy MLP: forward keeps what backward needs in a cache dict."""

from __future__ import annotations

import numpy as np

from .numpy_layers import cross_entropy, cross_entropy_backward, dense_param_grads


def logits(params: dict, x: np.ndarray, *, activation: str = "relu") -> np.ndarray:
    return _forward(params, x, activation)[0]


def _forward(params: dict, x: np.ndarray, activation: str):
    n_layers = len(params) // 2
    layer_inputs, h = [], x
    for i in range(n_layers):
        layer_inputs.append(h)
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n_layers - 1:
            h = np.maximum(h, 0.0) if activation == "relu" else np.tanh(h)
    return h, layer_inputs


def forward(params: dict, x: np.ndarray, labels: np.ndarray, *, activation: str = "relu"):
    out, layer_inputs = _forward(params, x, activation)
    value, probs = cross_entropy(out, labels)
    return value, {"layer_inputs": layer_inputs, "probs": probs, "labels": labels}


def backward(params: dict, cache: dict, *, activation: str = "relu") -> dict:
    """Layer i's input is layer i-1's activation output, so it also gives the activation's
    derivative: relu'(z) = (a > 0), tanh'(z) = 1 - a**2."""
    grads = {}
    dh = cross_entropy_backward(cache["probs"], cache["labels"])
    layer_inputs = cache["layer_inputs"]
    for i in reversed(range(len(layer_inputs))):
        grads[f"w{i}"], grads[f"b{i}"] = dense_param_grads(layer_inputs[i], dh)
        if i > 0:
            a, dx = layer_inputs[i], dh @ params[f"w{i}"].T
            dh = dx * (a > 0) if activation == "relu" else dx * (1.0 - a * a)
    return grads
