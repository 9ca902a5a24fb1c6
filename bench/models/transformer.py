"""One pre-LayerNorm transformer block written once with backplan ops: multi-head attention
(no mask) and a tanh-GELU MLP, each with a residual; the loss is mean(y**2)."""

from __future__ import annotations

import math

import numpy as np

import backplan as bp

from .spec import ModelInputs


def split_heads(t, n_heads: int):
    batch, seq, d_model = t.shape
    return t.reshape(batch, seq, n_heads, d_model // n_heads).transpose(0, 2, 1, 3)


def attention(params: dict, a, n_heads: int):
    batch, seq, d_model = a.shape
    q = split_heads(a @ params["wq"] + params["bq"], n_heads)
    k = split_heads(a @ params["wk"] + params["bk"], n_heads)
    v = split_heads(a @ params["wv"] + params["bv"], n_heads)
    scores = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(d_model // n_heads))
    heads = bp.softmax(scores, axis=-1) @ v
    merged = heads.transpose(0, 2, 1, 3).reshape(batch, seq, d_model)
    return merged @ params["wo"] + params["bo"]


def block(params: dict, x, *, n_heads: int, eps: float = 1e-5):
    h = x + attention(params, bp.layer_norm(x, params["ln1_g"], params["ln1_b"], eps), n_heads)
    c = bp.layer_norm(h, params["ln2_g"], params["ln2_b"], eps)
    hidden = bp.gelu(c @ params["w_fc"] + params["b_fc"], approximate="tanh")
    return h + (hidden @ params["w_proj"] + params["b_proj"])


def loss(params: dict, x, *, n_heads: int, eps: float = 1e-5):
    y = block(params, x, n_heads=n_heads, eps=eps)
    return bp.mean(y * y)


def make_inputs(config: dict, seed: int) -> ModelInputs:
    rng = np.random.default_rng(seed)
    d, ff = config["d_model"], config["d_ff"]

    def dense(n_in, n_out):
        return rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)

    params = {
        "ln1_g": 1.0 + 0.1 * rng.standard_normal(d),
        "ln1_b": 0.1 * rng.standard_normal(d),
        "wq": dense(d, d),
        "bq": 0.1 * rng.standard_normal(d),
        "wk": dense(d, d),
        "bk": 0.1 * rng.standard_normal(d),
        "wv": dense(d, d),
        "bv": 0.1 * rng.standard_normal(d),
        "wo": dense(d, d),
        "bo": 0.1 * rng.standard_normal(d),
        "ln2_g": 1.0 + 0.1 * rng.standard_normal(d),
        "ln2_b": 0.1 * rng.standard_normal(d),
        "w_fc": dense(d, ff),
        "b_fc": 0.1 * rng.standard_normal(ff),
        "w_proj": dense(ff, d),
        "b_proj": 0.1 * rng.standard_normal(d),
    }
    x = rng.standard_normal((config["batch"], config["seq"], d))
    return ModelInputs(params, (x,))
