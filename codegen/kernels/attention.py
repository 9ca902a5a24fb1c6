"""Fused attention kernels: per (batch, head) and block of query rows, the scores live in a
(block, S) workspace only, so no (B, H, T, S) matrix is ever written; backward recomputes them.

Arrays are 4-D (batch, head, length, features) of any strides (the usual q, k, v are
transposed views of a projection), read in place. `width` is the GEMM's: 512 or 256 for
backplan's own (codegen/kernels/gemm), 0 for BLAS where rows are contiguous, as the plan chose per
shape (codegen/kernels/gemm/choice.py; BLAS is ahead on 256-bit CPUs). The parallel variants use the
own GEMM, which is single-threaded and allocates its own packing buffers, so threads share
(batch, head) pairs with no lock. Per block of rows:

    forward   P = softmax(scale * Q_r K^T, masked)      O_r = P V
    backward  P as above   dP = G_r V^T   dV += P^T G_r   dS = P * (dP - rowsum(P * dP)) * scale
              dQ_r = dS K   dK += dS^T Q_r

Under the causal mask a block of rows first..first+R-1 sees keys 0..first+R-1 only: its
products and softmax rows stop there (K, V, dK, dV cut to those rows), so a long causal
sequence does about half the work of an unmasked one instead of all of it.
"""

import math

import numpy as np

from backplan.codegen.build.library_progress import announce_compiles
from backplan.codegen.flags import FASTMATH, threads
from backplan.codegen.jit import njit, prange
from backplan.codegen.kernels.blas import gemm_rows, rows_contiguous
from backplan.codegen.kernels.gemm import gemm, vector_width
from backplan.codegen.kernels.gemm.choice import use_own_gemm
from backplan.codegen.kernels.row_math import zero_like
from backplan.codegen.kernels.rows import softmax_row
from backplan.codegen.kernels.views import as_read_only
from backplan.codegen.render.choices import decide
from backplan.codegen.render.opaque import OpEmitter, emits
from backplan.ir.graph import Value

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}
# Helpers only the kernels below call: no CPython or C wrapper to compile. They are not inlined
# either: inlining the GEMM calls at each of backward's seven sites tripled its compile time.
_helper = {**_opts, "no_cpython_wrapper": True, "no_cfunc_wrapper": True}
ROWS = 128  # query rows per block: a (128, S) f32 workspace stays in L2 for S up to ~2k


@njit(**_helper)
def _matmul(width, trans_a, trans_b, alpha, a, b, beta, c):
    """gemm with the empty cases settled here: nothing to write, or an empty inner axis."""
    if c.shape[0] == 0 or c.shape[1] == 0:
        return
    inner = a.shape[0] if trans_a else a.shape[1]
    if inner == 0:
        if beta == 0:
            c[:] = 0
        return
    if width == 0 and rows_contiguous(a) and rows_contiguous(b) and rows_contiguous(c):
        gemm_rows(trans_a, trans_b, alpha, a, b, beta, c)
    else:
        gemm(width if width else 256, trans_a, trans_b, alpha, a, b, beta, c)


@njit(**_helper)
def _probabilities(width, q, k, first, p, scale, causal):
    """p = softmax of the scaled scores of query rows first.. against keys 0..p.shape[1]-1
    (every key, or under the causal mask the keys the block's last row sees), masked."""
    _matmul(width, False, True, scale, q[first : first + p.shape[0]], k[: p.shape[1]], 0.0, p)
    keys = p.shape[1]
    for i in range(p.shape[0]):
        row = p[i]
        if causal:
            for j in range(min(first + i + 1, keys), keys):
                row[j] = -np.inf
        softmax_row(row, row, False)


@njit(**_helper)
def _seen(first, rows, keys, causal):
    """Keys any row of the block first..first+rows-1 sees: under the causal mask, the keys
    after its last row are zero in every row and take no part in the products."""
    return min(first + rows, keys) if causal else keys


