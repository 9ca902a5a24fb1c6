"""Index ops: take and its adjoint, one_hot, argmax/argmin along one axis. Functions that can
fail on data return the position of the first bad index (in the flattened index array), or
-1 when every index is valid: a position is never negative, so -1 is never ambiguous, even
when the bad index itself is -1."""

import math

from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit
from backplan.codegen.kernels.rows import _first_bad_label
from backplan.codegen.render.opaque import HOLES, OpEmitter, emits
from backplan.ir.graph import Value
from backplan.ir.index_check import index_message, label_message

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}


@njit(inline="always", **_opts)
def _first_bad_index(indices, size):
    """The position of the first index outside [-size, size), or -1 when all are valid."""
    for j in range(indices.shape[0]):
        if indices[j] < -size or indices[j] >= size:
            return j
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


@njit(inline="always", **_opts)
def _arg_extreme(x, p, q, want_max):
    """Index of the first max (or min) of x[p, :, q]; the first NaN wins, as in NumPy."""
    best, index = x[p, 0, q], 0
    if best != best:
        return 0
    for j in range(1, x.shape[1]):
        v = x[p, j, q]
        if v != v:
            return j
        if (v > best) if want_max else (v < best):
            best, index = v, j
    return index


@njit(**_opts)
def arg_extreme_strided(x, out, want_max):
    """out[p, q] = argmax (or argmin) of x[p, :, q]."""
    for p in range(x.shape[0]):
        for q in range(x.shape[2]):
            out[p, q] = _arg_extreme(x, p, q, want_max)


__all__ = ["arg_extreme_strided", "one_hot", "take_grad_strided", "take_strided"]


@emits("take")
def emit_take(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    x, idx = node.inputs
    pre, n, post = ctx.split(x.shape, node.attrs["axis"])
    m = math.prod(idx.shape)
    return [
        f"bad = take_strided({ctx.array(x)}.reshape(({pre}, {n}, {post})), "
        f"{ctx.array(idx)}.reshape(({m},)), {out}.reshape(({pre}, {m}, {post})))",
        *ctx.index_error(node, idx, index_message(*HOLES, n)),
    ]


@emits("take_grad")
def emit_take_grad(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    g, idx = node.inputs
    axis, size = node.attrs["axis"], node.attrs["size"]
    m = math.prod(idx.shape)
    pre, post = math.prod(g.shape[:axis]), math.prod(g.shape[axis + len(idx.shape) :])
    return [
        f"bad = take_grad_strided({ctx.array(g)}.reshape(({pre}, {m}, {post})), "
        f"{ctx.array(idx)}.reshape(({m},)), {out}.reshape(({pre}, {size}, {post})))",
        *ctx.index_error(node, idx, index_message(*HOLES, size)),
    ]


@emits("one_hot")
def emit_one_hot(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    (labels,) = node.inputs
    rows, depth = math.prod(labels.shape), node.attrs["depth"]
    return [
        f"bad = one_hot({ctx.array(labels)}.reshape(({rows},)), {out}.reshape(({rows}, {depth})))",
        *ctx.index_error(node, labels, label_message(*HOLES, depth)),
    ]


def _arg_extreme_call(ctx: OpEmitter, node: Value, out: str, want_max: bool) -> list[str]:
    (x,) = node.inputs
    pre, n, post = ctx.split(x.shape, node.attrs["axis"])
    return [
        f"arg_extreme_strided({ctx.array(x)}.reshape(({pre}, {n}, {post})), "
        f"{out}.reshape(({pre}, {post})), {want_max})"
    ]


@emits("argmax")
def emit_argmax(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _arg_extreme_call(ctx, node, out, True)


@emits("argmin")
def emit_argmin(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _arg_extreme_call(ctx, node, out, False)
