"""Row composites: softmax, log_softmax, logsumexp, layer_norm, cross_entropy. Compiled once and
cached on disk; generated plans call them. Each has a serial and a prange version, chosen by
the generated code from the sizes (parallel pays above ~32k elements). cross_entropy returns
the position of its first bad label (in the flattened labels), or -1 when every label is
valid: a position is never negative, so -1 is never ambiguous."""

import math

import numpy as np

from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit, prange
from backplan.codegen.kernels.row_math import maxnum, one_like, row_exp, zero_like
from backplan.codegen.kernels.scalar_functions import fast_exp
from backplan.codegen.kernels.threads_now import threads_now
from backplan.codegen.kernels.views import transposed
from backplan.codegen.render.opaque import HOLES, OpEmitter, emits
from backplan.codegen.render.scalar import NP_TYPE, literal
from backplan.ir.graph import Value
from backplan.ir.index_check import label_message

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}


def _softmax_row(x, out, log):
    """x may be out. Every value stays in x's dtype: the peak starts from x[0] (a float64 peak
    made every exp of a float32 row a float64 one), the sum from a typed zero (0.0 would make
    it float64), and the reciprocal is taken of a typed one. The peak is a maxnum reduction and
    the exp mathlib's, inlined, so all three passes vectorise; each runs over the whole row (a
    pass from 1 left a row of 128 a scalar tail of 15 exps)."""
    n = x.shape[0]
    if n == 0:
        return
    peak = x[0]
    for j in range(n):
        peak = maxnum(peak, x[j])  # ignores a NaN, whose exp below turns the row NaN anyway
    total = zero_like(peak)
    if not log:  # each exp once: kept in out, then scaled
        for j in range(n):
            e = row_exp(x[j] - peak)
            out[j] = e
            total += e
        scale = one_like(total) / total
        for j in range(n):
            out[j] = out[j] * scale
        return
    for j in range(n):
        total += row_exp(x[j] - peak)
    # (x - peak) first: peak + log(total) would lose log(total) next to a huge peak; two
    # passes, so that fastmath's reassociation cannot fold them back together
    log_total = math.log(total)
    for j in range(n):
        out[j] = x[j] - peak
    for j in range(n):
        out[j] -= log_total


softmax_row = njit(inline="always", **_opts)(_softmax_row)


@njit(**_opts)
def softmax_rows(x, out, log):
    for r in range(x.shape[0]):
        softmax_row(x[r], out[r], log)


@njit(parallel=True, **_opts)
def softmax_rows_par(x, out, log):
    if threads_now() < 2:  # one free core: serial, no pool thread (kernels/threads_now.py)
        softmax_rows(x, out, log)
        return
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
    if threads_now() < 2:
        layer_norm_rows(x, weight, bias, affine, eps, out)
        return
    for r in prange(x.shape[0]):
        layer_norm_row(x[r], weight, bias, affine, eps, out[r])


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
    total_loss = 0.0  # the sum over rows stays float64
    for r in range(logits.shape[0]):
        label = labels[r]
        row = logits[r]
        # Each row in the logits' dtype, as softmax_row: a float64 peak and sum made every exp
        # of a float32 row a float64 one (a second exp to compile, and no 16-lane loop).
        peak = row[0]  # a row exists: no classes means every label is bad (returned above)
        for j in range(n_classes):
            peak = maxnum(peak, row[j])
        total = zero_like(peak)
        for j in range(n_classes):
            total += row_exp(row[j] - peak)
        loss = (peak - row[label]) + math.log(total)
        if reduce:
            total_loss += loss
        else:
            out[r] = loss
    if reduce:
        out[0] = total_loss * scale
    return -1


__all__ = [
    "cross_entropy_rows",
    "layer_norm_rows",
    "layer_norm_rows_par",
    "logsumexp_strided",
    "softmax_rows",
    "softmax_rows_par",
    "softmax_strided",
    "transposed",  # views.transposed: every driver's transposes, found here (render/emit.py)
]


def _softmax(ctx: OpEmitter, node: Value, out: str, log: bool) -> list[str]:
    (x,) = node.inputs
    pre, n, post = ctx.split(x.shape, node.attrs["axis"])
    if post == 1:
        fn = ctx.row_kernel("softmax_rows", pre, n)
        return [f"{fn}({ctx.array(x)}.reshape(({pre}, {n})), {out}.reshape(({pre}, {n})), {log})"]
    return [
        f"softmax_strided({ctx.array(x)}.reshape(({pre}, {n}, {post})), "
        f"{out}.reshape(({pre}, {n}, {post})), {log})"
    ]


@emits("softmax")
def emit_softmax(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _softmax(ctx, node, out, False)


@emits("log_softmax")
def emit_log_softmax(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _softmax(ctx, node, out, True)


@emits("logsumexp")
def emit_logsumexp(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    (x,) = node.inputs
    axes = node.attrs["axes"]
    if not axes:
        return [f"{out}[:] = {ctx.array(x)}"]
    source = ctx.array(x)
    if list(axes) != list(range(axes[0], axes[-1] + 1)):
        kept = [a for a in range(len(x.shape)) if a not in axes]
        perm = ",".join(str(a) for a in kept + list(axes))
        source = f'np.ascontiguousarray(transposed({source}, "{perm}"))'
        pre, n, post = (
            math.prod(x.shape[a] for a in kept),
            math.prod(x.shape[a] for a in axes),
            1,
        )
    else:
        pre, n, post = ctx.split(x.shape, axes[0], len(axes))
    return [
        f"logsumexp_strided({source}.reshape(({pre}, {n}, {post})), {out}.reshape(({pre}, {post})))"
    ]


@emits("layer_norm")
def emit_layer_norm(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    x = node.inputs[0]
    cols = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    affine = len(node.inputs) == 3
    w = ctx.array(node.inputs[1]) if affine else f"np.empty(1, {NP_TYPE[x.dtype]})"
    b = ctx.array(node.inputs[2]) if affine else w
    fn = ctx.row_kernel("layer_norm_rows", rows, cols)
    return [
        f"{fn}({ctx.array(x)}.reshape(({rows}, {cols})), {w}, {b}, {affine}, "
        f"{literal(node.attrs['eps'], x.dtype)}, {out}.reshape(({rows}, {cols})))"
    ]


@emits("cross_entropy")
def emit_cross_entropy(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    logits, labels = node.inputs
    cols = logits.shape[-1]
    rows = math.prod(logits.shape[:-1])
    reduction = node.attrs["reduction"]
    scale = 1.0
    if reduction == "mean":
        scale = 1.0 / rows if rows else math.nan  # the mean over no rows is nan, as NumPy's
    target = f"{out}.reshape(({rows},))" if reduction == "none" else out
    if reduction == "sum" and rows == 1:
        scale = 1.0  # one row: the per-row loss is the sum
    return [
        f"bad = cross_entropy_rows({ctx.array(logits)}.reshape(({rows}, {cols})), "
        f"{ctx.array(labels)}.reshape(({rows},)), {target}, {literal(scale, 'f64')})",
        *ctx.index_error(node, labels, label_message(*HOLES, cols)),
    ]
