"""A small CNN (conv-relu-pool twice, dropout, linear) trained on scikit-learn's bundled digits
(1797 8x8 images, no download) with Adam and gradient clipping. One compiled call per training
step does the forward, the backward, the optimizer update and the key split for the next step's
dropout mask; params and optimizer state are donated, so the update writes into their buffers.

    pip install -e ".[examples]" && python -m backplan.examples.cnn_digits
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import time

import numpy as np

import backplan as bp

LEARNING_RATE = 3e-3
MAX_GRAD_NORM = 1.0
DROPOUT = 0.25
DIGITS_CSV = "digits.csv.gz"  # in sklearn/datasets/data/: 64 pixels then the label per row
OPTIMIZER = bp.optim.chain(
    bp.optim.clip_by_global_norm(MAX_GRAD_NORM), bp.optim.adam(LEARNING_RATE)
)


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """(x_train, y_train, x_test, y_test): images as float32 (N, 1, 8, 8) in [0, 1]."""
    images, target = load_digits()
    x = (images / 16.0).astype(np.float32)[:, None]
    y = target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def load_digits():
    """scikit-learn's bundled digits as (images (1797, 8, 8) float64, target int): read from the
    CSV file it ships, without importing scikit-learn itself, whose import (SciPy's stats and
    more) took 1.5-5 s, longer than training; its own loader where the file is not found."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ImportError(
            "the digits example needs scikit-learn for its bundled data set: "
            "pip install 'backplan[examples]' (or pip install scikit-learn)"
        )
    for folder in spec.submodule_search_locations or []:
        path = os.path.join(folder, "datasets", "data", DIGITS_CSV)
        if os.path.isfile(path):
            break
    else:
        from sklearn.datasets import load_digits as sklearn_load_digits

        digits = sklearn_load_digits()
        return digits.images, digits.target
    with gzip.open(path, "rt") as file:
        data = np.loadtxt(file, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def init_params(key) -> dict:
    """He-normal convolution and linear weights (PyTorch's fan-in), zero biases."""
    k1, k2, k3 = bp.random.split(key, 3)
    init = bp.nn.init.kaiming_normal
    return {
        "conv1_w": init(k1, (16, 1, 3, 3)),
        "conv1_b": bp.zeros((16,)),
        "conv2_w": init(k2, (32, 16, 3, 3)),
        "conv2_b": bp.zeros((32,)),
        "fc_w": init(k3, (128, 10), layout="in_out"),
        "fc_b": bp.zeros((10,)),
    }


def logits(params: dict, x, key=None):
    """Class scores; dropout before the linear layer when a key is given (training)."""
    h = bp.max_pool2d(bp.relu(bp.conv2d(x, params["conv1_w"], params["conv1_b"], padding=1)), 2)
    h = bp.max_pool2d(bp.relu(bp.conv2d(h, params["conv2_w"], params["conv2_b"], padding=1)), 2)
    h = h.reshape(h.shape[0], -1)
    if key is not None:
        h = bp.dropout(h, DROPOUT, key)
    return h @ params["fc_w"] + params["fc_b"]


def loss_fn(params, x, labels, key):
    return bp.cross_entropy(logits(params, x, key), labels)


@bp.compile(donate_argnums=(0, 1))
def train_step(params, opt_state, x, labels, key):
    """(params, opt_state, key, loss): forward, backward and the clipped Adam update in one
    plan. The key is split here, so every step draws a new dropout mask without retracing."""
    key, dropout_key = bp.random.split(key)
    loss, grads = bp.value_and_grad(loss_fn)(params, x, labels, dropout_key)
    params, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return params, opt_state, key, loss


@bp.compile
def predict(params, x):
    return bp.argmax(logits(params, x), axis=1)


def accuracy(params, x, y) -> float:
    return float(np.mean(predict(params, bp.tensor(x)).numpy() == y))


def shuffled_batches(n: int, batch_size: int, epochs: int, seed: int):
    """Index arrays of full batches, reshuffled every epoch (the same order for every peer)."""
    order_rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = order_rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def train(epochs: int = 12, batch_size: int = 32, max_steps: int | None = None, seed: int = 0):
    """Train and report: {'losses', 'test_accuracy', 'step_ms', 'steps'}."""
    key = bp.random.key(seed)
    key, init_key = bp.random.split(key)
    params = init_params(init_key)
    return run_training(
        train_step,
        params,
        OPTIMIZER.init(params),
        key,
        load_digits_split(seed=seed),
        dict(epochs=epochs, batch_size=batch_size, max_steps=max_steps, seed=seed),
    )


def run_training(step, params, opt_state, key, split, schedule: dict) -> dict:
    """The loop of `train` for any compiled step (params, state, x, y, key) -> (params, state,
    key, loss) and split (x_train, y_train, x_test, y_test), in the dtype the images come in.
    schedule: epochs, batch_size, max_steps, seed."""
    x_train, y_train, x_test, y_test = split
    losses, times = [], []
    batches = shuffled_batches(
        len(y_train), schedule["batch_size"], schedule["epochs"], schedule["seed"]
    )
    for batch in batches:
        begin = time.perf_counter()
        params, opt_state, key, loss = step(
            params, opt_state, bp.tensor(x_train[batch]), bp.tensor(y_train[batch]), key
        )
        losses.append(float(loss.item()))
        times.append(time.perf_counter() - begin)
        if schedule["max_steps"] is not None and len(losses) >= schedule["max_steps"]:
            break
    steady = times[1:] or times
    return {
        "losses": losses,
        "test_accuracy": accuracy(params, x_test, y_test),
        "step_ms": 1000 * float(np.median(steady)),
        "steps": len(losses),
    }


def main() -> None:
    result = train()
    first, last = np.mean(result["losses"][:20]), np.mean(result["losses"][-20:])
    print(f"{result['steps']} steps, loss {first:.3f} -> {last:.3f}")
    print(f"test accuracy {result['test_accuracy']:.4f}, {result['step_ms']:.2f} ms per step")


if __name__ == "__main__":
    main()
