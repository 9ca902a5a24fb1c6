"""conv2d and its two adjoints over NCHW arrays as im2col + GEMM: the kernel taps of every output
position become columns of a (C/groups * kH * kW, N * OH * OW) matrix and BLAS multiplies it
by the weights. Measured on the digits CNN's layers (batch 32; 1->16 channels at 8x8 and
16->32 at 4x4, 3x3 kernels, one BLAS thread) against direct loops, one task per output plane:
forward 0.05 / 0.6 ms against 0.7 / 8.7 ms, input gradient 0.04 / 0.4 ms against 1.3 / 9.0 ms,
weight gradient 0.5 / 1.2 ms against 1.3 / 6.9 ms. The column buffer is C * kH * kW times the
input; padding is handled while filling it."""

import numpy as np

from backplan.codegen.build.library_progress import announce_compiles
from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit
from backplan.codegen.kernels.blas import gemm_rows
from backplan.codegen.kernels.views import as_read_only
from backplan.codegen.render.opaque import OpEmitter, emits
from backplan.ir.graph import Value

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}


@njit(**_opts)
def im2col(x, first, cols, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw):
    """cols[(c, i, j), (n, r, q)] = x[n, first + c, r*sh - ph + i*dh, q*sw - pw + j*dw] or 0."""
    height, width, positions = x.shape[2], x.shape[3], oh * ow
    for row in range(cols.shape[0]):
        c, i, j = row // (kh * kw), (row // kw) % kh, row % kw
        for n in range(x.shape[0]):
            for r in range(oh):
                ih = r * sh - ph + i * dh
                base = n * positions + r * ow
                for q in range(ow):
                    iw = q * sw - pw + j * dw
                    inside = 0 <= ih < height and 0 <= iw < width
                    cols[row, base + q] = x[n, first + c, ih, iw] if inside else 0


@njit(**_opts)
def col2im(cols, dx, first, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw):
    """The adjoint of im2col: dx[n, first + c, ...] += cols[(c, i, j), (n, r, q)]."""
    height, width, positions = dx.shape[2], dx.shape[3], oh * ow
    for row in range(cols.shape[0]):
        c, i, j = row // (kh * kw), (row // kw) % kh, row % kw
        for n in range(dx.shape[0]):
            for r in range(oh):
                ih = r * sh - ph + i * dh
                if ih < 0 or ih >= height:
                    continue
                for q in range(ow):
                    iw = q * sw - pw + j * dw
                    if 0 <= iw < width:
                        dx[n, first + c, ih, iw] += cols[row, n * positions + r * ow + q]


@njit(**_opts)
def _group_matrix(a, first, count):
    """a[:, first:first+count] of an (N, C, H, W) array as a (count, N*H*W) matrix."""
    n_total, height, width = a.shape[0], a.shape[2], a.shape[3]
    out = np.empty((count, n_total * height * width), a.dtype)
    for o in range(count):
        for n in range(n_total):
            for r in range(height):
                for q in range(width):
                    out[o, (n * height + r) * width + q] = a[n, first + o, r, q]
    return out


@njit(**_opts)
def _weight_matrix(w, first, count):
    """w[first:first+count] of (O, C/groups, kH, kW) weights as a (count, C/groups*kH*kW)
    matrix."""
    cg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    out = np.empty((count, cg * kh * kw), w.dtype)
    for o in range(count):
        for c in range(cg):
            for i in range(kh):
                for j in range(kw):
                    out[o, (c * kh + i) * kw + j] = w[first + o, c, i, j]
    return out


@njit(**_opts)
def _scatter_planes(product, out, first):
    """out[n, first + o, r, q] = product[o, (n, r, q)]: a GEMM's rows back into NCHW."""
    oh, ow = out.shape[2], out.shape[3]
    for o in range(product.shape[0]):
        for n in range(out.shape[0]):
            for r in range(oh):
                for q in range(ow):
                    out[n, first + o, r, q] = product[o, (n * oh + r) * ow + q]


# The products go through gemm_rows (one BLAS call, transposes as flags) and every copy is a
# plain loop: NumPy's np.dot, ascontiguousarray and array-slice assignment compiled into these
# functions made conv2d_gemm's cold compile 9.1 s on one pinned EPYC core; written this way
# 3.5 s (/tmp measurement in the commit message).
@njit(**_opts)
def conv2d_gemm(x, w, out, sh, sw, ph, pw, dh, dw, groups):
    o_total, cg, kh, kw = w.shape
    og, oh, ow = o_total // groups, out.shape[2], out.shape[3]
    if out.size == 0:
        return
    cols = np.empty((cg * kh * kw, x.shape[0] * oh * ow), x.dtype)
    product = np.empty((og, x.shape[0] * oh * ow), x.dtype)
    for g in range(groups):
        im2col(x, g * cg, cols, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
        gemm_rows(False, False, 1.0, _weight_matrix(w, g * og, og), cols, 0.0, product)
        _scatter_planes(product, out, g * og)


@njit(**_opts)
def conv2d_input_grad_gemm(gout, w, dx, sh, sw, ph, pw, dh, dw, groups):
    o_total, cg, kh, kw = w.shape
    og, oh, ow = o_total // groups, gout.shape[2], gout.shape[3]
    dx[:] = 0
    if gout.size == 0:
        return
    cols = np.empty((cg * kh * kw, gout.shape[0] * oh * ow), dx.dtype)
    for g in range(groups):
        weights = _weight_matrix(w, g * og, og)
        gemm_rows(True, False, 1.0, weights, _group_matrix(gout, g * og, og), 0.0, cols)
        col2im(cols, dx, g * cg, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)


@njit(**_opts)
def conv2d_weight_grad_gemm(x, gout, dw_out, sh, sw, ph, pw, dh, dw, groups):
    o_total, cg, kh, kw = dw_out.shape
    og, oh, ow = o_total // groups, gout.shape[2], gout.shape[3]
    if gout.size == 0:
        dw_out[:] = 0
        return
    cols = np.empty((cg * kh * kw, x.shape[0] * oh * ow), x.dtype)
    product = np.empty((og, cg * kh * kw), dw_out.dtype)
    for g in range(groups):
        im2col(x, g * cg, cols, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
        gemm_rows(False, True, 1.0, _group_matrix(gout, g * og, og), cols, 0.0, product)
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
    args = f"{sh}, {sw}, {ph}, {pw}, {dh}, {dw}, {node.attrs['groups']}"
    return [f"{fn}_gemm(as_read_only({a}), as_read_only({b}), {out}, {args})"]


@emits("conv2d")
def emit_conv2d(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _conv_call(ctx, node, out, "conv2d")


@emits("conv2d_input_grad")
def emit_conv2d_input_grad(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _conv_call(ctx, node, out, "conv2d_input_grad")


@emits("conv2d_weight_grad")
def emit_conv2d_weight_grad(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _conv_call(ctx, node, out, "conv2d_weight_grad")
