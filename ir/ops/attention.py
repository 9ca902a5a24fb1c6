"""Scaled dot-product attention as one op, so that no (T, S) score matrix outlives the kernel.

attention(q, k, v) = softmax(scale * q @ k^T [causal mask]) @ v over the last two axes, the
leading axes being batch and heads (equal for all three). Its derivative is one more op,
attention_grad(q, k, v, g), which recomputes the probabilities row block by row block and
returns dq, dk and dv packed in one flat array (a node has one value; the three are free views
of it). So the forward saves q, k and v only, as flash attention does; unfused, softmax saves
its (T, S) output and the matmuls save it again.

attention_grad's own derivative (second order) is the derivative of the same computation
written in primitive ops (`decomposed_grad`), so higher derivatives need no third op.
The causal mask is PyTorch's is_causal: query i sees keys 0..i (top-left aligned).

`layout` says where the heads axis is. "bhtd" (the default, PyTorch's): q, k, v and the output
are (..., heads, length, features). "bthd": all four are (batch, length, heads, features), the
layout a (B, T, H * D) projection has once reshaped, and the one the output projection reads;
gradients come back in it too. ir/attention_fusion.py picks it where the output's only reader
is transpose(0, 2, 1, 3), so neither the output nor dq, dk, dv is copied between layouts: the
kernels read and write (B, T, H, D) arrays through transposed views.
"""

import math

import numpy as np

from ..errors import ShapeError
from ..graph import Graph, inline_graph
from ..registry import AttrSpec, OpDef, register
from ..shapes import fmt
from ..types import TensorType, compute_dtype, np_dtype
from .common import float_only, same_dtype

LAYOUTS = ("bhtd", "bthd")
ATTRS = {
    "scale": AttrSpec("float"),
    "causal": AttrSpec("bool", False, required=False),
    "layout": AttrSpec("str", "bhtd", choices=LAYOUTS, required=False),
}
HEADS_SWAP = (0, 2, 1, 3)  # (B, T, H, D) <-> (B, H, T, D)


def heads_first(t: TensorType) -> TensorType:
    """A "bthd" type as the "bhtd" one the same data has once its axes 1 and 2 swap."""
    return TensorType(t.dtype, tuple(t.shape[i] for i in HEADS_SWAP))


def attention_type(
    q: TensorType, k: TensorType, v: TensorType, op: str, layout: str = "bhtd"
) -> TensorType:
    """The shape rule: q (..., T, D), k (..., S, D), v (..., S, Dv) -> (..., T, Dv); in the
    "bthd" layout q (B, T, H, D), k (B, S, H, D), v (B, S, H, Dv) -> (B, T, H, Dv)."""
    if layout == "bthd":
        if not len(q.shape) == len(k.shape) == len(v.shape) == 4:
            raise ShapeError(
                f"{op} in layout bthd takes 4-D (batch, length, heads, features) q, k and v, got "
                f"q {fmt(q.shape)}, k {fmt(k.shape)}, v {fmt(v.shape)}"
            )
        return heads_first(attention_type(*(heads_first(x) for x in (q, k, v)), op))
    float_only([q, k, v], op)
    dtype = same_dtype([q, k, v], op)
    if min(len(q.shape), len(k.shape), len(v.shape)) < 2:
        raise ShapeError("q, k and v need at least 2 dimensions (..., length, features)")
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ShapeError(
            f"q {fmt(q.shape)}, k {fmt(k.shape)} and v {fmt(v.shape)} must share their leading "
            "(batch, head) axes; broadcast them first"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"q {fmt(q.shape)} and k {fmt(k.shape)} differ in their last axis")
    if k.shape[-2] != v.shape[-2]:
        raise ShapeError(f"k {fmt(k.shape)} and v {fmt(v.shape)} differ in their key axis")
    return TensorType(dtype, q.shape[:-1] + (v.shape[-1],))


def _attention_infer(types, attrs):
    return attention_type(*types, "attention", attrs["layout"])


def _grad_infer(types, attrs):
    q, k, v, g = types
    out = attention_type(q, k, v, "attention_grad", attrs["layout"])
    if g != out:
        raise ShapeError(f"the output gradient must be {out}, got {g}")
    return TensorType(out.dtype, (q.size + k.size + v.size,))


def causal_mask(t: int, s: int) -> np.ndarray:
    """True where query i may see key j (j <= i)."""
    return np.tril(np.ones((t, s), bool))


def _probabilities(q, k, scale, causal):
    scores = scale * (q @ np.swapaxes(k, -1, -2))
    if causal:
        scores = np.where(causal_mask(*scores.shape[-2:]), scores, -np.inf)
    peak = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(scores - peak)
    return e / np.sum(e, axis=-1, keepdims=True)


def _swapped(layout: str, *arrays) -> list:
    """The arrays as "bhtd" views (or back: the swap is its own inverse)."""
    if layout == "bhtd":
        return list(arrays)
    return [np.swapaxes(x, 1, 2) for x in arrays]


def _attention_ref(q, k, v, scale, causal, layout="bhtd"):
    q, k, v = _swapped(layout, q, k, v)
    return _swapped(layout, _probabilities(q, k, scale, causal) @ v)[0]


