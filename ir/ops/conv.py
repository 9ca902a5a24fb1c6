"""2-D convolution over NCHW tensors with PyTorch's semantics (stride, zero padding, dilation,
groups; cross-correlation, weights (out_channels, in_channels / groups, kh, kw)).

Three bilinear ops close under differentiation: conv2d(x, w), its adjoint in x
(conv2d_input_grad(g, w)) and its adjoint in w (conv2d_weight_grad(x, g)). Each one's derivative
is written with the other two, so second derivatives work without new ops. Pooling is built
from slices and reductions by the tracer (tracer/conv.py), so it needs no entry here.
"""

import numpy as np

from ..errors import DtypeError, ShapeError
from ..registry import AttrSpec, OpDef, register
from ..shapes import fmt
from ..types import TensorType, is_float

CONV_ATTRS = {
    "stride": AttrSpec("ints", (1, 1), required=False),
    "padding": AttrSpec("ints", (0, 0), required=False),
    "dilation": AttrSpec("ints", (1, 1), required=False),
    "groups": AttrSpec("int", 1, required=False),
}


def conv_output_hw(hw, kernel_hw, attrs) -> tuple[int, int]:
    """PyTorch's output size: floor((H + 2p - d (k - 1) - 1) / s) + 1 per spatial axis."""
    return tuple(
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, k, s, p, d in zip(
            hw, kernel_hw, attrs["stride"], attrs["padding"], attrs["dilation"], strict=True
        )
    )


def _check_attrs(attrs) -> None:
    for key, low in (("stride", 1), ("padding", 0), ("dilation", 1)):
        value = attrs[key]
        if len(value) != 2 or any(v < low for v in value):
            raise ShapeError(f"{key} must be two integers >= {low}, got {value}")
    if attrs["groups"] < 1:
        raise ShapeError(f"groups must be at least 1, got {attrs['groups']}")


def conv_output_type(x: TensorType, w: TensorType, attrs) -> TensorType:
    """The shape rule of conv2d, shared by its two adjoints to check their operands."""
    _check_attrs(attrs)
    if not (is_float(x.dtype) and x.dtype == w.dtype):
        raise DtypeError(f"input and weight must share one float dtype, got {x.dtype}, {w.dtype}")
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ShapeError(
            f"input must be (N, C, H, W) and weight (O, C/groups, kH, kW), "
            f"got {fmt(x.shape)} and {fmt(w.shape)}"
        )
    groups = attrs["groups"]
    if x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        raise ShapeError(
            f"input channels {x.shape[1]} must equal weight in-channels {w.shape[1]} x groups "
            f"{groups}, and out-channels {w.shape[0]} must divide by groups"
        )
    oh, ow = conv_output_hw(x.shape[2:], w.shape[2:], attrs)
    if oh < 1 or ow < 1:
        raise ShapeError(
            f"kernel {fmt(w.shape[2:])} with dilation {attrs['dilation']} does not fit the "
            f"padded input {fmt(x.shape[2:])} (padding {attrs['padding']})"
        )
    return TensorType(x.dtype, (x.shape[0], w.shape[0], oh, ow))


def _windows(attrs, oh: int, ow: int, kh: int, kw: int):
    """(i, j, row slice, column slice) of the padded input that kernel tap (i, j) reads."""
    (sh, sw), (dh, dw) = attrs["stride"], attrs["dilation"]
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            yield i, j, rows, cols


def _padded(x, padding):
    ph, pw = padding
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def _conv_ref(x, w, **attrs):
    n, o, groups = x.shape[0], w.shape[0], attrs["groups"]
    cg, og = w.shape[1], o // groups
    oh, ow = conv_output_hw(x.shape[2:], w.shape[2:], attrs)
    xp = _padded(x, attrs["padding"])
    out = np.zeros((n, o, oh, ow), x.dtype)
    for g in range(groups):
        xg, wg = xp[:, g * cg : (g + 1) * cg], w[g * og : (g + 1) * og]
        for i, j, rows, cols in _windows(attrs, oh, ow, *w.shape[2:]):
            out[:, g * og : (g + 1) * og] += np.einsum(
                "ncij,oc->noij", xg[:, :, rows, cols], wg[:, :, i, j]
            )
    return out


def _input_grad_ref(gout, w, input_shape, **attrs):
    groups, (ph, pw) = attrs["groups"], attrs["padding"]
    cg, og = w.shape[1], w.shape[0] // groups
    n, c, h, wd = input_shape
    oh, ow = gout.shape[2:]
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), gout.dtype)
    for g in range(groups):
        gg, wg = gout[:, g * og : (g + 1) * og], w[g * og : (g + 1) * og]
        for i, j, rows, cols in _windows(attrs, oh, ow, *w.shape[2:]):
            dxp[:, g * cg : (g + 1) * cg, rows, cols] += np.einsum(
                "noij,oc->ncij", gg, wg[:, :, i, j]
            )
    return dxp[:, :, ph : ph + h, pw : pw + wd]


