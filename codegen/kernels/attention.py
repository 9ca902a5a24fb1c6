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

Keys beyond `tile` (KEYS from the plan) run key-tiled, so no tile outgrows (R, tile):
the forward keeps each row's running max and sum (online softmax) and rescales its output
rows when the max grows, then divides once; the backward makes two sweeps over the key tiles,
the first for each row's max, sum and rowsum(P * dP) (products Q K^T and G V^T), the second for
the gradients as above: seven products where the untiled backward runs five.

Every tile and row statistic is a slice of `work`, the plan's workspace for the kernel (a
slice of its scratch arena, sized by ir/kernel_workspace.py, carved here in its order): the
kernels allocate nothing. The parallel variants run the pairs on the workspace's slots, each
slot's pairs on one thread in that slot's `per` elements.
"""

import math

import numpy as np

from backplan.codegen.build.library_progress import announce_compiles
from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit, prange
from backplan.codegen.kernels.blas import gemm_rows, rows_contiguous
from backplan.codegen.kernels.by_address import by_address
from backplan.codegen.kernels.gemm import gemm, vector_width
from backplan.codegen.kernels.gemm.choice import use_own_gemm
from backplan.codegen.kernels.row_math import maxnum, one_like, row_exp, zero_like
from backplan.codegen.kernels.rows import softmax_row
from backplan.codegen.kernels.threads_now import threads_now
from backplan.codegen.kernels.views import as_read_only
from backplan.codegen.render.choices import chosen
from backplan.codegen.render.opaque import OpEmitter, emits
from backplan.ir.graph import Value
from backplan.ir.kernel_workspace import (
    ALIGN,
    KEYS,
    ROWS,
    attention_dims,
    attention_elements,
    attention_slot_elements,
    attention_slots,
)

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}
# Helpers only the kernels below call: no CPython or C wrapper to compile. They are not inlined
# (inlining the GEMM calls at each of backward's seven sites tripled its compile time) nor
# linked: each is called by address (by_address.py), so its machine code is made once and not
# again in every caller above it (both directions cold, one core: 11.2 -> 6.0 CPU s). Small
# leaves stay linked.
_helper = {**_opts, "no_cpython_wrapper": True, "no_cfunc_wrapper": True}


@by_address(arrays=(7,), read_only=(4, 5), **_helper)  # one variant for every operand layout
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


@by_address(**_helper)
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


@njit(**_helper)  # a leaf: linked, cheaper than a lookup on load
def _seen(first, rows, keys, causal):
    """Keys any row of the block first..first+rows-1 sees: under the causal mask, the keys
    after its last row are zero in every row and take no part in the products."""
    return min(first + rows, keys) if causal else keys


@njit(**_helper)  # a leaf: linked, cheaper than a lookup on load
def _block(flat, rows, seen):
    """A C-contiguous (rows, seen) view of a workspace of at least rows * seen elements."""
    return flat[: rows * seen].reshape((rows, seen))


@by_address(**_helper)
def _scores(width, q, k, first, start, s, scale, causal):
    """s = scale * Q K^T for query rows first.. against keys start.., masked: one tile."""
    rows, keys = s.shape
    _matmul(width, False, True, scale, q[first : first + rows], k[start : start + keys], 0.0, s)
    if causal:
        for i in range(rows):
            for j in range(max(first + i + 1 - start, 0), keys):
                s[i, j] = -np.inf


@by_address(**_helper)
def _exp_online(s, peak, total, factor):
    """One key tile of an online softmax, per row: the running max `peak` takes in the tile's
    scores, s becomes exp(s - peak), the running sum `total` is rescaled to the new max and
    takes in the row's sum, and factor = exp(old max - new max) for what else was summed."""
    for i in range(s.shape[0]):
        row = s[i]
        top = peak[i]
        for j in range(row.shape[0]):
            top = maxnum(top, row[j])
        if top == -np.inf:  # every key so far masked: nothing to add (exp(-inf + inf) is NaN)
            factor[i] = one_like(top)
            row[:] = 0
            continue
        factor[i] = row_exp(peak[i] - top)
        added = zero_like(top)
        for j in range(row.shape[0]):
            e = row_exp(row[j] - top)
            row[j] = e
            added += e
        total[i] = total[i] * factor[i] + added
        peak[i] = top


@njit(**_helper)  # a leaf: linked, cheaper than a lookup on load
def _take(work, at, count):
    """The workspace's next piece of `count` elements from `at`, and where the one after it
    starts (rounded up to ALIGN elements, as ir/kernel_workspace.py sizes the pieces)."""
    return work[at : at + count], at + (count + ALIGN - 1) // ALIGN * ALIGN