def _grad_ref(q, k, v, g, scale, causal, layout="bhtd"):
    q, k, v, g = _swapped(layout, q, k, v, g)
    p = _probabilities(q, k, scale, causal)
    dv = np.swapaxes(p, -1, -2) @ g
    dp = g @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True)) * scale
    dq, dk = ds @ k, np.swapaxes(ds, -1, -2) @ q
    grads = _swapped(layout, dq, dk, dv)
    return np.concatenate([x.ravel() for x in grads]).astype(q.dtype, copy=False)


def unpack(b, packed, types: list[TensorType]) -> list:
    """dq, dk, dv as reshaped slices of attention_grad's flat result (views, no copies)."""
    parts, offset = [], 0
    for t in types:
        flat = b.slice(packed, starts=(offset,), stops=(offset + t.size,), steps=(1,))
        parts.append(b.reshape(flat, shape=t.shape))
        offset += t.size
    return parts


def _attention_vjp(ctx, g):
    q, k, v = (ctx.input(i) for i in range(3))
    packed = ctx.b.attention_grad(q, k, v, g, **ctx.attrs)
    grads = unpack(ctx.b, packed, [ctx.in_type(i) for i in range(3)])
    return [grad if need else None for grad, need in zip(grads, ctx.needs, strict=True)]


def decomposed_grad(b, q, k, v, g, scale: float, causal: bool, layout: str = "bhtd"):
    """attention_grad in primitive ops (the derivative of this is attention_grad's). 16-bit
    inputs are widened to float32 and the packed result rounded once, as the fused kernel
    computes: rounding each of the chain's ops (scores, probabilities, dp - dot) put bfloat16
    second derivatives 1.2-1.6e-2 of their scale from float64, against 0.2-0.4e-2 after."""
    stored = q.dtype
    if compute_dtype(stored) != stored:
        q, k, v, g = (b.astype(x, dtype=compute_dtype(stored)) for x in (q, k, v, g))
    if layout == "bthd":
        q, k, v, g = (b.transpose(x, perm=HEADS_SWAP) for x in (q, k, v, g))
    scores = b.mul(b.matmul(q, b.swap_last2(k)), b.scalar(scale, q.dtype))
    if causal:
        t, s = scores.shape[-2:]
        mask = np.where(causal_mask(t, s), 0.0, -np.inf).astype(np_dtype(q.dtype))
        name = b.graph.add_constant(mask)
        scores = b.add(scores, b.const(name=name, shape=mask.shape, dtype=q.dtype))
    p = b.softmax(scores, axis=len(scores.shape) - 1)
    last = (len(p.shape) - 1,)
    dv = b.matmul(b.swap_last2(p), g)
    dp = b.matmul(g, b.swap_last2(v))
    dot = b.sum(b.mul(p, dp), axes=last, keepdims=True)
    ds = b.mul(b.mul(p, b.sub(dp, dot)), b.scalar(scale, q.dtype))
    grads = [b.matmul(ds, k), b.matmul(b.swap_last2(ds), q), dv]
    if layout == "bthd":
        grads = [b.transpose(x, perm=HEADS_SWAP) for x in grads]
    flat = [b.reshape(x, shape=(x.type.size,)) for x in grads]
    packed = b.concatenate(*flat, axis=0)
    return packed if packed.dtype == stored else b.astype(packed, dtype=stored)


def _grad_vjp(ctx, h):
    from ..autodiff import append_gradients  # autodiff imports the registry, which imports us
    from ..builder import Builder

    sub = Graph("attention_grad_decomposed")
    inputs = [sub.add_input(ctx.in_type(i)) for i in range(4)]
    cotangent = sub.add_input(h.type)
    b = Builder(sub, ctx.node.loc)
    packed = decomposed_grad(b, *inputs, **ctx.attrs)
    sub.outputs = [b.sum(b.mul(packed, cotangent), axes=(0,))]
    sub.outputs = append_gradients(sub, list(ctx.needs) + [False])
    grads = iter(inline_graph(ctx.b.graph, sub, [ctx.input(i) for i in range(4)] + [h]))
    return [next(grads) if need else None for need in ctx.needs]


def _attention_flops(q: TensorType, k: TensorType, v: TensorType, layout: str) -> int:
    """The two products and the softmax: (..., T, S) scores of D-long dots, then Dv-long ones."""
    if layout == "bthd":
        q, k, v = (heads_first(x) for x in (q, k, v))
    scores = q.size // max(q.shape[-1], 1) * k.shape[-2]
    return scores * (2 * q.shape[-1] + 2 * v.shape[-1] + 5)


def default_scale(features: int) -> float:
    """1 / sqrt(D), as PyTorch and JAX default to (1 for D = 0, which has no scores to scale)."""
    return 1.0 / math.sqrt(features) if features else 1.0


register(
    OpDef(
        "attention",
        (3,),
        _attention_infer,
        _attention_ref,
        "opaque",
        _attention_vjp,
        attrs=ATTRS,
        doc="softmax(scale * q @ k^T) @ v in one kernel; saves q, k and v, no (T, S) scores",
        flops=lambda types, out, attrs: _attention_flops(*types[:3], attrs["layout"]),
    )
)
register(
    OpDef(
        "attention_grad",
        (4,),
        _grad_infer,
        _grad_ref,
        "opaque",
        _grad_vjp,
        attrs=ATTRS,
        doc="dq, dk, dv of attention packed flat; recomputes the probabilities, saves q, k, v, g",
        flops=lambda types, out, attrs: 5 * _attention_flops(*types[:3], attrs["layout"]) // 2,
    )
)