def _weight_grad_ref(x, gout, weight_shape, **attrs):
    groups = attrs["groups"]
    o, cg, kh, kw = weight_shape
    og = o // groups
    oh, ow = gout.shape[2:]
    xp = _padded(x, attrs["padding"])
    dw = np.zeros(weight_shape, x.dtype)
    for g in range(groups):
        xg, gg = xp[:, g * cg : (g + 1) * cg], gout[:, g * og : (g + 1) * og]
        for i, j, rows, cols in _windows(attrs, oh, ow, kh, kw):
            dw[g * og : (g + 1) * og, :, i, j] = np.einsum(
                "noij,ncij->oc", gg, xg[:, :, rows, cols]
            )
    return dw


def _conv_infer(types, attrs):
    return conv_output_type(*types, attrs)


def _expect(what: str, got: TensorType, want: TensorType) -> None:
    if got != want:
        raise ShapeError(f"{what} must be {want} for this convolution, got {got}")


def _input_grad_infer(types, attrs):
    g, w = types
    x = TensorType(g.dtype, attrs["input_shape"])
    _expect("the output gradient", g, conv_output_type(x, w, _conv_attrs(attrs)))
    return x


def _weight_grad_infer(types, attrs):
    x, g = types
    w = TensorType(x.dtype, attrs["weight_shape"])
    _expect("the output gradient", g, conv_output_type(x, w, _conv_attrs(attrs)))
    return w


def _conv_flops(output: TensorType, weight: TensorType) -> int:
    """A multiply-add per output element and weight element of one output channel."""
    return 2 * output.size * (weight.size // max(weight.shape[0], 1))


def _conv_attrs(attrs) -> dict:
    return {k: attrs[k] for k in CONV_ATTRS}


def _conv_vjp(ctx, g):
    b, attrs = ctx.b, _conv_attrs(ctx.attrs)
    gx = gw = None
    if ctx.needs[0]:
        gx = b.conv2d_input_grad(g, ctx.input(1), input_shape=ctx.in_type(0).shape, **attrs)
    if ctx.needs[1]:
        gw = b.conv2d_weight_grad(ctx.input(0), g, weight_shape=ctx.in_type(1).shape, **attrs)
    return [gx, gw]


def _input_grad_vjp(ctx, h):
    """input_grad(g, w) is linear in each: <input_grad(g, w), h> = <conv2d(h, w), g>."""
    b, attrs = ctx.b, _conv_attrs(ctx.attrs)
    gg = gw = None
    if ctx.needs[0]:
        gg = b.conv2d(h, ctx.input(1), **attrs)
    if ctx.needs[1]:
        gw = b.conv2d_weight_grad(h, ctx.input(0), weight_shape=ctx.in_type(1).shape, **attrs)
    return [gg, gw]


def _weight_grad_vjp(ctx, k):
    """weight_grad(x, g) is linear in each: <weight_grad(x, g), k> = <conv2d(x, k), g>."""
    b, attrs = ctx.b, _conv_attrs(ctx.attrs)
    gx = gg = None
    if ctx.needs[0]:
        gx = b.conv2d_input_grad(ctx.input(1), k, input_shape=ctx.in_type(0).shape, **attrs)
    if ctx.needs[1]:
        gg = b.conv2d(ctx.input(0), k, **attrs)
    return [gx, gg]


register(
    OpDef(
        "conv2d",
        (2,),
        _conv_infer,
        _conv_ref,
        "opaque",
        _conv_vjp,
        attrs=CONV_ATTRS,
        doc="conv2d(x, w) over NCHW, PyTorch semantics; saves w for dx and x for dw",
        flops=lambda types, out, attrs: _conv_flops(out, types[1]),
    )
)
register(
    OpDef(
        "conv2d_input_grad",
        (2,),
        _input_grad_infer,
        _input_grad_ref,
        "opaque",
        _input_grad_vjp,
        attrs={**CONV_ATTRS, "input_shape": AttrSpec("shape")},
        doc="conv2d's adjoint in its input (a transposed convolution of g with w)",
        flops=lambda types, out, attrs: _conv_flops(types[0], types[1]),
    )
)
register(
    OpDef(
        "conv2d_weight_grad",
        (2,),
        _weight_grad_infer,
        _weight_grad_ref,
        "opaque",
        _weight_grad_vjp,
        attrs={**CONV_ATTRS, "weight_shape": AttrSpec("shape")},
        doc="conv2d's adjoint in its weight (correlates x with g)",
        flops=lambda types, out, attrs: _conv_flops(types[1], out),
    )
)
