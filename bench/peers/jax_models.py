"""The benchmark models as idiomatic JAX: pure functions of a parameter dict."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mlp_logits(params: dict, x, *, activation: str = "relu"):
    act = jax.nn.relu if activation == "relu" else jnp.tanh
    n_layers = len(params) // 2
    h = x
    for i in range(n_layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n_layers - 1:
            h = act(h)
    return h


def mlp_loss(params: dict, x, labels, *, activation: str = "relu"):
    log_probs = jax.nn.log_softmax(mlp_logits(params, x, activation=activation))
    return -jnp.take_along_axis(log_probs, labels[:, None], axis=-1).mean()


def layer_norm(x, g=None, b=None, eps: float = 1e-5):
    normed = jax.nn.standardize(x, axis=-1, epsilon=eps)
    return normed if g is None else normed * g + b


def transformer_loss(p: dict, x, *, n_heads: int, eps: float = 1e-5):
    batch, seq, d_model = x.shape

    def heads(t):
        return t.reshape(batch, seq, n_heads, d_model // n_heads)

    a = layer_norm(x, p["ln1_g"], p["ln1_b"], eps)
    q, k, v = (heads(a @ p[f"w{n}"] + p[f"b{n}"]) for n in "qkv")
    att = jax.nn.dot_product_attention(q, k, v).reshape(batch, seq, d_model)
    h = x + (att @ p["wo"] + p["bo"])
    c = layer_norm(h, p["ln2_g"], p["ln2_b"], eps)
    hidden = jax.nn.gelu(c @ p["w_fc"] + p["b_fc"], approximate=True)
    y = h + (hidden @ p["w_proj"] + p["b_proj"])
    return jnp.mean(y * y)


def ln_gelu_loss(p: dict, upstream, *, eps: float = 1e-5):
    x = p["x"]
    y = jax.nn.gelu(layer_norm(x, eps=eps) * p["g"] + p["b"], approximate=True) + x
    return jnp.sum(y * upstream)


def _conv_relu_pool(x, w, b):
    h = jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)))  # NCHW, OIHW
    h = jax.nn.relu(h + b[:, None, None])
    return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


def cnn_logits(p: dict, x):
    h = _conv_relu_pool(x, p["conv1_w"], p["conv1_b"])
    h = _conv_relu_pool(h, p["conv2_w"], p["conv2_b"])
    return h.reshape(h.shape[0], -1) @ p["fc_w"] + p["fc_b"]


def cnn_loss(p: dict, x, labels):
    log_probs = jax.nn.log_softmax(cnn_logits(p, x))
    return -jnp.take_along_axis(log_probs, labels[:, None], axis=-1).mean()


def lstm_loss(p: dict, xs, target):
    """Unrolled with a Python loop, as the other peers, so XLA compiles the same unrolled
    program (jax.lax.scan would compile one step and loop over it)."""
    h = c = None
    for t in range(xs.shape[0]):
        gates = xs[t] @ p["wx"] + p["b"]
        if h is not None:
            gates = gates + h @ p["wh"]
        i, f, g, o = jnp.split(gates, 4, axis=1)
        i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
        c = i * g if c is None else f * c + i * g
        h = o * jnp.tanh(c)
    return jnp.mean((h - target) ** 2)


# kind -> (loss, inference forward)
JAX_KINDS = {
    "mlp": (mlp_loss, mlp_logits),
    "transformer": (transformer_loss, None),
    "ln_gelu": (ln_gelu_loss, None),
    "cnn": (cnn_loss, cnn_logits),
    "lstm": (lstm_loss, None),
}
