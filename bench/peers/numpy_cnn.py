"""Hand-written NumPy CNN: 3x3 convolutions as one matrix product over im2col patches (stride 1,
padding 1), 2x2 max pooling through a window argmax, forward keeping what backward needs."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .numpy_layers import cross_entropy, cross_entropy_backward

KERNEL, PADDING = 3, 1


def conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray):
    """(out, patches): patches is (N*H*W, C*3*3), the im2col matrix backward reuses."""
    n, c, h, wd = x.shape
    padded = np.pad(x, ((0, 0), (0, 0), (PADDING, PADDING), (PADDING, PADDING)))
    windows = sliding_window_view(padded, (KERNEL, KERNEL), axis=(2, 3))  # N,C,H,W,3,3
    patches = windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * h * wd, c * KERNEL * KERNEL)
    out = patches @ w.reshape(w.shape[0], -1).T + b
    return out.reshape(n, h, wd, -1).transpose(0, 3, 1, 2), patches


def conv2d_backward(dout: np.ndarray, w: np.ndarray, patches: np.ndarray, x_shape):
    """(dx, dw, db): the patch gradients are summed back onto the padded input (col2im)."""
    n, c, h, wd = x_shape
    d2 = dout.transpose(0, 2, 3, 1).reshape(n * h * wd, -1)
    dw = (d2.T @ patches).reshape(w.shape)
    dpatches = (d2 @ w.reshape(w.shape[0], -1)).reshape(n, h, wd, c, KERNEL, KERNEL)
    dpadded = np.zeros((n, c, h + 2 * PADDING, wd + 2 * PADDING), dout.dtype)
    for i in range(KERNEL):
        for j in range(KERNEL):
            dpadded[:, :, i : i + h, j : j + wd] += dpatches[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    dx = dpadded[:, :, PADDING : PADDING + h, PADDING : PADDING + wd]
    return dx, dw, d2.sum(axis=0)


def _windows(x: np.ndarray) -> np.ndarray:
    """(N, C, H/2, W/2, 4): each 2x2 pooling window flattened."""
    n, c, h, w = x.shape
    blocks = x.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5)
    return blocks.reshape(n, c, h // 2, w // 2, 4)


def max_pool2(x: np.ndarray):
    """(out, argmax within each window): the argmax routes the gradient back."""
    windows = _windows(x)
    index = windows.argmax(axis=-1)[..., None]
    return np.take_along_axis(windows, index, axis=-1)[..., 0], index


def max_pool2_backward(dout: np.ndarray, index: np.ndarray, x_shape) -> np.ndarray:
    n, c, h, w = x_shape
    dwindows = np.zeros((*dout.shape, 4), dout.dtype)
    np.put_along_axis(dwindows, index, dout[..., None], axis=-1)
    blocks = dwindows.reshape(n, c, h // 2, w // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
    return blocks.reshape(x_shape)


def _forward(params: dict, x: np.ndarray):
    cache, h = {}, x
    for layer in ("conv1", "conv2"):
        pre, patches = conv2d(h, params[f"{layer}_w"], params[f"{layer}_b"])
        act = np.maximum(pre, 0.0)
        pooled, index = max_pool2(act)
        cache[layer] = (h.shape, patches, act, index)
        h = pooled
    flat = h.reshape(h.shape[0], -1)
    cache["flat"] = flat
    return flat @ params["fc_w"] + params["fc_b"], cache


def logits(params: dict, x: np.ndarray) -> np.ndarray:
    return _forward(params, x)[0]


def forward(params: dict, x: np.ndarray, labels: np.ndarray):
    out, cache = _forward(params, x)
    value, probs = cross_entropy(out, labels)
    cache.update(probs=probs, labels=labels)
    return value, cache


def backward(params: dict, cache: dict) -> dict:
    dlogits = cross_entropy_backward(cache["probs"], cache["labels"])
    flat = cache["flat"]
    grads = {"fc_w": flat.T @ dlogits, "fc_b": dlogits.sum(axis=0)}
    dh = dlogits @ params["fc_w"].T
    for layer in ("conv2", "conv1"):
        x_shape, patches, act, index = cache[layer]
        dact = max_pool2_backward(dh.reshape(index.shape[:-1]), index, act.shape)
        dpre = dact * (act > 0)
        dh, grads[f"{layer}_w"], grads[f"{layer}_b"] = conv2d_backward(
            dpre, params[f"{layer}_w"], patches, x_shape
        )
    return grads
