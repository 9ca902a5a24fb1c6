"""Hand-written NumPy LSTM unrolled over its time steps, forward and backward through time.
Gates in the order input, forget, cell, output, as bench/models/lstm.py; the first step has no
previous state (no h @ wh term, c = i * g)."""

from __future__ import annotations

import numpy as np


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _cell(params: dict, x_t, h, c):
    """One step: (h, c, what backward needs of it)."""
    hidden = params["wh"].shape[0]
    gates = x_t @ params["wx"] + params["b"]
    if h is not None:
        gates = gates + h @ params["wh"]
    i = _sigmoid(gates[:, :hidden])
    f = _sigmoid(gates[:, hidden : 2 * hidden])
    g = np.tanh(gates[:, 2 * hidden : 3 * hidden])
    o = _sigmoid(gates[:, 3 * hidden :])
    c_new = i * g if c is None else f * c + i * g
    tanh_c = np.tanh(c_new)
    return (
        o * tanh_c,
        c_new,
        {"x": x_t, "h": h, "c": c, "i": i, "f": f, "g": g, "o": o, "tc": tanh_c},
    )


def forward(params: dict, xs: np.ndarray, target: np.ndarray):
    h = c = None
    steps = []
    for t in range(xs.shape[0]):
        h, c, saved = _cell(params, xs[t], h, c)
        steps.append(saved)
    diff = h - target
    return (diff * diff).mean(), {"steps": steps, "diff": diff}


def backward(params: dict, cache: dict) -> dict:
    """Through time, last step first: dh flows back through h @ wh, dc through f * c."""
    diff = cache["diff"]
    dh, dc = diff * (2.0 / diff.size), np.zeros_like(diff)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    for s in reversed(cache["steps"]):
        dc = dc + dh * s["o"] * (1.0 - s["tc"] * s["tc"])
        d_o = dh * s["tc"]
        df = dc * s["c"] if s["c"] is not None else np.zeros_like(dc)
        dgates = np.concatenate(
            [
                dc * s["g"] * s["i"] * (1.0 - s["i"]),
                df * s["f"] * (1.0 - s["f"]),
                dc * s["i"] * (1.0 - s["g"] * s["g"]),
                d_o * s["o"] * (1.0 - s["o"]),
            ],
            axis=1,
        )
        grads["wx"] += s["x"].T @ dgates
        grads["b"] += dgates.sum(axis=0)
        if s["h"] is not None:
            grads["wh"] += s["h"].T @ dgates
        dh, dc = dgates @ params["wh"].T, dc * s["f"]
    return grads
