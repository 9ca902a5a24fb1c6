"""Neural-network ops of core ATen: matrix products, convolution, pooling, softmax, the
normalisations (layer, batch in training and eval, group), embedding, dropout, losses. Each
returns what its ATen overload returns, with None for outputs backplan does not compute
(saved means and inverse deviations, pooling indices): a graph that reads one is refused."""

from __future__ import annotations

import math

from backplan.tracer import ops
from backplan.tracer.attention import scaled_dot_product_attention
from backplan.tracer.conv import arange, avg_pool2d, conv2d, max_pool2d
from backplan.tracer.random import dropout

from .errors import TorchImportError
from .table import aten


def _same_dtype(op: str, *operands) -> None:
    """torch multiplies and convolves only operands of one dtype ("mat1 and mat2 must have the
    same dtype"); torch.export does not check it, and NumPy's promotion would compute what
    torch refuses (a float32 module on a bfloat16 input, in float32)."""
    present = [t for t in operands if t is not None]
    if len({t.dtype for t in present}) > 1:
        shown = ", ".join(f"{t._ir_dtype}[{','.join(map(str, t.shape))}]" for t in present)
        raise TorchImportError(
            f"{op} of {shown}: torch refuses a product of two dtypes "
            "(its eager call raises 'must have the same dtype'); cast the module "
            "(module.to(dtype)) or the input to one dtype"
        )


@aten("mm.default", "bmm.default", "matmul.default")
def matmul(a, b):
    _same_dtype("matmul", a, b)
    return ops.matmul(a, b)


@aten("addmm.default")
def addmm(bias, a, b, beta=1, alpha=1):
    _same_dtype("addmm", bias, a, b)
    product = ops.matmul(a, b)
    product = product if alpha == 1 else ops.mul(product, alpha)
    return ops.add(bias if beta == 1 else ops.mul(bias, beta), product)


@aten("convolution.default")
def convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    if transposed or x.ndim != 4:
        kind = "transposed" if transposed else f"{x.ndim - 2}-D"
        raise TorchImportError(f"convolution: backplan maps 2-D convolutions, this one is {kind}")
    _same_dtype("convolution", x, w, b)
    return conv2d(x, w, b, tuple(stride), tuple(padding), tuple(dilation), groups)


def _pool_args(op, kernel, stride, padding, dilation=(1, 1), ceil_mode=False):
    if ceil_mode or any(d != 1 for d in dilation):
        raise TorchImportError(f"{op}: ceil_mode and dilation are not mapped")
    return tuple(kernel), tuple(stride) if stride else None, tuple(padding)


