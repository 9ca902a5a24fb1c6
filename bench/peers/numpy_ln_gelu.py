"""Hand-written NumPy layer norm + scale/shift + tanh-GELU + residual, forward and backward."""

from __future__ import annotations

import numpy as np

from .numpy_layers import gelu_tanh, gelu_tanh_backward, layer_norm, layer_norm_backward


def forward(p: dict, upstream: np.ndarray, *, eps: float = 1e-5):
    xhat, rstd = layer_norm(p["x"], eps)
    pre = xhat * p["g"] + p["b"]
    act, t = gelu_tanh(pre)
    y = act + p["x"]
    cache = {"xhat": xhat, "rstd": rstd, "pre": pre, "t": t, "upstream": upstream}
    return (y * upstream).sum(), cache


def backward(p: dict, cache: dict, *, eps: float = 1e-5) -> dict:
    upstream = cache["upstream"]
    d_pre = gelu_tanh_backward(cache["pre"], cache["t"], upstream)
    dxhat = d_pre * p["g"]
    dx = upstream + layer_norm_backward(cache["xhat"], cache["rstd"], dxhat)
    return {"x": dx, "g": (d_pre * cache["xhat"]).sum(axis=0), "b": d_pre.sum(axis=0)}