@by_address(**_helper)
def _forward_tiled(width, q, k, v, out, scale, causal, tile, work):
    """_head_forward over key tiles: out rows accumulate P_t V_t, rescaled as the max grows."""
    length, keys = q.shape[0], k.shape[0]
    most = min(ROWS, length)
    s_flat, at = _take(work, 0, most * tile)
    acc_flat, at = _take(work, at, most * v.shape[1])
    acc = acc_flat.reshape((most, v.shape[1]))
    peak, at = _take(work, at, most)
    total, at = _take(work, at, most)
    factor, at = _take(work, at, most)
    for first in range(0, length, ROWS):
        rows = min(ROWS, length - first)
        seen = _seen(first, rows, keys, causal)
        peak[:rows] = -np.inf
        total[:rows] = 0
        for start in range(0, seen, tile):
            s = _block(s_flat, rows, min(tile, seen - start))
            _scores(width, q, k, first, start, s, scale, causal)
            _exp_online(s, peak[:rows], total[:rows], factor[:rows])
            if start > 0:
                _scale_rows(acc[:rows], factor)
            beta = 0.0 if start == 0 else 1.0
            _matmul(width, False, False, 1.0, s, v[start : start + s.shape[1]], beta, acc[:rows])
        for i in range(rows):
            inverse = one_like(total[i]) / total[i]
            for d in range(acc.shape[1]):
                out[first + i, d] = acc[i, d] * inverse


@njit(**_helper)  # a leaf: linked, cheaper than a lookup on load
def _scale_rows(a, factor):
    for i in range(a.shape[0]):
        for d in range(a.shape[1]):
            a[i, d] *= factor[i]


@by_address(**_helper)
def _head_forward(width, q, k, v, out, scale, causal, tile, work):
    length, keys = q.shape[0], k.shape[0]
    if keys == 0:
        out[:] = 0  # softmax over no keys is empty; its product with v is zero
        return
    if keys > tile:
        _forward_tiled(width, q, k, v, out, scale, causal, tile, work)
        return
    p_flat = work[: min(ROWS, length) * keys]
    for first in range(0, length, ROWS):
        rows = min(ROWS, length - first)
        seen = _seen(first, rows, keys, causal)
        p = _block(p_flat, rows, seen)
        _probabilities(width, q, k, first, p, scale, causal)
        _matmul(width, False, False, 1.0, p, v[:seen], 0.0, out[first : first + rows])


@by_address(**_helper)
def _row_sums(width, q, k, v, g, first, seen, tile, s_flat, dp_flat, stats, scale, causal):
    """The backward's first sweep over one row block's key tiles: each row's max, its sum of
    exp(s - max) and rowsum(P * dP) unnormalised (dP = G V^T), kept as `stats` (peak, total,
    dot, factor) for the second."""
    peak, total, dot, factor = stats
    rows = peak.shape[0]
    peak[:] = -np.inf
    total[:] = 0
    dot[:] = 0
    for start in range(0, seen, tile):
        keys = min(tile, seen - start)
        s, dp = _block(s_flat, rows, keys), _block(dp_flat, rows, keys)
        _scores(width, q, k, first, start, s, scale, causal)
        _matmul(width, False, True, 1.0, g[first : first + rows], v[start : start + keys], 0.0, dp)
        _exp_online(s, peak, total, factor)
        for i in range(rows):
            added = zero_like(total[i])
            for j in range(keys):
                added += s[i, j] * dp[i, j]
            dot[i] = dot[i] * factor[i] + added


