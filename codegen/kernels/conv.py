"""conv2d and its two adjoints over NCHW arrays as im2col + GEMM: the kernel taps of every output
position become columns of a (C/groups * kH * kW, N * OH * OW) matrix and a GEMM multiplies it
by the weights: backplan's own where gemm/choice.py's conv_gemm_width picks it (the emitter
passes the register tile width; 0 is BLAS). Measured on the digits CNN's layers (batch 32; 1->16
channels at 8x8 and 16->32 at 4x4, 3x3 kernels, one BLAS thread) against direct loops, one task
per output plane: forward 0.05 / 0.6 ms against 0.7 / 8.7 ms, input gradient 0.04 / 0.4 ms
against 1.3 / 9.0 ms, weight gradient 0.5 / 1.2 ms against 1.3 / 6.9 ms. The column buffer is C
* kH * kW times the input; padding is handled while filling it.

The columns, one group's product or gradient rows and one group's weights live in `work`, a 1-D
slice of the plan's scratch arena the driver passes (ir/kernel_workspace.py sizes it, in that
order): nothing is allocated here per call. Operands from a plan are C order, so the
np.ascontiguousarray calls below return them as they are; only a direct call with strided
operands copies."""

import numpy as np

from backplan.codegen.build.library_progress import announce_compiles
from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit
from backplan.codegen.kernels.blas import gemm_rows
from backplan.codegen.kernels.gemm.api import gemm as own_gemm
from backplan.codegen.kernels.gemm.choice import ROW_DOTS, conv_gemm_width
from backplan.codegen.kernels.gemm.row_dots import row_dots
from backplan.codegen.kernels.views import as_read_only
from backplan.codegen.render.choices import chosen
from backplan.codegen.render.opaque import OpEmitter, emits
from backplan.ir.graph import Value

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}


