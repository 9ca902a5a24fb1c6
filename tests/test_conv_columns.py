"""The compiled convolution kernels against the NumPy references for strides, padding larger
and smaller than the kernel's reach, dilation and groups, in both of the orders the im2col
columns are filled and read back in (output row by row, or image by image when rows are short
and images many), and with operands that are not C-contiguous. Operands are read-only as plans
pass them (conv.as_read_only): a writable one would compile a variant no plan uses."""

import numpy as np
import pytest

from backplan.codegen.kernels import conv
from backplan.codegen.kernels.gemm.isa import vector_width
from backplan.ir.kernel_workspace import conv_workspace_elements
from backplan.ir.ops.conv import _conv_ref, _input_grad_ref, _weight_grad_ref

CASES = [
    # (batch, channels, height, width, out channels, kernel, stride, padding, dilation, groups)
    (2, 3, 9, 11, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1),  # rows of 11: by rows
    (12, 4, 5, 4, 6, (3, 2), (1, 1), (1, 0), (1, 1), 2),  # rows of 3-4, 12 images: by images
    (9, 2, 7, 6, 4, (3, 3), (2, 1), (2, 3), (2, 1), 1),  # padding beyond the dilated reach
    (16, 4, 6, 7, 4, (2, 3), (2, 3), (0, 2), (1, 2), 4),  # depthwise, strides, by images
    (3, 2, 4, 4, 2, (5, 5), (1, 1), (2, 2), (1, 1), 1),  # kernel as large as the padded image
]


def _attrs(case):
    *_, stride, padding, dilation, groups = case
    return dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


def _operands(case, rng, dtype):
    n, c, h, w, o, (kh, kw), *_, groups = case
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    weights = rng.standard_normal((o, c // groups, kh, kw)).astype(dtype)
    return conv.as_read_only(x), conv.as_read_only(weights)


def _work(out_shape, weight_shape, groups, dtype):
    """The workspace a plan passes the kernels (ir/kernel_workspace.py), NaN-filled: a
    kernel must write every element it reads."""
    n, o, oh, ow = out_shape
    taps = weight_shape[1] * weight_shape[2] * weight_shape[3]
    return np.full(conv_workspace_elements(n, (oh, ow), o, taps, groups), np.nan, dtype)


def _args(attrs, width=0):
    """The kernels' trailing arguments; width 0 multiplies with BLAS, 512 or 256 with
    backplan's GEMM of that register tile."""
    (sh, sw), (ph, pw), (dh, dw) = attrs["stride"], attrs["padding"], attrs["dilation"]
    return sh, sw, ph, pw, dh, dw, attrs["groups"], width


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("gemm", ["blas", "own"])
def test_conv_kernels_match_the_references(case, dtype, gemm):
    rng = np.random.default_rng(len(case) + case[0])
    x, w = _operands(case, rng, dtype)
    attrs = _attrs(case)
    args = _args(attrs, vector_width() if gemm == "own" else 0)
    expected = _conv_ref(x, w, **attrs)
    out = np.full(expected.shape, np.nan, dtype)
    work = _work(expected.shape, w.shape, attrs["groups"], dtype)
    conv.conv2d_gemm(x, w, out, work, *args)
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)

    g = conv.as_read_only(rng.standard_normal(expected.shape).astype(dtype))
    dx = np.full(x.shape, np.nan, dtype)
    conv.conv2d_input_grad_gemm(g, w, dx, work, *args)
    np.testing.assert_allclose(dx, _input_grad_ref(g, w, x.shape, **attrs), rtol=tol, atol=tol)
    dw = np.full(w.shape, np.nan, dtype)
    conv.conv2d_weight_grad_gemm(x, g, dw, work, *args)
    want = _weight_grad_ref(x, g, w.shape, **attrs)
    np.testing.assert_allclose(dw, want, rtol=tol, atol=tol * 10)


def test_strided_operands_and_outputs_give_the_same_values():
    """Every operand and output a view with gaps (channels picked by a step, images reversed):
    the kernels read and write through the strides, not as if the memory were C order."""
    case = CASES[1]
    rng = np.random.default_rng(7)
    x, w = _operands(case, rng, np.float32)
    attrs = _attrs(case)
    wide_x = np.zeros((x.shape[0], 2 * x.shape[1]) + x.shape[2:], np.float32)
    wide_x[::-1, ::2] = x
    x_view = conv.as_read_only(wide_x[::-1, ::2])
    expected = _conv_ref(x, w, **attrs)
    out_base = np.full((expected.shape[0], 2 * expected.shape[1]) + expected.shape[2:], 5.0,
                       np.float32)  # fmt: skip
    out = out_base[:, 1::2]
    work = _work(expected.shape, w.shape, attrs["groups"], np.float32)
    conv.conv2d_gemm(x_view, w, out, work, *_args(attrs, vector_width()))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert (out_base[:, ::2] == 5.0).all()  # the gaps stay untouched

    g = conv.as_read_only(rng.standard_normal(expected.shape).astype(np.float32))
    dx_base = np.full(wide_x.shape, 5.0, np.float32)
    conv.conv2d_input_grad_gemm(g, w, dx_base[::-1, ::2], work, *_args(attrs, vector_width()))
    np.testing.assert_allclose(
        dx_base[::-1, ::2], _input_grad_ref(g, w, x.shape, **attrs), rtol=1e-4, atol=1e-4
    )
    assert (dx_base[:, 1::2] == 5.0).all()
    dw = np.empty(w.shape, np.float32)
    conv.conv2d_weight_grad_gemm(x_view, g, dw, work, *_args(attrs, vector_width()))
    np.testing.assert_allclose(dw, _weight_grad_ref(x, g, w.shape, **attrs), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("case", [CASES[0], CASES[1]])
def test_both_column_orders_fill_the_same_columns(case, monkeypatch):
    """im2col's two loop orders agree with a per-element NumPy im2col, and col2im with its
    adjoint: <im2col(x), C> = <x, col2im(C)>. Run as the compiled functions are chosen: case 0
    goes by rows, case 1 by images."""
    n, c, h, w_, o, (kh, kw), *_ = case
    attrs = _attrs(case)
    sh, sw, ph, pw, dh, dw, groups, _ = _args(attrs)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, c, h, w_))
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w_ + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    by_images = ow < conv.BY_IMAGES_BELOW and n >= conv.BY_IMAGES_BELOW
    assert by_images == (case is CASES[1])
    cg = c // groups
    cols = np.full((cg * kh * kw, n * oh * ow), np.nan)
    first = c - cg  # the last group's channels
    conv.im2col(x, first, cols, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    for row in range(cols.shape[0]):
        ci, i, j = row // (kh * kw), (row // kw) % kh, row % kw
        window = xp[:, first + ci, i * dh : i * dh + sh * (oh - 1) + 1 : sh,
                    j * dw : j * dw + sw * (ow - 1) + 1 : sw]  # fmt: skip
        np.testing.assert_array_equal(cols[row], window.reshape(-1))
    c_rand = rng.standard_normal(cols.shape)
    back = np.zeros_like(x)
    conv.col2im(c_rand, back, first, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
    assert not back[:, :first].any()  # only the group's own channels are written
    np.testing.assert_allclose(np.vdot(cols, c_rand), np.vdot(x, back), rtol=1e-12)