@by_address(**_helper)
def _tile_gradients(width, q, k, v, g, dq, dk, dv, first, seen, tile, work, stats, scale, causal):
    """The second sweep: per key tile P = exp(s - max) / total, dP = G V^T, dV += P^T G,
    dS = P * (dP - rowsum(P * dP)) * scale, dQ += dS K, dK += dS^T Q."""
    s_flat, dp_flat, typed = work
    peak, total, dot, _ = stats
    rows = peak.shape[0]
    q_rows, g_rows = q[first : first + rows], g[first : first + rows]
    for i in range(rows):
        total[i] = one_like(total[i]) / total[i]  # now each row's 1 / sum
        dot[i] *= total[i]  # now rowsum(P * dP) of the normalised P
    for start in range(0, seen, tile):
        keys = min(tile, seen - start)
        s, ds = _block(s_flat, rows, keys), _block(dp_flat, rows, keys)
        _scores(width, q, k, first, start, s, scale, causal)
        for i in range(rows):
            for j in range(keys):
                s[i, j] = row_exp(s[i, j] - peak[i]) * total[i]
        _matmul(width, False, True, 1.0, g_rows, v[start : start + keys], 0.0, ds)
        _matmul(width, True, False, 1.0, s, g_rows, 1.0, dv[start : start + keys])
        row_scale = typed[0]
        for i in range(rows):
            for j in range(keys):
                ds[i, j] = s[i, j] * (ds[i, j] - dot[i]) * row_scale
        beta = 0.0 if start == 0 else 1.0
        _matmul(
            width, False, False, 1.0, ds, k[start : start + keys], beta, dq[first : first + rows]
        )
        _matmul(width, True, False, 1.0, ds, q_rows, 1.0, dk[start : start + keys])


@by_address(**_helper)
def _backward_tiled(width, q, k, v, g, dq, dk, dv, scale, causal, tile, work):
    """_head_backward over key tiles: two sweeps per block of rows (_row_sums, then
    _tile_gradients); dk and dv start at zero."""
    length, keys = q.shape[0], k.shape[0]
    most = min(ROWS, length)
    s_flat, at = _take(work, 0, most * tile)
    dp_flat, at = _take(work, at, most * tile)
    typed, at = _take(work, at, 2)  # the scale in q's dtype: f32 math stays f32
    typed[0] = scale
    peak, at = _take(work, at, most)
    total, at = _take(work, at, most)
    dot, at = _take(work, at, most)
    factor, at = _take(work, at, most)
    for first in range(0, length, ROWS):
        rows = min(ROWS, length - first)
        seen = _seen(first, rows, keys, causal)
        stats = (peak[:rows], total[:rows], dot[:rows], factor[:rows])
        _row_sums(width, q, k, v, g, first, seen, tile, s_flat, dp_flat, stats, scale, causal)
        work = (s_flat, dp_flat, typed)
        _tile_gradients(
            width, q, k, v, g, dq, dk, dv, first, seen, tile, work, stats, scale, causal
        )


@by_address(**_helper)
def _head_backward(width, q, k, v, g, dq, dk, dv, scale, causal, tile, work):
    length, keys = q.shape[0], k.shape[0]
    dk[:] = 0
    dv[:] = 0
    if keys == 0:
        dq[:] = 0
        return
    if keys > tile:
        _backward_tiled(width, q, k, v, g, dq, dk, dv, scale, causal, tile, work)
        return
    p_flat, at = _take(work, 0, min(ROWS, length) * keys)
    ds_flat, at = _take(work, at, min(ROWS, length) * keys)
    typed, at = _take(work, at, 2)  # scale and each row's dot in q's dtype: f32 math stays f32
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
def attention_forward(width, q, k, v, out, scale, causal, tile, work):
    """out[b, h] = softmax(scale * q[b, h] @ k[b, h]^T) @ v[b, h], one pair after another,
    each in the workspace's first slot."""
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            _head_forward(width, q[b, h], k[b, h], v[b, h], out[b, h], scale, causal, tile, work)


