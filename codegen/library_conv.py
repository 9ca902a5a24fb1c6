"""Direct-loop kernels for conv2d and its two adjoints over NCHW arrays (no im2col buffer).
Each parallel task owns one output plane (or one weight slice), so tasks never write the same
element; padding is handled by the bounds of the innermost loops."""


from .flags import FASTMATH
from .jit import njit, prange

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}


@njit(inline="always", **_opts)
def _span(out_size, in_size, stride, pad, offset):
    """[lo, hi) of output positions o with 0 <= o * stride - pad + offset < in_size."""
    lo = 0
    while lo < out_size and lo * stride - pad + offset < 0:
        lo += 1
    hi = out_size
    while hi > lo and (hi - 1) * stride - pad + offset >= in_size:
        hi -= 1
    return lo, hi


@njit(inline="always", **_opts)
def _forward_plane(x, w, out, n, o, sh, sw, ph, pw, dh, dw, groups):
    """out[n, o] = sum over the group's channels and taps of w[o, c, i, j] * x[n, c, ...]."""
    cg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    oh, ow = out.shape[2], out.shape[3]
    first = (o // (w.shape[0] // groups)) * cg
    plane = out[n, o]
    plane[:] = 0
    for c in range(cg):
        xc = x[n, first + c]
        for i in range(kh):
            r0, r1 = _span(oh, x.shape[2], sh, ph, i * dh)
            for j in range(kw):
                c0, c1 = _span(ow, x.shape[3], sw, pw, j * dw)
                weight = w[o, c, i, j]
                for r in range(r0, r1):
                    row = xc[r * sh - ph + i * dh]
                    for q in range(c0, c1):
                        plane[r, q] += weight * row[q * sw - pw + j * dw]


@njit(**_opts)
def conv2d_serial(x, w, out, sh, sw, ph, pw, dh, dw, groups):
    for task in range(out.shape[0] * out.shape[1]):
        _forward_plane(
            x, w, out, task // out.shape[1], task % out.shape[1], sh, sw, ph, pw, dh, dw, groups
        )


@njit(parallel=True, **_opts)
def conv2d_par(x, w, out, sh, sw, ph, pw, dh, dw, groups):
    for task in prange(out.shape[0] * out.shape[1]):
        _forward_plane(
            x, w, out, task // out.shape[1], task % out.shape[1], sh, sw, ph, pw, dh, dw, groups
        )


@njit(inline="always", **_opts)
def _input_grad_plane(g, w, dx, n, c, sh, sw, ph, pw, dh, dw, groups):
    """dx[n, c] = sum over the group's output channels and taps of w * g, scattered back."""
    cg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    og = w.shape[0] // groups
    oh, ow = g.shape[2], g.shape[3]
    group, local = c // cg, c % cg
    plane = dx[n, c]
    plane[:] = 0
    for o in range(group * og, (group + 1) * og):
        go = g[n, o]
        for i in range(kh):
            r0, r1 = _span(oh, dx.shape[2], sh, ph, i * dh)
            for j in range(kw):
                c0, c1 = _span(ow, dx.shape[3], sw, pw, j * dw)
                weight = w[o, local, i, j]
                for r in range(r0, r1):
                    row = plane[r * sh - ph + i * dh]
                    for q in range(c0, c1):
                        row[q * sw - pw + j * dw] += weight * go[r, q]


@njit(**_opts)
def conv2d_input_grad_serial(g, w, dx, sh, sw, ph, pw, dh, dw, groups):
    for task in range(dx.shape[0] * dx.shape[1]):
        _input_grad_plane(
            g, w, dx, task // dx.shape[1], task % dx.shape[1], sh, sw, ph, pw, dh, dw, groups
        )


@njit(parallel=True, **_opts)
def conv2d_input_grad_par(g, w, dx, sh, sw, ph, pw, dh, dw, groups):
    for task in prange(dx.shape[0] * dx.shape[1]):
        _input_grad_plane(
            g, w, dx, task // dx.shape[1], task % dx.shape[1], sh, sw, ph, pw, dh, dw, groups
        )


@njit(inline="always", **_opts)
def _weight_grad_slice(x, g, dw_out, o, c, sh, sw, ph, pw, dh, dw, groups):
    """dw[o, c] = sum over the batch and output positions of g[n, o] * x[n, c', ...]."""
    kh, kw = dw_out.shape[2], dw_out.shape[3]
    cg = dw_out.shape[1]
    og = dw_out.shape[0] // groups
    oh, ow = g.shape[2], g.shape[3]
    channel = (o // og) * cg + c
    for i in range(kh):
        r0, r1 = _span(oh, x.shape[2], sh, ph, i * dh)
        for j in range(kw):
            c0, c1 = _span(ow, x.shape[3], sw, pw, j * dw)
            total = 0.0
            for n in range(x.shape[0]):
                xc, go = x[n, channel], g[n, o]
                for r in range(r0, r1):
                    row = xc[r * sh - ph + i * dh]
                    for q in range(c0, c1):
                        total += go[r, q] * row[q * sw - pw + j * dw]
            dw_out[o, c, i, j] = total


@njit(**_opts)
def conv2d_weight_grad_serial(x, g, dw_out, sh, sw, ph, pw, dh, dw, groups):
    for task in range(dw_out.shape[0] * dw_out.shape[1]):
        _weight_grad_slice(
            x,
            g,
            dw_out,
            task // dw_out.shape[1],
            task % dw_out.shape[1],
            sh,
            sw,
            ph,
            pw,
            dh,
            dw,
            groups,
        )


@njit(parallel=True, **_opts)
def conv2d_weight_grad_par(x, g, dw_out, sh, sw, ph, pw, dh, dw, groups):
    for task in prange(dw_out.shape[0] * dw_out.shape[1]):
        _weight_grad_slice(
            x,
            g,
            dw_out,
            task // dw_out.shape[1],
            task % dw_out.shape[1],
            sh,
            sw,
            ph,
            pw,
            dh,
            dw,
            groups,
        )


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