@njit(**_helper)
def _block(flat, rows, seen):
    """A C-contiguous (rows, seen) view of a workspace of at least rows * seen elements."""
    return flat[: rows * seen].reshape((rows, seen))


@njit(**_helper)
def _head_forward(width, q, k, v, out, scale, causal):
    length, keys = q.shape[0], k.shape[0]
    if keys == 0:
        out[:] = 0  # softmax over no keys is empty; its product with v is zero
        return
    p_flat = np.empty(min(ROWS, length) * keys, q.dtype)
    for first in range(0, length, ROWS):
        rows = min(ROWS, length - first)
        seen = _seen(first, rows, keys, causal)
        p = _block(p_flat, rows, seen)
        _probabilities(width, q, k, first, p, scale, causal)
        _matmul(width, False, False, 1.0, p, v[:seen], 0.0, out[first : first + rows])


@njit(**_helper)
def _head_backward(width, q, k, v, g, dq, dk, dv, scale, causal):
    length, keys = q.shape[0], k.shape[0]
    dk[:] = 0
    dv[:] = 0
    if keys == 0:
        dq[:] = 0
        return
    p_flat = np.empty(min(ROWS, length) * keys, q.dtype)
    ds_flat = np.empty(min(ROWS, length) * keys, q.dtype)
    typed = np.empty(2, q.dtype)  # scale and each row's dot in q's dtype: f32 math stays f32
    typed[0] = scale
    for first in range(0, length, ROWS):
        rows = min(ROWS, length - first)
        seen = _seen(first, rows, keys, causal)
        p, ds = _block(p_flat, rows, seen), _block(ds_flat, rows, seen)
        g_rows = g[first : first + rows]
        _probabilities(width, q, k, first, p, scale, causal)
        _matmul(width, False, True, 1.0, g_rows, v[:seen], 0.0, ds)
        _matmul(width, True, False, 1.0, p, g_rows, 1.0, dv[:seen])
        for i in range(rows):
            dot = zero_like(p[i, 0])  # a float32 sum for float32 rows (0.0 made it float64)
            for j in range(seen):
                dot += p[i, j] * ds[i, j]
            typed[1] = dot
            row_dot, row_scale = typed[1], typed[0]
            for j in range(seen):
                ds[i, j] = p[i, j] * (ds[i, j] - row_dot) * row_scale
        _matmul(width, False, False, 1.0, ds, k[:seen], 0.0, dq[first : first + rows])
        _matmul(width, True, False, 1.0, ds, q[first : first + rows], 1.0, dk[:seen])


@njit(**_opts)
def attention_forward(width, q, k, v, out, scale, causal):
    """out[b, h] = softmax(scale * q[b, h] @ k[b, h]^T) @ v[b, h], one pair after another."""
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            _head_forward(width, q[b, h], k[b, h], v[b, h], out[b, h], scale, causal)


@njit(parallel=True, **_opts)
def attention_forward_par(width, q, k, v, out, scale, causal):
    heads = q.shape[1]
    for pair in prange(q.shape[0] * heads):
        b, h = pair // heads, pair % heads
        _head_forward(width, q[b, h], k[b, h], v[b, h], out[b, h], scale, causal)


@njit(**_opts)
def attention_backward(width, q, k, v, g, dq, dk, dv, scale, causal):
    """dq, dk, dv of sum(attention(q, k, v) * g), per (batch, head) pair."""
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            _head_backward(
                width, q[b, h], k[b, h], v[b, h], g[b, h], dq[b, h], dk[b, h], dv[b, h],
                scale, causal,
            )  # fmt: skip


@njit(parallel=True, **_opts)
def attention_backward_par(width, q, k, v, g, dq, dk, dv, scale, causal):
    heads = q.shape[1]
    for pair in prange(q.shape[0] * heads):
        b, h = pair // heads, pair % heads
        _head_backward(
            width, q[b, h], k[b, h], v[b, h], g[b, h], dq[b, h], dk[b, h], dv[b, h],
            scale, causal,
        )  # fmt: skip


