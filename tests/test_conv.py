"""Convolution, pooling and their helpers against NumPy (and PyTorch where installed) on odd
shapes: strides, padding, dilation, groups; gradients against finite differences, eager and
compiled; clip's gradient on and off its bounds; argmax/argmin, arange and the initialisers."""

import math

import numpy as np
import pytest
from op_samples import np_conv2d

import backplan as bp


def np_pool(x, kernel, stride, padding, reduce, fill):
    """Pooling written window by window, from the definition."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=fill)
    oh, ow = (xp.shape[2] - kh) // sh + 1, (xp.shape[3] - kw) // sw + 1
    out = np.empty(x.shape[:2] + (oh, ow), x.dtype)
    for r in range(oh):
        for q in range(ow):
            window = xp[:, :, r * sh : r * sh + kh, q * sw : q * sw + kw]
            out[:, :, r, q] = reduce(window, axis=(2, 3))
    return out


POOLS = [
    ((2, 2), None, (0, 0)),
    ((3, 2), (2, 1), (1, 0)),
    ((3, 3), (2, 2), (1, 1)),
]


def fd_check(fn, x, rng, eps=1e-6):
    """<grad of sum(fn(x) * c), v> against central differences, in float64."""
    c = rng.standard_normal(fn(bp.tensor(x)).shape)
    v = rng.standard_normal(x.shape)
    t = bp.tensor(x, requires_grad=True)
    bp.sum(fn(t) * c).backward()
    analytic = float(np.sum(t.grad.numpy() * v))

    def f(z):
        return float(np.sum(fn(bp.tensor(z)).numpy() * c))

    numeric = (f(x + eps * v) - f(x - eps * v)) / (2 * eps)
    assert abs(analytic - numeric) <= 1e-6 * (
        np.linalg.norm(t.grad.numpy()) * np.linalg.norm(v) + 1
    )


@pytest.mark.numba
@pytest.mark.parametrize("kernel,stride,padding", POOLS, ids=["2x2", "3x2-s21-p10", "3x3-s2-p1"])
def test_pooling_matches_numpy_eager_and_compiled_with_gradients(kernel, stride, padding):
    rng = np.random.default_rng(1)
    x = rng.permutation(2 * 3 * 7 * 6).reshape(2, 3, 7, 6) * 0.1  # distinct: no ties
    st = kernel if stride is None else stride
    cases = [
        (bp.max_pool2d, np.max, -np.inf),
        (bp.avg_pool2d, np.mean, 0.0),
    ]
    for pool, reduce, fill in cases:
        expected = np_pool(x, kernel, st, padding, reduce, fill)

        def fn(t, pool=pool):
            return pool(t, kernel, stride, padding)

        np.testing.assert_allclose(fn(bp.tensor(x)).numpy(), expected, rtol=1e-12)
        np.testing.assert_allclose(bp.compile(fn)(bp.tensor(x)).numpy(), expected, rtol=1e-12)
        fd_check(fn, x, rng)
        t = bp.tensor(x, requires_grad=True)
        fn(t).sum().backward()
        c = bp.tensor(x, requires_grad=True)
        bp.compile(fn)(c).sum().backward()
        np.testing.assert_allclose(c.grad.numpy(), t.grad.numpy(), rtol=1e-12)


def test_conv2d_with_bias_matches_numpy_and_its_gradients_finite_differences():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 9, 8))
    w = rng.standard_normal((6, 2, 3, 2))
    b = rng.standard_normal(6)
    attrs = {"stride": (2, 3), "padding": (2, 1), "dilation": (2, 1), "groups": 2}
    expected = np_conv2d(x, w, **attrs) + b.reshape(1, 6, 1, 1)
    got = bp.conv2d(bp.tensor(x), bp.tensor(w), bp.tensor(b), **attrs).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    compiled = bp.compile(lambda x, w, b: bp.conv2d(x, w, b, **attrs))
    np.testing.assert_allclose(
        compiled(bp.tensor(x), bp.tensor(w), bp.tensor(b)).numpy(), expected, rtol=1e-12
    )
    fd_check(lambda t: bp.conv2d(t, bp.tensor(w), bp.tensor(b), **attrs), x, rng)
    fd_check(lambda t: bp.conv2d(bp.tensor(x), t, bp.tensor(b), **attrs), w, rng)
    fd_check(lambda t: bp.conv2d(bp.tensor(x), bp.tensor(w), t, **attrs), b, rng)


def test_conv2d_and_pooling_match_torch_where_installed():
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, 11, 10)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    attrs = {"stride": (2, 1), "padding": (1, 2), "dilation": (1, 2), "groups": 2}
    expected = functional.conv2d(torch.tensor(x), torch.tensor(w), torch.tensor(b), **attrs)
    got = bp.compile(lambda x, w, b: bp.conv2d(x, w, b, **attrs))(
        bp.tensor(x), bp.tensor(w), bp.tensor(b)
    )
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
    for ours, theirs in (
        (bp.max_pool2d, functional.max_pool2d),
        (bp.avg_pool2d, functional.avg_pool2d),
    ):
        np.testing.assert_allclose(
            ours(bp.tensor(x), 3, 2, 1).numpy(),
            theirs(torch.tensor(x), 3, 2, 1).numpy(),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize(
    "x_shape,w_shape,kwargs,match",
    [
        ((1, 3, 5, 5), (4, 2, 3, 3), {}, "input channels 3"),
        ((1, 4, 5, 5), (3, 2, 3, 3), {"groups": 2}, "divide by groups"),
        ((1, 3, 2, 2), (4, 3, 3, 3), {}, "does not fit"),
        ((3, 5, 5), (4, 3, 3, 3), {}, r"\(N, C, H, W\)"),
        ((1, 3, 5, 5), (4, 3, 3, 3), {"stride": 0}, "stride must be"),
    ],
    ids=["channels", "groups", "too-small", "rank", "stride"],
)
def test_conv2d_refuses_shapes_that_do_not_fit_with_a_clear_error(x_shape, w_shape, kwargs, match):
    x, w = bp.tensor(np.zeros(x_shape, np.float32)), bp.tensor(np.zeros(w_shape, np.float32))
    with pytest.raises(bp.ShapeError, match=match) as info:
        bp.conv2d(x, w, **kwargs)
    assert "conv2d" in str(info.value) and "test_conv.py" in str(info.value)


def test_pooling_refuses_bad_windows():
    x = bp.tensor(np.zeros((1, 1, 4, 4), np.float32))
    with pytest.raises(bp.ShapeError, match="at most half"):
        bp.max_pool2d(x, 2, padding=2)
    with pytest.raises(bp.ShapeError, match="does not fit"):
        bp.avg_pool2d(x, 5)
    with pytest.raises(bp.ShapeError, match=r"\(N, C, H, W\)"):
        bp.max_pool2d(bp.tensor(np.zeros((4, 4), np.float32)), 2)


def test_clip_gradient_is_one_inside_and_on_the_bounds_zero_outside():
    x = bp.tensor(np.array([-2.0, -1.0, 0.0, 1.0, 3.0]), requires_grad=True)
    y = bp.clip(x, -1.0, 1.0)
    np.testing.assert_array_equal(y.numpy(), [-1, -1, 0, 1, 1])
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [0, 1, 1, 1, 0])
    np.testing.assert_array_equal(bp.clip(bp.tensor([1.0, 5.0]), hi=2.0).numpy(), [1, 2])
    with pytest.raises(ValueError, match="lo, hi"):
        bp.clip(x)


def test_argmax_argmin_follow_numpy_including_axis_none_and_keepdims():
    x = np.array([[3.0, 7.0, 7.0], [9.0, 1.0, 1.0]])
    for ours, theirs in ((bp.argmax, np.argmax), (bp.argmin, np.argmin)):
        for axis in (None, 0, 1, -1):
            for keepdims in (False, True):
                expected = theirs(x, axis=axis, keepdims=keepdims)
                got = ours(bp.tensor(x), axis, keepdims)
                np.testing.assert_array_equal(got.numpy(), expected)
                compiled = bp.compile(lambda t, a=axis, k=keepdims, f=ours: f(t, a, k))
                np.testing.assert_array_equal(compiled(bp.tensor(x)).numpy(), expected)


def test_arange_dtypes_follow_torch():
    assert bp.arange(5).dtype == np.int64
    np.testing.assert_array_equal(bp.arange(2, 8, 3).numpy(), [2, 5])
    assert bp.arange(0.0, 1.0, 0.25).dtype == np.float32
    assert bp.arange(3, dtype="float64").dtype == np.float64


def test_initialisers_use_pytorch_fans():
    key = bp.random.key(0)
    w = bp.nn.init.kaiming_normal(key, (64, 32, 3, 3)).numpy()
    assert w.shape == (64, 32, 3, 3) and w.dtype == np.float32
    assert abs(w.std() - math.sqrt(2 / (32 * 9))) < 0.01 * math.sqrt(2 / (32 * 9)) * 5
    u = bp.nn.init.xavier_uniform(key, (200, 100)).numpy()
    bound = math.sqrt(6 / 300)
    assert -bound <= u.min() and u.max() < bound and u.max() > 0.95 * bound
    assert bp.nn.init.fans((3, 5), layout="in_out") == (3, 5)
    assert bp.nn.init.fans((5, 3)) == (3, 5)