@njit(**_helper)  # a leaf: linked, cheaper than a lookup on load
def _slots(work, per, pairs):
    """Slots of `per` elements the workspace holds, at most one a pair (1 where a pair needs
    none: the kernels return before reading it)."""
    if per == 0:
        return 1
    return max(1, min(pairs, work.shape[0] // per))


@njit(parallel=True, **_opts)
def attention_forward_par(width, q, k, v, out, scale, causal, tile, work, per):
    """attention_forward with each slot's share of the pairs on a thread of its own."""
    heads = q.shape[1]
    pairs = q.shape[0] * heads
    slots = _slots(work, per, pairs)
    if threads_now() < 2 or slots < 2:  # one free core: serial, no pool thread
        attention_forward(width, q, k, v, out, scale, causal, tile, work)
        return
    for slot in prange(slots):
        own = work[slot * per : (slot + 1) * per]
        for pair in range(slot * pairs // slots, (slot + 1) * pairs // slots):
            b, h = pair // heads, pair % heads
            _head_forward(width, q[b, h], k[b, h], v[b, h], out[b, h], scale, causal, tile, own)


@njit(**_opts)
def attention_backward(width, q, k, v, g, dq, dk, dv, scale, causal, tile, work):
    """dq, dk, dv of sum(attention(q, k, v) * g), per (batch, head) pair, each in the
    workspace's first slot."""
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            _head_backward(
                width, q[b, h], k[b, h], v[b, h], g[b, h], dq[b, h], dk[b, h], dv[b, h],
                scale, causal, tile, work,
            )  # fmt: skip


@njit(parallel=True, **_opts)
def attention_backward_par(width, q, k, v, g, dq, dk, dv, scale, causal, tile, work, per):
    """attention_backward with each slot's share of the pairs on a thread of its own."""
    heads = q.shape[1]
    pairs = q.shape[0] * heads
    slots = _slots(work, per, pairs)
    if threads_now() < 2 or slots < 2:
        attention_backward(width, q, k, v, g, dq, dk, dv, scale, causal, tile, work)
        return
    for slot in prange(slots):
        own = work[slot * per : (slot + 1) * per]
        for pair in range(slot * pairs // slots, (slot + 1) * pairs // slots):
            b, h = pair // heads, pair % heads
            _head_backward(
                width, q[b, h], k[b, h], v[b, h], g[b, h], dq[b, h], dk[b, h], dv[b, h],
                scale, causal, tile, own,
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


def slot_workspace(q, k, v, tile: int = KEYS, slots: int = 1) -> np.ndarray:
    """A workspace for calling the kernels directly on 4-D q, k, v (the plan passes a slice
    of its arena instead): `slots` slots, each enough for forward and backward."""
    length, keys, values = q.shape[2], k.shape[2], v.shape[3]
    per = max(attention_slot_elements(length, keys, values, g, tile) for g in (False, True))
    return np.empty(slots * per, q.dtype)


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
        return f'transposed({ctx.array(value, contiguous=False)}, "0,2,1,3")'
    lead = value.shape[:-2]
    if len(lead) == 2:
        return ctx.array(value, contiguous=False)
    return f"{ctx.array(value)}.reshape({_heads_shape(lead, value.shape[-2:])!r})"


def _written(node: Value, buffer: str, shape: tuple) -> str:
    """The 4-D (batch, heads, length, features) view the kernel writes of a contiguous buffer
    holding a value of this shape (the node's layout)."""
    if _tokens_first(node):
        return f'transposed({buffer}.reshape({tuple(shape)!r}), "0,2,1,3")'
    return f"{buffer}.reshape({_heads_shape(shape[:-2], shape[-2:])!r})"


def _variant(fn: str, node: Value, parallel: bool | None = None) -> tuple[str, int]:
    """The kernel (parallel over (batch, head) pairs where the plan gave its workspace more
    than one slot, ir/kernel_workspace.py; None: where a plan lowered now would) and its GEMM
    width: the own GEMM's in parallel (single-threaded, lock-free), else as chosen per shape,
    0 meaning BLAS."""
    if parallel is None:
        parallel = attention_slots(node) > 1
    if parallel:
        return f"{fn}_par", vector_width()
    _, t, s, d, _ = attention_dims(node)
    own = use_own_gemm(min(t, ROWS), s, d, True, node.dtype)
    return fn, vector_width() if own else 0


def _call(ctx: OpEmitter, node: Value, fn: str, arrays: str) -> str:
    """The kernel's call: its arrays, scale, mask, key tile and workspace (and a slot's
    elements for the parallel variant)."""
    per = attention_elements(node)
    parallel = per > 0 and ctx.workspace_elements(node) > per
    fn, width = chosen("attention", lambda: _variant(fn, node, parallel))
    tail = f", {per}" if fn.endswith("_par") else ""
    scale, causal = node.attrs["scale"], node.attrs["causal"]
    return f"{fn}({width}, {arrays}, {scale!r}, {causal}, {KEYS}, {ctx.workspace(node)}{tail})"


@emits("attention")
def emit_attention(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    q, k, v = (f"as_read_only({_heads(ctx, node, x)})" for x in node.inputs)
    out4 = _written(node, out, node.shape)
    return [_call(ctx, node, "attention_forward", f"{q}, {k}, {v}, {out4}")]


@emits("attention_grad")
def emit_attention_grad(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    q, k, v, g = (f"as_read_only({_heads(ctx, node, x)})" for x in node.inputs)
    parts, offset = [], 0
    for x in node.inputs[:3]:
        parts.append(_written(node, f"{out}[{offset}:{offset + x.type.size}]", x.shape))
        offset += x.type.size
    arrays = f"{q}, {k}, {v}, {g}, {', '.join(parts)}"
    return [_call(ctx, node, "attention_backward", arrays)]
