"""Composites with their own entries, because numerics or saved bytes demand it."""

import numpy as np

from ..errors import DtypeError, ShapeError
from ..index_check import check_in_range, label_message
from ..registry import AttrSpec, OpDef, register
from ..shapes import fmt, normalize_axes, normalize_axis, reduced_shape
from ..types import TensorType, compute_dtype, is_half, is_int
from .common import float_only

AXIS = {"axis": AttrSpec("int")}


def _axis_infer(types, attrs):
    (x,) = types
    float_only(types, "softmax")
    if attrs["axis"] != normalize_axis(attrs["axis"], len(x.shape)):
        raise ShapeError(f"axis must be non-negative, got {attrs['axis']}")
    return x


def _peak(x, axis):
    """The max along axis; -inf over an empty axis, so softmax of nothing is empty (PyTorch)."""
    return np.max(x, axis=axis, keepdims=True, initial=-np.inf)


def _softmax_ref(x, axis):
    shifted = x - _peak(x, axis)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax_ref(x, axis):
    shifted = x - _peak(x, axis)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _softmax_vjp(ctx, g):
    b, y, axis = ctx.b, ctx.output(), ctx.attrs["axis"]
    dot = b.sum(b.mul(g, y), axes=(axis,), keepdims=True)
    return [b.mul(y, b.sub(g, dot))]


def _log_softmax_vjp(ctx, g):
    b, y, axis = ctx.b, ctx.output(), ctx.attrs["axis"]
    total = b.sum(g, axes=(axis,), keepdims=True)
    return [b.sub(g, b.mul(b.exp(y), total))]


register(
    OpDef(
        "softmax",
        (1,),
        _axis_infer,
        _softmax_ref,
        "reduction",
        _softmax_vjp,
        attrs=AXIS,
        doc="stable softmax; saves its output",
    )
)
register(
    OpDef(
        "log_softmax",
        (1,),
        _axis_infer,
        _log_softmax_ref,
        "reduction",
        _log_softmax_vjp,
        attrs=AXIS,
        doc="stable log-softmax; saves its output",
    )
)


def _lse_infer(types, attrs):
    (x,) = types
    float_only(types, "logsumexp")
    axes = normalize_axes(attrs["axes"], len(x.shape))
    if tuple(attrs["axes"]) != axes:
        raise ShapeError(f"axes must be sorted and non-negative, got {attrs['axes']}")
    return TensorType(x.dtype, reduced_shape(x.shape, axes, attrs["keepdims"]))


def _lse_ref(x, axes, keepdims):
    from scipy import special  # imported on first use: it costs 0.1 s at startup

    if x.size == 0:  # scipy's logsumexp raises IndexError on an empty array over a tuple of axes
        return np.full(reduced_shape(x.shape, axes, keepdims), -np.inf, x.dtype)
    return special.logsumexp(x, axis=axes, keepdims=keepdims).astype(x.dtype)


def _lse_vjp(ctx, g):
    b, axes, ndim = ctx.b, ctx.attrs["axes"], len(ctx.in_type(0).shape)
    out = b.keepdims_like(ctx.output(), axes, ndim)
    return [b.mul(b.keepdims_like(g, axes, ndim), b.exp(b.sub(ctx.input(0), out)))]


register(
    OpDef(
        "logsumexp",
        (1,),
        _lse_infer,
        _lse_ref,
        "reduction",
        _lse_vjp,
        attrs={"axes": AttrSpec("axes"), "keepdims": AttrSpec("bool", False, required=False)},
        doc="stable log(sum(exp(x))); saves input and output",
    )
)


def _ce_infer(types, attrs):
    logits, labels = types
    float_only([logits], "cross_entropy")
    if not is_int(labels.dtype):
        raise DtypeError(f"labels must be integer class indices, got {labels.dtype}")
    if len(logits.shape) < 1 or logits.shape[:-1] != labels.shape:
        raise ShapeError(
            f"logits {fmt(logits.shape)} need labels of shape {fmt(logits.shape[:-1])}, "
            f"got {fmt(labels.shape)}"
        )
    if attrs["reduction"] == "none":
        return TensorType(logits.dtype, labels.shape)
    return TensorType(logits.dtype, ())


def _ce_ref(logits, labels, reduction):
    n_classes = logits.shape[-1]
    check_in_range(labels, 0, n_classes, label_message)
    logp = _log_softmax_ref(logits, logits.ndim - 1)
    picked = -np.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    if reduction == "none":
        return picked
    total = np.sum(picked, dtype=logits.dtype)
    if reduction == "sum":
        return total
    return total / logits.dtype.type(labels.size) if labels.size else logits.dtype.type(np.nan)