# Cold compile seconds of each (first use per installation, version, dtype and layout; the
# shared helpers compile inside the first), measured on a 2-core Zen 3 box. The parallel
# variants compile their prange loop on top.
announce_compiles(
    {
        attention_forward: 3.0,
        attention_backward: 4.0,
        attention_forward_par: 4.0,
        attention_backward_par: 5.0,
    }
)


__all__ = [
    "as_read_only",
    "attention_backward",
    "attention_backward_par",
    "attention_forward",
    "attention_forward_par",
]


def _heads_shape(lead, tail) -> tuple:
    if len(lead) <= 2:
        return (1,) * (2 - len(lead)) + tuple(lead) + tuple(tail)
    return (math.prod(lead[:-1]), lead[-1]) + tuple(tail)


def _tokens_first(node: Value) -> bool:
    """The "bthd" layout: every array is (B, T, H, D), handed to the kernels transposed."""
    return node.attrs.get("layout", "bhtd") == "bthd"


def _heads(ctx: OpEmitter, node: Value, value: Value) -> str:
    """value as a 4-D (batch, heads, length, features) array: a strided view passes as it
    is when there are exactly two leading axes, or in the "bthd" layout (a transposed view of
    the (B, T, H, D) value); otherwise a contiguous reshape."""
    if _tokens_first(node):
        return f"{ctx.array(value, contiguous=False)}.transpose(0, 2, 1, 3)"
    lead = value.shape[:-2]
    if len(lead) == 2:
        return ctx.array(value, contiguous=False)
    return f"{ctx.array(value)}.reshape({_heads_shape(lead, value.shape[-2:])!r})"


def _written(node: Value, buffer: str, shape: tuple) -> str:
    """The 4-D (batch, heads, length, features) view the kernel writes of a contiguous buffer
    holding a value of this shape (the node's layout)."""
    if _tokens_first(node):
        return f"{buffer}.reshape({tuple(shape)!r}).transpose(0, 2, 1, 3)"
    return f"{buffer}.reshape({_heads_shape(shape[:-2], shape[-2:])!r})"


def _dims(node: Value) -> tuple[int, int, int, int]:
    """(batch * heads pairs, query length, key length, features) in either layout."""
    q, k = node.inputs[0].shape, node.inputs[1].shape
    if _tokens_first(node):
        return q[0] * q[2], q[1], k[1], q[3]
    return math.prod(q[:-2]), q[-2], k[-2], q[-1]


def _variant(fn: str, node: Value) -> tuple[str, int]:
    """The kernel (parallel over (batch, head) pairs when that pays) and its GEMM width:
    the own GEMM's in parallel (single-threaded, lock-free), else as chosen per shape,
    0 meaning BLAS."""
    pairs, t, s, d = _dims(node)
    parallel = threads() > 1 and pairs > 1 and pairs * t * s * max(d, 1) >= (1 << 16)
    if parallel:
        return f"{fn}_par", vector_width()
    own = use_own_gemm(min(t, 128), s, d, True, node.dtype)
    return fn, vector_width() if own else 0


def _scale_and_mask(node: Value) -> str:
    return f"{node.attrs['scale']!r}, {node.attrs['causal']}"


@emits("attention")
def emit_attention(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    q, k, v = (f"as_read_only({_heads(ctx, node, x)})" for x in node.inputs)
    out4 = _written(node, out, node.shape)
    fn, width = decide("attention", _variant("attention_forward", node))
    return [f"{fn}({width}, {q}, {k}, {v}, {out4}, {_scale_and_mask(node)})"]


@emits("attention_grad")
def emit_attention_grad(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    q, k, v, g = (f"as_read_only({_heads(ctx, node, x)})" for x in node.inputs)
    parts, offset = [], 0
    for x in node.inputs[:3]:
        parts.append(_written(node, f"{out}[{offset}:{offset + x.type.size}]", x.shape))
        offset += x.type.size
    fn, width = decide("attention", _variant("attention_backward", node))
    return [f"{fn}({width}, {q}, {k}, {v}, {g}, {', '.join(parts)}, {_scale_and_mask(node)})"]
