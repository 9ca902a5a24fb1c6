"""Hand-written kernels for the ops that are not plain loops: row composites, gather and
scatter. Compiled once and cached on disk; generated plans call them. Each has a serial and a
prange version, chosen by the generated code from the sizes (parallel pays above ~32k elements).
Functions that can fail on data return the position of the first bad index (in the flattened
index array), or -1 when every index is valid: a position is never negative, so -1 is never
ambiguous, even when the bad index itself is -1."""

import math

import numpy as np

from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit, prange
from backplan.codegen.kernels.scalar_functions import fast_exp

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}


def _softmax_row(x, out, log):
    """x may be out. The peak starts from x[0], not -inf, so that it keeps x's dtype: a float64
    peak made every exp of a float32 row a float64 one (2.3x slower rows of 128)."""
    if x.shape[0] == 0:
        return
    peak = x[0]
    for j in range(1, x.shape[0]):
        peak = max(peak, x[j])
    if not log:  # each exp once: kept in out, then scaled
        total = 0.0
        for j in range(x.shape[0]):
            e = fast_exp(x[j] - peak)
            out[j] = e
            total += e
        scale = 1.0 / total
        for j in range(x.shape[0]):
            out[j] = out[j] * scale
        return
    total = 0.0
    for j in range(x.shape[0]):
        total += fast_exp(x[j] - peak)
    # (x - peak) first: peak + log(total) would lose log(total) next to a huge peak; two
    # passes, so that fastmath's reassociation cannot fold them back together
    log_total = math.log(total)
    for j in range(x.shape[0]):
        out[j] = x[j] - peak
    for j in range(x.shape[0]):
        out[j] -= log_total


softmax_row = njit(inline="always", **_opts)(_softmax_row)


@njit(**_opts)
def softmax_rows(x, out, log):
    for r in range(x.shape[0]):
        softmax_row(x[r], out[r], log)


@njit(parallel=True, **_opts)
def softmax_rows_par(x, out, log):
    for r in prange(x.shape[0]):
        softmax_row(x[r], out[r], log)


@njit(**_opts)
def softmax_strided(x, out, log):
    """Softmax over the middle axis of (pre, n, post) arrays."""
    for p in range(x.shape[0]):
        for q in range(x.shape[2]):
            softmax_row(x[p, :, q], out[p, :, q], log)


@njit(**_opts)
def logsumexp_strided(x, out):
    """log(sum(exp)) over the middle axis of (pre, n, post) into (pre, post)."""
    for p in range(x.shape[0]):
        for q in range(x.shape[2]):
            peak = -np.inf
            for j in range(x.shape[1]):
                peak = max(peak, x[p, j, q])
            if math.isinf(peak):  # all -inf: -inf; any +inf: +inf (NaN still wins, as in NumPy)
                out[p, q] = peak
                for j in range(x.shape[1]):
                    if x[p, j, q] != x[p, j, q]:
                        out[p, q] = np.nan
                continue
            total = 0.0
            for j in range(x.shape[1]):
                total += fast_exp(x[p, j, q] - peak)
            out[p, q] = peak + math.log(total)


def _layer_norm_row(x, weight, bias, affine, eps, out):
    n = x.shape[0]
    total = 0.0
    for j in range(n):
        total += x[j]
    mean = total / n
    sq = 0.0
    for j in range(n):
        d = x[j] - mean
        sq += d * d
    rstd = 1.0 / math.sqrt(sq / n + eps)
    if affine:
        for j in range(n):
            out[j] = (x[j] - mean) * rstd * weight[j] + bias[j]
    else:
        for j in range(n):
            out[j] = (x[j] - mean) * rstd


layer_norm_row = njit(inline="always", **_opts)(_layer_norm_row)


@njit(**_opts)
def layer_norm_rows(x, weight, bias, affine, eps, out):
    for r in range(x.shape[0]):
        layer_norm_row(x[r], weight, bias, affine, eps, out[r])


@njit(parallel=True, **_opts)
def layer_norm_rows_par(x, weight, bias, affine, eps, out):
    for r in prange(x.shape[0]):
        layer_norm_row(x[r], weight, bias, affine, eps, out[r])


@njit(inline="always", **_opts)
def _first_bad_index(indices, size):
    """The position of the first index outside [-size, size), or -1 when all are valid."""
    for j in range(indices.shape[0]):
        if indices[j] < -size or indices[j] >= size:
            return j
    return -1


@njit(inline="always", **_opts)
def _first_bad_label(labels, classes):
    """The position of the first label outside [0, classes), or -1 when all are valid."""
    for j in range(labels.shape[0]):
        if labels[j] < 0 or labels[j] >= classes:
            return j
    return -1


@njit(**_opts)
def cross_entropy_rows(logits, labels, out, scale):
    """Per-row -log_softmax(logits)[label] into out (rows), or, when out has one element and
    there are several rows, their sum times scale (1 for "sum", 1/rows for "mean"). Returns the
    position of the first label outside [0, classes), or -1; nothing is written then."""
    n_classes = logits.shape[1]
    bad = _first_bad_label(labels, n_classes)
    if bad != -1:
        return bad
    reduce = out.shape[0] != logits.shape[0] or scale != 1.0
    total_loss = 0.0
    for r in range(logits.shape[0]):
        label = labels[r]
        row = logits[r]
        peak = -np.inf
        for j in range(n_classes):
            peak = max(peak, row[j])
        total = 0.0
        for j in range(n_classes):
            total += fast_exp(row[j] - peak)
        loss = (peak - row[label]) + math.log(total)
        if reduce:
            total_loss += loss
        else:
            out[r] = loss
    if reduce:
        out[0] = total_loss * scale
    return -1


@njit(inline="always", **_opts)
def _wrapped(index, size):
    return index + size if index < 0 else index


@njit(**_opts)
def take_strided(x, indices, out):
    """out[p, j, q] = x[p, indices[j], q]; negative indices count from the end."""
    size = x.shape[1]
    bad = _first_bad_index(indices, size)
    if bad != -1:
        return bad
    for p in range(x.shape[0]):
        for j in range(indices.shape[0]):
            index = _wrapped(indices[j], size)
            for q in range(x.shape[2]):
                out[p, j, q] = x[p, index, q]
    return -1


@njit(**_opts)
def take_grad_strided(g, indices, out):
    """out = zeros; out[p, indices[j], q] += g[p, j, q] (take's adjoint)."""
    size = out.shape[1]
    bad = _first_bad_index(indices, size)
    if bad != -1:
        return bad
    out[:] = 0
    for p in range(g.shape[0]):
        for j in range(indices.shape[0]):
            index = _wrapped(indices[j], size)
            for q in range(g.shape[2]):
                out[p, index, q] += g[p, j, q]
    return -1


@njit(**_opts)
def one_hot(labels, out):
    """Returns the position of the first label outside [0, depth), or -1."""
    depth = out.shape[1]
    bad = _first_bad_label(labels, depth)
    if bad != -1:
        return bad
    out[:] = 0
    for r in range(labels.shape[0]):
        out[r, labels[r]] = 1
    return -1