@njit(**_opts)
def _inside(off, step, count, size):
    """The positions q in [lo, hi) of 0 <= q * step + off < size, 0 <= lo <= hi <= count: the
    outputs whose tap reads the image, not its padding."""
    lo = 0 if off >= 0 else (step - 1 - off) // step
    hi = min(0 if size - off <= 0 else (size - off + step - 1) // step, count)
    return min(lo, hi), hi


@njit(**_opts)
def _tap_bounds(row, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw, height, width):
    """Kernel row (c, i, j) of the columns: its channel c, the first image column it reads at
    q = 0 (j*dw - pw), the image row at r = 0 (i*dh - ph) and its inside ranges along q, r."""
    c, i, j = row // (kh * kw), (row // kw) % kh, row % kw
    col0, row0 = j * dw - pw, i * dh - ph
    q_lo, q_hi = _inside(col0, sw, ow, width)
    r_lo, r_hi = _inside(row0, sh, oh, height)
    return c, col0, row0, q_lo, q_hi, r_lo, r_hi


# The columns are filled and read back one of two ways, both with the padding's bounds found
# once per kernel tap (the old per-element test cost 1.4-2.8 ns an element), on flat C-order
# arrays: along each output row (q innermost, contiguous) when rows are long, or image by image
# (n innermost) when they are short: a small CNN's 4x4 planes made q-loops of four. Measured
# on its 16 -> 32 channel layer at 4x4, batch 32 (one pinned EPYC core, min of 25 rounds):
# 107 us per-element tests, 78 by rows, 58 by images; its 8x8 layer 17, 12, 15.
_u = np.uintp  # an index known to be >= 0: Numba skips the negative-index wrap, loops vectorise
BY_IMAGES_BELOW = 8  # output rows shorter than this, with at least as many images, go by images


@njit(**_opts)
def im2col(x, first, cols, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw):
    """cols[(c, i, j), (n, r, q)] = x[n, first + c, r*sh - ph + i*dh, q*sw - pw + j*dw] or 0;
    cols is C-contiguous."""
    xc = np.ascontiguousarray(x)  # x itself when C order (an intrinsic: quick to compile)
    n_img, chans, height, width = xc.shape
    xf, cf, positions = xc.reshape(-1), cols.reshape(-1), oh * ow
    total, plane = n_img * positions, height * width
    by_images = ow < BY_IMAGES_BELOW and n_img >= BY_IMAGES_BELOW
    for row in range(cols.shape[0]):
        c, col0, row0, q_lo, q_hi, r_lo, r_hi = _tap_bounds(
            row, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw, height, width
        )
        line = cf[row * total : (row + 1) * total]
        for p in range(total):
            line[_u(p)] = 0
        source = (first + c) * plane + row0 * width + col0
        if by_images:
            for r in range(r_lo, r_hi):
                for q in range(q_lo, q_hi):
                    s, d = source + r * sh * width + q * sw, r * ow + q
                    for n in range(n_img):
                        line[_u(d + n * positions)] = xf[_u(s + n * chans * plane)]
            continue
        for n in range(n_img):
            for r in range(r_lo, r_hi):
                s, d = source + n * chans * plane + r * sh * width, n * positions + r * ow
                for q in range(q_lo, q_hi):
                    line[_u(d + q)] = xf[_u(s + q * sw)]


@njit(**_opts)
def col2im(cols, dx, first, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw):
    """The adjoint of im2col: dx[n, first + c, ...] += cols[(c, i, j), (n, r, q)] over the taps
    im2col reads from the image; cols and dx are C-contiguous."""
    n_img, chans, height, width = dx.shape
    df, cf, positions = dx.reshape(-1), cols.reshape(-1), oh * ow
    total, plane = n_img * positions, height * width
    by_images = ow < BY_IMAGES_BELOW and n_img >= BY_IMAGES_BELOW
    for row in range(cols.shape[0]):
        c, col0, row0, q_lo, q_hi, r_lo, r_hi = _tap_bounds(
            row, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw, height, width
        )
        line = cf[row * total : (row + 1) * total]
        target = (first + c) * plane + row0 * width + col0
        if by_images:
            for r in range(r_lo, r_hi):
                for q in range(q_lo, q_hi):
                    t, d = target + r * sh * width + q * sw, r * ow + q
                    for n in range(n_img):
                        df[_u(t + n * chans * plane)] += line[_u(d + n * positions)]
            continue
        for n in range(n_img):
            for r in range(r_lo, r_hi):
                t, d = target + n * chans * plane + r * sh * width, n * positions + r * ow
                for q in range(q_lo, q_hi):
                    df[_u(t + q * sw)] += line[_u(d + q)]


@njit(**_opts)
def _copy4(source, out):
    """out[...] = source for 4-D arrays of one shape, any strides (a loop: see below)."""
    for n in range(out.shape[0]):
        for c in range(out.shape[1]):
            for r in range(out.shape[2]):
                for q in range(out.shape[3]):
                    out[n, c, r, q] = source[n, c, r, q]


@njit(**_opts)
def _group_matrix(a, first, out):
    """out = a[:, first:first+count] of an (N, C, H, W) array as a (count, N*H*W) matrix: a
    plane at a time, flat (a small CNN's 32x32x4x4 gradient 12.4 -> 2.3 us)."""
    ac = np.ascontiguousarray(a)
    n_total, chans, height, width = ac.shape
    plane, af, of = height * width, ac.reshape(-1), out.reshape(-1)
    for o in range(out.shape[0]):
        for n in range(n_total):
            s, d = (n * chans + first + o) * plane, (o * n_total + n) * plane
            for p in range(plane):
                of[_u(d + p)] = af[_u(s + p)]


@njit(**_opts)
def _weight_matrix(w, first, out):
    """out = w[first:first+count] of (O, C/groups, kH, kW) weights as a (count,
    C/groups*kH*kW) matrix."""
    cg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    for o in range(out.shape[0]):
        for c in range(cg):
            for i in range(kh):
                for j in range(kw):
                    out[o, (c * kh + i) * kw + j] = w[first + o, c, i, j]


@njit(**_opts)
def _carve(work, taps, positions, group_out):
    """(columns: taps x positions, one group's rows over the positions: group_out x
    positions, one group's weights: group_out x taps), consecutive slices of the 1-D workspace
    in ir/kernel_workspace.py's order."""
    a, b = taps * positions, group_out * positions
    cols = work[:a].reshape((taps, positions))
    rows = work[a : a + b].reshape((group_out, positions))
    weights = work[a + b : a + b + group_out * taps].reshape((group_out, taps))
    return cols, rows, weights


@njit(**_opts)
def _scatter_planes(product, out, first):
    """out[n, first + o, r, q] = product[o, (n, r, q)]: a GEMM's rows back into NCHW, a plane
    at a time into out itself when C order, else into a C-order copy written back."""
    flat = np.ascontiguousarray(out)
    n_total, chans, height, width = flat.shape
    plane, of, pf = height * width, flat.reshape(-1), product.reshape(-1)
    for o in range(product.shape[0]):
        for n in range(n_total):
            s, d = (o * n_total + n) * plane, (n * chans + first + o) * plane
            for p in range(plane):
                of[_u(d + p)] = pf[_u(s + p)]
    if flat.ctypes.data != out.ctypes.data:
        _copy4(flat, out)


@njit(**_opts)
def _product(width, trans_a, trans_b, a, b, out):
    """out = op(a) @ op(b) for C-contiguous 2-D operands: backplan's GEMM with register tile
    `width` (512 or 256 bits), row dot products where width is ROW_DOTS (a @ b.T only), or
    BLAS where width is 0. Callers pass the flags as np.bool_: literal flags compiled it (and
    the GEMM inside) once per pair, two in a CNN's step."""
    if width == ROW_DOTS and trans_b and not trans_a:
        row_dots(a, b, out)
    elif width > ROW_DOTS:
        own_gemm(width, trans_a, trans_b, 1.0, a, b, 0.0, out)
    else:
        gemm_rows(trans_a, trans_b, 1.0, a, b, 0.0, out)


# The products go through _product (one GEMM call, transposes as flags) and every copy is a
# plain loop: NumPy's np.dot, ascontiguousarray and array-slice assignment compiled into these
# functions made conv2d_gemm's cold compile 9.1 s on one pinned EPYC core; written this way
# 3.5 s (/tmp measurement in the commit message).
@njit(**_opts)
def conv2d_gemm(x, w, out, work, sh, sw, ph, pw, dh, dw, groups, width):
    o_total, cg, kh, kw = w.shape
    og, oh, ow = o_total // groups, out.shape[2], out.shape[3]
    if out.size == 0:
        return
    positions = x.shape[0] * oh * ow
    cols, product, weights = _carve(work, cg * kh * kw, positions, og)
    for g in range(groups):
        im2col(x, g * cg, cols, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
        _weight_matrix(w, g * og, weights)
        _product(width, np.bool_(False), np.bool_(False), weights, cols, product)
        _scatter_planes(product, out, g * og)


@njit(**_opts)
def conv2d_input_grad_gemm(gout, w, dx, work, sh, sw, ph, pw, dh, dw, groups, width):
    o_total, cg, kh, kw = w.shape
    og, oh, ow = o_total // groups, gout.shape[2], gout.shape[3]
    if gout.size == 0:
        dx[:] = 0
        return
    positions = gout.shape[0] * oh * ow
    cols, grads, weights = _carve(work, cg * kh * kw, positions, og)
    summed = np.ascontiguousarray(dx)  # dx itself when C order (col2im's), else a copy
    flat = summed.reshape(-1)
    for p in range(flat.size):
        flat[p] = 0
    for g in range(groups):
        _weight_matrix(w, g * og, weights)
        _group_matrix(gout, g * og, grads)
        _product(width, np.bool_(True), np.bool_(False), weights, grads, cols)
        col2im(cols, summed, g * cg, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
    if summed.ctypes.data != dx.ctypes.data:
        _copy4(summed, dx)


@njit(**_opts)
def conv2d_weight_grad_gemm(x, gout, dw_out, work, sh, sw, ph, pw, dh, dw, groups, width):
    o_total, cg, kh, kw = dw_out.shape
    og, oh, ow = o_total // groups, gout.shape[2], gout.shape[3]
    if gout.size == 0:
        dw_out[:] = 0
        return
    # the product (og x taps) where the other two keep their weights
    cols, grads, product = _carve(work, cg * kh * kw, x.shape[0] * oh * ow, og)
    for g in range(groups):
        im2col(x, g * cg, cols, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
        _group_matrix(gout, g * og, grads)
        _product(width, np.bool_(False), np.bool_(True), grads, cols, product)
        for o in range(og):
            for c in range(cg):
                for i in range(kh):
                    for j in range(kw):
                        dw_out[g * og + o, c, i, j] = product[o, (c * kh + i) * kw + j]


# Cold compile seconds of each (first use per installation and version; the nested im2col,
# col2im and gemm_rows compile inside the first of them): conv2d_gemm 2.5 s after im2col's 0.8 s
# on one pinned EPYC core (9.1 s with np.dot); the adjoints' figures predate the rewrite.
announce_compiles({conv2d_gemm: 3.0, conv2d_input_grad_gemm: 2.0, conv2d_weight_grad_gemm: 3.0})

__all__ = ["as_read_only", "conv2d_gemm", "conv2d_input_grad_gemm", "conv2d_weight_grad_gemm"]


def _conv_call(ctx: OpEmitter, node: Value, out: str, fn: str) -> list[str]:
    a, b = (ctx.array(v) for v in node.inputs)
    (sh, sw), (ph, pw) = node.attrs["stride"], node.attrs["padding"]
    dh, dw = node.attrs["dilation"]
    nt = fn == "conv2d_weight_grad"  # the one product of the three that reads B transposed
    width = chosen(
        "conv_gemm_width",
        lambda: conv_gemm_width(*_product_shape(node, fn), node.dtype, trans_b=nt),
    )
    args = f"{sh}, {sw}, {ph}, {pw}, {dh}, {dw}, {node.attrs['groups']}, {width}"
    work = ctx.workspace(node)  # a slice of the arena (ir/kernel_workspace.py)
    return [f"{fn}_gemm(as_read_only({a}), as_read_only({b}), {out}, {work}, {args})"]


def _product_shape(node: Value, fn: str) -> tuple[int, int, int]:
    """(m, n, k) of the one GEMM per group each conv kernel above runs."""
    groups = node.attrs["groups"]
    if fn == "conv2d":  # weights (O/g, C/g*kH*kW) @ columns (C/g*kH*kW, N*OH*OW)
        (o_total, cg, kh, kw), (n_img, _, oh, ow) = node.inputs[1].shape, node.shape
        return o_total // groups, n_img * oh * ow, cg * kh * kw
    if fn == "conv2d_input_grad":  # weights^T (C/g*kH*kW, O/g) @ gradient (O/g, N*OH*OW)
        (o_total, cg, kh, kw), (n_img, _, oh, ow) = node.inputs[1].shape, node.inputs[0].shape
        return cg * kh * kw, n_img * oh * ow, o_total // groups
    # gradient (O/g, N*OH*OW) @ columns^T (N*OH*OW, C/g*kH*kW)
    (o_total, cg, kh, kw), (n_img, _, oh, ow) = node.shape, node.inputs[1].shape
    return o_total // groups, cg * kh * kw, n_img * oh * ow


@emits("conv2d")
def emit_conv2d(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _conv_call(ctx, node, out, "conv2d")


@emits("conv2d_input_grad")
def emit_conv2d_input_grad(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _conv_call(ctx, node, out, "conv2d_input_grad")


@emits("conv2d_weight_grad")
def emit_conv2d_weight_grad(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _conv_call(ctx, node, out, "conv2d_weight_grad")
