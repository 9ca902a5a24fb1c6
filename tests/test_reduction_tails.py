"""Loop reductions whose reduced axes do not form the innermost run of the loop nest (a channel
sum over batch and positions, a 2x2 max pool): the innermost reduced run sums in a scalar,
combined into the output after it, instead of reading and writing the output at every element.
Compiled values equal the reference interpreter's, NaN and -inf included, on the driver compiled
and on the driver run as Python (address kernels: loads and stores)."""

import re

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

TAIL = re.compile(r"\] \+= acc\d|v_ = acc\d")  # an accumulator added or maxed into the output


def channel_and_pool(x, b):
    """x: (N, C, H, W), b: (C, 1, 1)."""
    n, c, h, w = x.shape
    y = bp.relu(x + b)
    pooled = bp.max(bp.reshape(y, (n, c, h // 2, 2, w // 2, 2)), axis=(3, 5))
    return {
        "channel_sum": bp.sum(y, axis=(0, 2, 3)),
        "channel_max": bp.max(x * 2.0, axis=(0, 2, 3), keepdims=True),
        "pool": pooled,
        "pool_count": bp.sum(bp.reshape(y, (n, c, h // 2, 2, w // 2, 2)) > 0.5, axis=(3, 5)),
    }


def _inputs(rng):
    x = rng.standard_normal((3, 4, 6, 10)).astype(np.float32)
    x[1, 2, 3, 4] = np.nan  # propagates through its channel's max and its pool window
    x[2, 1] = -np.inf  # a channel whose one image is all -inf
    b = rng.standard_normal((4, 1, 1)).astype(np.float32)
    return bp.tensor(x), bp.tensor(b)


@pytest.mark.parametrize("driver", ["inline", "python"])
def test_reductions_with_an_inner_reduced_run_match_the_reference(driver, monkeypatch):
    monkeypatch.setenv("BACKPLAN_DRIVER", driver)
    args = _inputs(np.random.default_rng(4))
    with use_backend("reference"):
        want = bp.compile(channel_and_pool)(*args)
    fn = bp.compile(channel_and_pool)
    with use_backend("numba"):
        got = fn(*args)
        sources = [k.source for r in fn.trace(*args).runners() for k in r.compiled.loop_kernels]
    assert sum(bool(TAIL.search(s)) for s in sources) >= 2, "no reduction tail was emitted"
    for key in want:
        np.testing.assert_allclose(
            np.asarray(got[key], np.float64), np.asarray(want[key], np.float64),
            rtol=1e-5, atol=1e-5, err_msg=key,
        )  # fmt: skip
    assert np.isnan(np.asarray(got["channel_max"]).ravel()[2])
    assert np.isnan(np.asarray(got["pool"])[1, 2, 1, 2])


def test_a_reduction_tail_also_runs_backward():
    """The cnn bench's pattern: the bias gradient of relu(conv + b) sums over batch and
    positions; compiled gradients equal the reference's."""

    def loss(b, x):
        return bp.sum(bp.relu(x + b) * x)

    rng = np.random.default_rng(5)
    b = bp.tensor(rng.standard_normal((4, 1, 1)).astype(np.float32))
    x = bp.tensor(rng.standard_normal((5, 4, 3, 7)).astype(np.float32))
    vg = bp.value_and_grad(loss)
    with use_backend("reference"):
        want_value, want_grad = vg(b, x)
    with use_backend("numba"):
        value, grad = vg(b, x)
        sources = [k.source for k in vg.trace(b, x).runner().compiled.loop_kernels]
    assert any(TAIL.search(s) for s in sources)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), want_grad.numpy(), rtol=1e-5, atol=1e-6)