def _ce_vjp(ctx, g):
    """(softmax - onehot) * g. 16-bit logits: computed in float32, rounded once (as autocast
    runs the loss in float32): a probability rounded to bfloat16 before `- onehot` left the
    well-classified rows' gradient 1.6% off (median) and zero where p rounded to 1."""
    b, logits_t = ctx.b, ctx.in_type(0)
    axis, stored = len(logits_t.shape) - 1, logits_t.dtype
    logits = ctx.input(0)
    if is_half(stored):
        work = compute_dtype(stored)
        logits, g = b.astype(logits, dtype=work), b.astype(g, dtype=work)
    probs = b.softmax(logits, axis=axis)
    onehot = b.one_hot(ctx.input(1), depth=logits_t.shape[-1], dtype=probs.dtype)
    diff = b.sub(probs, onehot)
    if ctx.attrs["reduction"] == "none":
        grad = b.mul(diff, b.reshape(g, shape=g.shape + (1,)))
    else:
        if ctx.attrs["reduction"] == "mean":
            g = b.div(g, b.scalar(max(ctx.in_type(1).size, 1), g.dtype))
        grad = b.mul(diff, g)
    return [grad if grad.dtype == stored else b.astype(grad, dtype=stored), None]


register(
    OpDef(
        "cross_entropy",
        (2,),
        _ce_infer,
        _ce_ref,
        "reduction",
        _ce_vjp,
        attrs={"reduction": AttrSpec("str", "mean", ("mean", "sum", "none"), required=False)},
        doc="softmax cross-entropy with integer labels; saves logits and labels",
    )
)


def _ln_infer(types, attrs):
    x = types[0]
    float_only(types, "layer_norm")
    if len(x.shape) < 1:
        raise ShapeError("needs at least one dimension")
    for t in types[1:]:
        if t.shape != x.shape[-1:] or t.dtype != x.dtype:
            raise ShapeError(f"weight and bias must be {x.dtype}{fmt(x.shape[-1:])}, got {t}")
    return x


def _ln_ref(x, *affine, eps):
    if x.shape[-1] == 0:  # no features: an empty result, without NumPy's empty-mean warning
        return np.zeros(x.shape, x.dtype)
    mean = np.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = np.mean(centered * centered, axis=-1, keepdims=True)
    y = centered / np.sqrt(var + x.dtype.type(eps))
    if affine:
        y = y * affine[0] + affine[1]
    return y


def normalise_last_axis(b, x, eps: float):
    """(1/n, 1/std, x normalised) over the last axis, in registry ops: layer_norm's derivative
    rule builds them, and joint plans write layer_norm itself with them (ir/passes.py
    expand_layer_norm), in the same order, so common-subexpression elimination shares them.
    A 16-bit x is read as float32 and they are float32, as the op itself computes (ir/widen.py):
    written in bfloat16 each statistic was a buffer rounded on its own."""
    x = as_dtype(b, x, "f32") if is_half(x.dtype) else x
    dt, last = x.dtype, len(x.shape) - 1
    inv_n = b.scalar(1.0 / max(x.shape[-1], 1), dt)  # no features: it scales only empties
    mean = b.mul(b.sum(x, axes=(last,), keepdims=True), inv_n)
    centered = b.sub(x, mean)
    var = b.mul(b.sum(b.mul(centered, centered), axes=(last,), keepdims=True), inv_n)
    rstd = b.div(b.scalar(1, dt), b.sqrt(b.add(var, b.scalar(eps, dt))))
    return inv_n, rstd, b.mul(centered, rstd)


def _ln_vjp(ctx, g):
    """Saves x (and the weight); mean and 1/std are recomputed, not saved."""
    b, x_t = ctx.b, ctx.in_type(0)
    last = len(x_t.shape) - 1
    inv_n, rstd, xhat = normalise_last_axis(b, ctx.input(0), ctx.attrs["eps"])
    dt = xhat.dtype  # float32 for 16-bit inputs: the gradients are rounded once, at the end
    g = as_dtype(b, g, dt)
    affine = len(ctx.node.inputs) == 3
    grads = [None] * len(ctx.node.inputs)
    if ctx.needs[0]:
        gxhat = b.mul(g, as_dtype(b, ctx.input(1), dt)) if affine else g
        mean_g = b.mul(b.sum(gxhat, axes=(last,), keepdims=True), inv_n)
        mean_gx = b.mul(b.sum(b.mul(gxhat, xhat), axes=(last,), keepdims=True), inv_n)
        dx = b.mul(rstd, b.sub(b.sub(gxhat, mean_g), b.mul(xhat, mean_gx)))
        grads[0] = as_dtype(b, dx, x_t.dtype)
    if affine and ctx.needs[1]:
        grads[1] = as_dtype(b, b.sum_to(b.mul(g, xhat), x_t.shape[-1:]), ctx.in_type(1).dtype)
    if affine and ctx.needs[2]:
        grads[2] = as_dtype(b, b.sum_to(g, x_t.shape[-1:]), ctx.in_type(2).dtype)
    return grads


def as_dtype(b, value, dtype: str):
    """value as dtype, with no cast where it is one already."""
    return value if value.dtype == dtype else b.astype(value, dtype=dtype)


register(
    OpDef(
        "layer_norm",
        (1, 3),
        _ln_infer,
        _ln_ref,
        "reduction",
        _ln_vjp,
        attrs={"eps": AttrSpec("float", 1e-5, required=False)},
        doc="layer_norm(x[, weight, bias]) over the last axis; saves x (and weight)",
        cost="one_pass",
    )
)
