"""Hand-written NumPy pre-LN transformer block, forward and backward."""

from __future__ import annotations

import math

import numpy as np

from .numpy_layers import (
    dense_param_grads,
    gelu_tanh,
    gelu_tanh_backward,
    layer_norm,
    layer_norm_backward,
    softmax,
    softmax_backward,
)


def split_heads(t: np.ndarray, n_heads: int) -> np.ndarray:
    batch, seq, d_model = t.shape
    return t.reshape(batch, seq, n_heads, d_model // n_heads).transpose(0, 2, 1, 3)


def merge_heads(t: np.ndarray) -> np.ndarray:
    batch, n_heads, seq, d_head = t.shape
    return t.transpose(0, 2, 1, 3).reshape(batch, seq, n_heads * d_head)


def attention_forward(p: dict, a: np.ndarray, n_heads: int):
    q, k, v = (split_heads(a @ p[f"w{n}"] + p[f"b{n}"], n_heads) for n in "qkv")
    scale = 1.0 / math.sqrt(q.shape[-1])
    probs = softmax((q @ k.swapaxes(-1, -2)) * scale)
    merged = merge_heads(probs @ v)
    cache = {"a": a, "q": q, "k": k, "v": v, "probs": probs, "merged": merged, "scale": scale}
    return merged @ p["wo"] + p["bo"], cache


def attention_backward(p: dict, c: dict, d_out: np.ndarray, grads: dict) -> np.ndarray:
    grads["wo"], grads["bo"] = dense_param_grads(c["merged"], d_out)
    d_heads = split_heads(d_out @ p["wo"].T, c["q"].shape[1])
    d_probs = d_heads @ c["v"].swapaxes(-1, -2)
    dv = c["probs"].swapaxes(-1, -2) @ d_heads
    d_scores = softmax_backward(c["probs"], d_probs) * c["scale"]
    dq, dk = d_scores @ c["k"], d_scores.swapaxes(-1, -2) @ c["q"]
    da = 0.0
    for name, d in (("q", dq), ("k", dk), ("v", dv)):
        d = merge_heads(d)
        grads[f"w{name}"], grads[f"b{name}"] = dense_param_grads(c["a"], d)
        da = da + d @ p[f"w{name}"].T
    return da


def forward(p: dict, x: np.ndarray, *, n_heads: int, eps: float = 1e-5):
    xhat1, rstd1 = layer_norm(x, eps)
    att, att_cache = attention_forward(p, xhat1 * p["ln1_g"] + p["ln1_b"], n_heads)
    h = x + att
    xhat2, rstd2 = layer_norm(h, eps)
    c = xhat2 * p["ln2_g"] + p["ln2_b"]
    pre = c @ p["w_fc"] + p["b_fc"]
    hidden, t = gelu_tanh(pre)
    y = h + (hidden @ p["w_proj"] + p["b_proj"])
    cache = {
        "att": att_cache,
        "xhat1": xhat1,
        "rstd1": rstd1,
        "xhat2": xhat2,
        "rstd2": rstd2,
        "c": c,
        "pre": pre,
        "t": t,
        "hidden": hidden,
        "y": y,
    }
    return (y * y).mean(), cache


def backward(p: dict, cache: dict, *, n_heads: int, eps: float = 1e-5) -> dict:
    grads = {}
    dy = cache["y"] * (2.0 / cache["y"].size)
    grads["w_proj"], grads["b_proj"] = dense_param_grads(cache["hidden"], dy)
    d_pre = gelu_tanh_backward(cache["pre"], cache["t"], dy @ p["w_proj"].T)
    grads["w_fc"], grads["b_fc"] = dense_param_grads(cache["c"], d_pre)
    dc = d_pre @ p["w_fc"].T
    grads["ln2_g"], grads["ln2_b"] = _affine_grads(cache["xhat2"], dc)
    dh = dy + layer_norm_backward(cache["xhat2"], cache["rstd2"], dc * p["ln2_g"])
    da = attention_backward(p, cache["att"], dh, grads)
    grads["ln1_g"], grads["ln1_b"] = _affine_grads(cache["xhat1"], da)
    return grads


def _affine_grads(xhat: np.ndarray, dy: np.ndarray):
    axes = tuple(range(dy.ndim - 1))
    return (dy * xhat).sum(axis=axes), dy.sum(axis=axes)
