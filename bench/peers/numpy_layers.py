"""Hand-written NumPy forward and backward of the layers the benchmark models use. Constants
are Python floats so float32 arrays stay float32 (NumPy 2 promotion)."""

from __future__ import annotations

import math

import numpy as np

GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


def dense_param_grads(x: np.ndarray, dy: np.ndarray):
    """(dw, db) of y = x @ w + b for x of any leading shape; dx is dy @ w.T."""
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    return x2.T @ dy2, dy2.sum(axis=0)


def gelu_tanh(x: np.ndarray):
    """Returns (gelu(x), tanh of the inner term) so backward need not recompute the tanh."""
    t = np.tanh(GELU_K * (x + GELU_C * x * x * x))
    return 0.5 * x * (1.0 + t), t


def gelu_tanh_backward(x: np.ndarray, t: np.ndarray, dy: np.ndarray) -> np.ndarray:
    dinner = GELU_K * (1.0 + 3.0 * GELU_C * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


def layer_norm(x: np.ndarray, eps: float):
    """Normalised x over the last axis and its reciprocal standard deviation."""
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    rstd = 1.0 / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    return centered * rstd, rstd


def layer_norm_backward(xhat: np.ndarray, rstd: np.ndarray, dxhat: np.ndarray) -> np.ndarray:
    mean_d = dxhat.mean(axis=-1, keepdims=True)
    mean_dx = (dxhat * xhat).mean(axis=-1, keepdims=True)
    return rstd * (dxhat - mean_d - xhat * mean_dx)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_backward(p: np.ndarray, dp: np.ndarray, axis: int = -1) -> np.ndarray:
    return p * (dp - (dp * p).sum(axis=axis, keepdims=True))


def cross_entropy(logits: np.ndarray, labels: np.ndarray):
    """Mean softmax cross-entropy and the probabilities backward needs."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    log_p = shifted - log_z
    rows = np.arange(len(labels))
    return -log_p[rows, labels].mean(), np.exp(log_p)


def cross_entropy_backward(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    d = probs.copy()
    d[np.arange(len(labels)), labels] -= 1.0
    return d / float(len(labels))