@aten("max_pool2d_with_indices.default")
def max_pool(x, kernel, stride=(), padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    kernel, stride, padding = _pool_args("max_pool2d", kernel, stride, padding, dilation, ceil_mode)
    return max_pool2d(x, kernel, stride, padding), None


@aten("avg_pool2d.default")
def avg_pool(x, kernel, stride=(), padding=(0, 0), ceil_mode=False, count_include_pad=True,
             divisor_override=None):  # fmt: skip
    if divisor_override is not None or (not count_include_pad and any(padding)):
        raise TorchImportError("avg_pool2d: divisor_override and count_include_pad=False")
    kernel, stride, padding = _pool_args("avg_pool2d", kernel, stride, padding, (1, 1), ceil_mode)
    return avg_pool2d(x, kernel, stride, padding)


@aten("_softmax.default")
def softmax(x, dim, half_to_float=False):
    return ops.softmax(x, dim)


@aten("_log_softmax.default")
def log_softmax(x, dim, half_to_float=False):
    return ops.log_softmax(x, dim)


@aten("native_layer_norm.default")
def layer_norm(x, shape, weight, bias, eps):
    k = len(shape)
    if k == 1:
        return ops.layer_norm(x, weight, bias, eps), None, None
    flat = ops.reshape(x, x.shape[:-k] + (math.prod(shape),))
    w = None if weight is None else ops.reshape(weight, (-1,))
    b = None if bias is None else ops.reshape(bias, (-1,))
    return ops.reshape(ops.layer_norm(flat, w, b, eps), x.shape), None, None


def _channel(v, ndim):
    return ops.reshape(v, (1, -1) + (1,) * (ndim - 2))


def _normalize(x, mean, var, weight, bias, eps):
    out = ops.div(ops.sub(x, mean), ops.sqrt(ops.add(var, eps)))
    if weight is not None:
        out = ops.mul(out, _channel(weight, x.ndim))
    if bias is not None:
        out = ops.add(out, _channel(bias, x.ndim))
    return out


def _batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = ops.mean(x, axes, keepdims=True)
    centered = ops.sub(x, mean)
    var = ops.mean(ops.mul(centered, centered), axes, keepdims=True)
    n = x.size // x.shape[1]
    return mean, var, n


@aten("_native_batch_norm_legit_functional.default")
def batch_norm_train(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Training: normalise by the batch's statistics; the running statistics move toward them
    (the variance unbiased, as PyTorch), outside the gradient."""
    if not training:
        return batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps) + (
            running_mean,
            running_var,
        )
    mean, var, n = _batch_stats(x)
    out = _normalize(x, mean, var, weight, bias, eps)
    batch_mean = ops.stop_gradient(ops.reshape(mean, (-1,)))
    batch_var = ops.stop_gradient(ops.reshape(var, (-1,))) * (n / max(n - 1, 1))
    new_mean = ops.add(ops.mul(running_mean, 1 - momentum), ops.mul(batch_mean, momentum))
    new_var = ops.add(ops.mul(running_var, 1 - momentum), ops.mul(batch_var, momentum))
    return out, None, None, new_mean, new_var


@aten("_native_batch_norm_legit.no_stats")
def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    mean, var, _ = _batch_stats(x)
    return _normalize(x, mean, var, weight, bias, eps), None, None


@aten("_native_batch_norm_legit_no_training.default")
def batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps):
    mean, var = _channel(running_mean, x.ndim), _channel(running_var, x.ndim)
    return _normalize(x, mean, var, weight, bias, eps), None, None


@aten("native_group_norm.default")
def group_norm(x, weight, bias, n, c, hw, groups, eps):
    grouped = ops.reshape(x, (n, groups, -1))
    mean = ops.mean(grouped, 2, keepdims=True)
    centered = ops.sub(grouped, mean)
    var = ops.mean(ops.mul(centered, centered), 2, keepdims=True)
    out = ops.reshape(ops.div(centered, ops.sqrt(ops.add(var, eps))), x.shape)
    if weight is not None:
        out = ops.mul(out, _channel(weight, x.ndim))
    if bias is not None:
        out = ops.add(out, _channel(bias, x.ndim))
    return out, None, None


@aten("embedding.default")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise TorchImportError("embedding: scale_grad_by_freq and sparse are not mapped")
    if padding_idx >= 0:  # that row gets no gradient, as in PyTorch
        rows = ops.expand_dims(ops.not_equal(_arange_rows(weight), padding_idx), 1)
        weight = ops.where(rows, weight, ops.stop_gradient(weight))
    return ops.embedding(indices, weight)


def _arange_rows(weight):
    return arange(0, weight.shape[0])


@aten("native_dropout.default", context=True)
def native_dropout(ctx, x, p, train):
    if not train or p == 0:
        return x, None
    return dropout(x, float(p), ctx.next_key("dropout")), None


@aten("nll_loss_forward.default")
def nll_loss(log_probs, target, weight, reduction, ignore_index):
    """-log_probs[target] averaged (reduction 1), summed (2) or kept (0); targets equal to
    ignore_index count neither in the loss nor in the mean's denominator."""
    if weight is not None:
        raise TorchImportError("nll_loss: class weights are not mapped")
    classes = log_probs.shape[-1] if log_probs.ndim == 1 else log_probs.shape[1]
    if log_probs.ndim > 2:
        log_probs = ops.swapaxes(log_probs, 1, -1)
    keep = ops.not_equal(target, ignore_index)
    safe = ops.where(keep, target, 0)
    picked = ops.sum(ops.mul(log_probs, ops.one_hot(safe, classes, log_probs.dtype)), -1)
    losses = ops.where(keep, ops.neg(picked), 0.0)
    count = ops.sum(ops.astype(keep, log_probs.dtype))
    if reduction == 0:
        return losses, count
    total = ops.sum(losses)
    return (total if reduction == 2 else ops.div(total, count)), count


@aten("mse_loss.default")
def mse_loss(x, y, reduction=1):
    diff = ops.sub(x, y)
    squares = ops.mul(diff, diff)
    return squares if reduction == 0 else ops.sum(squares) if reduction == 2 else ops.mean(squares)


@aten(
    "scaled_dot_product_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
)
def attention(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None, **_more):
    return scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)


@aten("constant_pad_nd.default")
def constant_pad(x, pad, value=0.0):
    for i in range(0, len(pad), 2):
        axis = x.ndim - 1 - i // 2
        before, after = pad[i], pad[i + 1]
        if before < 0 or after < 0:
            raise TorchImportError("constant_pad_nd: negative padding is not mapped")
        parts = [x]
        if before:
            parts.insert(
                0, ops.full(x.shape[:axis] + (before,) + x.shape[axis + 1 :], value, x.dtype)
            )
        if after:
            parts.append(ops.full(x.shape[:axis] + (after,) + x.shape[axis + 1 :], value, x.dtype))
        x = ops.concatenate(parts, axis) if len(parts) > 1 else x
    return x
