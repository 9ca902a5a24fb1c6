"""A small MLP classifier on synthetic data, written once with backplan ops."""

from __future__ import annotations

import numpy as np

import backplan as bp


def init_mlp(sizes, seed: int = 0, dtype=np.float32, requires_grad: bool = True) -> dict:
    """He-initialised weights and zero biases, as leaf tensors (that require grad, for
    loss.backward(); a compiled training step takes them without)."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        scale = np.sqrt(2.0 / fan_in)
        weight = (rng.standard_normal((fan_in, fan_out)) * scale).astype(dtype)
        params[f"w{i}"] = bp.tensor(weight, requires_grad=requires_grad)
        params[f"b{i}"] = bp.tensor(np.zeros(fan_out, dtype), requires_grad=requires_grad)
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


def make_train_step(optimizer):
    """One compiled call per step: forward, backward and the optimizer update. Parameters and
    optimizer state are donated, so the update writes into their buffers.

    >>> import backplan as bp
    >>> opt = bp.optim.adam(1e-3)
    >>> step = make_train_step(opt)
    >>> params = init_mlp([4, 8, 3], requires_grad=False)
    >>> state = opt.init(params)
    >>> x, labels = synthetic_classification(16, 4, 3)
    >>> params, state, loss = step(params, state, x, labels)
    >>> state["count"].item()
    1
    """

    def train_step(params, opt_state, x, labels):
        loss, grads = bp.value_and_grad(mlp_loss)(params, x, labels)
        params, opt_state = optimizer.update(grads, opt_state, params)
        return params, opt_state, loss

    return bp.compile(train_step, donate_argnums=(0, 1))


def synthetic_classification(n: int, n_features: int, n_classes: int, seed: int = 0):
    """Separable-ish clusters: labels come from a fixed random linear map of the features."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n_features)).astype(np.float32)
    projection = rng.standard_normal((n_features, n_classes)).astype(np.float32)
    labels = np.argmax(x @ projection, axis=1).astype(np.int64)
    return x, labels
