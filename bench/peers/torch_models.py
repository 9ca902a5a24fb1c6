"""The benchmark models as idiomatic PyTorch (functional style over a dict of parameters)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mlp_logits(params: dict, x, *, activation: str = "relu"):
    act = torch.relu if activation == "relu" else torch.tanh
    n_layers = len(params) // 2
    h = x
    for i in range(n_layers):
        h = F.linear(h, params[f"w{i}"].T, params[f"b{i}"])
        if i < n_layers - 1:
            h = act(h)
    return h


def mlp_loss(params: dict, x, labels, *, activation: str = "relu"):
    return F.cross_entropy(mlp_logits(params, x, activation=activation), labels)


def transformer_loss(p: dict, x, *, n_heads: int, eps: float = 1e-5):
    batch, seq, d_model = x.shape

    def heads(t):
        return t.view(batch, seq, n_heads, d_model // n_heads).transpose(1, 2)

    a = F.layer_norm(x, (d_model,), p["ln1_g"], p["ln1_b"], eps)
    q, k, v = (heads(a @ p[f"w{n}"] + p[f"b{n}"]) for n in "qkv")
    att = F.scaled_dot_product_attention(q, k, v)
    h = x + (att.transpose(1, 2).reshape(batch, seq, d_model) @ p["wo"] + p["bo"])
    c = F.layer_norm(h, (d_model,), p["ln2_g"], p["ln2_b"], eps)
    hidden = F.gelu(c @ p["w_fc"] + p["b_fc"], approximate="tanh")
    y = h + (hidden @ p["w_proj"] + p["b_proj"])
    return (y * y).mean()


def ln_gelu_loss(p: dict, upstream, *, eps: float = 1e-5):
    x = p["x"]
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    y = F.gelu(normed * p["g"] + p["b"], approximate="tanh") + x
    return (y * upstream).sum()


def cnn_logits(p: dict, x):
    h = F.max_pool2d(F.relu(F.conv2d(x, p["conv1_w"], p["conv1_b"], padding=1)), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, p["conv2_w"], p["conv2_b"], padding=1)), 2)
    return h.flatten(1) @ p["fc_w"] + p["fc_b"]


def cnn_loss(p: dict, x, labels):
    return F.cross_entropy(cnn_logits(p, x), labels)


def lstm_loss(p: dict, xs, target):
    """Unrolled as in the backplan model (torch.nn.LSTMCell's gate order i, f, g, o): under
    torch.compile Dynamo unrolls the Python loop into one graph."""
    hidden = p["wh"].shape[0]
    h = c = None
    for t in range(xs.shape[0]):
        gates = torch.addmm(p["b"], xs[t], p["wx"])
        if h is not None:
            gates = gates + h @ p["wh"]
        i, f, g, o = gates.split(hidden, dim=1)
        i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
        c = i * g if c is None else f * c + i * g
        h = o * torch.tanh(c)
    return F.mse_loss(h, target)


# kind -> (loss, inference forward)
TORCH_KINDS = {
    "mlp": (mlp_loss, mlp_logits),
    "transformer": (transformer_loss, None),
    "ln_gelu": (ln_gelu_loss, None),
    "cnn": (cnn_loss, cnn_logits),
    "lstm": (lstm_loss, None),
}
